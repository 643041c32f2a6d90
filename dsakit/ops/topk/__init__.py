"""Indexer top-k: ``index_topk(..., backend="auto" | "reference" | "triton")`` and ``select_topk``.

The reference (pure PyTorch fp32, CPU) is the spec and materializes [T, N]. The Triton path
(:mod:`dsakit.ops.topk.triton`) scores query rows chunk by chunk into a bounded fp32 workspace and selects
each chunk with an exact radix select, so its memory is O(T * K) plus the workspace. ``auto`` picks Triton
for CUDA tensors.

Decode: :func:`plan_decode_topk` + :func:`index_topk_decode` (:mod:`dsakit.ops.topk.decode`) preallocate the
workspace, tile plan and outputs once; each call then only launches kernels (no host sync, no allocation), so
it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from .._backend import resolve_backend
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


def index_topk(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt, block_table: torch.Tensor,
               entry_counts: torch.Tensor, query_seq: torch.Tensor, k: int,
               query_positions: torch.Tensor | None = None, ratio: int = 1, *, backend: str = "auto",
               return_slots: bool = False, workspace_bytes: int | None = None):
    """Top-k entries per query of a ragged batch against paged keys -> int32 [T, k] (-1 padded).

    Arguments as :func:`dsakit.ops.topk.reference.index_topk`. ``return_slots=True`` returns
    ``(indices, slots)`` with global slot ids (page * 64 + entry % 64 through the block table, -1 kept) for
    the sparse-attention kernel. ``workspace_bytes`` bounds the Triton path's fp32 score workspace
    (default :data:`dsakit.ops.topk.triton.DEFAULT_WORKSPACE_BYTES` = 512 MiB); the reference ignores it.
    The reference returns CPU tensors; Triton returns them on the inputs' device.
    """
    if not isinstance(return_slots, bool):
        raise ValueError(f"return_slots must be a bool, got {return_slots!r}")
    if workspace_bytes is not None and (isinstance(workspace_bytes, bool) or not isinstance(workspace_bytes, int)
                                        or workspace_bytes < 1):
        raise ValueError(f"workspace_bytes must be a positive int or None, got {workspace_bytes!r}")
    chosen = resolve_backend(backend, q, pool)
    if chosen == "triton":
        from .triton import DEFAULT_WORKSPACE_BYTES, index_topk_triton

        return index_topk_triton(q, weights, pool, fmt, block_table, entry_counts, query_seq, k,
                                 query_positions, ratio, return_slots=return_slots,
                                 workspace_bytes=workspace_bytes or DEFAULT_WORKSPACE_BYTES)
    indices = index_topk_reference(q, weights, pool, fmt, block_table, entry_counts, query_seq, k,
                                   query_positions, ratio)
    if not return_slots:
        return indices
    return indices, topk_to_slots(indices, block_table.cpu(), query_seq.cpu())


def __getattr__(name: str):
    # the decode plan path needs triton, an optional dependency: import it only when asked for
    if name in ("DecodeTopkPlan", "plan_decode_topk", "index_topk_decode"):
        from . import decode

        return getattr(decode, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["index_topk", "index_topk_reference", "select_topk", "select_topk_reference", "topk_to_slots",
           "DecodeTopkPlan", "plan_decode_topk", "index_topk_decode"]
