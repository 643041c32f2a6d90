"""The one place that knows how the top-k op takes a ragged paged batch (:class:`dsakit.PagedBatch`)."""

from __future__ import annotations

import torch

from ..batch import PagedBatch, check_batch  # noqa: F401  (the distributed entry points check through it)


def select_queries(batch: PagedBatch, rows: torch.Tensor) -> PagedBatch:
    """The same batch restricted to the query rows ``rows`` (int64 [T_r], in the order given).

    No device->host sync: a subset of a batch's rows keeps every value the batch was built with (pages,
    counts, sequences), so it is built with ``validate=False`` and the full batch's max_entries.
    """
    rows = rows.to(batch.device)
    positions = None if batch.query_positions is None else batch.query_positions.index_select(0, rows)
    return PagedBatch.build(batch.pool, batch.fmt, batch.block_table, batch.entry_counts,
                            batch.query_seq.index_select(0, rows), positions, batch.ratio, validate=False,
                            max_entries=batch.max_entries)


def index_topk(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int, *, backend: str = "auto",
               return_slots: bool = False):
    """The ordinary single-device top-k of ``batch``'s queries: int32 [T, k] (and slots with return_slots)."""
    from ..ops.indexer import index_topk as op

    return op(q, weights, batch, k, backend=backend, return_slots=return_slots)
