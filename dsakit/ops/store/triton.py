"""Fused Triton store kernels: norm -> rope -> (Hadamard) -> quantize -> paged write, one launch.

Per row n (pseudocode; the reference in ``reference.py`` is the spec)::

    x      = keys[n]                                 # fp32 [D], D = 128 (index keys) or 512 (attention KV)
    x      = x * rsqrt(mean(x^2) + eps) * w          # or (x - mean) * rsqrt(var + eps) * w + b
    x[a_i], x[b_i] = a c - b s, a s + b c            # rope pairs of the layout, c / s = table[pos[n]]
    x      = x @ H128 / sqrt(128)                    # index keys, optional: butterfly in registers
    pool[page(slot[n])] <- bytes of quantize(x)      # byte layout: dsakit.formats

Nothing but the cache entry is written to global memory. Two kernel families, every option a
compile-time constant:

* fast kernels for the preset geometry (rope_dim 64; attention rope on the trailing dims), shaped so that
  Triton keeps rows inside registers: ``_store_index_keys_kernel`` tiles [2, BLOCK_N, 8, 8] = (half, row,
  piece, e), so each lane holds one 64-dim half of a row and the row's two halves sit on two lanes (norm
  sums and Hadamard bit 6 are 2-lane shuffle reductions, everything else, including the rope pairs, the
  other 6 Hadamard stages and the fp4 blocks, is in-register); ``_store_attention_kv_kernel`` tiles
  [8, BLOCK_N, 8, 8] = (64-dim block, row, piece, e), one block per lane, so the per-block fp8 amax is
  in-register (fp8-rope-bf16 entries only: for plain bf16 entries the generic kernel measured faster).
  No shared memory, no gathers.
* generic kernels (``*_generic_kernel``) for any even rope width and placement: [BLOCK_N, D] tiles, the
  rope partner of each dim reloaded from global memory (an L1 hit).

Byte-exactness with the reference (CPU, fp32) is the goal, so the arithmetic mirrors it:

* every division the reference does is a correctly rounded ``div_rn``; ``rsqrt(v)`` is ``1 / sqrt_rn(v)``
  (what torch's CPU rsqrt computes); the launcher disables fp contraction so ``a * c - b * s`` is not fused
  into an FMA (the reference rounds each product);
* e2m1 codes and ue8m0 exponents are integer bit arithmetic; bf16 and e4m3 use the GPU's round-to-nearest-
  even conversions, and in the Triton interpreter (whose float casts truncate) an exact integer emulation;
* what cannot be identical is the order of the fp32 sums (mean of squares over 128 / 512 elements, the
  Hadamard butterfly versus the reference's matmul). Those differ in the last fp32 bits now and then, which
  changes a stored byte only when the reference value lies within that rounding of a code boundary (one
  code of fp8 / fp4; an fp32 fp8 scale by a few fp32 ulps). tests/test_store_triton.py states and checks
  the bound; inputs whose pipeline is exact in fp32 give identical bytes.

Safety without validation (CUDA-graph capture, torch.compile): rows whose slot is negative or
>= num_slots, or whose position is outside the rope table, are neither read nor written; no address
outside the pool, the inputs or the table is ever formed.

The launchers are registered as ``torch.library`` custom ops (``dsakit::store_index_keys``,
``dsakit::store_attention_kv``) that mutate ``pool`` and have fake (meta) implementations, so the public
functions work under ``torch.compile`` and CUDA graph capture.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ...formats import ENTRIES_PER_PAGE, AttentionKVFormat, KeyFormat

INDEX_DIM = 128
ATTENTION_DIM = 512
HADAMARD_SCALE = 1.0 / math.sqrt(INDEX_DIM)  # rounded to fp32 in the kernel, as hadamard_matrix() does

# compile-time codes of the options
_NORMS = {"rmsnorm": 0, "layernorm": 1}
_PAIRINGS = {"interleaved": 0, "half-split": 1}
_PLACEMENTS = {"trailing": 0, "leading": 1}
# index-key formats: (KIND, UE8M0 scale, RNE fp4 ties)
_KEY_KINDS = {"bf16": 0, "fp8": 1, "fp4": 2}
_ATTENTION_KINDS = {"bf16": 0, "fp8-rope-bf16": 1}

# Rows per program of the fast kernels, from the H200 sweep (benchmarks/results/store_h200_v2_inregister.json):
# index keys have two lanes per row (16 rows per warp), 32 rows x 2 warps was fastest (64 x 4 within 1%);
# attention KV has eight lanes per row (4 rows per warp), 8 rows x 2 warps was fastest.
INDEX_BLOCK_N = 32
INDEX_NUM_WARPS = 2
ATTENTION_BLOCK_N = 8
ATTENTION_NUM_WARPS = 2
# The generic kernels (any rope width / placement) use 16 rows x 4 warps for index keys (larger row blocks
# trip a Triton 3.6 layout pass, RemoveLayoutConversions, on their 1-D row vectors) and 4 rows x 4 warps
# for attention KV (the configuration measured in benchmarks/results/store_h200_v1_butterfly.json).
GENERIC_BLOCK_N = 16
GENERIC_NUM_WARPS = 4
GENERIC_ATTENTION_BLOCK_N = 4


# --------------------------------------------------------------------------------------------------
# Device helpers (all exact, portable between the GPU and the interpreter)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern (uint32 holding 16 bits), round to nearest even; NaN stays NaN (quiet)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    return tl.where(x != x, quiet_nan, rounded)


@triton.jit
def _e4m3_bits(v):
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
def _bf16_u16(x, NATIVE: tl.constexpr):
    """fp32 -> bf16 bits (uint16), RNE. NATIVE: the GPU's cvt.rn (the interpreter's own cast truncates)."""
    if NATIVE:
        return x.to(tl.bfloat16).to(tl.uint16, bitcast=True)
    else:
        return _bf16_bits(x).to(tl.uint16)


@triton.jit
def _e4m3_u8(v, NATIVE: tl.constexpr):
    """fp32 v, finite, |v| <= 448 -> e4m3fn byte, RNE. NATIVE: the GPU's cvt.rn.satfinite.e4m3x2."""
    if NATIVE:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return _e4m3_bits(v).to(tl.uint8)


@triton.jit
def _e2m1_code(v, FP4_RNE: tl.constexpr):
    """fp32 v, finite, |v| <= 6 -> e2m1 code (int32, sign in bit 3) with integer rounding of the bits.

    |v| >= 1: e2m1 is a float with a 1-bit mantissa and exponent bias 1, so dropping 22 mantissa bits
    (adding 2^21 - 1 rounds exact halves down = the 'threshold' ties; RNE adds the kept bit as well) gives
    (biased exponent << 1 | mantissa) - 252 = code. |v| < 1: codes 0 (0) and 1 (0.5) and the carry to
    2 (1.0) by the 0.25 / 0.75 thresholds. Same codes as counting thresholds (formats.encode_e2m1).
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
def _fp8_codes(x, inv_scale, NATIVE: tl.constexpr):
    """x [..] with the per-row reciprocal scale broadcast -> e4m3fn bytes (uint8) of clamp(x * inv_scale, +-448).

    inv_scale is the correctly rounded fp32 1 / scale, computed once per entry (exact for a power-of-two
    scale): multiplying by it, not dividing by the scale, is what the engines' quantizers do byte for byte.
    """
    return _e4m3_u8(tl.minimum(tl.maximum(_sanitize(x) * inv_scale, -448.0), 448.0), NATIVE)


@triton.jit
def _ue8m0_ceil(s):
    """Positive normal fp32 s -> biased exponent (int32) of the smallest power of two >= s."""
    bits = s.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _pow2(biased_exponent):
    """Biased exponent e in 1..254 (int32) -> fp32 2^(e - 127), exactly."""
    return (biased_exponent << 23).to(tl.float32, bitcast=True)


@triton.jit
def _finite_abs(x):
    """|x| where x is finite, 0 where it is NaN or +-Inf (these never enter an amax)."""
    return tl.where(tl.abs(x) < float("inf"), tl.abs(x), 0.0)


@triton.jit
def _sanitize(x):
    """NaN -> 0; +-Inf kept (a later clamp saturates it to the largest code)."""
    return tl.where(x != x, 0.0, x)


@triton.jit
def _live_rows(rows, slots_ptr, positions_ptr, n_rows, num_slots, max_position):
    """Row indices (any shape) -> (slot, position, live), int64 / int64 / bool of the same shape.

    A row is live when it exists, its slot is in 0..num_slots-1 and its position in 0..max_position-1.
    Rows that are padding or would address outside the pool / rope table are never read nor written:
    every load and store of the kernels is masked by ``live``, and the slot / position of a dead row are
    replaced by 0 so that even the masked addresses stay inside the pool and the table.
    """
    in_range = rows < n_rows
    slot = tl.load(slots_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    pos = tl.load(positions_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    live = in_range & (slot >= 0) & (slot < num_slots) & (pos >= 0) & (pos < max_position)
    return tl.where(live, slot, 0), tl.where(live, pos, 0), live


@triton.jit
def _norm_rope(row_ptrs, partner_ptrs, row_mask, w_ptr, b_ptr, cos_ptrs, sin_ptrs, rope_mask, is_second,
               partner_cols, cols, eps, D: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Load a [BLOCK_N, D] tile, normalize it and rotate its rope pairs; fp32 [BLOCK_N, D].

    The rope partner of each dim (b of an a, a of a b) is loaded a second time from global memory (an L1
    hit) and normalized with the very same operations, so both halves of a pair round identically to the
    reference without any cross-lane shuffle; the layout lives entirely in ``partner_cols``.
    """
    x = tl.load(row_ptrs, mask=row_mask, other=0.0).to(tl.float32)
    partner = tl.load(partner_ptrs, mask=row_mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols).to(tl.float32)[None, :]
    w_partner = tl.load(w_ptr + partner_cols).to(tl.float32)
    inv_d = 1.0 / D  # exact: D is a power of two
    if NORM == 0:  # RMSNorm: x * rsqrt(mean(x^2) + eps) * w
        mean_sq = tl.sum(x * x, axis=1) * inv_d
        r = tl.div_rn(tl.full(mean_sq.shape, 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))[:, None]
        x = x * r * w
        partner = partner * r * w_partner
    else:  # LayerNorm: (x - mean) * rsqrt(mean((x - mean)^2) + eps) * w + b
        mean = (tl.sum(x, axis=1) * inv_d)[:, None]
        centered = x - mean
        var = tl.sum(centered * centered, axis=1) * inv_d
        r = tl.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.sqrt_rn(var + eps))[:, None]
        x = centered * r * w
        partner = (partner - mean) * r * w_partner
        if HAS_BIAS:
            x = x + tl.load(b_ptr + cols).to(tl.float32)[None, :]
            partner = partner + tl.load(b_ptr + partner_cols).to(tl.float32)
    c = tl.load(cos_ptrs, mask=rope_mask, other=1.0)
    s = tl.load(sin_ptrs, mask=rope_mask, other=0.0)
    # first of a pair:  a c - b s (x = a, partner = b);  second: a s + b c (partner = a, x = b)
    rotated = tl.where(is_second, partner * s + x * c, x * c - partner * s)
    return tl.where(rope_mask, rotated, x)


@triton.jit
def _rope_geometry(cols, D: tl.constexpr, ROPE_DIM: tl.constexpr, PAIRING: tl.constexpr,
                   PLACEMENT: tl.constexpr):
    """Per dim [D]: (inside the rope segment, is the second of its pair, partner dim, pair index)."""
    start = D - ROPE_DIM if PLACEMENT == 0 else 0
    local = cols - start
    in_rope = (local >= 0) & (local < ROPE_DIM)
    if PAIRING == 0:  # interleaved: pair i = (2i, 2i + 1)
        is_second = (local % 2) == 1
        pair = local // 2
        partner_local = local ^ 1
    else:  # half-split: pair i = (i, i + ROPE_DIM / 2)
        half = ROPE_DIM // 2
        is_second = local >= half
        pair = tl.where(is_second, local - half, local)
        partner_local = tl.where(is_second, local - half, local + half)
    partner = tl.where(in_rope, start + partner_local, cols)
    pair = tl.where(in_rope, pair, 0)
    return in_rope, is_second, partner, pair


@triton.jit
def _hadamard128(x, BLOCK_N: tl.constexpr):
    """x [BLOCK_N, 128] -> x @ H128 (Sylvester order, unscaled) with a constant-geometry butterfly.

    Each stage combines neighbours (2p, 2p + 1) into outputs p (sum) and p + 64 (difference); after
    log2(128) = 7 stages the result is in natural Sylvester order. 7 x 128 adds per row, in registers.
    """
    for _ in tl.static_range(7):
        pairs = tl.reshape(x, [BLOCK_N, 64, 2])
        a, b = tl.split(pairs)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [BLOCK_N, 128])
    return x


# --------------------------------------------------------------------------------------------------
# Index keys: [N, 128] -> bf16 / fp8 / fp4 entries
# --------------------------------------------------------------------------------------------------


@triton.jit
def _store_index_keys_generic_kernel(
        keys_ptr, positions_ptr, slots_ptr, pool_ptr, table_ptr, w_ptr, b_ptr,
        n_rows, keys_row_stride, num_slots, max_position, eps,
        NORM: tl.constexpr, HAS_BIAS: tl.constexpr, ROPE_DIM: tl.constexpr, PAIRING: tl.constexpr, PLACEMENT: tl.constexpr,
        HADAMARD: tl.constexpr, KIND: tl.constexpr, UE8M0: tl.constexpr, FP4_RNE: tl.constexpr,
        VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PAGE_BYTES: tl.constexpr,
        BLOCK_N: tl.constexpr):
    D: tl.constexpr = 128
    PAGE: tl.constexpr = 64
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols = tl.arange(0, D)  # [D]
    slot, pos, live = _live_rows(rows, slots_ptr, positions_ptr, n_rows, num_slots, max_position)

    in_rope, is_second, partner_cols, pair = _rope_geometry(cols, D, ROPE_DIM, PAIRING, PLACEMENT)
    row_base = keys_ptr + rows[:, None] * keys_row_stride
    rope_mask = live[:, None] & in_rope[None, :]
    table_row = table_ptr + pos[:, None] * ROPE_DIM + pair[None, :]
    x = _norm_rope(row_base + cols[None, :], row_base + partner_cols[None, :], live[:, None], w_ptr, b_ptr,
                   table_row, table_row + ROPE_DIM // 2, rope_mask, is_second[None, :], partner_cols[None, :],
                   cols, eps, D, NORM, HAS_BIAS)  # [BLOCK_N, D]
    if HADAMARD:
        x = _hadamard128(x, BLOCK_N) * 0.08838834764831845  # 128^-0.5

    page = slot // PAGE
    entry = slot % PAGE
    value_base = page * PAGE_BYTES + entry * VALUE_BYTES  # [BLOCK_N] byte offsets
    scale_base = page * PAGE_BYTES + PAGE * VALUE_BYTES + entry * SCALE_BYTES
    if KIND == 0:  # bf16: 128 x 2 bytes, little endian
        bits = _bf16_bits(x).to(tl.uint16)
        dst = pool_ptr.to(tl.pointer_type(tl.uint16)) + (value_base // 2)[:, None] + cols[None, :]
        tl.store(dst, bits, mask=live[:, None])
    elif KIND == 1:  # fp8 e4m3fn values + one fp32 scale (maybe a power of two)
        amax = tl.max(_finite_abs(x), axis=1)
        scale = tl.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
        if UE8M0:
            exponent = _ue8m0_ceil(scale)
            scale = _pow2(exponent)
            inv_scale = _pow2(254 - exponent)
        else:
            inv_scale = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        codes = _fp8_codes(x, inv_scale[:, None], False)
        tl.store(pool_ptr + value_base[:, None] + cols[None, :], codes, mask=live[:, None])
        scale_dst = pool_ptr.to(tl.pointer_type(tl.float32)) + scale_base // 4
        tl.store(scale_dst, scale, mask=live)
    else:  # fp4 e2m1: 64 bytes (low nibble = even element) + 4 ue8m0 bytes (one per 32 elements)
        blocks = tl.reshape(x, [BLOCK_N, 4, 32])
        amax = tl.maximum(tl.max(_finite_abs(blocks), axis=2), 1e-4)  # [BLOCK_N, 4]
        exponent = _ue8m0_ceil(tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
        v = _sanitize(blocks) * _pow2(254 - exponent)[:, :, None]  # exact: dividing by 2^k
        code = _e2m1_code(tl.minimum(tl.maximum(v, -6.0), 6.0), FP4_RNE)
        even, odd = tl.split(tl.reshape(code, [BLOCK_N, 64, 2]))
        packed = (even | (odd << 4)).to(tl.uint8)  # [BLOCK_N, 64]
        byte_cols = tl.arange(0, 64)
        tl.store(pool_ptr + value_base[:, None] + byte_cols[None, :], packed, mask=live[:, None])
        scale_cols = tl.arange(0, 4)
        tl.store(pool_ptr + scale_base[:, None] + scale_cols[None, :], exponent.to(tl.uint8), mask=live[:, None])


# --------------------------------------------------------------------------------------------------
# V4 main-attention KV: [N, 512] -> fp8-rope-bf16 (584 B) or bf16 (1024 B)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _store_attention_kv_generic_kernel(
        kv_ptr, positions_ptr, slots_ptr, pool_ptr, table_ptr, w_ptr,
        n_rows, kv_row_stride, num_slots, max_position, eps,
        ROPE_DIM: tl.constexpr, PAIRING: tl.constexpr, PLACEMENT: tl.constexpr, KIND: tl.constexpr,
        VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PAGE_BYTES: tl.constexpr,
        BLOCK_N: tl.constexpr):
    D: tl.constexpr = 512
    NOPE: tl.constexpr = 448  # fp8 part of the fp8-rope-bf16 entry: 7 blocks of 64
    PAGE: tl.constexpr = 64
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D)
    slot, pos, live = _live_rows(rows, slots_ptr, positions_ptr, n_rows, num_slots, max_position)

    in_rope, is_second, partner_cols, pair = _rope_geometry(cols, D, ROPE_DIM, PAIRING, PLACEMENT)
    row_base = kv_ptr + rows[:, None] * kv_row_stride
    rope_mask = live[:, None] & in_rope[None, :]
    table_row = table_ptr + pos[:, None] * ROPE_DIM + pair[None, :]
    x = _norm_rope(row_base + cols[None, :], row_base + partner_cols[None, :], live[:, None], w_ptr, w_ptr,
                   table_row, table_row + ROPE_DIM // 2, rope_mask, is_second[None, :], partner_cols[None, :],
                   cols, eps, D, 0, False)  # RMSNorm, [BLOCK_N, D]

    page = slot // PAGE
    entry = slot % PAGE
    value_base = page * PAGE_BYTES + entry * VALUE_BYTES
    scale_base = page * PAGE_BYTES + PAGE * VALUE_BYTES + entry * SCALE_BYTES
    bits = _bf16_bits(x).to(tl.uint16)
    halfword_ptr = pool_ptr.to(tl.pointer_type(tl.uint16))
    if KIND == 0:  # bf16 [512]
        tl.store(halfword_ptr + (value_base // 2)[:, None] + cols[None, :], bits, mask=live[:, None])
    else:
        # 8 blocks of 64: blocks 0..6 are fp8 with a ue8m0 scale each, block 7 the bf16 tail
        blocks = tl.reshape(x, [BLOCK_N, 8, 64])
        amax = tl.maximum(tl.max(_finite_abs(blocks), axis=2), 1e-4)  # [BLOCK_N, 8]
        exponent = _ue8m0_ceil(tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
        v = _sanitize(blocks) * _pow2(254 - exponent)[:, :, None]  # exact: dividing by 2^k
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        codes = tl.reshape(_e4m3_bits(v), [BLOCK_N, D]).to(tl.uint8)
        is_nope = cols < NOPE
        tl.store(pool_ptr + value_base[:, None] + cols[None, :], codes, mask=live[:, None] & is_nope[None, :])
        tail = tl.where(is_nope, 0, cols - NOPE)  # bf16 element index of the tail, 0..63
        tl.store(halfword_ptr + ((value_base + NOPE) // 2)[:, None] + tail[None, :], bits,
                 mask=live[:, None] & (cols >= NOPE)[None, :])
        # scale part: 7 exponent bytes then one zero pad byte
        block_ids = tl.arange(0, 8)
        scale_bytes = tl.where(block_ids[None, :] < 7, exponent, 0).to(tl.uint8)
        tl.store(pool_ptr + scale_base[:, None] + block_ids[None, :], scale_bytes, mask=live[:, None])


# --------------------------------------------------------------------------------------------------
# Fast path for the preset geometry (rope_dim 64): rows are handled as 32-column pieces so that every
# operation is elementwise between identically laid out tiles (no gathers, few layout conversions)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _rope_interleaved16(q, c, s, BLOCK_N: tl.constexpr):
    """q [BLOCK_N, 32] holding 16 interleaved pairs (2i, 2i + 1); c, s [BLOCK_N, 16] -> rotated q."""
    a, b = tl.split(tl.reshape(q, [BLOCK_N, 16, 2]))
    return tl.reshape(tl.join(a * c - b * s, a * s + b * c), [BLOCK_N, 32])


@triton.jit
def _rope64(qa, qb, table_row, PAIRING: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rotate a 64-dim rope segment given as two [BLOCK_N, 32] halves; table_row [BLOCK_N, 1] pointers.

    interleaved: pair i = segment dims (2i, 2i + 1), so each half holds 16 whole pairs;
    half-split:  pair i = segment dims (i, i + 32), so pair i is column i of (qa, qb).
    """
    if PAIRING == 0:
        c16 = tl.arange(0, 16)[None, :]
        qa = _rope_interleaved16(qa, tl.load(table_row + c16), tl.load(table_row + 32 + c16), BLOCK_N)
        qb = _rope_interleaved16(qb, tl.load(table_row + 16 + c16), tl.load(table_row + 48 + c16), BLOCK_N)
    else:
        c32 = tl.arange(0, 32)[None, :]
        c = tl.load(table_row + c32)
        s = tl.load(table_row + 32 + c32)
        qa, qb = qa * c - qb * s, qa * s + qb * c
    return qa, qb


@triton.jit
def _wht32(x, BLOCK_N: tl.constexpr):
    """x [BLOCK_N, 32] -> x @ H32 (Sylvester order, unscaled): 5 constant-geometry butterfly stages."""
    for _ in tl.static_range(5):
        a, b = tl.split(tl.reshape(x, [BLOCK_N, 16, 2]))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [BLOCK_N, 32])
    return x


@triton.jit
def _fp4_block(x, FP4_RNE: tl.constexpr, BLOCK_N: tl.constexpr):
    """One 32-element block per row x [BLOCK_N, 32] -> (ue8m0 byte [BLOCK_N], packed e2m1 [BLOCK_N, 16])."""
    amax = tl.maximum(tl.max(_finite_abs(x), axis=1), 1e-4)
    exponent = _ue8m0_ceil(tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
    v = _sanitize(x) * _pow2(254 - exponent)[:, None]  # exact: dividing by 2^k
    code = _e2m1_code(tl.minimum(tl.maximum(v, -6.0), 6.0), FP4_RNE)
    even, odd = tl.split(tl.reshape(code, [BLOCK_N, 16, 2]))
    return exponent.to(tl.uint8), (even | (odd << 4)).to(tl.uint8)


# --------------------------------------------------------------------------------------------------
# Index keys, fast path (rope_dim 64, every preset). The tile is x [2, BLOCK_N, 8, 8] = (half, row,
# piece, e) with dim = 64 * half + 8 * piece + e. Listing the half first makes Triton give each thread
# one 64-dim half of one row (two 16-byte loads per piece row... all in registers) and put a row's two
# halves on two neighbouring lanes: the norm sums, the rope pairs, the fp4 blocks and Hadamard bits 0..5
# stay in registers; only the sums and Hadamard bit 6 cross the two lanes (shuffle reductions).
# --------------------------------------------------------------------------------------------------


@triton.jit
def _wht_stage(x, BLOCK_N: tl.constexpr, M: tl.constexpr):
    """Walsh-Hadamard stage on dim bit log2(M) < 6 of x [2, BLOCK_N, 8, 8]: (u, v) -> (u + v, u - v)."""
    u, v = tl.split(tl.permute(tl.reshape(x, [2, BLOCK_N, 32 // M, 2, M]), (0, 1, 2, 4, 3)))
    return tl.reshape(tl.permute(tl.join(u + v, u - v), (0, 1, 2, 4, 3)), [2, BLOCK_N, 8, 8])


@triton.jit
def _wht128_halves(x, half, BLOCK_N: tl.constexpr):
    """x [2, BLOCK_N, 8, 8] -> x @ H128 (Sylvester order, unscaled).

    Bit 6 pairs the two halves of a row, which live on two lanes: sum over the size-2 axis gives u + v,
    the sum of x * (+1, -1) gives u - v (each one exact fp32 add, like the other stages). Bits 0..5 are
    in-register stages.
    """
    plus = tl.sum(x, axis=0)
    minus = tl.sum(x * tl.where(half == 0, 1.0, -1.0), axis=0)
    x = tl.where(half == 0, plus[None, :, :, :], minus[None, :, :, :])
    x = _wht_stage(x, BLOCK_N, 1)
    x = _wht_stage(x, BLOCK_N, 2)
    x = _wht_stage(x, BLOCK_N, 4)
    x = _wht_stage(x, BLOCK_N, 8)
    x = _wht_stage(x, BLOCK_N, 16)
    x = _wht_stage(x, BLOCK_N, 32)
    return x


@triton.jit
def _rope_half(x, half, table_row, PAIRING: tl.constexpr, PLACEMENT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rope on the 64 trailing (half 1) or leading (half 0) dims of x [2, BLOCK_N, 8, 8].

    Both lanes of a row rotate their half with the row's cos / sin (the instructions run once per warp
    either way); the rope half keeps the result. Pairs: dim bit 0 (interleaved (2i, 2i + 1), pair
    i = 4 * piece + j) or dim bit 5 (half-split (i, i + 32), pair i = 8 * piece + e).
    """
    pair = tl.arange(0, 8)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
    c = tl.load(table_row + pair)  # [2, BLOCK_N, 8, 4]
    s = tl.load(table_row + 32 + pair)
    if PAIRING == 0:
        a, b = tl.split(tl.reshape(x, [2, BLOCK_N, 8, 4, 2]))
        rotated = tl.reshape(tl.join(a * c - b * s, a * s + b * c), [2, BLOCK_N, 8, 8])
    else:
        a, b = tl.split(tl.permute(tl.reshape(x, [2, BLOCK_N, 2, 4, 8]), (0, 1, 3, 4, 2)))
        c = tl.reshape(c, [2, BLOCK_N, 4, 8])
        s = tl.reshape(s, [2, BLOCK_N, 4, 8])
        rotated = tl.reshape(tl.permute(tl.join(a * c - b * s, a * s + b * c), (0, 1, 4, 2, 3)),
                             [2, BLOCK_N, 8, 8])
    rope_half = 1 if PLACEMENT == 0 else 0
    return tl.where(half == rope_half, rotated, x)


@triton.jit
def _store_index_keys_kernel(
        keys_ptr, positions_ptr, slots_ptr, pool_ptr, table_ptr, w_ptr, b_ptr,
        n_rows, keys_row_stride, num_slots, max_position, eps,
        NORM: tl.constexpr, HAS_BIAS: tl.constexpr, PAIRING: tl.constexpr, PLACEMENT: tl.constexpr,
        HADAMARD: tl.constexpr, KIND: tl.constexpr, UE8M0: tl.constexpr, FP4_RNE: tl.constexpr,
        VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PAGE_BYTES: tl.constexpr,
        BLOCK_N: tl.constexpr, NATIVE: tl.constexpr):
    """Index keys with rope_dim 64: x [2, BLOCK_N, 8, 8] (half, row, piece, e), two lanes per row.

    Per-row values (slot, position, validity) are kept as [1, BLOCK_N, 1, 1] tensors from the start:
    1-D row vectors used in several layouts trip a Triton 3.6 layout pass (RemoveLayoutConversions).
    """
    PAGE: tl.constexpr = 64
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None, None]  # [1, BLOCK_N, 1, 1]
    slot, pos, live = _live_rows(rows, slots_ptr, positions_ptr, n_rows, num_slots, max_position)
    half = tl.arange(0, 2)[:, None, None, None]
    cols = half * 64 + tl.arange(0, 8)[None, None, :, None] * 8 + tl.arange(0, 8)[None, None, None, :]
    x = tl.load(keys_ptr + rows * keys_row_stride + cols, mask=live, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols + rows * 0).to(tl.float32)  # broadcast over rows, in the tile's layout

    # norm: x * rsqrt(mean(x^2) + eps) * w   or   (x - mean) * rsqrt(mean((x - mean)^2) + eps) * w + b
    if NORM == 1:
        total = tl.sum(tl.sum(tl.sum(x, axis=3), axis=2), axis=0)
        x = x - (total * (1.0 / 128))[None, :, None, None]
    mean_sq = tl.sum(tl.sum(tl.sum(x * x, axis=3), axis=2), axis=0) * (1.0 / 128)
    r = tl.div_rn(tl.full(mean_sq.shape, 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))
    x = x * r[None, :, None, None] * w
    if HAS_BIAS:
        x = x + tl.load(b_ptr + cols + rows * 0).to(tl.float32)
    x = _rope_half(x, half, table_ptr + pos * 64 + half * 0, PAIRING, PLACEMENT, BLOCK_N)
    if HADAMARD:
        x = _wht128_halves(x, half, BLOCK_N) * 0.08838834764831845  # 128^-0.5

    page = slot // PAGE
    entry = slot % PAGE
    value_base = page * PAGE_BYTES + entry * VALUE_BYTES  # [1, BLOCK_N, 1, 1] byte offsets
    scale_base = page * PAGE_BYTES + PAGE * VALUE_BYTES + entry * SCALE_BYTES
    if KIND == 0:  # bf16: 128 x 2 bytes, little endian
        tl.store(pool_ptr.to(tl.pointer_type(tl.uint16)) + value_base // 2 + cols, _bf16_u16(x, NATIVE), mask=live)
    elif KIND == 1:  # fp8 e4m3fn values + one fp32 scale (maybe a power of two)
        amax = tl.max(tl.max(tl.max(_finite_abs(x), axis=3), axis=2), axis=0)[None, :, None, None]
        scale = tl.div_rn(tl.maximum(amax, 1e-4), tl.full(amax.shape, 448.0, tl.float32))
        if UE8M0:
            exponent = _ue8m0_ceil(scale)
            scale = _pow2(exponent)
            inv_scale = _pow2(254 - exponent)
        else:
            inv_scale = tl.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        tl.store(pool_ptr + value_base + cols, _fp8_codes(x, inv_scale, NATIVE), mask=live)
        tl.store(pool_ptr.to(tl.pointer_type(tl.float32)) + scale_base // 4, scale, mask=live)
    else:  # fp4 e2m1: 64 bytes (low nibble = even element) + 4 ue8m0 bytes, one per 32 dims
        blocks = tl.reshape(x, [2, BLOCK_N, 2, 4, 8])  # (half, row, block in half, piece, e)
        amax = tl.maximum(tl.max(tl.max(_finite_abs(blocks), axis=4), axis=3), 1e-4)  # [2, BLOCK_N, 2]
        exponent = _ue8m0_ceil(tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
        v = _sanitize(blocks) * _pow2(254 - exponent)[:, :, :, None, None]  # exact: dividing by 2^k
        code = _e2m1_code(tl.minimum(tl.maximum(v, -6.0), 6.0), FP4_RNE)
        even, odd = tl.split(tl.reshape(code, [2, BLOCK_N, 8, 4, 2]))
        packed = (even | (odd << 4)).to(tl.uint8)  # [2, BLOCK_N, 8, 4]: byte 32 * half + 4 * piece + j
        byte = half * 32 + tl.arange(0, 8)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
        tl.store(pool_ptr + value_base + byte, packed, mask=live)
        scale_byte = half * 2 + tl.arange(0, 2)[None, None, :, None]  # [2, 1, 2, 1]
        tl.store(pool_ptr + scale_base + scale_byte, exponent[:, :, :, None].to(tl.uint8), mask=live)


@triton.jit
def _store_attention_kv_kernel(
        kv_ptr, positions_ptr, slots_ptr, pool_ptr, table_ptr, w_ptr,
        n_rows, kv_row_stride, num_slots, max_position, eps,
        PAIRING: tl.constexpr,
        VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PAGE_BYTES: tl.constexpr,
        BLOCK_N: tl.constexpr, NATIVE: tl.constexpr):
    """V4 attention KV in the fp8-rope-bf16 entry, rope on the trailing 64 dims (either pairing).

    The tile is x [8, BLOCK_N, 8, 8]: (64-dim block, row, piece, e), dim = 64 * block + 8 * piece + e.
    Listing the block first makes Triton spread a row's 8 blocks over 8 lanes of one warp, each lane
    holding one whole 64-dim block: the fp8 block amax and the rope pairs stay in registers and the norm
    sum is one 8-lane shuffle reduction. Block 7 is the rope segment (stored as bf16).
    """
    NOPE: tl.constexpr = 448
    PAGE: tl.constexpr = 64
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None, None]  # [1, BLOCK_N, 1, 1]
    slot, pos, live = _live_rows(rows, slots_ptr, positions_ptr, n_rows, num_slots, max_position)
    block = tl.arange(0, 8)[:, None, None, None]
    cols = block * 64 + tl.arange(0, 8)[None, None, :, None] * 8 + tl.arange(0, 8)[None, None, None, :]
    x = tl.load(kv_ptr + rows * kv_row_stride + cols, mask=live, other=0.0).to(tl.float32)  # [8, BLOCK_N, 8, 8]
    w = tl.load(w_ptr + cols + rows * 0).to(tl.float32)  # broadcast over rows, in the tile's layout
    mean_sq = tl.sum(tl.sum(tl.sum(x * x, axis=3), axis=2), axis=0) * (1.0 / 512)  # [BLOCK_N]
    r = tl.div_rn(tl.full(mean_sq.shape, 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps))
    x = x * r[None, :, None, None] * w

    # rope: every lane rotates its block with the row's cos / sin, block 7 keeps the result
    pair = tl.arange(0, 8)[None, None, :, None] * 4 + tl.arange(0, 4)[None, None, None, :]
    table_row = table_ptr + pos * 64 + block * 0
    c = tl.load(table_row + pair)  # [8, BLOCK_N, 8, 4]: pair i = 4 * piece + j
    s = tl.load(table_row + 32 + pair)
    if PAIRING == 0:  # interleaved pairs (2i, 2i + 1)
        a, b = tl.split(tl.reshape(x, [8, BLOCK_N, 8, 4, 2]))
        rotated = tl.reshape(tl.join(a * c - b * s, a * s + b * c), [8, BLOCK_N, 8, 8])
    else:  # half-split pairs (i, i + 32): dim bit 5 = piece bit 2
        a, b = tl.split(tl.permute(tl.reshape(x, [8, BLOCK_N, 2, 4, 8]), (0, 1, 3, 4, 2)))
        c = tl.reshape(c, [8, BLOCK_N, 4, 8])
        s = tl.reshape(s, [8, BLOCK_N, 4, 8])
        rotated = tl.reshape(tl.permute(tl.join(a * c - b * s, a * s + b * c), (0, 1, 4, 2, 3)), [8, BLOCK_N, 8, 8])
    is_rope = block == 7
    x = tl.where(is_rope, rotated, x)

    page = slot // PAGE
    entry = slot % PAGE
    value_base = page * PAGE_BYTES + entry * VALUE_BYTES  # [1, BLOCK_N, 1, 1]
    scale_base = page * PAGE_BYTES + PAGE * VALUE_BYTES + entry * SCALE_BYTES
    halfword_ptr = pool_ptr.to(tl.pointer_type(tl.uint16))
    # blocks 0..6: e4m3 with one ue8m0 scale each; block 7: 64 bf16 right after the 448 fp8 bytes
    amax = tl.maximum(tl.max(tl.max(_finite_abs(x), axis=3), axis=2), 1e-4)  # [8, BLOCK_N]
    exponent = _ue8m0_ceil(tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
    v = _sanitize(x) * _pow2(254 - exponent)[:, :, None, None]  # exact: dividing by 2^k
    codes = _e4m3_u8(tl.minimum(tl.maximum(v, -448.0), 448.0), NATIVE)
    tl.store(pool_ptr + value_base + cols, codes, mask=live & (block < 7))
    tl.store(halfword_ptr + (value_base + NOPE) // 2 + (cols - NOPE), _bf16_u16(x, NATIVE), mask=live & is_rope)
    scale_byte = tl.where(block < 7, exponent[:, :, None, None], 0).to(tl.uint8)  # 7 scales + 1 zero pad
    tl.store(pool_ptr + scale_base + block, scale_byte, mask=live)


# --------------------------------------------------------------------------------------------------
# Launchers (no validation: the public functions in __init__.py validate) and custom ops
# --------------------------------------------------------------------------------------------------


def _launch_options(device: torch.device) -> dict:
    # Keep a * c - b * s as two rounded products (the reference's arithmetic); the interpreter ignores it.
    return {"enable_fp_fusion": False} if device.type == "cuda" else {}


def _native_casts(pool: torch.Tensor) -> bool:
    """Hardware bf16 / e4m3 conversions on a GPU (both round to nearest even); bit-exact emulation in the
    interpreter, whose float casts truncate. The GPU benchmark checks the native path byte for byte."""
    return pool.device.type == "cuda"


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """Rows may be strided; the last dim must be dense (a copy of the input, never of the pool)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def index_fast_path(rope_dim: int) -> bool:
    """The quarter-tile index kernel covers rope_dim 64 (every preset); other widths use the generic one."""
    return rope_dim == 64


def attention_fast_path(rope_dim: int, placement: str, kind: str) -> bool:
    """The fast attention kernel covers 64 rope dims at the tail (V4) for the fp8-rope-bf16 entry.

    For the plain bf16 entry the generic kernel measured faster on the H200 (1M rows: 0.88 ms versus
    1.39 ms, benchmarks/NOTES.md), so it keeps that format, and every other rope geometry.
    """
    return rope_dim == 64 and placement == "trailing" and kind == "fp8-rope-bf16"


def launch_store_index_keys(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                            rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor, norm_bias: Optional[torch.Tensor],
                            fmt: KeyFormat, norm: str, pairing: str, placement: str, hadamard: bool,
                            eps: float, block_n: int = INDEX_BLOCK_N, num_warps: int = INDEX_NUM_WARPS,
                            generic: bool = False) -> None:
    """Launch the index-key kernel on validated inputs (see ``dsakit.ops.store.store_index_keys``).

    ``generic=True`` forces the any-rope-width kernel (tests and benchmarks compare the two).
    """
    n = keys.shape[0]
    if n == 0:
        return
    keys = _rows_view(keys)
    positions, slots = positions.contiguous(), slots.contiguous()
    table = rope_cos_sin.contiguous()
    common = dict(NORM=_NORMS[norm], HAS_BIAS=norm_bias is not None, PAIRING=_PAIRINGS[pairing],
                  PLACEMENT=_PLACEMENTS[placement], HADAMARD=bool(hadamard), KIND=_KEY_KINDS[fmt.kind],
                  UE8M0=fmt.scale_fmt == "ue8m0", FP4_RNE=fmt.rounding == "rne", VALUE_BYTES=fmt.value_bytes,
                  SCALE_BYTES=fmt.scale_bytes, PAGE_BYTES=fmt.page_bytes, **_launch_options(pool.device))
    args = (keys, positions, slots, pool, table, norm_weight, norm_weight if norm_bias is None else norm_bias,
            n, keys.stride(0), pool.shape[0] * ENTRIES_PER_PAGE, table.shape[0], float(eps))
    if index_fast_path(table.shape[1]) and not generic:
        _store_index_keys_kernel[(triton.cdiv(n, block_n),)](
            *args, NATIVE=_native_casts(pool), BLOCK_N=block_n, num_warps=num_warps, **common)
    else:
        _store_index_keys_generic_kernel[(triton.cdiv(n, GENERIC_BLOCK_N),)](
            *args, ROPE_DIM=table.shape[1], BLOCK_N=GENERIC_BLOCK_N, num_warps=GENERIC_NUM_WARPS, **common)


def launch_store_attention_kv(kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                              rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor, fmt: AttentionKVFormat,
                              pairing: str, placement: str, eps: float, block_n: int = ATTENTION_BLOCK_N,
                              num_warps: int = ATTENTION_NUM_WARPS, generic: bool = False) -> None:
    """Launch the attention-KV kernel on validated inputs (see ``dsakit.ops.store.store_attention_kv``).

    ``block_n`` / ``num_warps`` tune the fast kernel; ``generic=True`` forces the generic one.
    """
    n = kv.shape[0]
    if n == 0:
        return
    kv = _rows_view(kv)
    positions, slots = positions.contiguous(), slots.contiguous()
    table = rope_cos_sin.contiguous()
    common = dict(PAIRING=_PAIRINGS[pairing], VALUE_BYTES=fmt.value_bytes, SCALE_BYTES=fmt.scale_bytes,
                  PAGE_BYTES=fmt.page_bytes, **_launch_options(pool.device))
    args = (kv, positions, slots, pool, table, norm_weight, n, kv.stride(0), pool.shape[0] * ENTRIES_PER_PAGE,
            table.shape[0], float(eps))
    if attention_fast_path(table.shape[1], placement, fmt.kind) and not generic:
        _store_attention_kv_kernel[(triton.cdiv(n, block_n),)](
            *args, NATIVE=_native_casts(pool), BLOCK_N=block_n, num_warps=num_warps, **common)
    else:
        _store_attention_kv_generic_kernel[(triton.cdiv(n, GENERIC_ATTENTION_BLOCK_N),)](
            *args, KIND=_ATTENTION_KINDS[fmt.kind], ROPE_DIM=table.shape[1], PLACEMENT=_PLACEMENTS[placement],
            BLOCK_N=GENERIC_ATTENTION_BLOCK_N, num_warps=GENERIC_NUM_WARPS, **common)


@torch.library.custom_op("dsakit::store_index_keys", mutates_args=("pool",))
def store_index_keys_op(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                        rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor, norm_bias: Optional[torch.Tensor],
                        fmt: str, norm: str, rope_layout: str, hadamard: bool, eps: float) -> None:
    """Custom op around :func:`launch_store_index_keys`; ``fmt`` / ``rope_layout`` by name."""
    pairing, placement = rope_layout.rsplit("-", 1)
    launch_store_index_keys(keys, positions, slots, pool, rope_cos_sin, norm_weight, norm_bias,
                            KeyFormat.parse(fmt), norm, pairing, placement, hadamard, eps)


@store_index_keys_op.register_fake
def _store_index_keys_fake(keys, positions, slots, pool, rope_cos_sin, norm_weight, norm_bias, fmt, norm,
                           rope_layout, hadamard, eps) -> None:
    return None


@torch.library.custom_op("dsakit::store_attention_kv", mutates_args=("pool",))
def store_attention_kv_op(kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                          rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor, fmt: str, rope_layout: str,
                          eps: float) -> None:
    """Custom op around :func:`launch_store_attention_kv`; ``fmt`` / ``rope_layout`` by name."""
    pairing, placement = rope_layout.rsplit("-", 1)
    launch_store_attention_kv(kv, positions, slots, pool, rope_cos_sin, norm_weight,
                              AttentionKVFormat.parse(fmt), pairing, placement, eps)


@store_attention_kv_op.register_fake
def _store_attention_kv_fake(kv, positions, slots, pool, rope_cos_sin, norm_weight, fmt, rope_layout, eps) -> None:
    return None
