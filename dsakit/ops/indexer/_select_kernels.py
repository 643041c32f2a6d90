"""Triton kernels of the streaming exact top-k (launch code: :mod:`dsakit.ops.indexer.select`).

Order keys (``_order_key``, shared with the multi-pass select in ``_kernels``): an fp32 score maps to an
int32 key whose signed order is the float order (non-negative floats keep their bits, negative ones flip the
31 magnitude bits); NaN -> INT32_MAX (above +inf), -0.0 -> +0.0. Candidates are scores > -inf (NaN
included); the key of -inf, ``KEY_NEG_INF``, is below every candidate.

Three kernels per call (see the launcher's docstring for the buffers):

* ``_filter_kernel``, grid (rows, splits): every program of a row first derives the same threshold key
  ``thr`` from a fixed sample of the row (SAMPLE entries in groups of SAMPLE_GROUP, one group per equal slice of
  the row at an offset that varies from slice to slice; the
  sample rank is chosen so that about 1.75 k of the row's entries are expected above it, never more than CAP
  in practice); a row with at most CAP entries uses thr = KEY_NEG_INF (take every candidate). Then it streams
  its segment of the row once: keys > thr are appended with their index to the split's candidate buffer,
  the first entries with key == thr (up to k) to the split's tie list, both in index order (one packed
  prefix sum per tile, no atomics: the buffers' content does not depend on scheduling). Counters per split:
  entries > thr, entries == thr (true counts, also beyond the buffers), whether a candidate < thr exists.
* ``_final_kernel``, grid (rows,): G = entries > thr, E = entries == thr, need = min(k, candidates).
  - DIRECT (a launch whose rows are no wider than CAP, one split): no filter ran; the row itself is the
    register tile (index = position) and the need largest are taken by the narrowing below.
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
  map to global slots. With ``order_chunks`` C > 1 (few rows: decode) two launches instead:
  ``_order_chunk_kernel`` (grid (rows, C)) sorts each 1/C of the selected entries, ``_order_merge_kernel``
  places each entry at the number of entries above it in the row (binary searches in the C sorted chunks).

Every path is deterministic: no atomics, the buffers are written in index order, the sample is fixed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._topk_kernels import _INT32_MIN as INT32_MIN
from ._topk_kernels import _INT64_MIN as INT64_MIN
from ._topk_kernels import (_bucket_shift, _keep_bucket, _order_key, _range_histogram, _sort_by_key, _sorted_packed,
                       _store_slots)
from .config import STREAM_STATS

INT32_MAX = tl.constexpr((1 << 31) - 1)
# order key of -inf: bits 0xFF800000 (negative) with the magnitude bits flipped = 0x807FFFFF
KEY_NEG_INF = tl.constexpr(-2139095041)
# per-(row, split) words: entries > thr, entries == thr, any candidate < thr, thr, (word 4 of split 0: the
# row's threshold from ``_threshold_kernel``, when it runs), largest lane count; word 6 of split 0: the path
# the final kernel took (1 buffer, 2 tie lists, 0 exact)
STATS = tl.constexpr(STREAM_STATS)


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
        shift = _bucket_shift(lo, hi, BINS)
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
def _sample_threshold(row_scores, n, K, CAP: tl.constexpr, SAMPLE: tl.constexpr, BINS: tl.constexpr,
                      MARGIN: tl.constexpr, SAMPLE_GROUP: tl.constexpr):
    """Threshold key of a row: KEY_NEG_INF when n <= CAP (every candidate fits the buffer), else the key of
    sample rank r = m + MARGIN sqrt(m) + 1 (m = SAMPLE * K / n, the expected sample rank of the k-th entry), so
    that the entries >= thr include the top k and number about k * r / m, with a margin of ~MARGIN standard
    deviations on both sides (below k: the row goes to the exact path; above CAP: same).

    The margin assumes independent sample entries. Scores come in runs of similar values (a page's entries
    share its centre in the centred formats; neighbouring tokens resemble each other), so a group of
    consecutive entries counts as about one entry there: the sample reads SAMPLE_GROUP consecutive entries
    (8 fp32 = one 32-byte sector: as many sectors as longer groups) from each of SAMPLE / SAMPLE_GROUP equal
    slices of the row, at an offset that walks through the slice (7 groups further per slice), so that the
    groups do not all sit at the same position of their pages either (entry 0 of a centred page is its
    centre, with a zero residual)."""
    thr = n * 0 + KEY_NEG_INF
    if n > CAP:
        lane = tl.arange(0, SAMPLE)
        groups: tl.constexpr = SAMPLE // SAMPLE_GROUP
        group = lane // SAMPLE_GROUP
        # offsets stay inside the group's slice: [g n / groups, (g + 1) n / groups) holds >= n // groups entries
        # (the offset in int32: group * 7 * SAMPLE_GROUP < 7 * 8192; the slice start in int64: g * n can exceed it)
        room = tl.maximum(n // groups - SAMPLE_GROUP, 0) + 1
        offset = (group * (7 * SAMPLE_GROUP)) % room
        pos = group.to(tl.int64) * n // groups + offset + lane % SAMPLE_GROUP
        inside = pos < n
        key, valid = _order_key(tl.load(row_scores + pos, mask=inside, other=float("-inf")), inside)
        m = (SAMPLE * 1.0 / n.to(tl.float32)) * K
        rank = (m + MARGIN * tl.sqrt(m) + 1.0).to(tl.int32) + 1
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
    cand_ptr,                       # int64 [R, SPLITS, LANES, LCAP]: entries > thr per lane, key << 32 | index
    tie_ptr,                        # int32 [R, SPLITS, LANES, TCAP]: each lane's first indices == thr
    lane_gt_ptr, lane_eq_ptr,       # int32 [R, SPLITS, LANES]: true per-lane counts (> thr, == thr)
    stats_ptr,                      # int32 [R, SPLITS, STATS]
    K,
    SPLITS: tl.constexpr, CAP: tl.constexpr, LANES: tl.constexpr, LCAP: tl.constexpr,
    TCAP: tl.constexpr, V: tl.constexpr, SAMPLE: tl.constexpr, BINS: tl.constexpr, MARGIN: tl.constexpr,
    SAMPLE_GROUP: tl.constexpr,
):
    """One pass over a split of a row. Split s of SPLITS streams the tiles s, s + SPLITS, s + 2 SPLITS, ...
    of LANES * V entries; a tile is [V, LANES]: lane l owns entries l * V .. l * V + V - 1 of it and appends
    its entries > thr to its own buffer region (and its first TCAP entries == thr to its own tie list), so
    the per-tile prefix sums and counts run along V inside a warp: the loop has no block-level
    synchronisation. Splits and lanes interleave along the row, so a trend along the row (recent entries
    scoring higher) spreads evenly over the buffers.

    Layout note: the tile's offsets are declared non-contiguous (max_contiguous 1) so that the loads and
    the scattered buffer stores get the same register layout (one entry per thread, a warp on 32
    consecutive entries: still coalesced); a vectorized load layout would force a shared-memory layout
    conversion with a barrier in front of every store."""
    row_id = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.load(counts_ptr + row_id)
    row = row_id.to(tl.int64)
    row_scores = scores_ptr + row * stride_scores
    thr = _sample_threshold(row_scores, n, K, CAP, SAMPLE, BINS, MARGIN, SAMPLE_GROUP)

    BLOCK: tl.constexpr = LANES * V
    part = row * SPLITS + split
    lanes = tl.arange(0, LANES)
    inner = tl.arange(0, V)[:, None] + lanes[None, :] * V           # [V, LANES] entry offsets in a tile
    cand = cand_ptr + part * (LANES * LCAP) + lanes[None, :] * LCAP
    ties = tie_ptr + part * (LANES * TCAP) + lanes[None, :] * TCAP
    start = split * BLOCK
    stop = n
    n_gt = tl.sum(tl.zeros([V, LANES], dtype=tl.int32), axis=0)   # per lane, in the reductions' layout
    n_eq = n_gt
    low = tl.full([V, LANES], INT32_MAX, tl.int32)  # smallest candidate key: is any candidate < thr?
    # the next tile is loaded before the current one is processed (a while loop is not pipelined; a second
    # tile in flight measured no faster: the loop is bound by its scan and stores, not by the load)
    STEP: tl.constexpr = BLOCK * SPLITS
    offs = tl.max_contiguous(start + inner, [1, 1])
    following = tl.load(row_scores + offs, mask=offs < stop, other=float("-inf"))
    while start < stop:
        offs = tl.max_contiguous(start + inner, [1, 1])
        tile = following
        following = tl.load(row_scores + offs + STEP, mask=offs + STEP < stop, other=float("-inf"))
        key, valid = _order_key(tile, offs < stop)
        gt = valid & (key > thr)
        eq = valid & (key == thr)
        low = tl.minimum(low, tl.where(valid, key, INT32_MAX))
        packed = gt.to(tl.int32) + eq.to(tl.int32) * 65536   # V < 65536: both ranks fit 16 bits
        ranks = tl.cumsum(packed, axis=0)
        gt_pos = n_gt[None, :] + (ranks & 65535) - 1
        eq_pos = n_eq[None, :] + (ranks >> 16) - 1
        # one 8-byte store per kept entry: fewer pointer registers, fewer store instructions
        tl.store(cand + gt_pos, (key.to(tl.int64) << 32) | offs.to(tl.int64), mask=gt & (gt_pos < LCAP))
        tl.store(ties + eq_pos, offs, mask=eq & (eq_pos < TCAP))
        total = tl.sum(packed, axis=0)
        n_gt += total & 65535
        n_eq += total >> 16
        start += STEP
    tl.store(lane_gt_ptr + part * LANES + lanes, n_gt)
    tl.store(lane_eq_ptr + part * LANES + lanes, n_eq)
    stats = stats_ptr + part * STATS
    tl.store(stats, tl.sum(n_gt, axis=0))
    tl.store(stats + 1, tl.sum(n_eq, axis=0))
    tl.store(stats + 2, (tl.min(tl.min(low, axis=0), axis=0) < thr).to(tl.int32))
    tl.store(stats + 3, thr)
    tl.store(stats + 5, tl.max(n_gt, axis=0))


@triton.jit
def _threshold_kernel(
    scores_ptr, stride_scores, counts_ptr,
    stats_ptr,                      # int32 [R, SPLITS, STATS]: the threshold key goes to word 4 of split 0
    K,
    SPLITS: tl.constexpr, CAP: tl.constexpr, SAMPLE: tl.constexpr, BINS: tl.constexpr, MARGIN: tl.constexpr,
    SAMPLE_GROUP: tl.constexpr,
):
    """Grid (rows,): the sampled threshold key of each row (``_sample_threshold``), computed once per row for the
    SPLITS programs of ``_filter_thread_kernel`` (which then start streaming at once instead of each sampling)."""
    row_id = tl.program_id(0)
    n = tl.load(counts_ptr + row_id)
    row = row_id.to(tl.int64)
    thr = _sample_threshold(scores_ptr + row * stride_scores, n, K, CAP, SAMPLE, BINS, MARGIN, SAMPLE_GROUP)
    tl.store(stats_ptr + row * SPLITS * STATS + 4, thr)


@triton.jit
def _filter_thread_kernel(
    scores_ptr, stride_scores, counts_ptr, cand_ptr, tie_ptr, lane_gt_ptr, lane_eq_ptr, stats_ptr,  # as _filter_kernel
    K,
    SPLITS: tl.constexpr, CAP: tl.constexpr, LANES: tl.constexpr, LCAP: tl.constexpr,
    TCAP: tl.constexpr, UNROLL: tl.constexpr, SAMPLE: tl.constexpr, BINS: tl.constexpr,
    MARGIN: tl.constexpr, SAMPLE_GROUP: tl.constexpr, SHARED_THR: tl.constexpr,
):
    """``_filter_kernel`` with one lane per thread and float compares (StreamConfig.filter = "thread"): the same
    buffers and counters, written in the same order (each lane's entries in index order), except that the
    candidate buffer holds the raw fp32 bits (not the order key) in its high half and stats word 2 ("a
    candidate below thr may exist") is 1 whenever thr > -inf (the final kernel then takes the exact passes for
    a row with fewer than k entries >= thr, as it does when that word is exact and 1).

    Split s streams the tiles s, s + SPLITS, ... of LANES entries, UNROLL of its tiles per step: a step is
    [LANES, UNROLL], lane l owns entry l of each tile. Why: a thread holds whole lanes (LANES = its threads),
    so the per-lane ranks are in-register adds (no shuffles, no block-wide step), the UNROLL loads of a thread
    share one address (immediate offsets), and the compares are two float compares per entry, score > thr or
    NaN (``~(s <= thr)``) and score == thr (-0.0 == +0.0, as the keys), instead of the order key's ~10 integer
    operations. The offsets are declared non-contiguous so that loads and scattered stores share one layout
    (a warp still reads 32 consecutive entries per load). SHARED_THR: read the row's threshold key from stats
    word 4 of split 0 (``_threshold_kernel``) instead of sampling it in every split program."""
    row_id = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.load(counts_ptr + row_id)
    row = row_id.to(tl.int64)
    row_scores = scores_ptr + row * stride_scores
    if SHARED_THR:
        thr = tl.load(stats_ptr + row * SPLITS * STATS + 4)
    else:
        thr = _sample_threshold(row_scores, n, K, CAP, SAMPLE, BINS, MARGIN, SAMPLE_GROUP)
    # the float of key thr (the key map is its own inverse); thr = -inf: nothing is "equal" (-inf entries are
    # not candidates), so compare equality against NaN; thr = NaN (a sample flooded with NaN): every entry
    # passes ~(s <= NaN), the lanes overflow and the final kernel takes the exact passes (flagged below)
    thr_f = tl.where(thr < 0, thr ^ 0x7FFFFFFF, thr).to(tl.float32, bitcast=True)
    eq_f = tl.where(thr == KEY_NEG_INF, float("nan"), thr_f)

    STEP: tl.constexpr = LANES * SPLITS           # from one of the split's tiles to its next
    part = row * SPLITS + split
    lanes = tl.arange(0, LANES)
    inner = tl.max_contiguous(lanes[:, None] + tl.arange(0, UNROLL)[None, :] * STEP, [1, 1])  # [LANES, UNROLL]
    cand = cand_ptr + part * (LANES * LCAP) + lanes[:, None] * LCAP
    ties = tie_ptr + part * (LANES * TCAP) + lanes[:, None] * TCAP
    start = split * LANES
    stop = n
    n_gt = tl.sum(tl.zeros([LANES, UNROLL], dtype=tl.int32), axis=1)  # per lane
    n_eq = n_gt
    # a thread's UNROLL loads: one per-lane address plus constants (immediate offsets), and one per-lane bound
    # compared with constants (no per-entry address or bound arithmetic)
    sub = tl.arange(0, UNROLL)[None, :] * STEP
    following = tl.load(tl.max_contiguous((row_scores + start + lanes)[:, None] + sub, [1, 1]),
                        mask=(stop - start - lanes)[:, None] > sub, other=float("-inf"))
    while start < stop:
        offs = start + inner
        tile = following
        ahead = start + STEP * UNROLL
        following = tl.load(tl.max_contiguous((row_scores + ahead + lanes)[:, None] + sub, [1, 1]),
                            mask=(stop - ahead - lanes)[:, None] > sub, other=float("-inf"))
        gt = ~(tile <= thr_f)             # out-of-range entries load -inf: never above, never equal
        eq = tile == eq_f
        # inclusive rank of each entry within its lane (index order): in-register
        gt_rank = tl.cumsum(gt.to(tl.int32), axis=1)
        eq_rank = tl.cumsum(eq.to(tl.int32), axis=1)
        gt_pos = n_gt[:, None] + gt_rank - 1
        eq_pos = n_eq[:, None] + eq_rank - 1
        bits = tile.to(tl.int32, bitcast=True).to(tl.int64) << 32
        tl.store(cand + gt_pos, bits | offs.to(tl.uint32).to(tl.int64), mask=gt & (gt_pos < LCAP))
        tl.store(ties + eq_pos, offs, mask=eq & (eq_pos < TCAP))
        n_gt += tl.sum(gt.to(tl.int32), axis=1)
        n_eq += tl.sum(eq.to(tl.int32), axis=1)
        start += STEP * UNROLL
    tl.store(lane_gt_ptr + part * LANES + lanes, n_gt)
    tl.store(lane_eq_ptr + part * LANES + lanes, n_eq)
    stats = stats_ptr + part * STATS
    tl.store(stats, tl.sum(n_gt, axis=0))
    tl.store(stats + 1, tl.sum(n_eq, axis=0))
    tl.store(stats + 2, (thr != KEY_NEG_INF).to(tl.int32))
    tl.store(stats + 3, thr)
    tl.store(stats + 5, tl.where(thr == INT32_MAX, LCAP + 1, tl.max(n_gt, axis=0)))


@triton.jit
def _row_exact(row_scores, n, K, out_row, key_row, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """Exact top-k of one row by whole-row passes (fallback): writes the selected indices / keys in index
    order to out_row / key_row and returns how many. Stats pass; range-narrowing passes until [lo, hi]
    holds exactly the keys still needed or one value; collect pass (keys > hi, then the first `needed`
    keys in [lo, hi] by index)."""
    lane = tl.arange(0, BLOCK)
    n_valid = 0
    lo = INT32_MAX
    hi = INT32_MIN
    start = 0
    while start < n:
        offs = start + lane
        key, valid = _order_key(tl.load(row_scores + offs, mask=offs < n, other=float("-inf")), offs < n)
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
        shift = _bucket_shift(lo, hi, BINS)
        hist = tl.zeros([BINS], dtype=tl.int32)
        start = 0
        while start < n:
            offs = start + lane
            key, valid = _order_key(tl.load(row_scores + offs, mask=offs < n, other=float("-inf")), offs < n)
            hist += _range_histogram(key, valid, lo, hi, shift, BINS)
            start += BLOCK
        lo, hi, needed, in_range = _keep_bucket(hist, lo, hi, shift, in_range, needed, BINS)
    written = 0
    inside_seen = 0
    start = 0
    while start < n:
        offs = start + lane
        key, valid = _order_key(tl.load(row_scores + offs, mask=offs < n, other=float("-inf")), offs < n)
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
def _take_top(key, have, lo, hi, count, need, cand_ptr, base, idx_row, key_row, BINS: tl.constexpr,
              DIRECT: tl.constexpr):
    """Write the need (<= count, > 0) largest of the count keys marked by ``have`` (all in [lo, hi]) with their
    indices to idx_row / key_row (tile order); equal keys at the boundary go to the lowest indices. A slot's
    index is the low half of cand_ptr[base + slot], or the slot itself (DIRECT). Returns need."""
    slot = tl.arange(0, key.shape[0])
    lo, hi, left = _narrow(key, have, lo, hi, count, need, BINS)
    above = have & (key > hi)
    inside = have & (key >= lo) & (key <= hi)
    in_range = tl.sum(inside.to(tl.int32), axis=0)
    take = above | inside
    if DIRECT:
        idx = slot
    else:
        idx = tl.load(cand_ptr + base + slot, mask=inside | above, other=0).to(tl.int32)
    if in_range != left:
        # one key value with more entries than still needed: the lowest indices win
        rev = INT32_MAX - idx
        lo2 = tl.min(tl.where(inside, rev, INT32_MAX), axis=0)
        hi2 = tl.max(tl.where(inside, rev, INT32_MIN), axis=0)
        lo2, hi2, _ = _narrow(rev, inside, lo2, hi2, in_range, left, BINS)
        take = above | (inside & (rev >= lo2))
    position = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(idx_row + position, idx, mask=take)
    tl.store(key_row + position, key, mask=take)
    return need


@triton.jit
def _final_kernel(
    scores_ptr, stride_scores, counts_ptr,
    cand_ptr, tie_ptr, lane_gt_ptr, lane_eq_ptr, stats_ptr,  # from _filter_kernel
    sel_key_ptr, sel_idx_ptr,       # int32 [R, K]: keys / indices of the selected entries (unordered)
    sel_count_ptr,                  # int32 [R]: how many entries each row selected
    K,
    SPLITS: tl.constexpr, LANES: tl.constexpr, LCAP: tl.constexpr, TCAP: tl.constexpr,
    BLOCK: tl.constexpr, BINS: tl.constexpr, DIRECT: tl.constexpr = False, FLOAT_BITS: tl.constexpr = False,
):
    """Grid (rows,): see the module docstring. FLOAT_BITS: the candidate buffer's high halves are fp32 bits
    (``_filter_thread_kernel``), mapped to order keys here."""
    row_id = tl.program_id(0)
    row = row_id.to(tl.int64)
    key_row = sel_key_ptr + row * K
    idx_row = sel_idx_ptr + row * K
    stats = stats_ptr + row * SPLITS * STATS
    CAP: tl.constexpr = SPLITS * LANES * LCAP
    if DIRECT:
        # every row has <= CAP entries and no filter ran: the row itself is the candidate tile (index = slot)
        n = tl.load(counts_ptr + row_id)
        slot = tl.arange(0, CAP)
        key, have = _order_key(tl.load(scores_ptr + row * stride_scores + slot, mask=slot < n,
                                       other=float("-inf")), slot < n)
        n_gt = tl.sum(have.to(tl.int32), axis=0)
        need = tl.minimum(n_gt, K)
        written = n_gt * 0
        if need > 0:
            top = tl.max(tl.where(have, key, INT32_MIN), axis=0)
            bottom = tl.min(tl.where(have, key, INT32_MAX), axis=0)
            written = _take_top(key, have, bottom, top, n_gt, need, cand_ptr, 0, idx_row, key_row, BINS, True)
        tl.store(sel_count_ptr + row, written)
        tl.store(stats + 6, 1)
        return
    n_gt = 0
    n_eq = 0
    below = 0
    overflow = 0
    for s in tl.static_range(SPLITS):
        n_gt += tl.load(stats + s * STATS)
        n_eq += tl.load(stats + s * STATS + 1)
        below = tl.maximum(below, tl.load(stats + s * STATS + 2))
        overflow = tl.maximum(overflow, (tl.load(stats + s * STATS + 5) > LCAP).to(tl.int32))
    thr = tl.load(stats + 3)
    short = n_gt + n_eq < K
    need = tl.minimum(n_gt + n_eq, K)  # = min(k, candidates) unless short with candidates below thr
    bad = (overflow > 0) or (short and (below > 0))
    done = 1 - bad.to(tl.int32)
    path = done  # 1: candidate buffer, 2: tie lists, 0: exact whole-row passes
    written = n_gt * 0
    TIES: tl.constexpr = SPLITS * LANES * TCAP

    if done != 0:
        # every lane's buffer as one register tile (lane-major; order does not matter: ties are broken
        # by index explicitly)
        slot = tl.arange(0, CAP)
        have = (slot % LCAP) < tl.load(lane_gt_ptr + row * (SPLITS * LANES) + slot // LCAP)
        base = row * CAP
        key = (tl.load(cand_ptr + base + slot, mask=have, other=0) >> 32).to(tl.int32)
        if FLOAT_BITS:
            key, _is_candidate = _order_key(key.to(tl.float32, bitcast=True), have)
        if n_gt >= need:
            if need > 0:
                # every buffered key is in [thr + 1, top]
                top = tl.max(tl.where(have, key, INT32_MIN), axis=0)
                written = _take_top(key, have, thr + 1, top, n_gt, need, cand_ptr, base, idx_row, key_row, BINS,
                                    False)
        else:
            # every key > thr, then the need - n_gt lowest indices == thr. Lane l's tie list holds its first
            # TCAP; a full list (more ties than TCAP) leaves its ties after its last stored index unknown, so
            # only ties <= bound (the smallest such last index) are known to be complete.
            tslot = tl.arange(0, TIES)
            lane_ties = tl.load(lane_eq_ptr + row * (SPLITS * LANES) + tslot // TCAP)
            stored = (tslot % TCAP) < lane_ties
            tie_idx = tl.load(tie_ptr + row * TIES + tslot, mask=stored, other=INT32_MAX)
            full_last = stored & ((tslot % TCAP) == TCAP - 1) & (lane_ties > TCAP)
            bound = tl.min(tl.where(full_last, tie_idx, INT32_MAX), axis=0)
            known = stored & (tie_idx <= bound)
            n_known = tl.sum(known.to(tl.int32), axis=0)
            wanted = need - n_gt
            if n_known >= wanted:
                rev = INT32_MAX - tie_idx
                lo2 = tl.min(tl.where(known, rev, INT32_MAX), axis=0)
                hi2 = tl.max(tl.where(known, rev, INT32_MIN), axis=0)
                lo2, hi2, _ = _narrow(rev, known, lo2, hi2, n_known, wanted, BINS)
                take = known & (rev >= lo2)
                position = n_gt + tl.cumsum(take.to(tl.int32), axis=0) - 1
                tl.store(idx_row + position, tie_idx, mask=take)
                tl.store(key_row + position, tl.full([TIES], 0, tl.int32) + thr, mask=take)
                idx = tl.load(cand_ptr + base + slot, mask=have, other=0).to(tl.int32)
                position = tl.cumsum(have.to(tl.int32), axis=0) - 1
                tl.store(idx_row + position, idx, mask=have)
                tl.store(key_row + position, key, mask=have)
                written = need
                path = path * 2
            else:
                done = done * 0
                path = path * 0
    if done == 0:
        n = tl.load(counts_ptr + row_id)
        written = _row_exact(scores_ptr + row * stride_scores, n, K, idx_row, key_row, BLOCK, BINS)
    tl.store(sel_count_ptr + row, written)
    tl.store(stats + 6, path)


@triton.jit
def _order_kernel(
    out_ptr, stride_out, sel_key_ptr, sel_idx_ptr, sel_count_ptr,
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
    idx = tl.load(sel_idx_ptr + row * K + col, mask=filled, other=0)
    if SORT:
        chosen_key = tl.load(sel_key_ptr + row * K + col, mask=filled, other=0)
        idx = _sort_by_key(chosen_key, idx, filled)
    idx = tl.where(filled, idx, -1)
    tl.store(out_row + col, idx, mask=col < K)
    if WITH_SLOTS:
        _store_slots(slots_ptr, stride_slots, seq_ptr, table_ptr, stride_table, row, idx, filled, col, K)


@triton.jit
def _order_blocked_kernel(
    out_ptr, stride_out, sel_key_ptr, sel_idx_ptr, sel_count_ptr,
    slots_ptr, stride_slots, seq_ptr, table_ptr, stride_table,  # as _order_kernel (WITH_SLOTS)
    K,
    ROWS: tl.constexpr, REGS: tl.constexpr, WITH_SLOTS: tl.constexpr,
):
    """``_order_kernel`` (SORT) with the sort's low strides in registers (StreamConfig.register_sort).

    The bitonic network of ``tl.sort`` compares entries at strides 1, 2, 4, ... of the sorted sequence, the
    low strides most often (stride 2^s in 11 - s of the 66 stages for 2048 entries). Loaded as a plain vector,
    four consecutive entries sit in a thread and stride 4 .. 128 cross lanes and warps (shuffles and shared
    memory in 39 stages). Here the K_PAD = ROWS x REGS selected entries are loaded as a [ROWS, REGS] tile
    whose rows run along the memory (entry (a, b) from position b ROWS + a: coalesced, every entry once;
    their order does not matter before a sort) and sorted as the flat sequence a REGS + b, so the sequence's
    low log2(REGS) + 2 bits are a thread's registers (with ROWS = 128 x warps: 4 rows per thread, the lanes
    and warps above): 45 of the 66 stages stay in registers for REGS = 8. Position p = a REGS + b of the
    sorted sequence is output column p."""
    row = tl.program_id(0).to(tl.int64)
    a = tl.arange(0, ROWS)[:, None]
    b = tl.arange(0, REGS)[None, :]
    written = tl.load(sel_count_ptr + row)
    source = b * ROWS + a
    filled = source < written
    key = tl.load(sel_key_ptr + row * K + source, mask=filled, other=0)
    idx = tl.load(sel_idx_ptr + row * K + source, mask=filled, other=0)
    packed = tl.where(filled, key.to(tl.int64) * 4294967296 + (0x7FFFFFFF - idx).to(tl.int64), INT64_MIN)
    ordered = tl.reshape(tl.sort(tl.reshape(packed, [ROWS * REGS]), descending=True), [ROWS, REGS])
    col = a * REGS + b
    placed = col < written
    idx = tl.where(placed, 0x7FFFFFFF - (ordered & 0xFFFFFFFF).to(tl.int32), -1)
    tl.store(out_ptr + row * stride_out + col, idx, mask=col < K)
    if WITH_SLOTS:
        _store_slots(slots_ptr, stride_slots, seq_ptr, table_ptr, stride_table, row, idx, placed, col, K)


@triton.jit
def _order_chunk_kernel(
    sel_key_ptr, sel_idx_ptr, sel_count_ptr, sorted_ptr, stride_sorted, K,
    CHUNK: tl.constexpr,
):
    """Grid (rows, K_PAD // CHUNK): sort chunk c of a row's selected entries (positions c CHUNK ..+ CHUNK of
    sel_key / sel_idx) by (key desc, index asc) as packed int64 (key << 32 | 0x7FFFFFFF - index), unfilled
    positions as INT64_MIN (last), into sorted_ptr [R, >= K_PAD] at the same positions."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    written = tl.load(sel_count_ptr + row)
    filled = col < written
    key = tl.load(sel_key_ptr + row * K + col, mask=filled, other=0)
    idx = tl.load(sel_idx_ptr + row * K + col, mask=filled, other=0)
    tl.store(sorted_ptr + row * stride_sorted + col, _sorted_packed(key, idx, filled))


@triton.jit
def _order_merge_kernel(
    out_ptr, stride_out, sorted_ptr, stride_sorted, sel_count_ptr,
    slots_ptr, stride_slots, seq_ptr, table_ptr, stride_table,  # as _order_kernel (WITH_SLOTS)
    K,
    CHUNK: tl.constexpr, LOG_CHUNK: tl.constexpr, CHUNKS: tl.constexpr, WITH_SLOTS: tl.constexpr,
):
    """Grid (rows, CHUNKS): place chunk c's sorted entries at their rank in the whole row. Packed values are
    distinct (the index is in them), so an entry's output position is the number of entries of the row
    above it: the sum over the CHUNKS sorted chunks of how many of theirs are larger (a binary search each,
    log2(CHUNK) + 1 probes). Positions >= the selected count get -1."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    local = tl.arange(0, CHUNK)
    col = c * CHUNK + local
    written = tl.load(sel_count_ptr + row)
    filled = col < written  # sorted chunks keep their filled entries first
    base = sorted_ptr + row * stride_sorted
    mine = tl.load(base + col)
    position = tl.zeros([CHUNK], dtype=tl.int32)
    for other in tl.static_range(CHUNKS):
        larger = tl.zeros([CHUNK], dtype=tl.int32)  # entries of chunk `other` > mine (a prefix of it)
        for level in tl.static_range(LOG_CHUNK + 1):  # steps CHUNK, CHUNK / 2, .., 1
            probe = larger + ((CHUNK >> level) - 1)
            inside = probe < CHUNK
            value = tl.load(base + other * CHUNK + probe, mask=inside, other=INT64_MIN)
            larger = tl.where(inside & (value > mine), larger + (CHUNK >> level), larger)
        position += larger
    idx = 0x7FFFFFFF - (mine & 0xFFFFFFFF).to(tl.int32)
    target = tl.where(filled, position, col)
    idx = tl.where(filled, idx, -1)
    tl.store(out_ptr + row * stride_out + target, idx, mask=target < K)
    if WITH_SLOTS:
        _store_slots(slots_ptr, stride_slots, seq_ptr, table_ptr, stride_table, row, idx, filled, target, K)
