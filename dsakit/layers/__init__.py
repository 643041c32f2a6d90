"""Model layers wired from dsakit's ops: the DeepSeek-V4 lightning indexer and the V4 attention blocks
(CSA / HCA / window) on paged caches.

* ``config.py``: :class:`V4AttentionConfig`, the frozen settings of one block;
* ``attention.py``: :class:`V4Attention`, the block (its stages and forward);
* ``kv_cache.py``: :class:`V4LayerCache`, the block's pools, slot maps and compressor rings, with checkpoints;
* ``indexer.py``: :class:`V4Indexer` (the indexer module of a CSA block, also the fp32 reference pipeline) and
  :class:`DSAIndexer` (the same, built from weight tensors);
* ``from_transformers.py``: reading transformers' DeepSeek-V4 modules (rope, config, shared parameters);
* ``modules.py``: RMSNorm, the compressor's projections, the device rope.
"""

from .attention import V4Attention
from .config import INDEX_KEY_FORMAT_ENV, V4AttentionConfig, resolve_index_key_format
from .from_transformers import rope_from_transformers
from .indexer import DSAIndexer, V4Indexer
from .kv_cache import V4LayerCache

__all__ = ["DSAIndexer", "V4Indexer", "rope_from_transformers", "V4Attention", "V4AttentionConfig", "V4LayerCache",
           "INDEX_KEY_FORMAT_ENV", "resolve_index_key_format"]
