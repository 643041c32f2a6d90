"""Triton top-k of the lightning indexer: exact radix select over a bounded score workspace.

Two entry points:

* :func:`select_topk_triton` - scores fp32 [T, W] (+ optional visible count per row) -> int32 [T, K], the
  rules of :func:`dsakit.ops.topk.reference.select_topk` (candidates are scores > -inf, NaN ranks above +inf,
  equal scores go to the lower index, -1 padding, descending score order).
* :func:`index_topk_triton` - scores of a ragged paged batch fused with the selection, never holding a
  [T, N] matrix: query rows are scored ``rows_per_chunk`` at a time into one fp32 workspace
  [rows_per_chunk, W] (W = max(entry_counts)) by ``dsakit.ops.scores.triton.index_scores_triton`` and each
  chunk is selected before the next one overwrites the workspace.

Workspace budget (documented, independent of N for the memory that matters):

    rows_per_chunk = clamp(workspace_bytes // (4 * W), 1, T)        default workspace_bytes = 512 MiB
    extra memory   = 4 * rows_per_chunk * W  (<= max(workspace_bytes, 4 * W))        fp32 score workspace
                   + 8 * rows_per_chunk * CANDIDATE_CAP (2048)                        candidate buffer
                   + 4 * T * K (indices) [+ 4 * T * K (slots)] + 4 * T (visible counts)

At T = 8192, N = W = 262144 (1M tokens at ratio 4), K = 2048: 512 rows per chunk, 512 MiB workspace + 8 MiB of
candidates + 64 MiB of indices (measured peak 0.57 GiB on the H200), against 8 GiB for materialized fp32 logits.

Selection algorithm (one program per row, ``_radix_select_kernel``; keys are order-preserving int32 of the
fp32 bits: NaN -> INT32_MAX above +inf, -0.0 -> +0.0; candidates are scores > -inf)::

    pass 1 (stats)     candidate count, smallest and largest key; if count <= K: take every candidate
    narrowing passes   keys in [lo, hi] hold the needed-th largest of what is not already above hi; histogram
                       (key - lo) >> shift into BINS buckets (tl.histogram), keep the needed-th key's bucket,
                       needed -= keys above it; until the range holds <= CAP keys, exactly the needed ones, or
                       a single key value (typically 1-2 passes)
    collect pass       index order, one packed scan: keys > hi are selected; keys in [lo, hi] are either
                       selected directly (exact range, or one value: first `needed` by index = the tie rule) or
                       copied with their index to the candidate buffer (<= CAP entries, index order)
    buffer select      exact 4-level 8-bit radix select of the needed largest among the buffered candidates,
                       ties to the lowest index (the buffer is in index order)
    epilogue           sort the <= K selected by (key desc, index asc) with tl.sort on packed int64
                       (key << 32 | 0x7FFFFFFF - index), pad with -1, optionally map to slots

Each row is streamed 3-4 times (stats, 1-2 narrowing passes, collect); every streaming loop prefetches its
next tile. Rows with few candidates stop after the stats pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...cache import check_pool
from ...formats import KeyFormat
from ..scores.reference import check_batch, check_queries, visible_counts

# Default fp32 score workspace of index_topk_triton (bytes). 512 MiB keeps the peak extra memory at
# T = 8192, N = 262144, K = 2048 under 1 GiB while chunks stay large enough (>= 512 rows at
# N <= 256K) to fill the GPU.
DEFAULT_WORKSPACE_BYTES = 512 << 20

_INT32_MIN = tl.constexpr(-(1 << 31))
# Candidates per row kept for the exact final select (fp32 value + int32 index = 8 bytes each).
CANDIDATE_CAP = 2048
# Largest tile of the streaming passes: the collect pass packs two per-tile ranks into one int32 cumsum
# (above + 65536 * inside), exact only while 65536 * BLOCK < 2^31.
MAX_SELECT_BLOCK = 16384


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
    buckets = tl.arange(0, BINS)

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
        span = hi.to(tl.int64) - lo.to(tl.int64)
        shift = 0
        while (span >> shift) >= BINS:
            shift += 1
        hist = tl.zeros([BINS], dtype=tl.int32)
        start = 0
        tile = tl.load(row_scores + lane, mask=lane < n, other=float("-inf"))
        while start < n:
            offs = start + lane
            following = tl.load(row_scores + offs + BLOCK, mask=offs + BLOCK < n, other=float("-inf"))
            key, valid = _order_key(tile, offs < n)
            tile = following
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
        # (key, index asc) as one int64: key in the high half, 0x7FFFFFFF - index (>= 0) in the low half.
        packed = chosen_key.to(tl.int64) * 4294967296 + (0x7FFFFFFF - idx).to(tl.int64)
        packed = tl.where(filled, packed, -9223372036854775807 - 1)
        packed = tl.sort(packed, descending=True)
        idx = 0x7FFFFFFF - (packed & 0xFFFFFFFF).to(tl.int32)
    idx = tl.where(filled, idx, -1)
    tl.debug_barrier()  # every thread has read the unsorted row before any overwrites it
    tl.store(row_out + col, idx, mask=col < K)
    if WITH_SLOTS:
        seq = tl.load(seq_ptr + row).to(tl.int64)
        page = tl.load(table_ptr + seq * stride_table + idx // 64, mask=filled, other=0)
        slot = tl.where(filled, page * 64 + idx % 64, -1)
        tl.store(slots_ptr + row * stride_slots + col, slot, mask=col < K)


def default_select_config(rows: int) -> tuple[int, int, int]:
    """(BLOCK, num_warps, BINS) of the select kernel, from the H200 sweep (benchmarks/results/indexer_h200_*.json):
    many rows (prefill) -> 2048 x 8 warps, 128 buckets; few long rows (decode, one program per row) -> 8192 x
    16 warps, 64 buckets."""
    return (2048, 8, 128) if rows >= 512 else (8192, 16, 64)


def _launch_select(scores: torch.Tensor, counts: torch.Tensor, out: torch.Tensor, k: int, sort: bool,
                   slots: torch.Tensor | None = None, seq: torch.Tensor | None = None,
                   block_table: torch.Tensor | None = None, block: int | None = None, num_warps: int | None = None,
                   bins: int | None = None, cap: int = CANDIDATE_CAP, cand_vals: torch.Tensor | None = None,
                   cand_idx: torch.Tensor | None = None) -> None:
    default_block, default_warps, default_bins = default_select_config(scores.shape[0])
    block = block or default_block
    num_warps = num_warps or default_warps
    bins = bins or default_bins
    if block < 16 or block & (block - 1) or block > MAX_SELECT_BLOCK:
        raise ValueError(f"block must be a power of two in 16..{MAX_SELECT_BLOCK}, got {block}")
    if bins < 32 or bins & (bins - 1) or bins > 1024:
        raise ValueError(f"bins must be a power of two in 32..1024, got {bins}")
    if cap < 32 or cap & (cap - 1):
        raise ValueError(f"cap must be a power of two >= 32, got {cap}")
    rows = scores.shape[0]
    if rows == 0:
        return
    with_slots = slots is not None
    if cand_vals is None or cand_vals.shape[0] < rows or cand_vals.shape[1] != cap:
        cand_vals = torch.empty((rows, cap), dtype=torch.float32, device=scores.device)
        cand_idx = torch.empty((rows, cap), dtype=torch.int32, device=scores.device)
    _radix_select_kernel[(rows,)](
        scores, scores.stride(0), counts, out, out.stride(0), cand_vals, cand_idx,
        slots if with_slots else out, slots.stride(0) if with_slots else 0,
        seq if with_slots else counts,
        block_table if with_slots else counts, block_table.stride(0) if with_slots else 0,
        k, BLOCK=block, BINS=bins, CAP=cap, K_PAD=triton.next_power_of_2(k), SORT=sort, WITH_SLOTS=with_slots,
        num_warps=num_warps)


def _check_k(k) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if k > 16384:
        # The final sort holds next_pow2(K) int64 keys in registers of one program.
        raise ValueError(f"k must be <= 16384 for the Triton top-k (register sort), got {k}")


def select_topk_triton(scores: torch.Tensor, k: int, *, row_counts: torch.Tensor | None = None,
                       sort: bool = True, block: int | None = None, num_warps: int | None = None,
                       bins: int | None = None,
                       cap: int = CANDIDATE_CAP) -> torch.Tensor:
    """Exact top-k per row of scores fp32 [T, W] -> int32 [T, k] (rules of the reference ``select_topk``).

    ``row_counts`` int [T] (optional): row t considers only its first row_counts[t] entries (the rest is
    treated as masked and never read). ``sort=False`` returns the same set per row in index order
    (skips the final sort). ``block`` / ``num_warps`` / ``bins`` / ``cap``: tuning (tile of the streaming
    passes, buckets of the narrowing histograms, candidate buffer entries per row; None = the tuned defaults of
    :func:`default_select_config`). Memory: the [T, k] output
    plus a candidate scratch of 8 * cap bytes per row.
    """
    if not isinstance(scores, torch.Tensor) or scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be an fp32 [T, W] tensor, got "
                         f"{(scores.dtype, list(scores.shape)) if isinstance(scores, torch.Tensor) else type(scores).__name__}")
    _check_k(k)
    if scores.stride(1) != 1:
        raise ValueError(f"scores must have unit stride along W, got strides {scores.stride()}")
    t, w = scores.shape
    if row_counts is None:
        counts = torch.full((t,), w, dtype=torch.int32, device=scores.device)
    else:
        if row_counts.shape != (t,) or row_counts.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"row_counts must be int [T] = [{t}], got {row_counts.dtype} {list(row_counts.shape)}")
        if row_counts.device != scores.device:
            raise ValueError(f"row_counts is on {row_counts.device}, scores on {scores.device}")
        if t and (bool((row_counts < 0).any()) or bool((row_counts > w).any())):
            raise ValueError(f"row_counts must be in 0..{w} (the scores width), got range "
                             f"{int(row_counts.min())}..{int(row_counts.max())}")
        counts = row_counts.to(torch.int32).contiguous()
    out = torch.empty((t, k), dtype=torch.int32, device=scores.device)
    _launch_select(scores, counts, out, k, sort, block=block, num_warps=num_warps, bins=bins, cap=cap)
    return out


def rows_per_chunk(t: int, width: int, workspace_bytes: int) -> int:
    """Query rows scored at once so that the fp32 workspace [rows, width] fits ``workspace_bytes``."""
    if width <= 0:
        return max(1, t)
    return int(max(1, min(t, workspace_bytes // (4 * width))))


def index_topk_triton(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: "KeyFormat | str",
                      block_table: torch.Tensor, entry_counts: torch.Tensor, query_seq: torch.Tensor, k: int,
                      query_positions: torch.Tensor | None = None, ratio: int = 1, *,
                      return_slots: bool = False, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
                      q_scale: torch.Tensor | None = None, sort: bool = True,
                      select_block: int | None = None, select_warps: int | None = None,
                      select_bins: int | None = None):
    """Top-k entries per query of a ragged paged batch, scores fused with an exact radix select.

    Arguments as :func:`dsakit.ops.topk.reference.index_topk`: q [T, H, 128] (fp32/bf16, or fp8 e4m3 with
    ``q_scale`` [T, H]), weights [T, H], pool uint8 [P, page_bytes], block_table int [B, max_pages],
    entry_counts int [B], query_seq int [T], query_positions int [T] or None, ratio.

    Returns int32 [T, k] entry indices within each query's sequence (-1 padded), or
    ``(indices, slots)`` with ``return_slots=True`` (slots = page * 64 + entry % 64 via the block table, -1
    kept). Never materializes [T, N]: scores go through one fp32 workspace of at most
    max(workspace_bytes, 4 * W) bytes (W = max(entry_counts); see the module docstring).
    ``sort=False`` returns each row's set without the final ordering (deterministic: entries above the
    threshold range in index order, then the chosen candidates in index order); ``select_block`` /
    ``select_warps`` / ``select_bins``: tuning of the select kernel (benchmarks).
    """
    # the scores kernel (separate module, same contract) and its reusable tile plans
    from ..scores.triton import index_scores_triton, plan_query_tiles

    fmt = KeyFormat.parse(fmt)
    check_queries(q, weights)
    check_pool(pool, fmt)
    t = q.shape[0]
    check_batch(block_table, entry_counts, query_seq, t, query_positions, ratio)
    _check_k(k)
    if isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, int) or workspace_bytes < 1:
        raise ValueError(f"workspace_bytes must be a positive int, got {workspace_bytes!r}")
    device = q.device
    for name, tensor in (("weights", weights), ("pool", pool), ("block_table", block_table),
                         ("entry_counts", entry_counts), ("query_seq", query_seq),
                         ("query_positions", query_positions), ("q_scale", q_scale)):
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, q on {device}: put every input on one device")

    indices = torch.empty((t, k), dtype=torch.int32, device=device)
    slots = torch.empty((t, k), dtype=torch.int32, device=device) if return_slots else None
    width = int(entry_counts.max()) if entry_counts.numel() else 0
    if t == 0 or width == 0:
        indices.fill_(-1)
        if slots is not None:
            slots.fill_(-1)
        return (indices, slots) if return_slots else indices

    seq = query_seq.to(torch.int32).contiguous()
    visible = visible_counts(entry_counts[query_seq.long()], query_positions, ratio).to(torch.int32)
    table = block_table.to(torch.int32).contiguous() if return_slots else None
    chunk = rows_per_chunk(t, width, workspace_bytes)
    workspace = torch.empty((chunk, width), dtype=torch.float32, device=device)
    cand_vals = torch.empty((chunk, CANDIDATE_CAP), dtype=torch.float32, device=device)
    cand_idx = torch.empty((chunk, CANDIDATE_CAP), dtype=torch.int32, device=device)
    if q_scale is not None and isinstance(q_scale, torch.Tensor) and q_scale.shape == (t, q.shape[1]):
        if not bool((q_scale > 0).all()):
            raise ValueError("q_scale must be > 0 everywhere (it is moved through the relu: relu(c x) = c relu(x))")
    # Host syncs happen here, before the first launch: every chunk's tile plan is built up front, the first
    # chunk's scores call validates the values that do not depend on the rows (page ids, counts), and the
    # rest run with validate=False (query_seq and q_scale were checked above for all rows; the workspace
    # width W >= every visible count by construction). The loop then launches without waiting for the GPU.
    starts = list(range(0, t, chunk))
    plans = [plan_query_tiles(query_seq[start:start + chunk], block_table.shape[0], q.shape[1]) for start in starts]
    for number, (start, plan) in enumerate(zip(starts, plans)):
        stop = min(t, start + chunk)
        rows = stop - start
        scores = index_scores_triton(
            q[start:stop], weights[start:stop], pool, fmt, block_table, entry_counts, query_seq[start:stop],
            None if query_positions is None else query_positions[start:stop], ratio,
            out=workspace[:rows], q_scale=None if q_scale is None else q_scale[start:stop], tiles=plan,
            validate=number == 0)
        _launch_select(scores, visible[start:stop], indices[start:stop], k, sort,
                       slots=None if slots is None else slots[start:stop], seq=seq[start:stop],
                       block_table=table, block=select_block, num_warps=select_warps, bins=select_bins,
                       cand_vals=cand_vals, cand_idx=cand_idx)
    return (indices, slots) if return_slots else indices
