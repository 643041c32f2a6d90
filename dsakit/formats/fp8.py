"""fp8 e4m3fn index keys (132 B per entry: 128 value bytes, one fp32 scale): torch codec (the spec) and Triton
codec functions.

scale = max(amax, 1e-4) / 448 in fp32 (``ue8m0``: rounded up to a power of two); value byte =
e4m3fn(clamp(x * (1 / scale), +-448)) with the fp32 reciprocal computed once per entry, round to nearest
even. Multiplying by the reciprocal, not dividing by the scale, is the engines' arithmetic byte for byte.
"""

from __future__ import annotations

import torch

from .common import SCALE_FLOOR, finite_amax, sanitize, ue8m0_exponent_ceil, ue8m0_to_float

try:
    import triton
    import triton.language as tl

    from .common import finite_abs_tl, pow2_tl, sanitize_tl, ue8m0_ceil_tl
except ImportError:  # the torch side works without triton
    triton = None

FP8_MAX = 448.0


def fp8_scale(amax: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    """fp32 scale for e4m3 from amax [..]: max(amax, 1e-4) / 448, optionally rounded up to 2^n."""
    scale = torch.clamp(amax.float(), min=SCALE_FLOOR) / FP8_MAX
    if scale_fmt == "ue8m0":
        scale = ue8m0_to_float(ue8m0_exponent_ceil(scale).to(torch.uint8))
    return scale


def encode_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 x [.., n], scale [..] -> e4m3fn bytes uint8 [.., n] of e4m3(clamp(x * (1 / scale), +-448)).

    The fp32 reciprocal is computed once per scale and the elements are multiplied by it (not divided by the
    scale): that is the engines' quantizer arithmetic, and it differs from x / scale at e4m3 rounding ties
    (e.g. x = 0.890625 in a row of amax 2.375: x / scale is exactly 168, a tie stored as 0x72; x * (1 / scale)
    lies just above it and is stored as 0x73). For a power-of-two scale both are exact and equal.
    """
    inv_scale = (1.0 / scale.float()).unsqueeze(-1)  # correctly rounded fp32 division
    x = sanitize(x.float(), torch.tensor(float("inf")))
    v = torch.clamp(x * inv_scale, -FP8_MAX, FP8_MAX)  # Inf * inv_scale -> Inf -> clamped to +-448
    return v.to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes uint8 [..] -> fp32 [..]."""
    return codes.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def quantize_fp8(x: torch.Tensor, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, D] -> (values uint8 [N, D], scales uint8 [N, 4] = the fp32 scale, little endian)."""
    n = x.shape[0]
    scale = fp8_scale(finite_amax(x), scale_fmt)  # [N]
    return encode_e4m3(x, scale), scale.reshape(n, 1).contiguous().view(torch.uint8).reshape(n, 4)


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(values uint8 [N, D], scales uint8 [N, 4]) -> fp32 [N, D] = value * scale."""
    return decode_e4m3(values) * scales.contiguous().view(torch.float32).reshape(values.shape[0], 1)


if triton is not None:

    @triton.jit
    def e4m3_bits(v):
        """fp32 v, finite and |v| <= 448 -> e4m3fn byte (uint32), round to nearest even, sign kept (-0 -> 0x80)."""
        bits = v.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag_bits = bits & 0x7FFFFFFF
        # normal range (|v| >= 2^-6): drop 20 of the 23 mantissa bits with RNE, rebias exponent 127 -> 7
        normal = ((mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) >> 20) - (120 << 3)
        # subnormal range: code = RNE(|v| / 2^-9) in 0..8 (8 is the smallest normal); |v| * 512 is exact and
        # adding then removing 2^23 rounds it to the nearest even integer
        scaled = tl.abs(v) * 512.0
        subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.uint32)
        code = tl.where(tl.abs(v) < 0.015625, subnormal, normal)
        return code | sign

    @triton.jit
    def e4m3_float(code):
        """e4m3fn byte (any int dtype, 0..255) -> fp32, exactly as torch decodes it (0x80 -> -0.0; 0x7F / 0xFF
        -> NaN), with integer bit arithmetic only (portable between the GPU and the interpreter)."""
        c = code.to(tl.int32)
        exponent = (c >> 3) & 0xF
        mantissa = c & 7
        normal = (((exponent + 120) << 23) | (mantissa << 20)).to(tl.float32, bitcast=True)
        subnormal = mantissa.to(tl.float32) * 0.001953125  # m * 2^-9, exact
        magnitude = tl.where(exponent == 0, subnormal, normal)
        magnitude = tl.where((c & 0x7F) == 0x7F, float("nan"), magnitude)
        return (magnitude.to(tl.int32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)

    @triton.jit
    def e4m3_u8(v, NATIVE: tl.constexpr):
        """fp32 v, finite, |v| <= 448 -> e4m3fn byte, RNE. NATIVE: the GPU's cvt.rn.satfinite.e4m3x2."""
        if NATIVE:
            return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            return e4m3_bits(v).to(tl.uint8)

    @triton.jit
    def fp8_scales_tl(amax, UE8M0: tl.constexpr):
        """fp32 amax [..] -> (scale, inv_scale): max(amax, 1e-4) / 448 (ue8m0: rounded up to 2^k) and its
        correctly rounded fp32 reciprocal (exact for 2^k)."""
        scale = tl.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
        if UE8M0:
            exponent = ue8m0_ceil_tl(scale)
            scale = pow2_tl(exponent)
            inv_scale = pow2_tl(254 - exponent)
        else:
            inv_scale = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        return scale, inv_scale

    @triton.jit
    def fp8_codes(x, inv_scale, NATIVE: tl.constexpr):
        """x [..] with the per-entry reciprocal scale broadcast -> e4m3fn bytes of clamp(x * inv_scale, +-448)."""
        return e4m3_u8(tl.minimum(tl.maximum(sanitize_tl(x) * inv_scale, -448.0), 448.0), NATIVE)

    @triton.jit
    def load_fp8_tile(values_ptr, pages, slot, valid, FP8_DOT: tl.constexpr, D: tl.constexpr,
                      PAGE_EXTRA: tl.constexpr = 0):
        """Key tile [BLOCK_N, D] of entries (pages[n], slot[n]) as e4m3 (FP8_DOT) or bf16 (exact upcast);
        the per-entry scale is applied by the caller per score column (:func:`load_fp8_scales`). PAGE_EXTRA:
        bytes a page holds after its scales (a page-centred format's centre)."""
        dims = tl.arange(0, D)
        raw = tl.load(values_ptr + pages[:, None] * (64 * D + 64 * 4 + PAGE_EXTRA) + slot[:, None] * D + dims[None, :],
                      mask=valid[:, None], other=0)
        k = raw.to(tl.float8e4nv, bitcast=True)
        if not FP8_DOT:
            k = k.to(tl.bfloat16)
        return k

    @triton.jit
    def load_fp8_scales(scales_ptr, pages, slot, valid, D: tl.constexpr, PAGE_EXTRA: tl.constexpr = 0):
        """Per-entry fp32 scales [BLOCK_N] (scales_ptr: the pool viewed as fp32)."""
        page_words = (64 * D + 64 * 4 + PAGE_EXTRA) // 4
        return tl.load(scales_ptr + pages * page_words + (64 * D) // 4 + slot, mask=valid, other=0.0)

    @triton.jit
    def store_fp8_rows(x, pool_ptr, value_base, scale_base, cols, live, UE8M0: tl.constexpr):
        """Store rows x fp32 [BLOCK_N, D]: e4m3fn values at value_base [BLOCK_N], the fp32 scale at scale_base."""
        scale, inv_scale = fp8_scales_tl(tl.max(finite_abs_tl(x), axis=1), UE8M0)
        codes = fp8_codes(x, inv_scale[:, None], False)
        tl.store(pool_ptr + value_base[:, None] + cols[None, :], codes, mask=live[:, None])
        tl.store(pool_ptr.to(tl.pointer_type(tl.float32)) + scale_base // 4, scale, mask=live)

    @triton.jit
    def store_fp8_halves(x, pool_ptr, value_base, scale_base, cols, live, UE8M0: tl.constexpr,
                         NATIVE: tl.constexpr):
        """Store x fp32 [2, BLOCK_N, 8, 8] (half, row, piece, e); value_base / scale_base / live [1, BLOCK_N, 1, 1]."""
        amax = tl.max(tl.max(tl.max(finite_abs_tl(x), axis=3), axis=2), axis=0)[None, :, None, None]
        scale, inv_scale = fp8_scales_tl(amax, UE8M0)
        tl.store(pool_ptr + value_base + cols, fp8_codes(x, inv_scale, NATIVE), mask=live)
        tl.store(pool_ptr.to(tl.pointer_type(tl.float32)) + scale_base // 4, scale, mask=live)
