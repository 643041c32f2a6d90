"""Context-parallel indexer top-k: each rank scores and selects its own query rows against the full cache."""

from __future__ import annotations

import torch

from .._memory import check_bool, check_instance
from ..batch import PagedBatch
from . import _batch
from .exchange import _gather_rows
from .split import ContextParallelPlan


def context_parallel_index_topk(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int,
                                plan: ContextParallelPlan,
                                *, group=None, gather: bool = False, backend: str = "auto",
                                return_slots: bool = False, local_rows: slice | None = None):
    """Top-k of this rank's query rows of a ragged batch; optionally gathered back to the full [T, k].

    q [T_r, H, 128] and weights [T_r, H]: this rank's rows (``plan.take(q_full)``, T_r = plan.num_local).
    batch: the FULL :class:`dsakit.PagedBatch` (query_seq / query_positions [T] of every rank's queries)
    over this rank's pool, which must already hold every entry the queries see (:func:`all_gather_pages` or
    :func:`all_gather_entries` after a context-parallel store). plan: :meth:`ContextParallelPlan.zigzag` of
    the batch's query_seq. The local batch is built without a device sync (the full batch's values hold).

    Runs the ordinary single-device top-k on the local rows, so each row equals the single-device result
    (same set, same order, ties to the lower index). Returns int32 [T_r, k] (-1 padded) in ``plan.rows``
    order, or with ``gather=True`` the full int32 [T, k] in the batch's order on every rank (one
    all-gather). ``return_slots=True`` returns ``(indices, slots)`` (slots via the block table, -1 kept).
    Not collective unless ``gather=True``; with it every rank's call is checked collectively before the rows
    move (the rows, ``k``, ``return_slots`` and the plan must agree): bad input on any rank (wrong rows, another
    rank's plan, a k the op refuses...) raises ValueError on every rank, none is left in the all-gather.

    ``local_rows``: a slice of this rank's rows (``plan.rows[local_rows]``) to run in this call, with q /
    weights holding just those rows: a long prefill's local rows in calls of a few thousand queries, each
    output consumed before the next (bounded memory). Not with ``gather=True``.
    """
    if gather is False:
        return _local_topk(q, weights, batch, k, plan, backend, return_slots, local_rows)

    def local():  # inside the agreement: whatever it raises (on any rank) is a refusal every rank sees
        check_bool("gather", gather)
        if local_rows is not None:
            raise ValueError("gather=True needs every local row in one call (local_rows=None)")
        out = _local_topk(q, weights, batch, k, plan, backend, return_slots, None)
        return tuple(out) if return_slots else (out,)

    rows, _ = _gather_rows("context_parallel_index_topk", local, plan, group)
    return tuple(rows) if return_slots else rows[0]


def _local_topk(q, weights, batch, k, plan, backend, return_slots, local_rows):
    check_instance("plan", plan, ContextParallelPlan)
    _batch.check_batch(batch)
    if batch.num_queries != plan.num_queries:
        raise ValueError(f"plan covers {plan.num_queries} queries, the batch has {batch.num_queries}")
    rows = plan.rows
    if local_rows is not None:
        if not isinstance(local_rows, slice) or local_rows.step not in (None, 1):
            raise ValueError(f"local_rows must be a slice with step 1 or None, got {local_rows!r}")
        rows = rows[local_rows]
    for what, x in (("q", q), ("weights", weights)):
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != rows.numel():
            raise ValueError(f"{what} must hold this rank's {rows.numel()} query rows (plan.take of the full "
                             f"tensor, sliced by local_rows), got "
                             f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    local = _batch.select_queries(batch, rows)
    return _batch.index_topk(q, weights, local, k, backend=backend, return_slots=return_slots)
