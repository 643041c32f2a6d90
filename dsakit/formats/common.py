"""Scale arithmetic shared by the quantized key formats: torch (the spec) and Triton (the kernels).

Triton is optional: the ``@triton.jit`` functions exist only when it imports.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch side works without triton
    triton = None

SCALE_FLOOR = 1e-4


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """Largest finite |x| along the last dim (0 if none), fp32 [..]."""
    finite = torch.isfinite(x)
    return torch.where(finite, x.abs(), torch.zeros_like(x)).amax(dim=-1)


def sanitize(x: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """NaN -> 0, +-Inf -> +-limit (broadcast), everything else unchanged."""
    x = torch.where(torch.isnan(x), torch.zeros_like(x), x)
    return torch.where(torch.isinf(x), torch.sign(x) * limit, x)


def ue8m0_exponent_ceil(s: torch.Tensor) -> torch.Tensor:
    """Biased exponent (int32) of the smallest power of two >= s, for positive normal fp32 s.

    Exact bit arithmetic rather than ceil(log2(s)), which can misround next to powers of two:
    biased exponent of s, plus one unless the mantissa bits are all zero.
    """
    bits = s.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    return exponent + (mantissa != 0).to(torch.int32)


def ue8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """ue8m0 byte (uint8) -> fp32 power of two 2^(byte - 127)."""
    return torch.exp2(byte.to(torch.float32) - 127.0)


if triton is not None:

    @triton.jit
    def ue8m0_ceil_tl(s):
        """Positive normal fp32 s -> biased exponent (int32) of the smallest power of two >= s."""
        bits = s.to(tl.int32, bitcast=True)
        return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)

    @triton.jit
    def pow2_tl(biased_exponent):
        """Biased exponent e in 1..254 (int32) -> fp32 2^(e - 127), exactly."""
        return (biased_exponent << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def finite_abs_tl(x):
        """|x| where x is finite, 0 where it is NaN or +-Inf (these never enter an amax)."""
        return tl.where(tl.abs(x) < float("inf"), tl.abs(x), 0.0)

    @triton.jit
    def sanitize_tl(x):
        """NaN -> 0; +-Inf kept (a later clamp saturates it to the largest code)."""
        return tl.where(x != x, 0.0, x)
