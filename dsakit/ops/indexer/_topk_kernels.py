"""Triton kernels of the indexer top-k (launch code: :mod:`dsakit.ops.indexer.triton`, which documents the
selection algorithm).
"""

from __future__ import annotations

import triton
import triton.language as tl

_INT32_MIN = tl.constexpr(-(1 << 31))
_INT64_MIN = tl.constexpr(-(1 << 63))  # the packed (key, index) of an unfilled slot: below every filled one


@triton.jit
def _order_key(x, in_bounds):
    """fp32 -> (int32 key with the float order, candidate mask).

    Signed-int trick: non-negative floats keep their bits, negative ones flip the 31 magnitude bits, so
    signed int32 comparison equals float comparison. NaN -> INT32_MAX (above +inf = 0x7F800000),
    -0.0 -> +0.0 (the reference treats them as equal). Candidates: in bounds and x > -inf (NaN included).
    """
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    is_nan = x != x
    key = tl.where(is_nan, 0x7FFFFFFF, key)
    valid = in_bounds & (is_nan | (x > float("-inf")))
    return key, valid


@triton.jit
def _bucket_shift(lo, hi, BINS: tl.constexpr):
    """Smallest shift with (hi - lo) >> shift < BINS: BINS buckets of (key - lo) >> shift cover [lo, hi]."""
    span = hi.to(tl.int64) - lo.to(tl.int64)
    shift = 0
    while (span >> shift) >= BINS:
        shift += 1
    return shift


@triton.jit
def _range_histogram(key, valid, lo, hi, shift, BINS: tl.constexpr):
    """Histogram of the valid keys in [lo, hi] of a tile by (key - lo) >> shift into BINS buckets."""
    match = valid & (key >= lo) & (key <= hi)
    digit = ((key.to(tl.int64) - lo) >> shift).to(tl.int32)
    return tl.histogram(tl.where(match, digit, 0), BINS, mask=match)


@triton.jit
def _keep_bucket(hist, lo, hi, shift, in_range, needed, BINS: tl.constexpr):
    """One range-narrowing step from the histogram of a whole row (see :func:`_range_histogram`): keep the
    bucket of the needed-th largest key. Returns (lo, hi, needed, in_range) of that bucket."""
    buckets = tl.arange(0, BINS)
    at_or_above = in_range - tl.cumsum(hist, axis=0) + hist
    bucket = tl.max(tl.where(at_or_above >= needed, buckets, -1), axis=0)
    needed -= tl.sum(tl.where(buckets > bucket, hist, 0), axis=0)
    in_range = tl.sum(tl.where(buckets == bucket, hist, 0), axis=0)
    new_lo = lo.to(tl.int64) + (bucket.to(tl.int64) << shift)
    hi = tl.minimum(hi.to(tl.int64), new_lo + (1 << shift) - 1).to(tl.int32)
    lo = new_lo.to(tl.int32)
    return lo, hi, needed, in_range


@triton.jit
def _sorted_packed(key, idx, filled):
    """(key, index) pairs as one int64 each, sorted descending: key in the high half, 0x7FFFFFFF - index (>= 0)
    in the low half, so the order is (key desc, index asc) and all packed values differ; unfilled lanes are
    INT64_MIN (last)."""
    packed = key.to(tl.int64) * 4294967296 + (0x7FFFFFFF - idx).to(tl.int64)
    return tl.sort(tl.where(filled, packed, _INT64_MIN), descending=True)


@triton.jit
def _sort_by_key(key, idx, filled):
    """Indices ordered by (key desc, index asc); unfilled lanes last (their values are garbage)."""
    return 0x7FFFFFFF - (_sorted_packed(key, idx, filled) & 0xFFFFFFFF).to(tl.int32)


@triton.jit
def _store_slots(slots_ptr, stride_slots, seq_ptr, table_ptr, stride_table, row, idx, filled, col, K):
    """slots[row, col < K] = page * 64 + idx % 64 through the block-table row of the row's sequence; -1 where
    not filled."""
    seq = tl.load(seq_ptr + row).to(tl.int64)
    page = tl.load(table_ptr + seq * stride_table + idx // 64, mask=filled, other=0)
    slot = tl.where(filled, page * 64 + idx % 64, -1)
    tl.store(slots_ptr + row * stride_slots + col, slot, mask=col < K)


@triton.jit
def _radix_threshold(vals_ptr, n, needed, lane, BLOCK: tl.constexpr):
    """Exact threshold of the ``needed`` largest keys among vals_ptr[0:n] (fp32): 4 levels of 8-bit radix.

    Returns (shift, prefix, n_equal): select keys with (key >> shift) > prefix, plus the first n_equal (in
    array order) with (key >> shift) == prefix. Stops early when a bin must be taken whole.
    """
    bins = tl.arange(0, 256)
    thr_shift = 0
    thr_prefix = _INT32_MIN  # every candidate key is > INT32_MIN (the smallest, -FLT_MAX, is 0x80800000)
    n_equal = 0
    prefix = 0
    done = 0
    for level in tl.static_range(4):
        if done == 0:
            shift: tl.constexpr = 24 - 8 * level
            hist = tl.zeros([256], dtype=tl.int32)
            start = 0
            while start < n:  # (a while loop: the interpreter cannot range() over a loaded scalar)
                offs = start + lane
                in_bounds = offs < n
                tile = tl.load(vals_ptr + offs, mask=in_bounds, other=float("-inf"))
                key, valid = _order_key(tile, in_bounds)
                digit = (key >> shift) & 255
                if level == 0:
                    digit = digit ^ 128  # the top digit carries the sign: flip it so bins follow the order
                    match = valid
                else:
                    match = valid & ((key >> (shift + 8)) == prefix)
                hist += tl.histogram(digit, 256, mask=match)
                start += BLOCK
            total = tl.sum(hist, axis=0)
            take_all = total <= needed
            if level != 0:
                take_all = False
            if take_all:
                done = 1  # no more candidates than needed: take them all (thr_prefix = INT32_MIN)
            else:
                at_or_above = total - tl.cumsum(hist, axis=0) + hist  # keys in bins >= b
                digit_k = tl.max(tl.where(at_or_above >= needed, bins, -1), axis=0)
                n_above = tl.sum(tl.where(bins > digit_k, hist, 0), axis=0)
                in_bin = tl.sum(tl.where(bins == digit_k, hist, 0), axis=0)
                needed = needed - n_above
                if level == 0:
                    prefix = digit_k - 128  # == key >> 24 (arithmetic shift) of the k-th key
                else:
                    prefix = prefix * 256 + digit_k  # == key >> shift
                if (in_bin == needed) or (level == 3):
                    done = 1
                    thr_shift = shift
                    thr_prefix = prefix
                    n_equal = needed
    return thr_shift, thr_prefix, n_equal


@triton.jit
def _radix_select_kernel(
    scores_ptr, stride_scores,      # fp32 [R, W] (row stride in elements)
    counts_ptr,                     # int32 [R]: entries of the row to consider (<= W)
    out_ptr, stride_out,            # int32 [R, K] entry indices, -1 padded
    cand_vals_ptr, cand_idx_ptr,    # fp32 / int32 [R, CAP] scratch: candidates of the threshold range
    slots_ptr, stride_slots,        # int32 [R, K] global slot ids (only when WITH_SLOTS)
    seq_ptr,                        # int32 [R] sequence of each row (only when WITH_SLOTS)
    table_ptr, stride_table,        # int32 [B, max_pages] block table (only when WITH_SLOTS)
    K,                              # runtime k
    BLOCK: tl.constexpr,            # elements per tile of the streaming passes
    BINS: tl.constexpr,             # buckets of the range-narrowing histograms (power of two, >= 32)
    CAP: tl.constexpr,              # candidate buffer entries per row (power of two)
    K_PAD: tl.constexpr,            # next power of two >= K (register tile of the final sort)
    SORT: tl.constexpr,             # order the output by (score desc, index asc)
    WITH_SLOTS: tl.constexpr,
):
    row_id = tl.program_id(0)
    n = tl.load(counts_ptr + row_id)
    row = row_id.to(tl.int64)
    row_scores = scores_ptr + row * stride_scores
    row_out = out_ptr + row * stride_out
    row_cand_vals = cand_vals_ptr + row * CAP
    row_cand_idx = cand_idx_ptr + row * CAP
    lane = tl.arange(0, BLOCK)

    # Pass 1: candidate count and key range.
    n_valid = 0
    lo = 0x7FFFFFFF
    hi = _INT32_MIN
    # Every streaming loop loads tile i + 1 before working on tile i (hand-made double buffering: a while
    # loop is not software-pipelined by the compiler, and the passes are short on arithmetic per byte).
    start = 0
    tile = tl.load(row_scores + lane, mask=lane < n, other=float("-inf"))
    while start < n:
        offs = start + lane
        following = tl.load(row_scores + offs + BLOCK, mask=offs + BLOCK < n, other=float("-inf"))
        key, valid = _order_key(tile, offs < n)
        tile = following
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
        lo = tl.minimum(lo, tl.min(tl.where(valid, key, 0x7FFFFFFF), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(valid, key, _INT32_MIN), axis=0))
        start += BLOCK

    # Range narrowing: keys in [lo, hi] hold the needed-th largest of what is not already above hi.
    # Each pass histograms (key - lo) >> shift into BINS buckets and keeps the bucket of the needed-th key,
    # until the range holds <= CAP keys, holds exactly the needed keys, or is a single key value.
    needed = K
    in_range = n_valid
    if n_valid <= K:
        hi = _INT32_MIN  # take every candidate (all keys > INT32_MIN); empty range
        lo = 0x7FFFFFFF
        in_range = 0
        needed = 0
    while (in_range > CAP) and (lo < hi) and (in_range != needed):
        shift = _bucket_shift(lo, hi, BINS)
        hist = tl.zeros([BINS], dtype=tl.int32)
        start = 0
        tile = tl.load(row_scores + lane, mask=lane < n, other=float("-inf"))
        while start < n:
            offs = start + lane
            following = tl.load(row_scores + offs + BLOCK, mask=offs + BLOCK < n, other=float("-inf"))
            key, valid = _order_key(tile, offs < n)
            tile = following
            hist += _range_histogram(key, valid, lo, hi, shift, BINS)
            start += BLOCK
        lo, hi, needed, in_range = _keep_bucket(hist, lo, hi, shift, in_range, needed, BINS)

    # Collect pass (index order): keys above hi are selected; keys in [lo, hi] are either taken directly
    # (the range is exactly what is needed, or one key value: first `needed` by index = the tie rule) or
    # copied to the candidate buffer for an exact radix select. One packed scan gives both ranks.
    direct = (in_range == needed) or (lo == hi)
    remaining = tl.where(direct, needed, 0)
    written = 0
    in_range_seen = 0
    start = 0
    following = tl.load(row_scores + lane, mask=lane < n, other=float("-inf"))
    while start < n:
        offs = start + lane
        tile = following
        following = tl.load(row_scores + offs + BLOCK, mask=offs + BLOCK < n, other=float("-inf"))
        key, valid = _order_key(tile, offs < n)
        above = valid & (key > hi)
        inside = valid & (key >= lo) & (key <= hi)
        ranks = tl.cumsum(above.to(tl.int32) + inside.to(tl.int32) * 65536, axis=0)
        above_rank = ranks & 65535
        inside_rank = ranks >> 16
        left = tl.maximum(remaining - in_range_seen, 0)
        take = above | (inside & (inside_rank <= left))
        position = written + above_rank + tl.minimum(inside_rank, left) - 1
        tl.store(row_out + position, offs, mask=take)
        to_buffer = inside & (direct == 0)
        buffer_pos = in_range_seen + inside_rank - 1
        tl.store(row_cand_vals + buffer_pos, tile, mask=to_buffer)
        tl.store(row_cand_idx + buffer_pos, offs, mask=to_buffer)
        tile_inside = tl.sum(inside.to(tl.int32), axis=0)
        written += tl.sum(above.to(tl.int32), axis=0) + tl.minimum(tile_inside, left)
        in_range_seen += tile_inside
        start += BLOCK

    if direct == 0:
        # Exact select of the needed largest among the <= CAP buffered candidates (buffer is in index order).
        tl.debug_barrier()  # the buffer was written by other threads of this program
        cand_lane = tl.arange(0, CAP)
        thr_shift, thr_prefix, n_equal = _radix_threshold(row_cand_vals, in_range, needed, cand_lane, CAP)
        cand = cand_lane < in_range
        key, valid = _order_key(tl.load(row_cand_vals + cand_lane, mask=cand, other=float("-inf")), cand)
        high = key >> thr_shift
        equal = valid & (high == thr_prefix)
        take = (valid & (high > thr_prefix)) | (equal & (tl.cumsum(equal.to(tl.int32), axis=0) <= n_equal))
        idx = tl.load(row_cand_idx + cand_lane, mask=cand, other=0)
        tl.store(row_out + written + tl.cumsum(take.to(tl.int32), axis=0) - 1, idx, mask=take)
        written += tl.sum(take.to(tl.int32), axis=0)

    # Epilogue: order the collected entries, pad with -1, map to slots.
    tl.debug_barrier()  # the collect stores above came from other threads of this program
    col = tl.arange(0, K_PAD)
    filled = col < written
    idx = tl.load(row_out + col, mask=filled, other=0)
    if SORT:
        chosen = tl.load(row_scores + idx, mask=filled, other=float("-inf"))
        chosen_key, _ = _order_key(chosen, filled)
        idx = _sort_by_key(chosen_key, idx, filled)
    idx = tl.where(filled, idx, -1)
    tl.debug_barrier()  # every thread has read the unsorted row before any overwrites it
    tl.store(row_out + col, idx, mask=col < K)
    if WITH_SLOTS:
        _store_slots(slots_ptr, stride_slots, seq_ptr, table_ptr, stride_table, row, idx, filled, col, K)


@triton.jit
def _visible_kernel(counts_ptr, seq_ptr, pos_ptr, out_ptr, rows, num_seqs, ratio, limit,
                    HAS_POS: tl.constexpr, BLOCK: tl.constexpr):
    """visible int32 [R]: entries row r (of sequence seq[r]) sees, clamped to 0..limit (memory safety)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < rows
    seq = tl.minimum(tl.maximum(tl.load(seq_ptr + offs, mask=ok, other=0), 0), num_seqs - 1)
    visible = tl.load(counts_ptr + seq, mask=ok, other=0).to(tl.int64)
    if HAS_POS:
        pos = tl.load(pos_ptr + offs, mask=ok, other=0).to(tl.int64)
        # floor division of pos + 1 >= 0; pos + 1 < 0 sees nothing (clamped below)
        causal = tl.maximum(pos + 1, 0) // ratio
        visible = tl.minimum(visible, causal)
    visible = tl.minimum(tl.maximum(visible, 0), limit)
    tl.store(out_ptr + offs, visible.to(tl.int32), mask=ok)
