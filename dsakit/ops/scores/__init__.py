"""Lightning-indexer scores: ``index_scores(..., backend="auto" | "reference" | "triton")``.

The reference (pure PyTorch fp32, CPU) is the spec; the Triton kernels read keys straight from the paged
cache (see :mod:`dsakit.ops.scores.triton`). ``auto`` picks Triton for CUDA tensors.
"""

from __future__ import annotations

import torch

from .._backend import resolve_backend
from .reference import index_scores as index_scores_reference
from .reference import index_scores_dense


def index_scores(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt, block_table: torch.Tensor,
                 entry_counts: torch.Tensor, query_seq: torch.Tensor, query_positions: torch.Tensor | None = None,
                 ratio: int = 1, *, backend: str = "auto") -> torch.Tensor:
    """Scores of a ragged batch against paged keys -> fp32 [T, max(entry_counts)], -inf where invisible.

    Arguments as :func:`dsakit.ops.scores.reference.index_scores`; ``backend`` picks the implementation.
    The reference returns a CPU tensor; Triton returns one on the inputs' device.
    """
    chosen = resolve_backend(backend, q, pool)
    if chosen == "triton":
        from .triton import index_scores_triton  # imported lazily: triton is an optional dependency

        return index_scores_triton(q, weights, pool, fmt, block_table, entry_counts, query_seq,
                                   query_positions, ratio)
    return index_scores_reference(q, weights, pool, fmt, block_table, entry_counts, query_seq,
                                  query_positions, ratio)


__all__ = ["index_scores", "index_scores_dense", "index_scores_reference"]
