"""Indexer top-k: ``index_topk(q, weights, batch, k, backend="auto" | "reference" | "triton")`` and
``select_topk``.

The reference (pure PyTorch fp32, CPU) is the spec and materializes [T, N]. The Triton path
(:mod:`dsakit.ops.topk.triton`) scores query rows chunk by chunk into a bounded fp32 workspace and selects
each chunk with an exact radix select, so its memory is O(T * K) plus the workspace; workspaces and tile
plans are cached by shape, so a repeated call makes no device->host sync. ``auto`` picks Triton for CUDA
tensors.

Decode inside a CUDA graph: :func:`plan_decode_topk` + :func:`index_topk_decode`
(:mod:`dsakit.ops.topk.decode`) preallocate the workspace and the outputs once; each call then only
launches kernels (no sync, no allocation).
"""

from __future__ import annotations

import torch

from ...batch import PagedBatch, check_batch
from ..._memory import check_bool, check_instance
from .._backend import resolve_backend
from .config import SelectConfig, TopkConfig
from .reference import index_topk as index_topk_reference
from .reference import select_topk as select_topk_reference
from .reference import topk_to_slots


def select_topk(scores: torch.Tensor, k: int, *, backend: str = "auto") -> torch.Tensor:
    """scores fp32 [T, N] -> int32 [T, k] indices (rules of :mod:`dsakit.ops.topk.reference`)."""
    chosen = resolve_backend(backend, scores)
    if chosen == "triton":
        from .triton import select_topk_triton  # imported lazily: triton is an optional dependency

        return select_topk_triton(scores, k)
    return select_topk_reference(scores, k)


def index_topk(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int, *, backend: str = "auto",
               return_slots: bool = False, config: TopkConfig | None = None):
    """Top-k entries per query of a ragged batch against paged keys -> int32 [T, k] (-1 padded).

    q [T, H, 128], weights [T, H], batch: a :class:`dsakit.PagedBatch` (``PagedCache.batch`` or
    ``PagedBatch.build``). ``return_slots=True`` returns ``(indices, slots)`` with global slot ids
    (page * 64 + entry % 64 through the block table, -1 kept) for the sparse-attention kernel. ``config``
    (:class:`TopkConfig`: workspace bound, kernel tuning) is used by Triton; the reference ignores it.
    The reference returns CPU tensors; Triton returns them on the batch's device.
    """
    check_bool("return_slots", return_slots)
    if config is not None:
        check_instance("config", config, TopkConfig, label="TopkConfig or None")
    check_batch(batch)
    chosen = resolve_backend(backend, q, batch.pool)
    if chosen == "triton":
        from .triton import index_topk_triton

        return index_topk_triton(q, weights, batch, k, return_slots=return_slots, config=config)
    indices = index_topk_reference(q, weights, batch, k)
    if not return_slots:
        return indices
    return indices, topk_to_slots(indices, batch.block_table.cpu(), batch.query_seq.cpu())


def __getattr__(name: str):
    # the decode plan path needs triton, an optional dependency: import it only when asked for
    if name in ("DecodeTopkPlan", "plan_decode_topk", "index_topk_decode"):
        from . import decode

        return getattr(decode, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["index_topk", "index_topk_reference", "select_topk", "select_topk_reference", "topk_to_slots",
           "DecodeTopkPlan", "plan_decode_topk", "index_topk_decode", "TopkConfig", "SelectConfig"]
