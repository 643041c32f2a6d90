"""The one place that knows how the top-k op takes a ragged paged batch.

The distributed code is written against the ``PagedBatch`` contract (fields ``pool``, ``fmt``,
``block_table``, ``entry_counts``, ``query_seq``, ``query_positions``, ``ratio``; ``index_topk(q, weights,
batch, k, ...)``). Until ``dsakit.PagedBatch`` exists, :class:`BatchShim` carries the same fields and
:func:`index_topk` calls the op with the explicit arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import KeyFormat


@dataclass(frozen=True, eq=False)
class BatchShim:
    """Stand-in with the PagedBatch fields (pool uint8 [P, page_bytes], block_table int32 [B, W],
    entry_counts int32 [B], query_seq int32 [T], query_positions int64 [T] | None, ratio)."""

    pool: torch.Tensor
    fmt: KeyFormat
    block_table: torch.Tensor
    entry_counts: torch.Tensor
    query_seq: torch.Tensor
    query_positions: torch.Tensor | None
    ratio: int

    @property
    def num_queries(self) -> int:
        return int(self.query_seq.shape[0])

    @property
    def device(self) -> torch.device:
        return self.pool.device


BATCH_TYPES: tuple[type, ...] = (BatchShim,)


def build_batch(pool, fmt, block_table, entry_counts, query_seq, query_positions=None, ratio: int = 1):
    """A batch from explicit tensors (the PagedBatch.build signature). Shapes and values are validated by the
    top-k op itself when it runs."""
    fmt = KeyFormat.parse(fmt)
    if not isinstance(query_seq, torch.Tensor) or query_seq.dim() != 1:
        raise ValueError(f"query_seq must be an int tensor [T], got "
                         f"{list(query_seq.shape) if isinstance(query_seq, torch.Tensor) else type(query_seq).__name__}")
    if query_positions is not None and (not isinstance(query_positions, torch.Tensor)
                                        or query_positions.shape != query_seq.shape):
        raise ValueError(f"query_positions must be an int tensor [T] = [{query_seq.shape[0]}] or None")
    return BatchShim(pool, fmt, block_table, entry_counts, query_seq.to(torch.int32),
                     None if query_positions is None else query_positions.to(torch.int64), ratio)


def select_queries(batch, rows: torch.Tensor):
    """The same batch restricted to the query rows ``rows`` (int64 [T_r], in the order given)."""
    rows = rows.to(batch.query_seq.device)
    positions = None if batch.query_positions is None else batch.query_positions.index_select(0, rows)
    return build_batch(batch.pool, batch.fmt, batch.block_table, batch.entry_counts,
                       batch.query_seq.index_select(0, rows), positions, batch.ratio)


def index_topk(q: torch.Tensor, weights: torch.Tensor, batch, k: int, *, backend: str = "auto",
               return_slots: bool = False):
    """The ordinary single-device top-k of ``batch``'s queries: int32 [T, k] (and slots with return_slots)."""
    from ..batch import PagedBatch
    from ..ops.topk import index_topk as op

    if not isinstance(batch, PagedBatch):
        batch = PagedBatch.build(batch.pool, batch.fmt, batch.block_table, batch.entry_counts, batch.query_seq,
                                 batch.query_positions, batch.ratio)
    return op(q, weights, batch, k, backend=backend, return_slots=return_slots)
