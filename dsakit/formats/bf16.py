"""bf16 index keys (256 B per entry, no scales): torch codec (the spec) and Triton codec functions.

Values: 128 x bf16 little endian, round-to-nearest-even cast; NaN and Inf kept as they are.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch side works without triton
    triton = None


def quantize_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, D] -> (values uint8 [N, 2 D], scales uint8 [N, 0])."""
    n = x.shape[0]
    return x.to(torch.bfloat16).view(torch.uint8).reshape(n, 2 * x.shape[1]), torch.zeros(n, 0, dtype=torch.uint8)


def dequantize_bf16(values: torch.Tensor, head_dim: int) -> torch.Tensor:
    """values uint8 [N, 2 D] -> fp32 [N, D]."""
    return values.contiguous().view(torch.bfloat16).reshape(values.shape[0], head_dim).float()


if triton is not None:

    @triton.jit
    def bf16_bits(x):
        """fp32 -> bf16 bit pattern (uint32 holding 16 bits), round to nearest even; NaN stays NaN (quiet)."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = (bits >> 16) | 0x40
        return tl.where(x != x, quiet_nan, rounded)

    @triton.jit
    def bf16_u16(x, NATIVE: tl.constexpr):
        """fp32 -> bf16 bits (uint16), RNE. NATIVE: the GPU's cvt.rn (the interpreter's own cast truncates)."""
        if NATIVE:
            return x.to(tl.bfloat16).to(tl.uint16, bitcast=True)
        else:
            return bf16_bits(x).to(tl.uint16)

    @triton.jit
    def load_bf16_tile(values_ptr, pages, slot, valid, D: tl.constexpr):
        """Key tile bf16 [BLOCK_N, D] of entries (pages[n], slot[n]); values_ptr: the pool viewed as bf16."""
        dims = tl.arange(0, D)
        return tl.load(values_ptr + pages[:, None] * (64 * D) + slot[:, None] * D + dims[None, :],
                       mask=valid[:, None], other=0.0)

    @triton.jit
    def store_bf16_rows(x, pool_ptr, value_base, cols, live):
        """Store rows x fp32 [BLOCK_N, D] as bf16 entries: value_base [BLOCK_N] byte offsets, live [BLOCK_N]."""
        bits = bf16_bits(x).to(tl.uint16)
        dst = pool_ptr.to(tl.pointer_type(tl.uint16)) + (value_base // 2)[:, None] + cols[None, :]
        tl.store(dst, bits, mask=live[:, None])

    @triton.jit
    def store_bf16_halves(x, pool_ptr, value_base, cols, live, NATIVE: tl.constexpr):
        """Store x fp32 [2, BLOCK_N, 8, 8] (half, row, piece, e) with cols its dims; value_base / live
        [1, BLOCK_N, 1, 1]."""
        tl.store(pool_ptr.to(tl.pointer_type(tl.uint16)) + value_base // 2 + cols, bf16_u16(x, NATIVE), mask=live)
