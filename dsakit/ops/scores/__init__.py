"""Lightning-indexer scores: ``index_scores(q, weights, batch, backend="auto" | "reference" | "triton")``.

The reference (pure PyTorch fp32, CPU) is the spec; the Triton kernels read keys straight from the paged
cache (see :mod:`dsakit.ops.scores.triton`). ``auto`` picks Triton for CUDA tensors.

DeepGEMM-style paged logits (:mod:`dsakit.ops.scores.deepgemm_compat`, imported on first use since they need
triton): ``fp8_paged_mqa_logits`` for plain fp8 pools and ``centred_paged_mqa_logits`` /
``deepgemm_centred_paged_mqa_logits`` (DeepGEMM's positional order) for page-centred pools.
"""

from __future__ import annotations

import torch

from ...batch import PagedBatch, check_batch
from .._backend import resolve_backend
from .config import ScoresConfig
from .reference import index_scores as index_scores_reference
from .reference import index_scores_dense


def index_scores(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, *, backend: str = "auto",
                 config: ScoresConfig | None = None) -> torch.Tensor:
    """Scores of a ragged batch against paged keys -> fp32 [T, batch.max_entries], -inf where invisible.

    q [T, H, 128], weights [T, H], batch: a :class:`dsakit.PagedBatch` (``PagedCache.batch`` or
    ``PagedBatch.build``). ``backend`` picks the implementation; ``config`` tunes the Triton kernels (ignored
    by the reference). The reference returns a CPU tensor; Triton returns one on the batch's device.
    """
    check_batch(batch)
    chosen = resolve_backend(backend, q, batch.pool)
    if chosen == "triton":
        from .triton import index_scores_triton  # imported lazily: triton is an optional dependency

        return index_scores_triton(q, weights, batch, config=config)
    return index_scores_reference(q, weights, batch)


def index_scores_kernels() -> dict:
    """The Triton kernels behind ``index_scores`` by name ({"group": ..., "tile": ...}), for tools that
    inspect their compiled code (benchmarks/sm90_registers.py). Needs triton."""
    from . import _kernels

    return {"group": _kernels._index_scores_group_kernel, "tile": _kernels._index_scores_tile_kernel}


_COMPAT = ("fp8_paged_mqa_logits", "deepgemm_fp8_paged_mqa_logits", "centred_paged_mqa_logits",
           "deepgemm_centred_paged_mqa_logits", "fp8_mqa_logits")


def __getattr__(name: str):
    """The DeepGEMM-style entry points, imported lazily (triton is an optional dependency)."""
    if name in _COMPAT:
        from . import deepgemm_compat

        return getattr(deepgemm_compat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["index_scores", "index_scores_dense", "index_scores_reference", "index_scores_kernels", "ScoresConfig",
           *_COMPAT]
