"""Triton top-k of the lightning indexer: exact radix select over a bounded score workspace.

Entry points (the select launchers are in :mod:`dsakit.ops.indexer.select`, the scores launchers in
:mod:`dsakit.ops.indexer.scores`, the decode plan in :mod:`dsakit.ops.indexer.plans`):

* :func:`dsakit.ops.indexer.select.select_topk_triton` - scores fp32 [T, W] (+ optional visible count per
  row) -> int32 [T, K], the rules of :func:`dsakit.ops.indexer.reference.select_topk` (candidates are scores
  > -inf, NaN ranks above +inf, equal scores go to the lower index, -1 padding, descending score order).
* :func:`index_topk_triton` / :func:`index_topk_decode` (through a ``DecodeTopkPlan``) - scores of a ragged
  paged batch (a :class:`dsakit.PagedBatch`) fused with the selection, never holding a [T, N] matrix: query
  rows are scored ``rows_per_chunk`` at a time into one fp32 workspace [rows_per_chunk, W] (W =
  batch.max_entries) by the scores kernel and each chunk is selected before the next one overwrites the
  workspace.

Both select with the streaming select (:func:`select_topk_stream`, :class:`SelectBuffers`; launch settings from
``SelectConfig.stream_for``) for k <= 4096 (one pass over the scores in the common case;
``SelectConfig.algorithm``) and with the multi-pass radix select below otherwise. Every launch setting comes
from :mod:`dsakit.ops.indexer.config`.

Host cost. Workspaces (visible counts, score workspace, candidate buffers) and tile plans are cached by
shape (device, T, H, workspace width rounded up to a power of two, queries per sequence), so a repeated
call with the same shapes makes no device->host sync and allocates only its outputs. A batch whose rows
are not grouped by sequence, cut into several chunks, costs one sync per call (the per-chunk tile counts).
:func:`release_workspaces` frees the cache.

Workspace budget (documented, independent of N for the memory that matters):

    rows_per_chunk = clamp(workspace_bytes // (4 * W'), 1, T)       default workspace_bytes = 512 MiB
    W' = W rounded up to a power of two (the cached workspace serves every W up to it)
    extra memory   = 4 * rows_per_chunk * W' (<= max(workspace_bytes, 4 * W'))      fp32 score workspace
                   + the select's scratch: the streaming select's SelectBuffers (k <= 4096, bounded by
                     SelectConfig.cached_bytes) or 8 * rows_per_chunk * SelectConfig.cap (2048) candidates
                   + 4 * T * K (indices) [+ 4 * T * K (slots)] + 4 * T (visible counts)

At T = 8192, N = W = 262144 (1M tokens at ratio 4), K = 2048: 512 rows per chunk, 512 MiB workspace + the
select's scratch + 64 MiB of indices (measured peak 0.57 GiB on the H200), against 8 GiB for materialized
fp32 logits.

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

import dataclasses
from collections import OrderedDict

import torch
import triton

from ..._memory import check_bool, check_instance, check_tensor
from ...batch import PagedBatch, check_batch, check_k
from ...formats import ENTRIES_PER_PAGE, INDEX_HEAD_DIM
from ._topk_kernels import _visible_kernel
from .config import MAX_K, SelectConfig, TopkConfig
from .inputs import _BUFFERS, cached_buffer, check_q_inputs, check_q_scale_values, decode_rows, lru_get  # noqa: F401
from .plans import DecodeTopkPlan, QueryTiles, plan_batch_tiles, plan_chunks, plan_decode_topk, workspace_width
from .scores import launch_index_scores, prepare_q
from .select import SelectBuffers, launch_select, release_select_buffers

# Decode plans of the eager path (index_topk_triton on a decode-shaped batch), keyed by shape; a decode loop
# uses one shape until its widest sequence crosses the next power of two, so two are kept.
_DECODE_PLANS: "OrderedDict[tuple, tuple[TopkConfig, DecodeTopkPlan]]" = OrderedDict()
_DECODE_PLANS_KEPT = 2


def release_workspaces() -> None:
    """Free the workspaces and decode plans cached by :func:`index_topk_triton` (the next call allocates them
    again)."""
    _BUFFERS.clear()
    _DECODE_PLANS.clear()
    release_select_buffers()


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


def _score_chunk(q, weights, batch: PagedBatch, scores: torch.Tensor, tiles: QueryTiles, start: int,
                 q_scale: torch.Tensor | None, config: TopkConfig) -> None:
    """Scores of query rows start .. start + len(scores) into the workspace slice ``scores``."""
    stop = start + scores.shape[0]
    launch_index_scores(q[start:stop], weights[start:stop], batch, scores, tiles, start=start,
                        q_scale=None if q_scale is None else q_scale[start:stop], config=config.scores)


def _select_chunk(scores: torch.Tensor, batch: PagedBatch, visible: torch.Tensor, indices: torch.Tensor,
                  slots: torch.Tensor | None, start: int, config: TopkConfig, cand_vals: torch.Tensor | None,
                  cand_idx: torch.Tensor | None) -> None:
    """Select the rows start .. start + len(scores) of a chunk's scores into indices (and slots)."""
    stop = start + scores.shape[0]
    launch_select(scores, visible[start:stop], indices[start:stop], indices.shape[1], config.sort, config=config.select,
                  slots=None if slots is None else slots[start:stop], seq=batch.query_seq[start:stop],
                  block_table=batch.block_table if slots is not None else None,
                  cand_vals=cand_vals, cand_idx=cand_idx)


def index_topk_triton(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int, *,
                      return_slots: bool = False, q_scale: torch.Tensor | None = None,
                      config: TopkConfig | None = None, check_q_scale: bool = True):
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
    chunk = config.chunk_rows(t, columns)
    next_n = batch.next_n
    if next_n is not None and chunk >= t:
        # a decode-shaped batch scored in one chunk: the launches of index_topk_decode through a plan cached by
        # shape, into the outputs allocated above
        plan = cached_decode_plan(batch, next_n, num_heads, k, q.dtype, return_slots, config)
        _launch_decode(q, weights, batch, plan, indices, slots, q_scale)
        return (indices, slots) if return_slots else indices
    plans = plan_chunks(batch, chunk, num_heads, config)
    visible = cached_buffer("visible", (t,), torch.int32, device)
    launch_visible(batch, visible, min(width, batch.block_table.shape[1] * 64), config.select)
    workspace = cached_buffer("scores", (chunk, columns), torch.float32, device)[:, :width]
    cand_vals = cand_idx = None  # the multi-pass select's candidate buffers (the streaming select has its own)
    if not config.select.uses_stream(k):
        cand_vals = cached_buffer("cand_vals", (chunk, config.select.cap), torch.float32, device)
        cand_idx = cached_buffer("cand_idx", (chunk, config.select.cap), torch.int32, device)
    q = prepare_q(q)
    for number, tiles in enumerate(plans):
        start = number * chunk
        stop = min(t, start + chunk)
        scores = workspace[: stop - start]
        _score_chunk(q, weights, batch, scores, tiles, start, q_scale, config)
        _select_chunk(scores, batch, visible, indices, slots, start, config, cand_vals, cand_idx)
    return (indices, slots) if return_slots else indices


def cached_decode_plan(batch: PagedBatch, next_n: int, num_heads: int, k: int, q_dtype: torch.dtype,
                       return_slots: bool, config: TopkConfig) -> DecodeTopkPlan:
    """The decode plan of the eager path for this batch shape, built on first use and kept by shape: (device,
    B, next_n, workspace width = batch.max_entries rounded up to a power of two, k, format, H, q dtype, slots or
    not, config). Its tile plan is the batch's own (:func:`plan_batch_tiles`, cached by shape), so the kernels
    launched are those of the chunked path. Its indices / slots buffers are not used by the eager path."""
    columns = workspace_width(batch.max_entries)
    # the config by identity (hashing a TopkConfig walks every field: microseconds per call); the entry keeps
    # the config alive, so its id names it for as long as the entry lives
    key = (batch.device, batch.num_seqs, next_n, columns, k, batch.fmt, num_heads, q_dtype, return_slots,
           id(config))

    def build() -> tuple[TopkConfig, DecodeTopkPlan]:
        plan = plan_decode_topk(batch.num_seqs, next_n, columns, k, batch.fmt, batch.device, num_heads=num_heads,
                                return_slots=return_slots, sort=config.sort, scores=config.scores,
                                select=config.select)
        return config, dataclasses.replace(plan, tiles=plan_batch_tiles(batch, num_heads, config.scores))

    return lru_get(_DECODE_PLANS, key, _DECODE_PLANS_KEPT, build)[1]


def _launch_decode(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, plan: DecodeTopkPlan,
                   indices: torch.Tensor, slots: torch.Tensor | None, q_scale: torch.Tensor | None) -> None:
    """The three launches of a decode top-k (visible counts, scores, select) through ``plan``'s workspace and
    scratch into indices int32 [R, k] (and slots); q [R, H, 128], weights / q_scale [R, H]. No checks, no sync."""
    # the batch's widest sequence bounds the columns worth scoring (an unchecked batch states it itself)
    width = max(1, min(batch.max_entries, plan.max_entries))
    launch_visible(batch, plan.visible, min(width, batch.block_table.shape[1] * ENTRIES_PER_PAGE), plan.select)
    scores = plan.workspace[:, :width]
    launch_index_scores(prepare_q(q), weights, batch, scores, plan.tiles, q_scale=q_scale, config=plan.scores)
    launch_select(scores, plan.visible, indices, plan.k, plan.sort, config=plan.select, slots=slots,
                  seq=batch.query_seq, block_table=batch.block_table if slots is not None else None,
                  cand_vals=plan.cand_vals, cand_idx=plan.cand_idx, stream_buffers=plan.stream)


def _check_plan(q, weights, batch, k, plan, q_scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Host-only checks of q / weights / q_scale against the plan and the batch; returns them as [R, ...]."""
    check_instance("plan", plan, DecodeTopkPlan, label="DecodeTopkPlan from plan_decode_topk")
    check_batch(batch)
    q_shapes = f"q must be [B, next_n, H, {INDEX_HEAD_DIM}] or [B * next_n, H, {INDEX_HEAD_DIM}]"
    check_tensor("q", q, message=q_shapes)
    if q.dim() not in (3, 4) or q.shape[-1] != INDEX_HEAD_DIM:
        raise ValueError(f"{q_shapes}, got {list(q.shape)}")
    rows, h = plan.rows, plan.num_heads
    if q.dim() == 4 and tuple(q.shape[:3]) != (plan.batch, plan.next_n, h) or q.dim() == 3 and q.shape[:2] != (rows, h):
        raise ValueError(f"q is {list(q.shape[:-1])} but the plan was built for [B, next_n, H] = "
                         f"[{plan.batch}, {plan.next_n}, {h}]")
    if k != plan.k:
        raise ValueError(f"k = {k!r} but the plan was built for k = {plan.k}")
    if batch.fmt != plan.fmt:
        raise ValueError(f"the batch's format is {batch.fmt.name} but the plan was built for {plan.fmt.name}")
    if batch.num_seqs != plan.batch or batch.num_queries != rows \
            or (batch.next_n is not None and batch.next_n != plan.next_n):
        raise ValueError(f"the batch has {batch.num_seqs} sequences and {batch.num_queries} queries but the plan "
                         f"was built for B = {plan.batch} x next_n = {plan.next_n}")
    limit = min(plan.max_entries, batch.block_table.shape[1] * ENTRIES_PER_PAGE)
    if batch.max_entries > plan.max_entries:
        raise ValueError(f"entry_counts must be in 0..{limit} (plan max_entries {plan.max_entries}): the batch "
                         f"has a sequence of {batch.max_entries} entries")
    if batch.device != plan.device:
        raise ValueError(f"the batch is on {batch.device} but the plan is on {plan.device}")
    weights = decode_rows("weights", weights, plan.batch, plan.next_n, h)
    q_scale = decode_rows("q_scale", q_scale, plan.batch, plan.next_n, h)
    q = q.reshape(rows, h, INDEX_HEAD_DIM)
    check_q_inputs(q, weights, batch, q_scale)
    return q, weights, q_scale


def index_topk_decode(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int, *,
                      plan: DecodeTopkPlan, q_scale: torch.Tensor | None = None):
    """Decode top-k through a plan: int32 [B * next_n, k] indices (-1 padded), or ``(indices, slots)``.

    Arguments as in the module docstring; q_scale fp32 [B * next_n, H] or [B, next_n, H] (> 0, not checked:
    no sync) multiplies the weights (fp8 q). Returns the plan's output buffers (``plan.indices``,
    ``plan.slots`` when the plan was built with return_slots=True), overwritten by the next call with the same
    plan. No device->host sync and no allocation (bf16 / fp8 q), so a call can be captured in a CUDA graph
    once the kernels are compiled (run it once eagerly first).
    """
    q, weights, q_scale = _check_plan(q, weights, batch, k, plan, q_scale)
    _launch_decode(q, weights, batch, plan, plan.indices, plan.slots, q_scale)
    return (plan.indices, plan.slots) if plan.slots is not None else plan.indices


__all__ = ["index_topk_triton", "index_topk_decode", "launch_visible", "release_workspaces", "cached_buffer"]
