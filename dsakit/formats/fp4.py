"""fp4 e2m1 index keys (68 B per entry: 64 packed value bytes, four ue8m0 scales): torch codec (the spec) and
Triton codec functions.

Per block of 32 elements: scale = 2^ceil(log2(max(amax, 1e-4) / 6)) stored as a ue8m0 byte; magnitude
|x| * (1 / scale) coded to {0, .5, 1, 1.5, 2, 3, 4, 6} by thresholds .25 .75 1.25 1.75 2.5 3.5 5
(``threshold``: a tie goes to the smaller code; ``rne``: to the even code); the sign (bit 3) only on non-zero
codes. Byte i holds elements 2i (low nibble) and 2i + 1.
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

FP4_MAX = 6.0
FP4_BLOCK = 32
# e2m1 magnitudes by 3-bit code, and the decision thresholds between consecutive codes.
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def encode_e2m1(v: torch.Tensor, rounding: str) -> torch.Tensor:
    """Scaled fp32 values [..] (|v| <= 6 after sanitizing) -> 4-bit codes uint8 [..] (sign in bit 3)."""
    mag = v.abs()
    thresholds = torch.tensor(FP4_THRESHOLDS, dtype=torch.float32)
    # threshold mode: code = number of thresholds strictly below |v| (ties go to the smaller code)
    code = (mag.unsqueeze(-1) > thresholds).sum(dim=-1).to(torch.uint8)
    if rounding == "rne":
        # a tie sits exactly on a threshold: go up when the upper code is even
        is_tie = (mag.unsqueeze(-1) == thresholds).any(dim=-1)
        code = torch.where(is_tie & (code % 2 == 1), code + 1, code)
    # the sign only on non-zero codes: a negative value that rounds to magnitude 0 encodes as 0x0, never 0x8
    sign = ((v < 0) & (code != 0)).to(torch.uint8) << 3
    return code | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes uint8 [..] -> fp32 [..] (unscaled)."""
    table = torch.tensor(FP4_MAGNITUDES, dtype=torch.float32)
    mag = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -mag, mag)


def quantize_fp4(x: torch.Tensor, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [N, D] -> (values uint8 [N, D / 2], scales uint8 [N, D / 32] ue8m0 bytes)."""
    n, d = x.shape
    blocks = x.reshape(n, d // FP4_BLOCK, FP4_BLOCK)
    amax = torch.clamp(finite_amax(blocks), min=SCALE_FLOOR)
    exponent = ue8m0_exponent_ceil(amax / FP4_MAX)  # [N, D / 32]
    scale = ue8m0_to_float(exponent.to(torch.uint8))
    v = sanitize(blocks, torch.tensor(float("inf"))) * (1.0 / scale).unsqueeze(-1)  # exact: scale is 2^k
    v = torch.clamp(v, -FP4_MAX, FP4_MAX)
    codes = encode_e2m1(v, rounding).reshape(n, d)
    values = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return values.contiguous(), exponent.to(torch.uint8).contiguous()


def dequantize_fp4(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(values uint8 [N, D / 2], scales uint8 [N, D / 32]) -> fp32 [N, D]."""
    n = values.shape[0]
    codes = torch.stack([values & 0xF, values >> 4], dim=-1).reshape(n, 2 * values.shape[1])
    return decode_e2m1(codes) * ue8m0_to_float(scales).repeat_interleave(FP4_BLOCK, dim=1)


if triton is not None:

    @triton.jit
    def e2m1_code(v, FP4_RNE: tl.constexpr):
        """fp32 v, finite, |v| <= 6 -> e2m1 code (int32, sign in bit 3) with integer rounding of the bits.

        |v| >= 1: e2m1 is a float with a 1-bit mantissa and exponent bias 1, so dropping 22 mantissa bits
        (adding 2^21 - 1 rounds exact halves down = the 'threshold' ties; RNE adds the kept bit as well) gives
        (biased exponent << 1 | mantissa) - 252 = code. |v| < 1: codes 0 (0) and 1 (0.5) and the carry to
        2 (1.0) by the 0.25 / 0.75 thresholds. Same codes as counting thresholds (:func:`encode_e2m1`).
        """
        mag = tl.abs(v)
        bits = mag.to(tl.int32, bitcast=True)
        if FP4_RNE:
            rounded = bits + 0x1FFFFF + ((bits >> 22) & 1)
            small = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32)
        else:
            rounded = bits + 0x1FFFFF
            small = (mag > 0.25).to(tl.int32) + (mag > 0.75).to(tl.int32)
        code = tl.where(mag >= 1.0, (rounded >> 22) - 252, small)
        # the sign only on non-zero codes: a negative value that rounds to 0 stores +0 (0x0), as the engines do
        return code | (((v < 0) & (code != 0)).to(tl.int32) << 3)

    @triton.jit
    def e2m1_float(code):
        """4-bit e2m1 code (int32, sign in bit 3) -> fp32, exactly :func:`decode_e2m1` (code 8 -> -0.0)."""
        mag_code = code & 7
        exponent = mag_code >> 1
        mantissa = mag_code & 1
        normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
        magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
        return (magnitude.to(tl.int32, bitcast=True) | ((code & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def ue8m0_float(byte):
        """ue8m0 byte (int32, 0..255) -> fp32 2^(byte - 127), exactly :func:`ue8m0_to_float` for every byte
        (0 -> the subnormal 2^-127, 255 -> +Inf)."""
        return tl.where(byte == 0, 0x400000, byte << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def load_fp4_tile(values_ptr, scales_ptr, pages, slot, valid, D: tl.constexpr, PAGE_EXTRA: tl.constexpr = 0):
        """Key tile bf16 [BLOCK_N, D] of entries (pages[n], slot[n]): e2m1 magnitude x 2^(s - 127), exact in
        bf16 (<= 2 significant bits). Page = 64 x D / 2 packed bytes then 64 x D / 32 ue8m0 bytes (then
        PAGE_EXTRA bytes: a page-centred format's centre)."""
        dims = tl.arange(0, D)
        half = tl.arange(0, D // 2)
        page_base = pages[:, None] * (64 * (D // 2 + 4) + PAGE_EXTRA)
        raw = tl.load(values_ptr + page_base + slot[:, None] * (D // 2) + half[None, :],
                      mask=valid[:, None], other=0).to(tl.int32)
        # element 2i = low nibble, 2i + 1 = high nibble: join on a new last axis, then flatten
        codes = tl.reshape(tl.join(raw & 0xF, raw >> 4), (raw.shape[0], D))
        sbyte = tl.load(scales_ptr + page_base + 64 * (D // 2) + slot[:, None] * 4 + dims[None, :] // 32,
                        mask=valid[:, None], other=127).to(tl.int32)
        mag_code = codes & 7
        exponent = mag_code >> 1
        mantissa = mag_code & 1
        # e2m1: exponent 0 -> 0 or 0.5 (subnormal); else 2^(exponent - 1) * (1 + mantissa / 2), built as fp32
        # bits with integer arithmetic only (no boolean selects: when the tile feeds the dot from registers,
        # Triton 3.6 fails to lower i1 tensors in the dot-operand layout)
        is_normal = (exponent | (exponent >> 1)) & 1
        normal_bits = ((exponent + 126) << 23) | (mantissa << 22)
        mag_bits = is_normal * normal_bits + (1 - is_normal) * (mantissa * 0x3F000000)
        magnitude = mag_bits.to(tl.float32, bitcast=True)
        scale = (sbyte << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) for s in 1..254
        value_bits = (magnitude * scale).to(tl.int32, bitcast=True) | ((codes & 8) << 28)  # sign bit 3 -> 31
        return value_bits.to(tl.float32, bitcast=True).to(tl.bfloat16)

    @triton.jit
    def load_fp4_block_e4m3(values_ptr, pages, slot, valid, BLOCK: tl.constexpr, D: tl.constexpr,
                            INTERPRET: tl.constexpr, PAGE_EXTRA: tl.constexpr = 0):
        """Elements 32 BLOCK .. 32 BLOCK + 31 of entries (pages[n], slot[n]) as e4m3 [BLOCK_N, 32], each the e2m1
        value times 2^-6, unscaled (the block's ue8m0 scale: :func:`load_fp4_block_scales`). Invalid entries: 0.

        Exact by bit placement, no arithmetic: the e2m1 magnitude bits (e1 e0 m) moved to bits 4..2 of an e4m3
        byte read as exponent e1 e0 (bias 7) and mantissa m00, which is the e2m1 value times 2^(1 - 7) for
        every code, the subnormal 0.5 (e4m3 0x04 = 2^-7) included; the sign moves from bit 3 to bit 7. About
        four integer operations per element against ~20 for the fp32 dequantization of :func:`load_fp4_tile`
        (on the GPU: inline PTX on four bytes at a time; INTERPRET: the same bits with plain Triton ops).
        """
        half = tl.arange(0, 16)
        page_base = pages[:, None] * (64 * (D // 2 + D // 32) + PAGE_EXTRA)
        raw = tl.load(values_ptr + page_base + slot[:, None] * (D // 2) + BLOCK * 16 + half[None, :],
                      mask=valid[:, None], other=0)  # uint8 [BLOCK_N, 16]: elements 2i (low), 2i + 1 (high)
        return fp4_bytes_e4m3(raw, INTERPRET)

    @triton.jit
    def fp4_bytes_e4m3(raw, INTERPRET: tl.constexpr, SPLIT: tl.constexpr = False):
        """Packed e2m1 bytes uint8 [N, B] (element 2i in the low nibble of byte i) -> e4m3 [N, 2 B], each the
        e2m1 value times 2^-6 (the bit placement of :func:`load_fp4_block_e4m3`). Columns in element order, or
        with SPLIT in nibble order: the B low nibbles (elements 0, 2, ..), then the B high ones (1, 3, ..)."""
        if INTERPRET:
            low = ((raw & 0x08) << 4) | ((raw & 0x07) << 2)
            high = (raw & 0x80) | ((raw & 0x70) >> 2)
        else:
            # the same on four bytes per 32-bit register (the compiler works byte by byte otherwise); bits
            # shifted across a byte boundary fall outside each byte's masks
            low, high = tl.inline_asm_elementwise(
                """{
                .reg .b32 t;
                shl.b32 t, $2, 4;
                and.b32 t, t, 0x80808080;
                shl.b32 $0, $2, 2;
                and.b32 $0, $0, 0x1C1C1C1C;
                or.b32 $0, $0, t;
                and.b32 t, $2, 0x80808080;
                shr.b32 $1, $2, 2;
                and.b32 $1, $1, 0x1C1C1C1C;
                or.b32 $1, $1, t;
                }""",
                "=r,=r,r", [raw], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)
        if SPLIT:  # the low nibbles (even elements), then the high ones
            codes = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (raw.shape[0], 2 * raw.shape[1]))
        else:
            codes = tl.reshape(tl.join(low, high), (raw.shape[0], 2 * raw.shape[1]))
        return codes.to(tl.float8e4nv, bitcast=True)

    @triton.jit
    def load_fp4_block_scales(scales_ptr, pages, slot, valid, D: tl.constexpr, PAGE_EXTRA: tl.constexpr = 0):
        """The four ue8m0 scale bytes of entries (pages[n], slot[n]) as one int32 word [BLOCK_N] (block b in
        byte b; scales_ptr: the uint8 pool, every entry's four scale bytes 4-byte aligned). Invalid: 0x7F7F7F7F."""
        page_words = (64 * (D // 2 + D // 32) + PAGE_EXTRA) // 4
        words_ptr = scales_ptr.to(tl.pointer_type(tl.int32))
        return tl.load(words_ptr + pages * page_words + (64 * (D // 2)) // 4 + slot, mask=valid, other=0x7F7F7F7F)

    @triton.jit
    def fp4_block_scale(words, BLOCK: tl.constexpr):
        """fp32 2^(s - 127) of block BLOCK from the words of :func:`load_fp4_block_scales` (s in 1..254)."""
        return (((words >> (8 * BLOCK)) & 0xFF) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def store_fp4_rows(x, pool_ptr, value_base, scale_base, live, FP4_RNE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Store rows x fp32 [BLOCK_N, 128]: 64 packed bytes at value_base [BLOCK_N], 4 ue8m0 bytes at scale_base."""
        blocks = tl.reshape(x, [BLOCK_N, 4, 32])
        amax = tl.maximum(tl.max(finite_abs_tl(blocks), axis=2), 1e-4)  # [BLOCK_N, 4]
        exponent = ue8m0_ceil_tl(tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
        v = sanitize_tl(blocks) * pow2_tl(254 - exponent)[:, :, None]  # exact: dividing by 2^k
        code = e2m1_code(tl.minimum(tl.maximum(v, -6.0), 6.0), FP4_RNE)
        even, odd = tl.split(tl.reshape(code, [BLOCK_N, 64, 2]))
        packed = (even | (odd << 4)).to(tl.uint8)  # [BLOCK_N, 64]
        byte_cols = tl.arange(0, 64)
        tl.store(pool_ptr + value_base[:, None] + byte_cols[None, :], packed, mask=live[:, None])
        scale_cols = tl.arange(0, 4)
        tl.store(pool_ptr + scale_base[:, None] + scale_cols[None, :], exponent.to(tl.uint8), mask=live[:, None])

    @triton.jit
    def store_fp4_halves(x, pool_ptr, value_base, scale_base, half, live, FP4_RNE: tl.constexpr,
                         BLOCK_N: tl.constexpr):
        """Store x fp32 [2, BLOCK_N, 8, 8] (half, row, piece, e); value_base / scale_base / live [1, BLOCK_N, 1, 1],
        half [2, 1, 1, 1]."""
        blocks = tl.reshape(x, [2, BLOCK_N, 2, 4, 8])  # (half, row, block in half, piece, e)
        amax = tl.maximum(tl.max(tl.max(finite_abs_tl(blocks), axis=4), axis=3), 1e-4)  # [2, BLOCK_N, 2]
        exponent = ue8m0_ceil_tl(tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
        v = sanitize_tl(blocks) * pow2_tl(254 - exponent)[:, :, :, None, None]  # exact: dividing by 2^k
        code = e2m1_code(tl.minimum(tl.maximum(v, -6.0), 6.0), FP4_RNE)
        even, odd = tl.split(tl.reshape(code, [2, BLOCK_N, 8, 4, 2]))
        packed = (even | (odd << 4)).to(tl.uint8)  # [2, BLOCK_N, 8, 4]: byte 32 * half + 4 * piece + j
        byte = half * 32 + tl.arange(0, 8)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
        tl.store(pool_ptr + value_base + byte, packed, mask=live)
        scale_byte = half * 2 + tl.arange(0, 2)[None, None, :, None]  # [2, 1, 2, 1]
        tl.store(pool_ptr + scale_base + scale_byte, exponent[:, :, :, None].to(tl.uint8), mask=live)
