"""Triton top-k of the lightning indexer: exact radix select over a bounded score workspace.

Two entry points:

* :func:`select_topk_triton` - scores fp32 [T, W] (+ optional visible count per row) -> int32 [T, K], the
  rules of :func:`dsakit.ops.topk.reference.select_topk` (candidates are scores > -inf, NaN ranks above +inf,
  equal scores go to the lower index, -1 padding, descending score order).
* :func:`index_topk_triton` - scores of a ragged paged batch (a :class:`dsakit.PagedBatch`) fused with the
  selection, never holding a [T, N] matrix: query rows are scored ``rows_per_chunk`` at a time into one fp32
  workspace [rows_per_chunk, W] (W = batch.max_entries) by the scores kernel and each chunk is selected
  before the next one overwrites the workspace. On CUDA with several chunks and ``TopkConfig.overlap``
  (opt-in; measured no faster on the H200) two half-size workspaces alternate: chunk i is selected on a
  high-priority side stream while chunk i + 1 is scored on the caller's stream, ordered by events only.

Both select with the streaming select (:func:`select_topk_stream`, :class:`SelectBuffers`; launch settings from
``SelectConfig.stream_for``) for k <= 4096 (one pass over the scores in the common case;
``SelectConfig.algorithm``) and with the multi-pass radix select below otherwise. Every launch setting comes
from :mod:`dsakit.ops.topk.config`.

Host cost. Workspaces (visible counts, score workspace, candidate buffers) and tile plans are cached by
shape (device, T, H, workspace width rounded up to a power of two, queries per sequence), so a repeated
call with the same shapes makes no device->host sync and allocates only its outputs. A batch whose rows
are not grouped by sequence, cut into several chunks, costs one sync per call (the per-chunk tile counts).
:func:`release_workspaces` frees the cache.

Workspace budget (documented, independent of N for the memory that matters):

    rows_per_chunk = clamp(workspace_bytes // (4 * W'), 1, T)       default workspace_bytes = 512 MiB
    W' = W rounded up to a power of two (the cached workspace serves every W up to it)
    extra memory   = 4 * rows_per_chunk * W' (<= max(workspace_bytes, 4 * W'))      fp32 score workspace
                   + 8 * rows_per_chunk * SelectConfig.cap (2048)                     candidate buffer
                   + 4 * T * K (indices) [+ 4 * T * K (slots)] + 4 * T (visible counts)

    overlap (CUDA, rows_per_chunk above < T): rows_per_chunk = clamp((workspace_bytes // 2) // (4 * W'), 1, T)
    and two such workspaces, 2 * 4 * rows_per_chunk * W' (<= max(workspace_bytes, 8 * W')): the same peak
    extra memory for the scores, half the rows per select launch (smaller select buffers).

At T = 8192, N = W = 262144 (1M tokens at ratio 4), K = 2048: 512 rows per chunk, 512 MiB workspace + 8 MiB of
candidates + 64 MiB of indices (measured peak 0.57 GiB on the H200 with overlap=False; with overlap 2 x 256
rows, the same 512 MiB of workspaces), against 8 GiB for materialized fp32 logits.

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

from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton

from ..._memory import check_bool, check_instance
from ...batch import PagedBatch, check_k
from ..scores.triton import (QueryTiles, check_q_inputs, check_q_scale_values, launch_index_scores,
                             plan_query_tiles, prepare_q, tiles_from_lens)
from ._inputs import check_scores_matrix, lru_get, row_counts_int32, slot_args
from ._kernels import _radix_select_kernel, _visible_kernel
from ._select_stream import (SelectBuffers, launch_stream_select, launch_stream_select_cached,
                             release_select_buffers, select_topk_stream)
from .config import (DEFAULT_WORKSPACE_BYTES, MAX_K, STREAM_MAX_K, SelectConfig, StreamConfig, TopkConfig,
                     rows_per_chunk)

# Buffers reused across calls, keyed by (role, device, shape); bounded so that a long-running process that
# sees many shapes keeps only the latest few.
_BUFFERS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_BUFFERS_KEPT = 12
# Side stream per CUDA device of the overlapped prefill (TopkConfig.overlap).
_SIDE_STREAMS: "dict[torch.device, torch.cuda.Stream]" = {}


def release_workspaces() -> None:
    """Free the workspaces cached by :func:`index_topk_triton` (the next call allocates them again)."""
    _BUFFERS.clear()
    release_select_buffers()


def cached_buffer(role: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable uninitialized buffer for ``role`` (allocated once per shape and device)."""
    return lru_get(_BUFFERS, (role, device, shape, dtype), _BUFFERS_KEPT,
                   lambda: torch.empty(shape, dtype=dtype, device=device))


def launch_select(scores: torch.Tensor, counts: torch.Tensor, out: torch.Tensor, k: int, sort: bool, *,
                  config: SelectConfig | None = None, slots: torch.Tensor | None = None,
                  seq: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                  cand_vals: torch.Tensor | None = None, cand_idx: torch.Tensor | None = None,
                  stream_buffers=None) -> None:
    """Launch the radix select of scores fp32 [R, W] (row r considers its first counts[r] entries) into
    out int32 [R, k] (and slots, through seq [R] and block_table, when given). No checks, no sync; the
    candidate buffers (fp32 / int32 [>= R, cap]) are allocated when not given. With the streaming select
    (``config.algorithm``), ``stream_buffers`` (a ``SelectBuffers``) or cached ones are used."""
    config = config or SelectConfig()
    if config.uses_stream(k):
        if stream_buffers is None:
            launch_stream_select_cached(scores, counts, out, k, sort, slots=slots, seq=seq, block_table=block_table,
                                        select=config)
        else:
            launch_stream_select(scores, counts, out, k, sort, stream_buffers, slots=slots, seq=seq,
                                 block_table=block_table)
        return
    block, num_warps, bins = config.resolve(scores.shape[0])
    cap = config.cap
    rows = scores.shape[0]
    if rows == 0:
        return
    if cand_vals is None or cand_vals.shape[0] < rows or cand_vals.shape[1] != cap:
        cand_vals = torch.empty((rows, cap), dtype=torch.float32, device=scores.device)
        cand_idx = torch.empty((rows, cap), dtype=torch.int32, device=scores.device)
    _radix_select_kernel[(rows,)](
        scores, scores.stride(0), counts, out, out.stride(0), cand_vals, cand_idx,
        *slot_args(out, counts, slots, seq, block_table),
        k, BLOCK=block, BINS=bins, CAP=cap, K_PAD=triton.next_power_of_2(k), SORT=sort,
        WITH_SLOTS=slots is not None, num_warps=num_warps)


def launch_visible(batch: PagedBatch, out: torch.Tensor, limit: int, config: SelectConfig | None = None) -> None:
    """visible int32 [T] of every batch row, clamped to 0..limit (one kernel, no sync); config: its launch
    (``SelectConfig.visible_block`` rows per program)."""
    rows = batch.num_queries
    if rows == 0:
        return
    block = (config or SelectConfig()).visible_block
    positions = batch.query_positions
    _visible_kernel[(triton.cdiv(rows, block),)](
        batch.entry_counts, batch.query_seq, positions if positions is not None else batch.entry_counts, out,
        rows, max(batch.num_seqs, 1), batch.ratio, limit, HAS_POS=positions is not None, BLOCK=block)


def select_topk_triton(scores: torch.Tensor, k: int, *, row_counts: torch.Tensor | None = None,
                       sort: bool = True, config: SelectConfig | None = None) -> torch.Tensor:
    """Exact top-k per row of scores fp32 [T, W] -> int32 [T, k] (rules of the reference ``select_topk``).

    ``row_counts`` int [T] (optional): row t considers only its first row_counts[t] entries (the rest is
    treated as masked and never read; checking the values costs one sync). ``sort=False`` returns the same
    set per row in a deterministic order (index order for the multi-pass select; the streaming select's
    buffer order otherwise) and skips the final sort. ``config``: select tuning (:class:`SelectConfig`).
    Memory: the [T, k] output plus a candidate scratch of 8 * cap bytes per row.
    """
    check_scores_matrix(scores, sort)
    check_k(k, MAX_K)
    t = scores.shape[0]
    counts = row_counts_int32(scores, row_counts)
    out = torch.empty((t, k), dtype=torch.int32, device=scores.device)
    launch_select(scores, counts, out, k, sort, config=config)
    return out


def workspace_width(max_entries: int) -> int:
    """Columns of the cached score workspace for W = max_entries: the next power of two (>= 64), so a
    sequence that grows by one entry per decode step reuses the same workspace for many steps."""
    return max(64, triton.next_power_of_2(max(1, max_entries)))


def _chunk_lens(batch: PagedBatch, chunk: int) -> list[Sequence[int]]:
    """Queries per sequence within each chunk of ``chunk`` rows: host arithmetic when the rows are grouped
    by sequence, else one device->host sync for every chunk at once."""
    t, b = batch.num_queries, batch.num_seqs
    starts = range(0, t, chunk)
    if batch.query_lens is not None and chunk >= t:
        return [batch.query_lens]
    if batch.query_lens is not None and batch.rows_sorted:
        out = []
        bounds = [0]
        for n in batch.query_lens:
            bounds.append(bounds[-1] + n)
        for start in starts:
            stop = min(t, start + chunk)
            out.append([max(0, min(stop, bounds[i + 1]) - max(start, bounds[i])) for i in range(b)])
        return out
    which = torch.arange(t, device=batch.device) // chunk
    seq = batch.query_seq.long().clamp(0, max(b - 1, 0))
    flat = torch.bincount(which * b + seq, minlength=len(starts) * b)[: len(starts) * b]
    values = flat.tolist()
    return [values[i * b:(i + 1) * b] for i in range(len(starts))]


def plan_chunks(batch: PagedBatch, chunk: int, num_heads: int, config: TopkConfig) -> list[QueryTiles]:
    """Tile plan of every chunk of ``chunk`` rows (no sync for a batch with rows grouped by sequence)."""
    if batch.num_queries <= chunk and batch.query_lens is None:
        return [plan_query_tiles(batch.query_seq, batch.num_seqs, num_heads, config.scores.kernel,
                                 cap=config.scores.prefill_block_t)]
    plans = []
    for number, lens in enumerate(_chunk_lens(batch, chunk)):
        rows = None
        if not batch.rows_sorted:
            start = number * chunk
            rows = torch.argsort(batch.query_seq[start:start + chunk], stable=True)
        plans.append(tiles_from_lens(lens, num_heads, batch.device, config.scores, rows))
    return plans


def _has_streams(device: torch.device) -> bool:
    """Whether the chunk loop can overlap on ``device`` (CUDA streams; the CPU path stays serial)."""
    return device.type == "cuda"


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The cached side stream of ``device`` for the overlapped selects, at the highest priority torch offers
    (lower number = higher priority): a select's CTAs are scheduled as soon as the scores kernel frees SMs."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = torch.cuda.Stream(device, priority=torch.cuda.Stream.priority_range()[1])
        _SIDE_STREAMS[device] = stream
    return stream


def _score_chunk(q, weights, batch: PagedBatch, scores: torch.Tensor, tiles: QueryTiles, start: int,
                 q_scale: torch.Tensor | None, config: TopkConfig) -> None:
    """Scores of query rows start .. start + len(scores) into the workspace slice ``scores``."""
    stop = start + scores.shape[0]
    launch_index_scores(q[start:stop], weights[start:stop], batch, scores, tiles, start=start,
                        q_scale=None if q_scale is None else q_scale[start:stop], config=config.scores)


def _select_chunk(scores: torch.Tensor, batch: PagedBatch, visible: torch.Tensor, indices: torch.Tensor,
                  slots: torch.Tensor | None, k: int, start: int, config: TopkConfig, cand_vals: torch.Tensor,
                  cand_idx: torch.Tensor) -> None:
    """Select the rows start .. start + len(scores) of a chunk's scores into indices (and slots)."""
    stop = start + scores.shape[0]
    launch_select(scores, visible[start:stop], indices[start:stop], k, config.sort, config=config.select,
                  slots=None if slots is None else slots[start:stop], seq=batch.query_seq[start:stop],
                  block_table=batch.block_table if slots is not None else None,
                  cand_vals=cand_vals, cand_idx=cand_idx)


def _overlapped_chunks(q, weights, batch: PagedBatch, k: int, plans: list[QueryTiles], chunk: int,
                       workspaces: torch.Tensor, visible: torch.Tensor, indices: torch.Tensor,
                       slots: torch.Tensor | None, q_scale: torch.Tensor | None, config: TopkConfig,
                       cand_vals: torch.Tensor, cand_idx: torch.Tensor) -> None:
    """The chunk loop of :func:`index_topk_triton` with the select of chunk i on the side stream while chunk
    i + 1 is scored on the caller's stream, into workspaces fp32 [2, chunk, W] used in turn. Only events order
    the two streams (no host sync, capture-legal: the side stream forks from and joins the capturing stream).

    Lifetimes (no ``record_stream`` needed): the caching allocator hands a freed block out again only to
    work queued later on the stream that allocated it. Tensors made on ``main`` and used by the selects
    (outputs, visible counts, workspaces, batch metadata): ``main`` waits for the side stream before this
    returns, so whatever ``main`` queues after they are freed runs after the selects. Buffers that the
    streaming select's cache allocates inside the side-stream context belong to the side stream's pool and
    are used by selects on either stream (serial calls select on ``main``): side work of a call starts after
    everything ``main`` queued before it (each select waits on an event recorded after its chunk's scores)
    and ends before anything ``main`` queues after the call, so the uses never overlap, and a block evicted
    from that cache is reused only by work ordered after them. Inside the loop ``main`` allocates nothing and
    writes only the workspace the ``free`` events hand back; the selects share the candidate / select
    buffers but run one after another on the side stream."""
    device = batch.device
    t = q.shape[0]
    main = torch.cuda.current_stream(device)
    side = _side_stream(device)
    free: list = [None, None]  # free[b]: recorded on the side stream once the select reading buffer b is done
    for number, tiles in enumerate(plans):
        buf = number % 2
        start = number * chunk
        stop = min(t, start + chunk)
        scores = workspaces[buf, : stop - start]
        if free[buf] is not None:
            main.wait_event(free[buf])  # the select of chunk number - 2 has read this buffer
        _score_chunk(q, weights, batch, scores, tiles, start, q_scale, config)
        ready = torch.cuda.Event()
        ready.record(main)
        # also orders the side stream after all earlier work of main (visible counts, q, batch metadata)
        side.wait_event(ready)
        with torch.cuda.stream(side):
            _select_chunk(scores, batch, visible, indices, slots, k, start, config, cand_vals, cand_idx)
        free[buf] = torch.cuda.Event()
        free[buf].record(side)
    main.wait_stream(side)


def index_topk_triton(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int, *,
                      return_slots: bool = False, q_scale: torch.Tensor | None = None,
                      config: TopkConfig | None = None, check_q_scale: bool = True):
    """Top-k entries per query of a ragged paged batch, scores fused with an exact radix select.

    q [T, H, 128] (fp32 / fp16 / bf16, or fp8 e4m3 with ``q_scale`` fp32 [T, H] > 0, whose check costs one
    sync), weights [T, H], batch a :class:`dsakit.PagedBatch` on q's device.

    Returns int32 [T, k] entry indices within each query's sequence (-1 padded), or ``(indices, slots)`` with
    ``return_slots=True`` (slots = page * 64 + entry % 64 via the block table, -1 kept). Never materializes
    [T, N]: scores go through one cached fp32 workspace, or two half-size ones whose selects overlap the
    next chunk's scores on CUDA (see the module docstring). config: a :class:`TopkConfig` (workspace bound,
    sort, overlap, kernel tuning; default: the measured table of the GPU).
    """
    check_q_inputs(q, weights, batch, q_scale)
    check_k(k, MAX_K)
    check_bool("return_slots", return_slots)
    config = check_instance("config", config or TopkConfig.for_device(batch.device), TopkConfig)
    if check_q_scale:  # a caller that checked it once (hierarchical top-k) skips the sync
        check_q_scale_values(q_scale)
    device = batch.device
    t, num_heads, _ = q.shape
    width = batch.max_entries
    indices = torch.empty((t, k), dtype=torch.int32, device=device)
    slots = torch.empty((t, k), dtype=torch.int32, device=device) if return_slots else None
    if t == 0 or width == 0:
        indices.fill_(-1)
        if slots is not None:
            slots.fill_(-1)
        return (indices, slots) if return_slots else indices

    columns = workspace_width(width)
    overlap = config.overlaps(t, columns) and _has_streams(device)
    chunk = config.chunk_rows(t, columns, overlap)
    plans = plan_chunks(batch, chunk, num_heads, config)
    visible = cached_buffer("visible", (t,), torch.int32, device)
    launch_visible(batch, visible, min(width, batch.block_table.shape[1] * 64), config.select)
    if overlap:
        workspaces = cached_buffer("scores2", (2, chunk, columns), torch.float32, device)[:, :, :width]
    else:
        workspace = cached_buffer("scores", (chunk, columns), torch.float32, device)[:, :width]
    cap = config.select.cap
    cand_vals = cached_buffer("cand_vals", (chunk, cap), torch.float32, device)
    cand_idx = cached_buffer("cand_idx", (chunk, cap), torch.int32, device)
    q = prepare_q(q)
    if overlap:
        _overlapped_chunks(q, weights, batch, k, plans, chunk, workspaces, visible, indices, slots, q_scale,
                           config, cand_vals, cand_idx)
        return (indices, slots) if return_slots else indices
    for number, tiles in enumerate(plans):
        start = number * chunk
        stop = min(t, start + chunk)
        scores = workspace[: stop - start]
        _score_chunk(q, weights, batch, scores, tiles, start, q_scale, config)
        _select_chunk(scores, batch, visible, indices, slots, k, start, config, cand_vals, cand_idx)
    return (indices, slots) if return_slots else indices


__all__ = ["index_topk_triton", "select_topk_triton", "launch_select", "launch_visible", "rows_per_chunk",
           "release_workspaces", "TopkConfig", "SelectConfig", "StreamConfig", "DEFAULT_WORKSPACE_BYTES", "MAX_K",
           "STREAM_MAX_K", "SelectBuffers", "select_topk_stream", "launch_stream_select"]
