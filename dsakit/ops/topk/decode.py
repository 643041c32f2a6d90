"""CUDA-graph-capturable decode top-k: a plan that owns the workspace and the outputs.

The public :func:`dsakit.ops.topk.index_topk` already reuses cached workspaces and tile plans, so in the
steady state it makes no device->host sync; what it still does per call is allocate its outputs and look
its workspace up. The decode plan moves that into an object built once per batch shape, so that a call
only launches kernels and can be captured in a CUDA graph::

    batch = cache.batch(seq_ids)                       # a PagedBatch: B sequences, one query each
    plan = plan_decode_topk(batch=B, next_n=1, max_entries=W, k=K, fmt="fp8", device="cuda")
    indices = index_topk_decode(q, weights, batch, K, plan=plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index_topk_decode(q, weights, batch, K, plan=plan)
    graph.replay()  # after writing the next step's q / weights / batch tensors into the same tensors

For graph replays the batch's tensors must stay the same tensors: build the batch once over static tensors
with ``PagedBatch.build(..., validate=False, max_entries=W)`` and update them in place.

Shapes (glossary of docs/spec.md): q [B, next_n, H, 128] or [B * next_n, H, 128] (bf16, fp8 e4m3fn with
optional q_scale, or fp32 / fp16 which costs one bf16 conversion per call), weights [B * next_n, H] or
[B, next_n, H]. Row r = b * next_n + i is query i of sequence b (the batch's rows are in that order).

What one call launches (nothing else touches the GPU, nothing is allocated for bf16 / fp8 q):

    1. visible-count kernel    visible[r] = clamp(min(entry_counts[b], (pos[r] + 1) // ratio), 0, limit)
                               limit = min(W, 64 * max_pages): the select never reads past the workspace
                               row, the slot map never past the block-table row
    2. scores group kernel     workspace fp32 [B * next_n, W] (tile plan from the plan)
    3. radix select kernel     indices int32 [B * next_n, K] (+ slots), -1 padded

The plan owns the workspace and the outputs. Memory (bytes, fixed at plan time):

    4 * R * W (scores workspace) + 8 * R * 2048 (candidate buffer) + 4 * R * K (indices)
    [+ 4 * R * K (slots)] + 8 * R (visible counts, tile rows) + 12 * B (tile plan),  R = B * next_n
    + the streaming select's buffers for k <= 4096 (``plan.stream.nbytes``, see ``SelectBuffers``)

e.g. B = 64, next_n = 1, W = 128K, K = 2048: 32 MiB + 1 MiB + 0.5 MiB + 9 MiB.

Results are the plan's buffers: a later call with the same plan overwrites them (as the static outputs of a
CUDA graph do); clone them to keep them. Semantics are those of the reference
:func:`dsakit.ops.topk.reference.index_topk`. The batch carries the value guarantees; a batch built with
``validate=False`` is trusted, and bad values then give wrong indices but never an out-of-bounds access
(every page id and block-table column is clamped in the scores kernel, every visible count to ``limit``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._memory import check_bool, check_fits, check_instance, check_tensor, parse_device
from ...batch import PagedBatch, check_batch, check_k, check_positive_int
from ...formats import ENTRIES_PER_PAGE, INDEX_HEAD_DIM, KeyFormat
from ..scores.config import ScoresConfig
from ..scores.triton import (QueryTiles, check_q_inputs, decode_rows, launch_index_scores, plan_decode_tiles,
                             prepare_q)
from ._select_stream import SelectBuffers
from .config import MAX_K, SelectConfig
from .triton import launch_select, launch_visible


@dataclass(frozen=True)
class DecodeTopkPlan:
    """Preallocated state of :func:`index_topk_decode` for one decode batch shape (see the module docstring).

    batch B, next_n, num_heads H, max_entries W (workspace columns: the largest entry count a call may have),
    k, fmt, sort. Buffers (all on ``device``, R = B * next_n): workspace fp32 [R, W], visible int32 [R],
    indices int32 [R, k], slots int32 [R, k] or None, cand_vals fp32 / cand_idx int32 [R, 2048], tiles
    (scores tile plan). scores / select: kernel launch configs.
    """

    batch: int
    next_n: int
    num_heads: int
    max_entries: int
    k: int
    fmt: KeyFormat
    sort: bool
    tiles: QueryTiles
    workspace: torch.Tensor
    visible: torch.Tensor
    indices: torch.Tensor
    slots: torch.Tensor | None
    cand_vals: torch.Tensor
    cand_idx: torch.Tensor
    scores: ScoresConfig
    select: SelectConfig
    stream: SelectBuffers | None = None  # streaming-select scratch (None: the multi-pass select runs)

    @property
    def rows(self) -> int:
        return self.batch * self.next_n

    @property
    def device(self) -> torch.device:
        return self.workspace.device

    @property
    def workspace_bytes(self) -> int:
        """Bytes held by the plan (workspace, candidates, outputs, counts, tile plan)."""
        tensors = [self.workspace, self.visible, self.indices, self.cand_vals, self.cand_idx,
                   self.tiles.rows, self.tiles.tile_seq, self.tiles.tile_start, self.tiles.tile_len]
        if self.slots is not None:
            tensors.append(self.slots)
        return sum(t.numel() * t.element_size() for t in tensors) + (self.stream.nbytes if self.stream else 0)


def plan_decode_topk(batch: int, next_n: int, max_entries: int, k: int, fmt: "KeyFormat | str",
                     device: "torch.device | str", *, num_heads: int = 64, return_slots: bool = False,
                     sort: bool = True, scores: ScoresConfig | None = None,
                     select: SelectConfig | None = None) -> DecodeTopkPlan:
    """Allocate everything :func:`index_topk_decode` needs for batch B x next_n queries, W = max_entries.

    max_entries: the most entries any sequence may have during the plan's life (workspace width W; a batch
    whose max_entries is larger is refused). num_heads: H of q (picks the scores kernel). return_slots: also
    fill a slots int32 [R, k] output (page * 64 + e via the block table, -1 kept). sort: order each row by
    (score desc, index asc); False keeps the set in a deterministic, unspecified order. scores / select: kernel
    tuning (default: the measured table of the GPU). Building the plan allocates; using it does not.
    """
    batch = check_positive_int("batch", batch, 1)
    next_n = check_positive_int("next_n", next_n, 1)
    max_entries = check_positive_int("max_entries", max_entries, 1)
    num_heads = check_positive_int("num_heads", num_heads, 1)
    check_k(k, MAX_K)
    fmt = KeyFormat.parse(fmt)
    check_bool("return_slots", return_slots)
    check_bool("sort", sort)
    device = parse_device(device)
    select = select or SelectConfig()
    check_instance("select", select, SelectConfig, label="SelectConfig or None")
    rows = batch * next_n
    per_row = 4 * (max_entries + 1 + k * (2 if return_slots else 1)) + 8 * select.cap
    check_fits(rows * per_row, device, f"a decode plan for {rows:,} rows x max_entries {max_entries:,}")
    return DecodeTopkPlan(
        batch=batch, next_n=next_n, num_heads=num_heads, max_entries=max_entries, k=k, fmt=fmt, sort=sort,
        tiles=plan_decode_tiles(batch, next_n, num_heads, device),
        workspace=torch.empty((rows, max_entries), dtype=torch.float32, device=device),
        visible=torch.zeros((rows,), dtype=torch.int32, device=device),
        indices=torch.full((rows, k), -1, dtype=torch.int32, device=device),
        slots=torch.full((rows, k), -1, dtype=torch.int32, device=device) if return_slots else None,
        cand_vals=torch.empty((rows, select.cap), dtype=torch.float32, device=device),
        cand_idx=torch.empty((rows, select.cap), dtype=torch.int32, device=device),
        scores=scores or ScoresConfig.for_device(device), select=select,
        stream=SelectBuffers.allocate(rows, max_entries, k, device, select.stream_for(rows, max_entries, k))
        if select.uses_stream(k) else None)


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
    # the batch's widest sequence bounds the columns worth scoring (an unchecked batch states it itself)
    width = max(1, min(batch.max_entries, plan.max_entries))
    launch_visible(batch, plan.visible, min(width, batch.block_table.shape[1] * ENTRIES_PER_PAGE), plan.select)
    scores = plan.workspace[:, :width]
    launch_index_scores(prepare_q(q), weights, batch, scores, plan.tiles, q_scale=q_scale, config=plan.scores)
    launch_select(scores, plan.visible, plan.indices, plan.k, plan.sort, config=plan.select, slots=plan.slots,
                  seq=batch.query_seq, block_table=batch.block_table if plan.slots is not None else None,
                  cand_vals=plan.cand_vals, cand_idx=plan.cand_idx, stream_buffers=plan.stream)
    return (plan.indices, plan.slots) if plan.slots is not None else plan.indices


__all__ = ["DecodeTopkPlan", "plan_decode_topk", "index_topk_decode"]
