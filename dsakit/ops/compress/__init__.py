"""V4 compressor: ``reference`` (fp32 CPU spec) and ``device`` (torch ops on the tensors' device, with a decode
state). Both give the pre-norm pooled entries; see the module docstrings for the math."""

from .device import CompressorState, compress_device, compress_step, pool_blocks
from .reference import compress, compress_projected

__all__ = ["compress", "compress_projected", "CompressorState", "compress_device", "compress_step", "pool_blocks"]
