"""Model layers wired from dsakit's ops (pure PyTorch): the DeepSeek-V4 lightning indexer."""

from .indexer import DSAIndexer, rope_from_transformers

__all__ = ["DSAIndexer", "rope_from_transformers"]
