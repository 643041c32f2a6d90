from .reference import compress, compress_projected

__all__ = ["compress", "compress_projected"]
