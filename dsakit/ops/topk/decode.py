"""Sync-free, CUDA-graph-capturable decode top-k: a reusable plan + three kernel launches per call.

The general :func:`dsakit.ops.topk.triton.index_topk_triton` plans, validates and allocates on every call
(several device->host syncs, tens of small torch ops): at decode sizes that host work costs more than the
kernels. The decode path moves all of it into a plan built once per batch shape::

    plan = plan_decode_topk(batch=B, next_n=n, max_entries=W, k=K, fmt="fp8", device="cuda")
    indices = index_topk_decode(q, weights, pool, "fp8", block_table, entry_counts, K, plan=plan)
    # every later decode step of the same shape: same call, no sync, no allocation -> capturable:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index_topk_decode(q, weights, pool, "fp8", block_table, entry_counts, K, plan=plan)
    graph.replay()  # after writing the next step's q / weights / counts / positions into the same tensors

Shapes (glossary in docs/spec.md §1): q [B, next_n, H, 128] (bf16, fp8 e4m3fn with optional q_scale, or fp32 / fp16
which costs one bf16 conversion per call), weights [B * next_n, H] or [B, next_n, H], pool uint8
[P, page_bytes], block_table int [B, max_pages], entry_counts int [B], query_positions int [B, next_n] or
[B * next_n] or None. Row r = b * next_n + i is query i of sequence b.

What one call launches (nothing else touches the GPU, nothing is allocated for bf16 / fp8 q):

    1. ``_decode_visible_kernel``   visible[r] = clamp(min(entry_counts[b], (pos[r] + 1) // ratio), 0, limit)
                                    limit = min(W, 64 * max_pages): the select never reads past the
                                    workspace row, the slot map never past the block-table row
    2. scores group kernel          workspace fp32 [B * next_n, W] (``index_scores_triton``, sync-free planned
                                    path: tile plan from the plan, ``validate=False``)
    3. radix select kernel          indices int32 [B * next_n, K] (+ slots), -1 padded

The plan owns the workspace and the outputs. Memory (bytes, fixed at plan time):

    4 * R * W (scores workspace) + 8 * R * 2048 (candidate buffer) + 4 * R * K (indices)
    [+ 4 * R * K (slots)] + 12 * R (visible counts, query_seq, tile rows) + 12 * B (tile plan),  R = B * next_n

e.g. B = 64, next_n = 1, W = 128K, K = 2048: 32 MiB + 1 MiB + 0.5 MiB.

Results are the plan's buffers: a later call with the same plan overwrites them (as the static outputs of a
CUDA graph do); clone them to keep them. Semantics are those of the reference
:func:`dsakit.ops.topk.reference.index_topk` (entry j visible to row r iff j < entry_counts[b] and
j < (pos[r] + 1) // ratio; top-k of the visible scores by the documented tie / NaN rules; -1 padding).

Value checks. ``validate=False`` (the default: the point of this path) trusts the values: the caller
guarantees entry_counts <= W and <= 64 * max_pages, block-table page ids of the used pages inside the pool,
q_scale > 0. Bad values then give wrong indices but never an out-of-bounds access: every page id and
block-table column is clamped in the scores kernel and every visible count is clamped to ``limit``.
``validate=True`` checks every value first (two device->host syncs, so not inside a graph capture) and
raises ValueError naming the bad value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...cache import check_pool
from ...formats import ENTRIES_PER_PAGE, INDEX_HEAD_DIM, KeyFormat
from .triton import CANDIDATE_CAP, _check_k, _launch_select

_VISIBLE_BLOCK = 256  # rows per program of the visible-count kernel


@triton.jit
def _decode_visible_kernel(counts_ptr, pos_ptr, out_ptr, rows, next_n, ratio, limit,
                           HAS_POS: tl.constexpr, BLOCK: tl.constexpr):
    """visible int32 [R]: entries row r = b * next_n + i sees, clamped to 0..limit (memory safety)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < rows
    seq = offs // next_n
    visible = tl.load(counts_ptr + seq, mask=ok, other=0).to(tl.int64)
    if HAS_POS:
        pos = tl.load(pos_ptr + offs, mask=ok, other=0).to(tl.int64)
        # floor division of pos + 1 >= 0; pos + 1 < 0 sees nothing (clamped below)
        causal = tl.maximum(pos + 1, 0) // ratio
        visible = tl.minimum(visible, causal)
    visible = tl.minimum(tl.maximum(visible, 0), limit)
    tl.store(out_ptr + offs, visible.to(tl.int32), mask=ok)


@dataclass(frozen=True)
class DecodeTopkPlan:
    """Preallocated state of :func:`index_topk_decode` for one decode batch shape (see the module docstring).

    batch B, next_n, num_heads H, max_entries W (workspace columns: the largest entry count a call may have),
    k, fmt, sort, with_slots. Buffers (all on ``device``, R = B * next_n):
    workspace fp32 [R, W], visible int32 [R], query_seq int32 [R] (= r // next_n), indices int32 [R, k],
    slots int32 [R, k] or None, cand_vals fp32 / cand_idx int32 [R, 2048], tiles (scores tile plan).
    """

    batch: int
    next_n: int
    num_heads: int
    max_entries: int
    k: int
    fmt: KeyFormat
    sort: bool
    tiles: object  # dsakit.ops.scores.triton.QueryTiles
    workspace: torch.Tensor
    visible: torch.Tensor
    query_seq: torch.Tensor
    indices: torch.Tensor
    slots: torch.Tensor | None
    cand_vals: torch.Tensor
    cand_idx: torch.Tensor

    @property
    def rows(self) -> int:
        return self.batch * self.next_n

    @property
    def device(self) -> torch.device:
        return self.workspace.device

    @property
    def workspace_bytes(self) -> int:
        """Bytes held by the plan (workspace, candidates, outputs, counts, tile plan)."""
        tensors = [self.workspace, self.visible, self.query_seq, self.indices, self.cand_vals, self.cand_idx,
                   self.tiles.rows, self.tiles.tile_seq, self.tiles.tile_start, self.tiles.tile_len]
        if self.slots is not None:
            tensors.append(self.slots)
        return sum(t.numel() * t.element_size() for t in tensors)


def _positive_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def plan_decode_topk(batch: int, next_n: int, max_entries: int, k: int, fmt: "KeyFormat | str",
                     device: "torch.device | str", *, num_heads: int = 64, return_slots: bool = False,
                     sort: bool = True) -> DecodeTopkPlan:
    """Allocate everything :func:`index_topk_decode` needs for batch B x next_n queries, W = max_entries.

    max_entries: the most entries any sequence may have during the plan's life (workspace width W; a call
    with a larger entry count only sees its first W entries, and ``validate=True`` rejects it). num_heads: H
    of q (picks the scores kernel). return_slots: also fill a slots int32 [R, k] output (page * 64 + e via the
    block table, -1 kept). sort: order each row by (score desc, index asc); False keeps the set in a
    deterministic index order. Building the plan may sync (it allocates); using it does not.
    """
    from ..scores.triton import plan_decode_tiles

    batch = _positive_int("batch", batch, 1)
    next_n = _positive_int("next_n", next_n, 1)
    max_entries = _positive_int("max_entries", max_entries, 1)
    num_heads = _positive_int("num_heads", num_heads, 1)
    _check_k(k)
    fmt = KeyFormat.parse(fmt)
    if not isinstance(return_slots, bool) or not isinstance(sort, bool):
        raise ValueError(f"return_slots and sort must be bools, got {return_slots!r}, {sort!r}")
    device = torch.device(device)
    rows = batch * next_n
    query_seq = torch.arange(batch, device=device, dtype=torch.int32).repeat_interleave(next_n)
    return DecodeTopkPlan(
        batch=batch, next_n=next_n, num_heads=num_heads, max_entries=max_entries, k=k, fmt=fmt, sort=sort,
        tiles=plan_decode_tiles(batch, next_n, num_heads, device),
        workspace=torch.empty((rows, max_entries), dtype=torch.float32, device=device),
        visible=torch.zeros((rows,), dtype=torch.int32, device=device),
        query_seq=query_seq,
        indices=torch.full((rows, k), -1, dtype=torch.int32, device=device),
        slots=torch.full((rows, k), -1, dtype=torch.int32, device=device) if return_slots else None,
        cand_vals=torch.empty((rows, CANDIDATE_CAP), dtype=torch.float32, device=device),
        cand_idx=torch.empty((rows, CANDIDATE_CAP), dtype=torch.int32, device=device),
    )


def _check_decode_shapes(q, weights, pool, fmt, block_table, entry_counts, k, plan, query_positions, ratio,
                         q_scale) -> None:
    """Host-only checks of shapes, dtypes, devices and the plan (no device->host sync)."""
    if not isinstance(plan, DecodeTopkPlan):
        raise ValueError(f"plan must be a DecodeTopkPlan from plan_decode_topk, got {type(plan).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[3] != INDEX_HEAD_DIM:
        raise ValueError(f"q must be [B, next_n, H, {INDEX_HEAD_DIM}], got "
                         f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    b, next_n, h, _ = q.shape
    if (b, next_n, h) != (plan.batch, plan.next_n, plan.num_heads):
        raise ValueError(f"q is [B, next_n, H] = [{b}, {next_n}, {h}] but the plan was built for "
                         f"[{plan.batch}, {plan.next_n}, {plan.num_heads}]")
    if k != plan.k:
        raise ValueError(f"k = {k!r} but the plan was built for k = {plan.k}")
    if fmt != plan.fmt:
        raise ValueError(f"fmt is {fmt.name} but the plan was built for {plan.fmt.name}")
    check_pool(pool, fmt)
    rows = b * next_n
    if not isinstance(weights, torch.Tensor) or weights.shape not in ((rows, h), (b, next_n, h)):
        raise ValueError(f"weights must be [B * next_n, H] = [{rows}, {h}] or [B, next_n, H], got "
                         f"{list(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__}")
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.shape[0] != b \
            or block_table.dtype not in (torch.int32, torch.int64) or block_table.shape[1] < 1:
        raise ValueError(f"block_table must be int [B = {b}, max_pages >= 1], got "
                         f"{getattr(block_table, 'dtype', None)} {list(getattr(block_table, 'shape', []))}")
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        # the kernels address a block-table row as contiguous columns; a silent copy would allocate per call
        raise ValueError(f"block_table must have unit column stride, got strides {block_table.stride()}")
    if not isinstance(entry_counts, torch.Tensor) or entry_counts.shape != (b,) \
            or entry_counts.dtype not in (torch.int32, torch.int64) or (b > 1 and entry_counts.stride(0) != 1):
        raise ValueError(f"entry_counts must be contiguous int [B] = [{b}], got "
                         f"{getattr(entry_counts, 'dtype', None)} {list(getattr(entry_counts, 'shape', []))}")
    if q_scale is not None and (not isinstance(q_scale, torch.Tensor) or q_scale.dtype != torch.float32
                                or q_scale.shape not in ((rows, h), (b, next_n, h))):
        raise ValueError(f"q_scale must be fp32 [B * next_n, H] = [{rows}, {h}] or [B, next_n, H], got "
                         f"{getattr(q_scale, 'dtype', type(q_scale).__name__)} "
                         f"{list(getattr(q_scale, 'shape', []))}")
    if query_positions is not None and (not isinstance(query_positions, torch.Tensor)
                                        or query_positions.shape not in ((b, next_n), (rows,))
                                        or query_positions.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"query_positions must be int [B, next_n] = [{b}, {next_n}] or [B * next_n] or None, "
                         f"got {getattr(query_positions, 'dtype', None)} "
                         f"{list(getattr(query_positions, 'shape', []))}")
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"ratio must be a positive int, got {ratio!r}")
    for name, tensor in (("weights", weights), ("pool", pool), ("block_table", block_table),
                         ("entry_counts", entry_counts), ("query_positions", query_positions),
                         ("q_scale", q_scale)):
        if tensor is not None and isinstance(tensor, torch.Tensor) and tensor.device != plan.device:
            raise ValueError(f"{name} is on {tensor.device} but the plan is on {plan.device}")
    if q.device != plan.device:
        raise ValueError(f"q is on {q.device} but the plan is on {plan.device}")


def _check_decode_values(block_table: torch.Tensor, entry_counts: torch.Tensor, plan: DecodeTopkPlan) -> None:
    """validate=True: entry counts against the plan's workspace and the block table (one sync)."""
    limit = min(plan.max_entries, block_table.shape[1] * ENTRIES_PER_PAGE)
    low, high = (int(v) for v in torch.stack([entry_counts.min(), entry_counts.max()]).long().tolist())
    if low < 0 or high > limit:
        raise ValueError(f"entry_counts must be in 0..{limit} (plan max_entries {plan.max_entries}, block table "
                         f"width {block_table.shape[1]} x 64), got range {low}..{high}")


def index_topk_decode(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: "KeyFormat | str",
                      block_table: torch.Tensor, entry_counts: torch.Tensor, k: int, *, plan: DecodeTopkPlan,
                      query_positions: torch.Tensor | None = None, ratio: int = 1,
                      q_scale: torch.Tensor | None = None, validate: bool = False):
    """Decode top-k through a plan: int32 [B * next_n, k] indices (-1 padded), or ``(indices, slots)``.

    Arguments as in the module docstring; q_scale fp32 [B * next_n, H] or [B, next_n, H] (> 0) multiplies
    the weights (fp8 q). Returns the plan's output buffers (``plan.indices``, ``plan.slots`` when the plan
    was built with return_slots=True), overwritten by the next call with the same plan. No device->host
    sync and no allocation (bf16 / fp8 q) unless ``validate=True``, so a call can be captured in a CUDA graph
    once the kernels are compiled (run it once eagerly first).
    """
    fmt = KeyFormat.parse(fmt)
    _check_decode_shapes(q, weights, pool, fmt, block_table, entry_counts, k, plan, query_positions, ratio,
                         q_scale)
    if not isinstance(validate, bool):
        raise ValueError(f"validate must be a bool, got {validate!r}")
    from ..scores.triton import index_scores_triton

    b, next_n, h, d = q.shape
    rows = b * next_n
    if validate:
        _check_decode_values(block_table, entry_counts, plan)
    # a view for contiguous positions; the kernels index them as a dense [R] vector
    positions = None if query_positions is None else query_positions.reshape(rows).contiguous()
    limit = min(plan.max_entries, block_table.shape[1] * ENTRIES_PER_PAGE)
    _decode_visible_kernel[(triton.cdiv(rows, _VISIBLE_BLOCK),)](
        entry_counts, positions if positions is not None else entry_counts, plan.visible, rows, next_n, ratio,
        limit, HAS_POS=positions is not None, BLOCK=_VISIBLE_BLOCK)
    # validate=True here adds the scores' own value checks (page ids, q_scale > 0) in one more sync
    scores = index_scores_triton(
        q.reshape(rows, h, d), weights.reshape(rows, h), pool, fmt, block_table, entry_counts, plan.query_seq,
        positions, ratio, out=plan.workspace, q_scale=None if q_scale is None else q_scale.reshape(rows, h),
        tiles=plan.tiles, validate=validate)
    _launch_select(scores, plan.visible, plan.indices, plan.k, plan.sort, slots=plan.slots, seq=plan.query_seq,
                   block_table=block_table if plan.slots is not None else None, cand_vals=plan.cand_vals,
                   cand_idx=plan.cand_idx)
    return (plan.indices, plan.slots) if plan.slots is not None else plan.indices


__all__ = ["DecodeTopkPlan", "plan_decode_topk", "index_topk_decode"]
