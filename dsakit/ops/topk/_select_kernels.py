"""Triton kernels of the streaming exact top-k (launch code: :mod:`dsakit.ops.topk._select_stream`).

Order keys: an fp32 score maps to an int32 key whose signed order is the float order (non-negative floats
keep their bits, negative ones flip the 31 magnitude bits); NaN -> INT32_MAX (above +inf), -0.0 -> +0.0.
Candidates are scores > -inf (NaN included); the key of -inf, ``KEY_NEG_INF``, is below every candidate.

Three kernels per call (see the launcher's docstring for the buffers):

* ``_filter_kernel``, grid (rows, splits): every program of a row first derives the same threshold key
  ``thr`` from a fixed sample of the row (SAMPLE entries in SAMPLE / 32 groups of 32 spread over the row; the
  sample rank is chosen so that about 1.75 k of the row's entries are expected above it, never more than CAP
  in practice); a row with at most CAP entries uses thr = KEY_NEG_INF (take every candidate). Then it streams
  its segment of the row once: keys > thr are appended with their index to the split's candidate buffer,
  the first entries with key == thr (up to k) to the split's tie list, both in index order (one packed
  prefix sum per tile, no atomics: the buffers' content does not depend on scheduling). Counters per split:
  entries > thr, entries == thr (true counts, also beyond the buffers), whether a candidate < thr exists.
* ``_final_kernel``, grid (rows,): G = entries > thr, E = entries == thr, need = min(k, candidates).
  - G >= need (common case): the split buffers are concatenated in split order (= index order) into one
    register tile of CAP keys; the exact need-th largest key is found by range narrowing with small
    histograms of (key - lo) >> shift; keys above it are taken, then the first ones equal to it (tile order
    = index order: the lower index wins ties).
  - G < need <= G + E: every key > thr, then the first need - G tie-list entries (split order = index
    order). This is the relu case: rows made mostly of exact zeros select the lowest-index zeros.
  - otherwise the sample misled the threshold (a split buffer overflowed, or fewer than need entries are
    >= thr while candidates below it exist): the row is selected by the exact multi-pass path
    ``_row_exact`` (stats, range narrowing over the whole row until the range is exact, collect), the same
    result by construction. Its cost is several passes over the row, but it is rare by the sample margins.
  The selected indices (unordered) and their keys go to the output row and a key scratch row.
* ``_order_kernel``, grid (rows,): the <= k selected (key, index) pairs are ordered by key descending,
  index ascending with one tl.sort on packed int64 (key << 32 | 0x7FFFFFFF - index); -1 padding; optional
  map to global slots.

Every path is deterministic: no atomics, the buffers are written in index order, the sample is fixed.
"""

from __future__ import annotations

import triton
import triton.language as tl

INT32_MIN = tl.constexpr(-(1 << 31))
INT32_MAX = tl.constexpr((1 << 31) - 1)
# order key of -inf: bits 0xFF800000 (negative) with the magnitude bits flipped = 0x807FFFFF
KEY_NEG_INF = tl.constexpr(-2139095041)
# per-(row, split) counters: entries > thr, entries == thr, any candidate < thr, thr, largest key > thr
STATS = tl.constexpr(8)


@triton.jit
def _key_of(x, in_bounds):
    """fp32 -> (int32 order key, candidate mask); see the module docstring."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    is_nan = x != x
    key = tl.where(is_nan, 0x7FFFFFFF, key)
    valid = in_bounds & (is_nan | (x > float("-inf")))
    return key, valid


@triton.jit
def _narrow(key, valid, lo, hi, in_range, needed, BINS: tl.constexpr):
    """Range narrowing on a register tile: returns (lo, hi, needed) such that the needed largest valid keys
    are the keys > hi plus the first `needed` (tile order) keys in [lo, hi]; the range then holds exactly
    `needed` keys or a single value.

    Inputs: [lo, hi] contains the needed-th largest of the valid keys not above hi, in_range = valid keys in
    [lo, hi], 1 <= needed <= in_range. Each step histograms (key - lo) >> shift into BINS buckets (unsigned
    32-bit difference: key >= lo on matching lanes) and keeps the bucket of the needed-th key. Per step three
    block-level operations (histogram, prefix sum, one packed max): the kernels that call this are bound by
    the latency of those, not by arithmetic.
    """
    buckets = tl.arange(0, BINS)
    while (lo < hi) and (in_range != needed):
        span = hi.to(tl.int64) - lo.to(tl.int64)
        shift = 0
        while (span >> shift) >= BINS:
            shift += 1
        match = valid & (key >= lo) & (key <= hi)
        digit = ((key - lo).to(tl.uint32, bitcast=True) >> shift.to(tl.uint32)).to(tl.int32)
        hist = tl.histogram(tl.where(match, digit, 0), BINS, mask=match)
        at_or_above = in_range - tl.cumsum(hist, axis=0) + hist  # keys in buckets >= b (< 2^20 each)
        best = tl.max(tl.where(at_or_above >= needed,
                               (buckets.to(tl.int64) << 40) | (at_or_above.to(tl.int64) << 20) | hist, -1), axis=0)
        bucket = (best >> 40).to(tl.int32)
        in_range = (best & 0xFFFFF).to(tl.int32)
        needed -= ((best >> 20) & 0xFFFFF).to(tl.int32) - in_range
        new_lo = lo.to(tl.int64) + (bucket.to(tl.int64) << shift)
        hi = tl.minimum(hi.to(tl.int64), new_lo + (1 << shift) - 1).to(tl.int32)
        lo = new_lo.to(tl.int32)
    return lo, hi, needed


@triton.jit
def _sample_threshold(row_scores, n, K, CAP: tl.constexpr, SAMPLE: tl.constexpr, BINS: tl.constexpr):
    """Threshold key of a row: KEY_NEG_INF when n <= CAP (every candidate fits the buffer), else the key of
    sample rank r = m + 4 sqrt(m) + 1 (m = SAMPLE * K / n, the expected sample rank of the k-th entry), so
    that the entries >= thr include the top k and number about k * r / m, with a margin of ~4 standard
    deviations on both sides (below k: the row goes to the exact path; above CAP: same)."""
    thr = n * 0 + KEY_NEG_INF
    if n > CAP:
        lane = tl.arange(0, SAMPLE)
        groups: tl.constexpr = SAMPLE // 32
        pos = (lane // 32).to(tl.int64) * n // groups + lane % 32
        inside = pos < n
        key, valid = _key_of(tl.load(row_scores + pos, mask=inside, other=float("-inf")), inside)
        m = (SAMPLE * 1.0 / n.to(tl.float32)) * K
        rank = (m + 4.0 * tl.sqrt(m) + 1.0).to(tl.int32) + 1
        n_valid = tl.sum(valid.to(tl.int32), axis=0)
        if rank <= n_valid:
            lo = tl.min(tl.where(valid, key, INT32_MAX), axis=0)
            hi = tl.max(tl.where(valid, key, INT32_MIN), axis=0)
            # [lo, hi] ends holding the rank-th sample key; its lower end has >= rank sample keys above or at it
            lo, hi, _ = _narrow(key, valid, lo, hi, n_valid, rank, BINS)
            thr = lo
    return thr


@triton.jit
def _filter_kernel(
    scores_ptr, stride_scores,      # fp32 [R, W]
    counts_ptr,                     # int32 [R]: entries of each row to consider
    buf_key_ptr, buf_idx_ptr,       # int32 [R, SPLITS, CAP_S]: entries > thr (key, index), index order
    tie_ptr,                        # int32 [R, SPLITS, K]: first indices with key == thr
    stats_ptr,                      # int32 [R, SPLITS, STATS]
    K, SEG,                         # k; entries per split (a multiple of BLOCK)
    SPLITS: tl.constexpr, CAP: tl.constexpr, CAP_S: tl.constexpr, SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr, BINS: tl.constexpr,
):
    row_id = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.load(counts_ptr + row_id)
    row = row_id.to(tl.int64)
    row_scores = scores_ptr + row * stride_scores
    thr = _sample_threshold(row_scores, n, K, CAP, SAMPLE, BINS)

    part = row * SPLITS + split
    buf_key = buf_key_ptr + part * CAP_S
    buf_idx = buf_idx_ptr + part * CAP_S
    ties = tie_ptr + part * K
    lane = tl.arange(0, BLOCK)
    start = split * SEG
    stop = tl.minimum(n, start + SEG)
    n_gt = 0
    n_eq = 0
    below = tl.zeros([BLOCK], dtype=tl.int32)
    top = tl.full([BLOCK], INT32_MIN, tl.int32)
    # the next tile is loaded before the current one is processed (a while loop is not pipelined)
    following = tl.load(row_scores + start + lane, mask=start + lane < stop, other=float("-inf"))
    while start < stop:
        offs = start + lane
        tile = following
        following = tl.load(row_scores + offs + BLOCK, mask=offs + BLOCK < stop, other=float("-inf"))
        key, valid = _key_of(tile, offs < stop)
        gt = valid & (key > thr)
        eq = valid & (key == thr)
        below |= (valid & (key < thr)).to(tl.int32)
        top = tl.maximum(top, tl.where(gt, key, INT32_MIN))
        packed = gt.to(tl.int32) + eq.to(tl.int32) * 65536   # BLOCK <= 16384: both ranks fit 16 bits
        ranks = tl.cumsum(packed, axis=0)
        gt_pos = n_gt + (ranks & 65535) - 1
        eq_pos = n_eq + (ranks >> 16) - 1
        keep = gt & (gt_pos < CAP_S)
        tl.store(buf_key + gt_pos, key, mask=keep)
        tl.store(buf_idx + gt_pos, offs, mask=keep)
        tl.store(ties + eq_pos, offs, mask=eq & (eq_pos < K))
        total = tl.sum(packed, axis=0)
        n_gt += total & 65535
        n_eq += total >> 16
        start += BLOCK
    stats = stats_ptr + part * STATS
    tl.store(stats, n_gt)
    tl.store(stats + 1, n_eq)
    tl.store(stats + 2, tl.max(below, axis=0))
    tl.store(stats + 3, thr)
    tl.store(stats + 4, tl.max(top, axis=0))


@triton.jit
def _row_exact(row_scores, n, K, out_row, key_row, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """Exact top-k of one row by whole-row passes (fallback): writes the selected indices / keys in index
    order to out_row / key_row and returns how many. Stats pass; range-narrowing passes until [lo, hi]
    holds exactly the keys still needed or one value; collect pass (keys > hi, then the first `needed`
    keys in [lo, hi] by index)."""
    lane = tl.arange(0, BLOCK)
    buckets = tl.arange(0, BINS)
    n_valid = 0
    lo = INT32_MAX
    hi = INT32_MIN
    start = 0
    while start < n:
        offs = start + lane
        key, valid = _key_of(tl.load(row_scores + offs, mask=offs < n, other=float("-inf")), offs < n)
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
        lo = tl.minimum(lo, tl.min(tl.where(valid, key, INT32_MAX), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(valid, key, INT32_MIN), axis=0))
        start += BLOCK
    needed = K
    in_range = n_valid
    if n_valid <= K:  # take every candidate: empty range, everything is above hi
        hi = INT32_MIN
        lo = INT32_MAX
        in_range = 0
        needed = 0
    while (lo < hi) and (in_range != needed):
        span = hi.to(tl.int64) - lo.to(tl.int64)
        shift = 0
        while (span >> shift) >= BINS:
            shift += 1
        hist = tl.zeros([BINS], dtype=tl.int32)
        start = 0
        while start < n:
            offs = start + lane
            key, valid = _key_of(tl.load(row_scores + offs, mask=offs < n, other=float("-inf")), offs < n)
            match = valid & (key >= lo) & (key <= hi)
            digit = ((key.to(tl.int64) - lo) >> shift).to(tl.int32)
            hist += tl.histogram(tl.where(match, digit, 0), BINS, mask=match)
            start += BLOCK
        at_or_above = in_range - tl.cumsum(hist, axis=0) + hist
        bucket = tl.max(tl.where(at_or_above >= needed, buckets, -1), axis=0)
        needed -= tl.sum(tl.where(buckets > bucket, hist, 0), axis=0)
        in_range = tl.sum(tl.where(buckets == bucket, hist, 0), axis=0)
        new_lo = lo.to(tl.int64) + (bucket.to(tl.int64) << shift)
        hi = tl.minimum(hi.to(tl.int64), new_lo + (1 << shift) - 1).to(tl.int32)
        lo = new_lo.to(tl.int32)
    written = 0
    inside_seen = 0
    start = 0
    while start < n:
        offs = start + lane
        key, valid = _key_of(tl.load(row_scores + offs, mask=offs < n, other=float("-inf")), offs < n)
        above = valid & (key > hi)
        inside = valid & (key >= lo) & (key <= hi)
        ranks = tl.cumsum(above.to(tl.int32) + inside.to(tl.int32) * 65536, axis=0)
        left = tl.maximum(needed - inside_seen, 0)
        inside_rank = ranks >> 16
        take = above | (inside & (inside_rank <= left))
        position = written + (ranks & 65535) + tl.minimum(inside_rank, left) - 1
        tl.store(out_row + position, offs, mask=take)
        tl.store(key_row + position, key, mask=take)
        tile_inside = tl.sum(inside.to(tl.int32), axis=0)
        written += tl.sum(above.to(tl.int32), axis=0) + tl.minimum(tile_inside, left)
        inside_seen += tile_inside
        start += BLOCK
    return written


@triton.jit
def _final_kernel(
    scores_ptr, stride_scores, counts_ptr,
    buf_key_ptr, buf_idx_ptr, tie_ptr, stats_ptr,   # as written by _filter_kernel
    sel_key_ptr,                    # int32 [R, K] scratch: keys of the selected entries
    sel_count_ptr,                  # int32 [R]: how many entries each row selected
    out_ptr, stride_out,            # int32 [R, K]: the selected indices (unordered, first sel_count)
    K,
    SPLITS: tl.constexpr, CAP: tl.constexpr, CAP_S: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK: tl.constexpr, BINS: tl.constexpr,
):
    row_id = tl.program_id(0)
    row = row_id.to(tl.int64)
    out_row = out_ptr + row * stride_out
    key_row = sel_key_ptr + row * K
    stats = stats_ptr + row * SPLITS * STATS
    n_gt = 0
    n_eq = 0
    below = 0
    overflow = 0
    top = INT32_MIN
    for s in tl.static_range(SPLITS):
        g = tl.load(stats + s * STATS)
        n_gt += g
        n_eq += tl.load(stats + s * STATS + 1)
        below = tl.maximum(below, tl.load(stats + s * STATS + 2))
        overflow = tl.maximum(overflow, (g > CAP_S).to(tl.int32))
        top = tl.maximum(top, tl.load(stats + s * STATS + 4))
    thr = tl.load(stats + 3)
    short = n_gt + n_eq < K
    need = tl.minimum(n_gt + n_eq, K)  # = min(k, candidates) unless short with candidates below thr
    exact_path = (overflow > 0) or (n_gt > CAP) or (short and (below > 0))

    written = n_gt * 0
    if exact_path:
        n = tl.load(counts_ptr + row_id)
        written = _row_exact(scores_ptr + row * stride_scores, n, K, out_row, key_row, BLOCK, BINS)
    else:
        # the split buffers, concatenated in split order (= index order), as one register tile
        lane = tl.arange(0, CAP)
        src = lane
        before = 0
        for s in tl.static_range(SPLITS):
            g = tl.load(stats + s * STATS)
            src = tl.where((lane >= before) & (lane < before + g), s * CAP_S + lane - before, src)
            before += g
        have = lane < n_gt
        part = row * SPLITS * CAP_S
        key = tl.load(buf_key_ptr + part + src, mask=have, other=INT32_MIN)
        if n_gt >= need:
            if need > 0:
                # every buffered key is in [thr + 1, top]
                lo, hi, left = _narrow(key, have, thr + 1, top, n_gt, need, BINS)
                above = have & (key > hi)
                inside = have & (key >= lo) & (key <= hi)
                ranks = tl.cumsum(above.to(tl.int32) + inside.to(tl.int32) * 65536, axis=0)
                inside_rank = ranks >> 16
                take = above | (inside & (inside_rank <= left))
                position = (ranks & 65535) + tl.minimum(inside_rank, left) - 1
                idx = tl.load(buf_idx_ptr + part + src, mask=take, other=0)
                tl.store(out_row + position, idx, mask=take)
                tl.store(key_row + position, key, mask=take)
                written = need
        else:
            # every key > thr, then the first need - n_gt entries equal to thr (tie lists in split order)
            idx = tl.load(buf_idx_ptr + part + src, mask=have, other=0)
            tl.store(out_row + lane, idx, mask=have)
            tl.store(key_row + lane, key, mask=have)
            col = tl.arange(0, K_PAD)
            tie_src = col
            before = 0
            for s in tl.static_range(SPLITS):
                e = tl.minimum(tl.load(stats + s * STATS + 1), K)
                tie_src = tl.where((col >= before) & (col < before + e), s * K + col - before, tie_src)
                before += e
            wanted = col < need - n_gt
            tie_idx = tl.load(tie_ptr + row * SPLITS * K + tie_src, mask=wanted, other=0)
            tl.store(out_row + n_gt + col, tie_idx, mask=wanted)
            tl.store(key_row + n_gt + col, tl.full([K_PAD], 0, tl.int32) + thr, mask=wanted)
            written = need
    tl.store(sel_count_ptr + row, written)


@triton.jit
def _order_kernel(
    out_ptr, stride_out, sel_key_ptr, sel_count_ptr,
    slots_ptr, stride_slots,        # int32 [R, K] global slots (WITH_SLOTS)
    seq_ptr,                        # int32 [R] sequence of each row (WITH_SLOTS)
    table_ptr, stride_table,        # int32 [B, max_pages] block table (WITH_SLOTS)
    K,
    K_PAD: tl.constexpr, SORT: tl.constexpr, WITH_SLOTS: tl.constexpr,
):
    """Order each row's selected entries by (key desc, index asc), pad with -1, map to slots.

    A kernel of its own (few registers, several programs per SM) because the sort is a chain of
    block-level exchanges whose latency only overlapping rows can hide."""
    row = tl.program_id(0).to(tl.int64)
    out_row = out_ptr + row * stride_out
    written = tl.load(sel_count_ptr + row)
    col = tl.arange(0, K_PAD)
    filled = col < written
    idx = tl.load(out_row + col, mask=filled, other=0)
    if SORT:
        chosen_key = tl.load(sel_key_ptr + row * K + col, mask=filled, other=0)
        # (key desc, index asc) as one int64: key in the high half, 0x7FFFFFFF - index (>= 0) in the low half
        packed = chosen_key.to(tl.int64) * 4294967296 + (0x7FFFFFFF - idx).to(tl.int64)
        packed = tl.where(filled, packed, -9223372036854775807 - 1)
        packed = tl.sort(packed, descending=True)
        idx = 0x7FFFFFFF - (packed & 0xFFFFFFFF).to(tl.int32)
    idx = tl.where(filled, idx, -1)
    tl.debug_barrier()  # every thread has read the unordered row before any overwrites it
    tl.store(out_row + col, idx, mask=col < K)
    if WITH_SLOTS:
        seq = tl.load(seq_ptr + row).to(tl.int64)
        page = tl.load(table_ptr + seq * stride_table + idx // 64, mask=filled, other=0)
        slot = tl.where(filled, page * 64 + idx % 64, -1)
        tl.store(slots_ptr + row * stride_slots + col, slot, mask=col < K)
