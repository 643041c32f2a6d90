"""Triton kernels of the fused store (launch code: :mod:`dsakit.ops.store.triton`, which documents the
pipeline, the byte-exactness rules and the safety without validation).

Index keys are encoded and written by the format codecs of :mod:`dsakit.formats.triton` (``CODE`` = the
format's :class:`dsakit.formats.codes.KeyCode`); the element codecs of the attention-KV entry (e4m3, bf16, ue8m0
scales) come from the same per-format modules.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...formats.bf16 import bf16_bits, bf16_u16
from ...formats.common import finite_abs_tl, pow2_tl, sanitize_tl, ue8m0_ceil_tl
from ...formats.fp8 import e4m3_bits, e4m3_u8
from ...formats.triton import (key_page_started, key_page_value, load_key_decoded, load_key_page_value,
                               store_key_halves, store_key_page_halves, store_key_page_rows, store_key_page_value,
                               store_key_rows)

# 128^-0.5 as the fp32 constant hadamard_matrix() scales by (dsakit.transforms), applied as 2^-4 before the
# butterfly (exact) and sqrt(2) after it: fl(sqrt(2)) / 16 = fl(128^-0.5), so the bits are the same, and the
# butterfly's unscaled sums of values near the fp32 maximum do not overflow
HADAMARD_PRE_SCALE = tl.constexpr(0.0625)
HADAMARD_POST_SCALE = tl.constexpr(1.4142135623730951)


# PAGE_STEP of the index-key kernels: what a launch does for a format with a per-page side value (the
# page-centred keys' centre); the launcher picks them (StoreConfig.page_term_launches)
PAGE_NONE = tl.constexpr(0)  # no side value (plain formats)
PAGE_ONE_LAUNCH = tl.constexpr(1)  # entries and side values in one launch (_page_sources)
PAGE_SIDES = tl.constexpr(2)  # first of two launches: the side values of the pages whose entry 0 is a row
PAGE_ENTRIES = tl.constexpr(3)  # second of two: every entry against the side value in the pool


# SUMMARY of the index-key store kernels: whether the launch also keeps the page summaries
# (dsakit.pool.PageSummaries); the launcher picks it (triton.py, "Page summaries")
SUMMARY_NONE = tl.constexpr(0)  # no summaries, or a second launch (_summarize_pages_kernel) keeps them
SUMMARY_IN_STORE = tl.constexpr(1)  # each live row's page is summarized by its own program after its store
CANONICAL_BF16_NAN = tl.constexpr(0x7FC0)  # dsakit.pool.CANONICAL_BF16_NAN


# --------------------------------------------------------------------------------------------------
# Device helpers (all exact, portable between the GPU and the interpreter)
# --------------------------------------------------------------------------------------------------


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
def _norm_inv_scale(amax):
    """2^-k (k in 0..126) from the exponent bits of a row's max |x|: dsakit.transforms.norm_scale, so a
    finite row near the fp32 maximum normalizes without overflowing its sums (exact scaling otherwise)."""
    biased = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    k = tl.minimum(tl.maximum(biased - 127, 0), 126)
    return ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _inverse_norm(mean_sq, eps_scaled):
    """1 / sqrt_rn(mean_sq + eps), clamped to the fp32 maximum (zero rows without eps: 0, not NaN).

    A NaN mean square (a row holding NaN) stays NaN, as torch's clamp keeps it: the clamp must propagate
    NaN explicitly, because the default ``tl.minimum`` compiles to the GPU's ``min.f32``, which returns the
    other operand (the interpreter's numpy minimum propagates, so only the GPU stored such rows as huge
    finite values: benchmarks/results/store_nonfinite_h200_2abae80.log).
    """
    r = tl.div_rn(tl.full(mean_sq.shape, 1.0, tl.float32), tl.sqrt_rn(mean_sq + eps_scaled))
    return tl.minimum(r, 3.4028234663852886e38, propagate_nan=tl.PropagateNan.ALL)


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
    inv = _norm_inv_scale(tl.max(tl.abs(x), axis=1))  # [BLOCK_N]
    eps_scaled = eps * inv * inv
    x = x * inv[:, None]
    partner = partner * inv[:, None]
    if NORM == 0:  # RMSNorm: x * rsqrt(mean(x^2) + eps) * w
        mean_sq = tl.sum(x * x, axis=1) * inv_d
        r = _inverse_norm(mean_sq, eps_scaled)[:, None]
        x = x * r * w
        partner = partner * r * w_partner
    else:  # LayerNorm: (x - mean) * rsqrt(mean((x - mean)^2) + eps) * w + b
        mean = (tl.sum(x, axis=1) * inv_d)[:, None]
        centered = x - mean
        var = tl.sum(centered * centered, axis=1) * inv_d
        r = _inverse_norm(var, eps_scaled)[:, None]
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
# Page summaries (the spec: dsakit.pool.summarize_page), any layout
# --------------------------------------------------------------------------------------------------


@triton.jit
def _bf16_summary_bits(x):
    """fp32 -> bf16 bits (uint16), round to nearest even, every NaN as the canonical 0x7FC0."""
    return tl.where(x != x, CANONICAL_BF16_NAN, bf16_bits(x)).to(tl.uint16)


@triton.jit
def _bf16_outward_bits(x, DOWN: tl.constexpr):
    """fp32 -> bf16 bits (uint16) rounded toward -inf (DOWN) or +inf: the RNE value, moved one bf16 step
    outward when it lies on the wrong side of x (torch.nextafter on the bits; NaN -> 0x7FC0)."""
    r = bf16_bits(x)  # uint32 holding 16 bits
    back = (r << 16).to(tl.float32, bitcast=True)
    negative = (r & 0x8000) != 0
    zero = (r & 0x7FFF) == 0
    if DOWN:  # next toward -inf: a positive value shrinks, +0 becomes -2^-133, a negative one grows
        wrong = back > x
        step = tl.where(negative, r + 1, tl.where(zero, 0x8001, r - 1))
    else:  # next toward +inf: a negative value shrinks toward 0, -0 becomes +2^-133, a positive one grows
        wrong = back < x
        step = tl.where(negative, tl.where(zero, 0x0001, r - 1), r + 1)
    out = tl.where(wrong, step, r)
    return tl.where(x != x, CANONICAL_BF16_NAN, out).to(tl.uint16)


@triton.jit
def _store_page_summaries(pool_ptr, page, page_base, last, active, cols, centre_ptr, lower_ptr, upper_ptr,
                          CODE: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr):
    """Summarize entries 0..last of each active row's page from the pool and write its three summary rows.

    page / page_base / last / active: per row, broadcasting against cols (the dims) in any layout ([BLOCK_N, 1]
    x [1, D] or [1, BLOCK_N, 1, 1] x [2, 1, 8, 8]). The spec's arithmetic (dsakit.pool.summarize_page): the
    decoded rows added one at a time in entry order from fp32 zeros, one IEEE division by the count
    (div_rn), bf16 RNE; the per-dimension min / max of the decoded rows (-0 read as +0, NaN propagated)
    rounded outward. One entry per iteration, up to the block's largest ``last`` (none if no row is active).
    """
    zero = (cols * 0 + last * 0).to(tl.float32)  # the full broadcast shape
    total = zero
    lower = zero + float("inf")
    upper = zero - float("inf")
    rounds = tl.max(tl.ravel(tl.where(active, last, -1)), axis=0) + 1
    # a constant trip count with a uniform branch (the interpreter cannot loop to a tensor-valued bound)
    for j in range(0, PAGE):
        if j < rounds:
            take = active & (j <= last)
            x = load_key_decoded(pool_ptr, page_base, j, cols, take, CODE, D)
            total = tl.where(take, total + x, total)
            boxed = tl.where(x == 0.0, 0.0, x)
            lower = tl.where(take & ((boxed < lower) | (boxed != boxed)), boxed, lower)
            upper = tl.where(take & ((boxed > upper) | (boxed != boxed)), boxed, upper)
    centre = tl.div_rn(total, (last + 1).to(tl.float32) + zero)
    row = page * D + cols
    mask = active & (cols >= 0)
    tl.store(centre_ptr.to(tl.pointer_type(tl.uint16)) + row, _bf16_summary_bits(centre), mask=mask)
    tl.store(lower_ptr.to(tl.pointer_type(tl.uint16)) + row, _bf16_outward_bits(lower, True), mask=mask)
    tl.store(upper_ptr.to(tl.pointer_type(tl.uint16)) + row, _bf16_outward_bits(upper, False), mask=mask)


@triton.jit
def _summarize_pages_kernel(slots_ptr, positions_ptr, pool_ptr, centre_ptr, lower_ptr, upper_ptr,
                            n_rows, num_slots, max_position,
                            CODE: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PAGE_BYTES: tl.constexpr,
                            BLOCK_N: tl.constexpr):
    """The second launch of a store whose pages may get several rows: after every row is stored, the row that
    ends each page's run (the next row does not hold the next entry of the same page) summarizes the page's
    entries 0..its entry from the pool. Rows are the store's (same liveness: dead rows are never read)."""
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, D)
    slot, _, live = _live_rows(rows, slots_ptr, positions_ptr, n_rows, num_slots, max_position)
    next_slot, _, next_live = _live_rows(rows + 1, slots_ptr, positions_ptr, n_rows, num_slots, max_position)
    entry = slot % PAGE
    ends_run = live & ~(next_live & (entry < PAGE - 1) & (next_slot == slot + 1))
    page = slot // PAGE
    _store_page_summaries(pool_ptr, page[:, None], (page * PAGE_BYTES)[:, None], entry[:, None],
                          ends_run[:, None], cols[None, :], centre_ptr, lower_ptr, upper_ptr, CODE, D, PAGE)


# --------------------------------------------------------------------------------------------------
# Index keys: [N, 128] -> bf16 / fp8 / fp4 entries
# --------------------------------------------------------------------------------------------------


@triton.jit
def _transform_rows(keys_ptr, rows, pos, live, w_ptr, b_ptr, table_ptr, keys_row_stride, eps, cols, in_rope,
                    is_second, partner_cols, pair, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ROPE_DIM: tl.constexpr, HADAMARD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Index-key rows [BLOCK_N] (row indices, their positions and live mask) -> transformed keys fp32
    [BLOCK_N, 128]: norm, rope, optional Hadamard (dead rows read 0)."""
    row_base = keys_ptr + rows[:, None] * keys_row_stride
    rope_mask = live[:, None] & in_rope[None, :]
    table_row = table_ptr + pos[:, None] * ROPE_DIM + pair[None, :]
    x = _norm_rope(row_base + cols[None, :], row_base + partner_cols[None, :], live[:, None], w_ptr, b_ptr,
                   table_row, table_row + ROPE_DIM // 2, rope_mask, is_second[None, :], partner_cols[None, :],
                   cols, eps, 128, NORM, HAS_BIAS)  # [BLOCK_N, 128]
    if HADAMARD:
        x = _hadamard128(x * HADAMARD_PRE_SCALE, BLOCK_N) * HADAMARD_POST_SCALE
    return x


@triton.jit
def _page_sources(rows, slot, entry, live, slots_ptr, positions_ptr, n_rows, num_slots, max_position):
    """Where each row of a page-term format (page-centred keys) gets its page's side value from.

    Returns (source row, its position, in_call, from_pool), shaped like ``rows``: ``in_call`` rows (entry > 0)
    take it from the row of this call that holds their page's entry 0, which is ``rows - entry`` when the
    rows of a page run in order from its entry 0 (every sequence append does; the public store refuses
    other orders); ``from_pool`` rows (entry > 0, entry 0 not in the call) read the one an earlier call
    stored. Entry 0 rows make their own.
    """
    src = rows - entry
    src_slot, src_pos, src_live = _live_rows(tl.where(src >= 0, src, n_rows), slots_ptr, positions_ptr, n_rows,
                                             num_slots, max_position)
    in_call = live & (entry > 0) & src_live & (src_slot == slot - entry)
    from_pool = live & (entry > 0) & ~in_call
    return src, src_pos, in_call, from_pool


@triton.jit
def _store_index_keys_generic_kernel(
        keys_ptr, positions_ptr, slots_ptr, pool_ptr, table_ptr, w_ptr, b_ptr,
        n_rows, keys_row_stride, num_slots, max_position, eps, centre_ptr, lower_ptr, upper_ptr,
        NORM: tl.constexpr, HAS_BIAS: tl.constexpr, ROPE_DIM: tl.constexpr, PAIRING: tl.constexpr, PLACEMENT: tl.constexpr,
        HADAMARD: tl.constexpr, CODE: tl.constexpr, UE8M0: tl.constexpr, FP4_RNE: tl.constexpr,
        VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PAGE_BYTES: tl.constexpr, PAGE_STEP: tl.constexpr,
        D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SUMMARY: tl.constexpr):
    """Index keys [N, D] for any rope width / placement (D = 128, PAGE = 64 entries per page: the format's).
    SUMMARY (SUMMARY_IN_STORE): each live row's program then summarizes its page (centre_ptr / lower_ptr /
    upper_ptr: the PageSummaries rows) over entries 0..its entry, the launcher's rows holding at most one row
    per page (the entries before it were stored by earlier launches)."""
    tl.static_assert(D == 128, "the index kernels rotate 128-dim keys (Hadamard 128)")
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    cols = tl.arange(0, D)  # [D]
    slot, pos, live = _live_rows(rows, slots_ptr, positions_ptr, n_rows, num_slots, max_position)
    in_rope, is_second, partner_cols, pair = _rope_geometry(cols, D, ROPE_DIM, PAIRING, PLACEMENT)
    page = slot // PAGE
    entry = slot % PAGE
    page_base = page * PAGE_BYTES
    value_base = page_base + entry * VALUE_BYTES  # [BLOCK_N] byte offsets
    scale_base = page_base + PAGE * VALUE_BYTES + entry * SCALE_BYTES
    if PAGE_STEP == PAGE_SIDES:
        live = live & (entry == 0)
    if (PAGE_STEP == PAGE_ONE_LAUNCH) or (PAGE_STEP == PAGE_ENTRIES):
        src, src_pos, in_call, from_pool = _page_sources(rows, slot, entry, live, slots_ptr, positions_ptr, n_rows,
                                                         num_slots, max_position)
        # a page never started (entry 0 never stored) has no side value: its rows are dropped, not coded
        # against zeros (the public store refuses them before launching)
        live = live & (~from_pool | key_page_started(pool_ptr, page_base, from_pool, CODE, D))
        if PAGE_STEP == PAGE_ENTRIES:  # the side values of this call's pages are in the pool already
            from_pool = live & (entry > 0)
        value = load_key_page_value(pool_ptr, page_base[:, None], cols[None, :], (from_pool & live)[:, None], CODE)
        if PAGE_STEP == PAGE_ONE_LAUNCH:
            need = in_call & live
            # bulk stores: entry 0's key again, with the same arithmetic (before x: the two are never both live)
            if tl.max(need.to(tl.int32), axis=0) > 0:
                x0 = _transform_rows(keys_ptr, src, src_pos, need, w_ptr, b_ptr, table_ptr, keys_row_stride, eps,
                                     cols, in_rope, is_second, partner_cols, pair, NORM, HAS_BIAS, ROPE_DIM, HADAMARD,
                                     BLOCK_N)
                value = tl.where(need[:, None], key_page_value(x0, CODE, False), value)
    x = _transform_rows(keys_ptr, rows, pos, live, w_ptr, b_ptr, table_ptr, keys_row_stride, eps, cols, in_rope,
                        is_second, partner_cols, pair, NORM, HAS_BIAS, ROPE_DIM, HADAMARD, BLOCK_N)
    if PAGE_STEP == PAGE_NONE:
        store_key_rows(x, pool_ptr, page_base, value_base, scale_base, cols, live, CODE, UE8M0, FP4_RNE, BLOCK_N)
    elif PAGE_STEP == PAGE_SIDES:
        store_key_page_value(key_page_value(x, CODE, False), pool_ptr, page_base[:, None], cols[None, :],
                             live[:, None], CODE)
    else:
        first = entry == 0
        value = tl.where(first[:, None], key_page_value(x, CODE, False), value)
        store_key_page_rows(x, value, first, pool_ptr, page_base, value_base, scale_base, cols, live, CODE, UE8M0,
                            FP4_RNE, BLOCK_N)
    if (SUMMARY == SUMMARY_IN_STORE) and (PAGE_STEP != PAGE_SIDES):
        tl.debug_barrier()  # this program's stores are visible to all its threads before they read the page
        _store_page_summaries(pool_ptr, page[:, None], page_base[:, None], entry[:, None], live[:, None],
                              cols[None, :], centre_ptr, lower_ptr, upper_ptr, CODE, D, PAGE)


# --------------------------------------------------------------------------------------------------
# V4 main-attention KV: [N, 512] -> fp8-rope-bf16 (584 B) or bf16 (1024 B)
# --------------------------------------------------------------------------------------------------


@triton.jit
def _store_attention_kv_generic_kernel(
        kv_ptr, positions_ptr, slots_ptr, pool_ptr, table_ptr, w_ptr,
        n_rows, kv_row_stride, num_slots, max_position, eps,
        ROPE_DIM: tl.constexpr, PAIRING: tl.constexpr, PLACEMENT: tl.constexpr, KIND: tl.constexpr,
        VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PAGE_BYTES: tl.constexpr,
        D: tl.constexpr, NOPE: tl.constexpr, FP8_BLOCK: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Attention KV [N, D] for any rope geometry. Layout constants from the format (dsakit.formats): D = 512
    dims, NOPE = 448 fp8 dims of the fp8-rope-bf16 entry in blocks of FP8_BLOCK = 64 with one ue8m0 scale each
    (then SCALE_BYTES - NOPE / FP8_BLOCK zero pad bytes), PAGE = 64 entries per page."""
    BLOCKS: tl.constexpr = D // FP8_BLOCK
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
    bits = bf16_bits(x).to(tl.uint16)
    halfword_ptr = pool_ptr.to(tl.pointer_type(tl.uint16))
    if KIND == 0:  # bf16 [512]
        tl.store(halfword_ptr + (value_base // 2)[:, None] + cols[None, :], bits, mask=live[:, None])
    else:
        # 8 blocks of 64: blocks 0..6 are fp8 with a ue8m0 scale each, block 7 the bf16 tail
        blocks = tl.reshape(x, [BLOCK_N, BLOCKS, FP8_BLOCK])
        amax = tl.maximum(tl.max(finite_abs_tl(blocks), axis=2), 1e-4)  # [BLOCK_N, BLOCKS]
        exponent = ue8m0_ceil_tl(tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
        v = sanitize_tl(blocks) * pow2_tl(254 - exponent)[:, :, None]  # exact: dividing by 2^k
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        codes = tl.reshape(e4m3_bits(v), [BLOCK_N, D]).to(tl.uint8)
        is_nope = cols < NOPE
        tl.store(pool_ptr + value_base[:, None] + cols[None, :], codes, mask=live[:, None] & is_nope[None, :])
        tail = tl.where(is_nope, 0, cols - NOPE)  # bf16 element index of the tail, 0..63
        tl.store(halfword_ptr + ((value_base + NOPE) // 2)[:, None] + tail[None, :], bits,
                 mask=live[:, None] & (cols >= NOPE)[None, :])
        # scale part: 7 exponent bytes then one zero pad byte
        tl.static_assert(SCALE_BYTES == BLOCKS, "one scale byte per 64-dim block (the rope block's is the pad)")
        block_ids = tl.arange(0, SCALE_BYTES)
        scale_bytes = tl.where(block_ids[None, :] < NOPE // FP8_BLOCK, exponent, 0).to(tl.uint8)
        tl.store(pool_ptr + scale_base[:, None] + block_ids[None, :], scale_bytes, mask=live[:, None])


# --------------------------------------------------------------------------------------------------
# Fast path for the preset geometry (rope_dim 64): rows are handled as 32-column pieces so that every
# operation is elementwise between identically laid out tiles (no gathers, few layout conversions)
# --------------------------------------------------------------------------------------------------


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
def _transform_halves(keys_ptr, rows, pos, live, half, cols, w_ptr, b_ptr, table_ptr, keys_row_stride, eps,
                      NORM: tl.constexpr, HAS_BIAS: tl.constexpr, PAIRING: tl.constexpr, PLACEMENT: tl.constexpr,
                      HADAMARD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows / positions / live [1, BLOCK_N, 1, 1] -> transformed keys x fp32 [2, BLOCK_N, 8, 8] (half, row, piece,
    e): norm, rope on 64 dims, optional Hadamard (dead rows read 0)."""
    x = tl.load(keys_ptr + rows * keys_row_stride + cols, mask=live, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols + rows * 0).to(tl.float32)  # broadcast over rows, in the tile's layout

    # norm: x * rsqrt(mean(x^2) + eps) * w   or   (x - mean) * rsqrt(mean((x - mean)^2) + eps) * w + b,
    # on x * 2^-k with eps * 2^-2k (dsakit.transforms.norm_scale)
    inv = _norm_inv_scale(tl.max(tl.max(tl.max(tl.abs(x), axis=3), axis=2), axis=0))  # [BLOCK_N]
    x = x * inv[None, :, None, None]
    if NORM == 1:
        total = tl.sum(tl.sum(tl.sum(x, axis=3), axis=2), axis=0)
        x = x - (total * (1.0 / 128))[None, :, None, None]
    mean_sq = tl.sum(tl.sum(tl.sum(x * x, axis=3), axis=2), axis=0) * (1.0 / 128)
    r = _inverse_norm(mean_sq, eps * inv * inv)
    x = x * r[None, :, None, None] * w
    if HAS_BIAS:
        x = x + tl.load(b_ptr + cols + rows * 0).to(tl.float32)
    x = _rope_half(x, half, table_ptr + pos * 64 + half * 0, PAIRING, PLACEMENT, BLOCK_N)
    if HADAMARD:
        x = _wht128_halves(x * HADAMARD_PRE_SCALE, half, BLOCK_N) * HADAMARD_POST_SCALE
    return x


@triton.jit
def _store_index_keys_kernel(
        keys_ptr, positions_ptr, slots_ptr, pool_ptr, table_ptr, w_ptr, b_ptr,
        n_rows, keys_row_stride, num_slots, max_position, eps, centre_ptr, lower_ptr, upper_ptr,
        NORM: tl.constexpr, HAS_BIAS: tl.constexpr, PAIRING: tl.constexpr, PLACEMENT: tl.constexpr,
        HADAMARD: tl.constexpr, CODE: tl.constexpr, UE8M0: tl.constexpr, FP4_RNE: tl.constexpr,
        VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PAGE_BYTES: tl.constexpr, PAGE_STEP: tl.constexpr,
        D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE: tl.constexpr,
        SUMMARY: tl.constexpr):
    """Index keys with rope_dim 64: x [2, BLOCK_N, 8, 8] (half, row, piece, e), two lanes per row.

    Per-row values (slot, position, validity) are kept as [1, BLOCK_N, 1, 1] tensors from the start:
    1-D row vectors used in several layouts trip a Triton 3.6 layout pass (RemoveLayoutConversions).
    PAGE_STEP (formats with a per-page side value: the page-centred keys; the PAGE_* constants): in one launch,
    rows at entry 0 of a page make and write their page's side value and the others code against it (see
    ``_page_sources``), or the same in two launches (side values, then entries).
    D / PAGE: the format's dims and entries per page (the tile is built for 128 dims). SUMMARY: as in the
    generic kernel (the page summaries of a store with at most one row per page, in this launch).
    """
    tl.static_assert(D == 128, "the tile [2, BLOCK_N, 8, 8] holds 128-dim keys")
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None, None]  # [1, BLOCK_N, 1, 1]
    slot, pos, live = _live_rows(rows, slots_ptr, positions_ptr, n_rows, num_slots, max_position)
    half = tl.arange(0, 2)[:, None, None, None]
    cols = half * 64 + tl.arange(0, 8)[None, None, :, None] * 8 + tl.arange(0, 8)[None, None, None, :]
    page = slot // PAGE
    entry = slot % PAGE
    page_base = page * PAGE_BYTES
    value_base = page_base + entry * VALUE_BYTES  # [1, BLOCK_N, 1, 1] byte offsets
    scale_base = page_base + PAGE * VALUE_BYTES + entry * SCALE_BYTES
    if PAGE_STEP == PAGE_SIDES:
        live = live & (entry == 0)
        if tl.max(live.to(tl.int32)) > 0:  # only programs holding an entry 0 transform anything
            x = _transform_halves(keys_ptr, rows, pos, live, half, cols, w_ptr, b_ptr, table_ptr, keys_row_stride,
                                  eps, NORM, HAS_BIAS, PAIRING, PLACEMENT, HADAMARD, BLOCK_N)
            store_key_page_value(key_page_value(x, CODE, NATIVE), pool_ptr, page_base, cols, live, CODE)
        return
    x = _transform_halves(keys_ptr, rows, pos, live, half, cols, w_ptr, b_ptr, table_ptr, keys_row_stride, eps,
                          NORM, HAS_BIAS, PAIRING, PLACEMENT, HADAMARD, BLOCK_N)
    if PAGE_STEP == PAGE_NONE:
        store_key_halves(x, pool_ptr, page_base, value_base, scale_base, cols, half, live, CODE, UE8M0, FP4_RNE,
                         NATIVE, BLOCK_N)
    else:  # as in the generic kernel
        src, src_pos, in_call, from_pool = _page_sources(rows, slot, entry, live, slots_ptr, positions_ptr, n_rows,
                                                         num_slots, max_position)
        live = live & (~from_pool | key_page_started(pool_ptr, page_base, from_pool, CODE, 128))
        if PAGE_STEP == PAGE_ENTRIES:
            from_pool = live & (entry > 0)
        first = entry == 0
        value = tl.where(first, key_page_value(x, CODE, NATIVE),
                         load_key_page_value(pool_ptr, page_base, cols, from_pool & live, CODE))
        if PAGE_STEP == PAGE_ONE_LAUNCH:
            need = in_call & live
            if tl.max(need.to(tl.int32)) > 0:  # bulk stores: entry 0's key again, the same arithmetic and layout
                x0 = _transform_halves(keys_ptr, src, src_pos, need, half, cols, w_ptr, b_ptr, table_ptr,
                                       keys_row_stride, eps, NORM, HAS_BIAS, PAIRING, PLACEMENT, HADAMARD, BLOCK_N)
                value = tl.where(need, key_page_value(x0, CODE, NATIVE), value)
        store_key_page_halves(x, value, first, pool_ptr, page_base, value_base, scale_base, cols, half, live, CODE,
                              UE8M0, FP4_RNE, NATIVE, BLOCK_N)
    if SUMMARY == SUMMARY_IN_STORE:  # (PAGE_SIDES returned above)
        tl.debug_barrier()  # this program's stores are visible to all its threads before they read the page
        _store_page_summaries(pool_ptr, page, page_base, entry, live, cols, centre_ptr, lower_ptr, upper_ptr,
                              CODE, D, PAGE)


@triton.jit
def _store_attention_kv_kernel(
        kv_ptr, positions_ptr, slots_ptr, pool_ptr, table_ptr, w_ptr,
        n_rows, kv_row_stride, num_slots, max_position, eps,
        PAIRING: tl.constexpr,
        VALUE_BYTES: tl.constexpr, SCALE_BYTES: tl.constexpr, PAGE_BYTES: tl.constexpr,
        D: tl.constexpr, NOPE: tl.constexpr, FP8_BLOCK: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_N: tl.constexpr, NATIVE: tl.constexpr):
    """V4 attention KV in the fp8-rope-bf16 entry, rope on the trailing 64 dims (either pairing); layout
    constants as in the generic kernel (from the format).

    The tile is x [8, BLOCK_N, 8, 8]: (64-dim block, row, piece, e), dim = 64 * block + 8 * piece + e.
    Listing the block first makes Triton spread a row's 8 blocks over 8 lanes of one warp, each lane
    holding one whole 64-dim block: the fp8 block amax and the rope pairs stay in registers and the norm
    sum is one 8-lane shuffle reduction. Block 7 is the rope segment (stored as bf16).
    """
    tl.static_assert((D == 512) and (NOPE == 448) and (FP8_BLOCK == 64) and (SCALE_BYTES == 8),
                     "the tile [8, BLOCK_N, 8, 8] holds 7 fp8 blocks of 64 and the 64 rope dims")
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :, None, None]  # [1, BLOCK_N, 1, 1]
    slot, pos, live = _live_rows(rows, slots_ptr, positions_ptr, n_rows, num_slots, max_position)
    block = tl.arange(0, 8)[:, None, None, None]
    cols = block * 64 + tl.arange(0, 8)[None, None, :, None] * 8 + tl.arange(0, 8)[None, None, None, :]
    x = tl.load(kv_ptr + rows * kv_row_stride + cols, mask=live, other=0.0).to(tl.float32)  # [8, BLOCK_N, 8, 8]
    w = tl.load(w_ptr + cols + rows * 0).to(tl.float32)  # broadcast over rows, in the tile's layout
    inv = _norm_inv_scale(tl.max(tl.max(tl.max(tl.abs(x), axis=3), axis=2), axis=0))  # [BLOCK_N]
    x = x * inv[None, :, None, None]  # dsakit.transforms.norm_scale
    mean_sq = tl.sum(tl.sum(tl.sum(x * x, axis=3), axis=2), axis=0) * (1.0 / 512)  # [BLOCK_N]
    r = _inverse_norm(mean_sq, eps * inv * inv)
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
    amax = tl.maximum(tl.max(tl.max(finite_abs_tl(x), axis=3), axis=2), 1e-4)  # [8, BLOCK_N]
    exponent = ue8m0_ceil_tl(tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)))
    v = sanitize_tl(x) * pow2_tl(254 - exponent)[:, :, None, None]  # exact: dividing by 2^k
    codes = e4m3_u8(tl.minimum(tl.maximum(v, -448.0), 448.0), NATIVE)
    tl.store(pool_ptr + value_base + cols, codes, mask=live & (block < 7))
    tl.store(halfword_ptr + (value_base + NOPE) // 2 + (cols - NOPE), bf16_u16(x, NATIVE), mask=live & is_rope)
    scale_byte = tl.where(block < 7, exponent[:, :, None, None], 0).to(tl.uint8)  # 7 scales + 1 zero pad
    tl.store(pool_ptr + scale_base + block, scale_byte, mask=live)
