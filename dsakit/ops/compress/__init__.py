"""V4 compressor: ``compress(x, wkv, wgate, ape, ratio, backend="auto" | "reference" | "device")``.

The op-folder pattern with a torch fast path instead of a Triton one: ``reference.py`` is the fp32 CPU spec,
``device.py`` the same math in torch ops on the tensors' own device (GPU or CPU) with a decode state
(:class:`CompressorState`, :func:`compress_step`); there is no kernel of its own. Both give the pre-norm
pooled entries; see the module docstrings for the math. ``auto`` runs the device path for CUDA tensors and
the reference otherwise.
"""

from __future__ import annotations

import torch

from ..._memory import check_choice
from .device import CompressorState, compress_device, compress_step, pool_blocks
from .reference import compress as compress_reference
from .reference import compress_projected

BACKENDS = ("auto", "reference", "device")

__all__ = ["compress", "compress_reference", "compress_projected", "CompressorState", "compress_device",
           "compress_step", "pool_blocks", "BACKENDS"]


def compress(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor, ratio: int, *,
             backend: str = "auto", chunk_tokens: int | None = None) -> torch.Tensor:
    """Hidden states x [S, hidden], wkv / wgate [c*d, hidden], ape [ratio, c*d] -> fp32 [S // ratio, d]
    (c = 2 for ratio 4, else 1; the incomplete tail block dropped), on x's device for ``device``, on the CPU
    for ``reference``. ``chunk_tokens`` (device path only) bounds its working memory."""
    check_choice("backend", backend, BACKENDS)
    on_cuda = isinstance(x, torch.Tensor) and x.is_cuda
    if backend == "device" or (backend == "auto" and on_cuda):
        return compress_device(x, wkv, wgate, ape, ratio, chunk_tokens=chunk_tokens)
    if chunk_tokens is not None:
        raise ValueError("chunk_tokens bounds the device path's memory; the reference takes none")
    return compress_reference(x, wkv, wgate, ape, ratio)
