"""Model layers wired from dsakit's ops: the DeepSeek-V4 lightning indexer (pure PyTorch reference layer) and the
V4 attention blocks (CSA / HCA / window) on paged caches."""

from .attention import INDEX_KEY_FORMAT_ENV, V4Attention, V4LayerCache, resolve_index_key_format
from .indexer import DSAIndexer, rope_from_transformers

__all__ = ["DSAIndexer", "rope_from_transformers", "V4Attention", "V4LayerCache", "INDEX_KEY_FORMAT_ENV",
           "resolve_index_key_format"]
