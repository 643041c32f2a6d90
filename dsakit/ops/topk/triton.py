"""Triton top-k of the lightning indexer: exact radix select over a bounded score workspace.

Two entry points:

* :func:`select_topk_triton` - scores fp32 [T, W] (+ optional visible count per row) -> int32 [T, K], the
  rules of :func:`dsakit.ops.topk.reference.select_topk` (candidates are scores > -inf, NaN ranks above +inf,
  equal scores go to the lower index, -1 padding, descending score order).
* :func:`index_topk_triton` - scores of a ragged paged batch (a :class:`dsakit.PagedBatch`) fused with the
  selection, never holding a [T, N] matrix: query rows are scored ``rows_per_chunk`` at a time into one fp32
  workspace [rows_per_chunk, W] (W = batch.max_entries) by the scores kernel and each chunk is selected
  before the next one overwrites the workspace.

Both select with the streaming select of :mod:`dsakit.ops.topk._select_stream` for k <= 4096 (one pass over
the scores in the common case; ``SelectConfig.algorithm``) and with the multi-pass radix select below
otherwise.

Host cost. Workspaces (visible counts, score workspace, candidate buffers) and tile plans are cached by
shape (device, T, H, workspace width rounded up to a power of two, queries per sequence), so a repeated
call with the same shapes makes no device->host sync and allocates only its outputs. A batch whose rows
are not grouped by sequence, cut into several chunks, costs one sync per call (the per-chunk tile counts).
:func:`release_workspaces` frees the cache.

Workspace budget (documented, independent of N for the memory that matters):

    rows_per_chunk = clamp(workspace_bytes // (4 * W'), 1, T)       default workspace_bytes = 512 MiB
    W' = W rounded up to a power of two (the cached workspace serves every W up to it)
    extra memory   = 4 * rows_per_chunk * W' (<= max(workspace_bytes, 4 * W'))      fp32 score workspace
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

from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton

from ...batch import PagedBatch, check_k
from ..scores.triton import (QueryTiles, check_q_inputs, check_q_scale_values, launch_index_scores,
                             plan_query_tiles, prepare_q, tiles_from_lens)
from ._inputs import check_scores_matrix, lru_get, row_counts_int32, slot_args
from ._kernels import _radix_select_kernel, _visible_kernel
from ._select_stream import (STREAM_MAX_K, launch_stream_select, launch_stream_select_cached,
                             release_select_buffers)
from .config import DEFAULT_WORKSPACE_BYTES, MAX_K, SelectConfig, TopkConfig

# Candidates per row kept for the exact final select (fp32 value + int32 index = 8 bytes each).
CANDIDATE_CAP = 2048
_VISIBLE_BLOCK = 256  # rows per program of the visible-count kernel
# Buffers reused across calls, keyed by (role, device, shape); bounded so that a long-running process that
# sees many shapes keeps only the latest few.
_BUFFERS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_BUFFERS_KEPT = 12


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
    if config.algorithm == "stream" or (config.algorithm == "auto" and k <= STREAM_MAX_K):
        if stream_buffers is None:
            launch_stream_select_cached(scores, counts, out, k, sort, slots=slots, seq=seq, block_table=block_table)
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


def launch_visible(batch: PagedBatch, out: torch.Tensor, limit: int) -> None:
    """visible int32 [T] of every batch row, clamped to 0..limit (one kernel, no sync)."""
    rows = batch.num_queries
    if rows == 0:
        return
    positions = batch.query_positions
    _visible_kernel[(triton.cdiv(rows, _VISIBLE_BLOCK),)](
        batch.entry_counts, batch.query_seq, positions if positions is not None else batch.entry_counts, out,
        rows, max(batch.num_seqs, 1), batch.ratio, limit, HAS_POS=positions is not None, BLOCK=_VISIBLE_BLOCK)


def select_topk_triton(scores: torch.Tensor, k: int, *, row_counts: torch.Tensor | None = None,
                       sort: bool = True, config: SelectConfig | None = None) -> torch.Tensor:
    """Exact top-k per row of scores fp32 [T, W] -> int32 [T, k] (rules of the reference ``select_topk``).

    ``row_counts`` int [T] (optional): row t considers only its first row_counts[t] entries (the rest is
    treated as masked and never read; checking the values costs one sync). ``sort=False`` returns the same
    set per row in a deterministic order (index order for the multi-pass select; the streaming select's
    buffer order otherwise) and skips the final sort. ``config``: select tuning (:class:`SelectConfig`).
    Memory: the [T, k] output plus a candidate scratch of 8 * cap bytes per row.
    """
    check_scores_matrix(scores)
    check_k(k, MAX_K)
    if scores.stride(1) != 1:
        raise ValueError(f"scores must have unit stride along W, got strides {scores.stride()}")
    if not isinstance(sort, bool):
        raise ValueError(f"sort must be a bool, got {sort!r}")
    t = scores.shape[0]
    counts = row_counts_int32(scores, row_counts)
    out = torch.empty((t, k), dtype=torch.int32, device=scores.device)
    launch_select(scores, counts, out, k, sort, config=config)
    return out


def rows_per_chunk(t: int, width: int, workspace_bytes: int) -> int:
    """Query rows scored at once so that the fp32 workspace [rows, width] fits ``workspace_bytes``."""
    if width <= 0:
        return max(1, t)
    return int(max(1, min(t, workspace_bytes // (4 * width))))


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


def index_topk_triton(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int, *,
                      return_slots: bool = False, q_scale: torch.Tensor | None = None,
                      config: TopkConfig | None = None):
    """Top-k entries per query of a ragged paged batch, scores fused with an exact radix select.

    q [T, H, 128] (fp32 / fp16 / bf16, or fp8 e4m3 with ``q_scale`` fp32 [T, H] > 0, whose check costs one
    sync), weights [T, H], batch a :class:`dsakit.PagedBatch` on q's device.

    Returns int32 [T, k] entry indices within each query's sequence (-1 padded), or ``(indices, slots)`` with
    ``return_slots=True`` (slots = page * 64 + entry % 64 via the block table, -1 kept). Never materializes
    [T, N]: scores go through one cached fp32 workspace (see the module docstring). config: a
    :class:`TopkConfig` (workspace bound, sort, kernel tuning; default: the measured table of the GPU).
    """
    check_q_inputs(q, weights, batch, q_scale)
    check_k(k, MAX_K)
    if not isinstance(return_slots, bool):
        raise ValueError(f"return_slots must be a bool, got {return_slots!r}")
    config = config or TopkConfig.for_device(batch.device)
    if not isinstance(config, TopkConfig):
        raise ValueError(f"config must be a TopkConfig, got {type(config).__name__}")
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
    chunk = rows_per_chunk(t, columns, config.workspace_bytes)
    plans = plan_chunks(batch, chunk, num_heads, config)
    visible = cached_buffer("visible", (t,), torch.int32, device)
    launch_visible(batch, visible, min(width, batch.block_table.shape[1] * 64))
    workspace = cached_buffer("scores", (chunk, columns), torch.float32, device)[:, :width]
    cap = config.select.cap
    cand_vals = cached_buffer("cand_vals", (chunk, cap), torch.float32, device)
    cand_idx = cached_buffer("cand_idx", (chunk, cap), torch.int32, device)
    q = prepare_q(q)
    for number, tiles in enumerate(plans):
        start = number * chunk
        stop = min(t, start + chunk)
        scores = workspace[: stop - start]
        launch_index_scores(q[start:stop], weights[start:stop], batch, scores, tiles, start=start,
                            q_scale=None if q_scale is None else q_scale[start:stop], config=config.scores)
        launch_select(scores, visible[start:stop], indices[start:stop], k, config.sort, config=config.select,
                      slots=None if slots is None else slots[start:stop], seq=batch.query_seq[start:stop],
                      block_table=batch.block_table if slots is not None else None,
                      cand_vals=cand_vals, cand_idx=cand_idx)
    return (indices, slots) if return_slots else indices


__all__ = ["index_topk_triton", "select_topk_triton", "launch_select", "launch_visible", "rows_per_chunk",
           "release_workspaces", "TopkConfig", "SelectConfig", "DEFAULT_WORKSPACE_BYTES", "CANDIDATE_CAP", "MAX_K"]
