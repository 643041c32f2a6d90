"""dsakit: DeepSeek Sparse Attention made fast, memory-safe and trustworthy at long context."""

from .batch import PagedBatch
from .cache import PagedCache, bytes_per_token, tokens_that_fit
from .formats import AttentionKVFormat, KeyFormat
from .presets import DSAPreset, KeyTransform, get_preset
from .transforms import ROPE_V4, ROPE_V32, RopeConfig, RopeLayout

__version__ = "0.1.0"

__all__ = ["PagedBatch", "PagedCache", "bytes_per_token", "tokens_that_fit", "AttentionKVFormat", "KeyFormat", "DSAPreset",
           "KeyTransform", "get_preset", "RopeConfig", "RopeLayout", "ROPE_V4", "ROPE_V32", "__version__"]
