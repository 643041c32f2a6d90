"""Fused Triton store kernels: norm -> rope -> (Hadamard) -> quantize -> paged write, one launch.

Two kernels, one per entry family; every option is a compile-time constant:

* ``_store_index_keys_kernel``: pre-norm keys [N, 128] (fp32 / bf16 / fp16) -> index-key cache entries in
  bf16, fp8 (fp32 or ue8m0 scale) or fp4 (threshold or round-half-even ties).
* ``_store_attention_kv_kernel``: pre-norm V4 main-attention KV [N, 512] -> ``fp8-rope-bf16`` (584 B: 448
  e4m3 + 64 bf16 rope values, 7 ue8m0 scales + 1 zero pad byte) or plain ``bf16`` [512] entries.

Each program handles ``BLOCK_N`` rows held in registers as fp32 [BLOCK_N, D]; nothing but the cache entry
is written to global memory. Per row n (pseudocode; the reference in ``reference.py`` is the spec)::

    x      = keys[n]                                 # fp32 [D]
    x      = x * rsqrt(mean(x^2) + eps) * w          # or (x - mean) * rsqrt(var + eps) * w + b
    x[a_i], x[b_i] = a c - b s, a s + b c            # rope pairs of the layout, c/s = table[pos[n]]
    x      = x @ H128 / sqrt(128)                    # index keys, optional: 7-stage butterfly in registers
    pool[page(slot[n])] <- bytes of quantize(x)      # byte layout: dsakit.formats

Byte-exactness with the reference (CPU, fp32) is the goal, so the arithmetic mirrors it:

* every division the reference does is a correctly rounded ``div_rn``; ``rsqrt(v)`` is ``1 / sqrt_rn(v)``
  (what torch's CPU rsqrt computes); the launcher disables fp contraction so ``a * c - b * s`` is not fused
  into an FMA (the reference rounds each product);
* casts to bf16 / e4m3fn / e2m1 and the ue8m0 exponent are integer bit arithmetic (round-to-nearest-even
  written out), identical on the GPU and in the Triton interpreter (whose own float casts truncate);
* what cannot be identical is the order of the fp32 sums (mean of squares over 128 / 512 elements, the
  Hadamard butterfly versus the reference's matmul). Those differ in the last fp32 bit now and then, which
  changes a stored byte only when the reference value lies within that rounding of a code boundary: then
  the byte differs by one code (one ulp of the stored format; an fp32 fp8 scale by one fp32 ulp). The
  tests check exactly this bound.

Safety without validation (CUDA-graph capture, torch.compile): rows whose slot is negative or
>= num_slots, or whose position is outside the rope table, are not written; no address outside the pool,
the inputs or the table is ever formed.

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

# Tile sizes: rows per program. 16 x 128 fp32 keeps a tile in 16 registers per thread at 4 warps; a
# 512-dim attention row is 4x larger, so 4 rows. Tuned on the H200 (benchmarks/NOTES.md, store section).
INDEX_BLOCK_N = 16
INDEX_NUM_WARPS = 4
ATTENTION_BLOCK_N = 4
ATTENTION_NUM_WARPS = 4


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
def _store_index_keys_kernel(
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
    in_range = rows < n_rows
    slot = tl.load(slots_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    pos = tl.load(positions_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    # rows that are padding or would address outside the pool / rope table are never read nor written
    live = in_range & (slot >= 0) & (slot < num_slots) & (pos >= 0) & (pos < max_position)
    pos = tl.where(live, pos, 0)
    slot = tl.where(live, slot, 0)

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
            v = _sanitize(x) * _pow2(254 - exponent)[:, None]  # exact: dividing by 2^k
        else:
            v = tl.div_rn(_sanitize(x), tl.broadcast_to(scale[:, None], x.shape))
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        codes = _e4m3_bits(v).to(tl.uint8)
        tl.store(pool_ptr + value_base[:, None] + cols[None, :], codes, mask=live[:, None])
        scale_dst = pool_ptr.to(tl.pointer_type(tl.float32)) + scale_base // 4
        tl.store(scale_dst, scale, mask=live)
    else:  # fp4 e2m1: 64 bytes (low nibble = even element) + 4 ue8m0 bytes (one per 32 elements)
        blocks = tl.reshape(x, [BLOCK_N, 4, 32])
        amax = tl.maximum(tl.max(_finite_abs(blocks), axis=2), 1e-4)  # [BLOCK_N, 4]
        exponent = _ue8m0_ceil(tl.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
        v = _sanitize(blocks) * _pow2(254 - exponent)[:, :, None]  # exact: dividing by 2^k
        v = tl.minimum(tl.maximum(v, -6.0), 6.0)
        mag = tl.abs(v)
        # code = number of thresholds strictly below |v| (ties go to the smaller magnitude) ...
        code = ((mag > 0.25).to(tl.int32) + (mag > 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
                + (mag > 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag > 3.5).to(tl.int32)
                + (mag > 5.0).to(tl.int32))
        if FP4_RNE:  # ... except a tie above an odd code goes up to the even one (0.75, 1.75, 3.5)
            code += ((mag == 0.75) | (mag == 1.75) | (mag == 3.5)).to(tl.int32)
        code = code | ((v < 0).to(tl.int32) << 3)
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
def _store_attention_kv_kernel(
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
    in_range = rows < n_rows
    slot = tl.load(slots_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    pos = tl.load(positions_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    live = in_range & (slot >= 0) & (slot < num_slots) & (pos >= 0) & (pos < max_position)
    pos = tl.where(live, pos, 0)
    slot = tl.where(live, slot, 0)

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
# Launchers (no validation: the public functions in __init__.py validate) and custom ops
# --------------------------------------------------------------------------------------------------


def _launch_options(device: torch.device) -> dict:
    # Keep a * c - b * s as two rounded products (the reference's arithmetic); the interpreter ignores it.
    return {"enable_fp_fusion": False} if device.type == "cuda" else {}


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """Rows may be strided; the last dim must be dense (a copy of the input, never of the pool)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_store_index_keys(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                            rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor, norm_bias: Optional[torch.Tensor],
                            fmt: KeyFormat, norm: str, pairing: str, placement: str, hadamard: bool,
                            eps: float, block_n: int = INDEX_BLOCK_N, num_warps: int = INDEX_NUM_WARPS) -> None:
    """Launch the index-key kernel on validated inputs (see ``dsakit.ops.store.store_index_keys``)."""
    n = keys.shape[0]
    if n == 0:
        return
    keys = _rows_view(keys)
    positions, slots = positions.contiguous(), slots.contiguous()
    table = rope_cos_sin.contiguous()
    grid = (triton.cdiv(n, block_n),)
    _store_index_keys_kernel[grid](
        keys, positions, slots, pool, table, norm_weight, norm_weight if norm_bias is None else norm_bias,
        n, keys.stride(0), pool.shape[0] * ENTRIES_PER_PAGE, table.shape[0], float(eps),
        NORM=_NORMS[norm], HAS_BIAS=norm_bias is not None, ROPE_DIM=table.shape[1], PAIRING=_PAIRINGS[pairing], PLACEMENT=_PLACEMENTS[placement],
        HADAMARD=bool(hadamard), KIND=_KEY_KINDS[fmt.kind], UE8M0=fmt.scale_fmt == "ue8m0",
        FP4_RNE=fmt.rounding == "rne", VALUE_BYTES=fmt.value_bytes, SCALE_BYTES=fmt.scale_bytes,
        PAGE_BYTES=fmt.page_bytes, BLOCK_N=block_n, num_warps=num_warps, **_launch_options(pool.device))


def launch_store_attention_kv(kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                              rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor, fmt: AttentionKVFormat,
                              pairing: str, placement: str, eps: float, block_n: int = ATTENTION_BLOCK_N,
                              num_warps: int = ATTENTION_NUM_WARPS) -> None:
    """Launch the attention-KV kernel on validated inputs (see ``dsakit.ops.store.store_attention_kv``)."""
    n = kv.shape[0]
    if n == 0:
        return
    kv = _rows_view(kv)
    positions, slots = positions.contiguous(), slots.contiguous()
    table = rope_cos_sin.contiguous()
    grid = (triton.cdiv(n, block_n),)
    _store_attention_kv_kernel[grid](
        kv, positions, slots, pool, table, norm_weight,
        n, kv.stride(0), pool.shape[0] * ENTRIES_PER_PAGE, table.shape[0], float(eps),
        ROPE_DIM=table.shape[1], PAIRING=_PAIRINGS[pairing], PLACEMENT=_PLACEMENTS[placement],
        KIND=_ATTENTION_KINDS[fmt.kind], VALUE_BYTES=fmt.value_bytes, SCALE_BYTES=fmt.scale_bytes,
        PAGE_BYTES=fmt.page_bytes, BLOCK_N=block_n, num_warps=num_warps, **_launch_options(pool.device))


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
