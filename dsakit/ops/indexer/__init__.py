"""The lightning indexer as one op: ``index_scores(q, weights, batch)``, ``index_topk(q, weights, batch, k)`` and
``select_topk(scores, k)``, each with ``backend="auto" | "reference" | "triton"``.

The reference (:mod:`.reference`, pure PyTorch fp32, CPU) is the spec and materializes [T, N]. The Triton
path scores query rows chunk by chunk into a bounded fp32 workspace (:mod:`.scores`, kernels in
``_kernels.py``) and selects each chunk with an exact select (:mod:`.select`, kernels in ``_select_kernels.py``
and ``_topk_kernels.py``), so its memory is O(T * K) plus the workspace; workspaces and tile plans
(:mod:`.plans`) are cached by shape, so a repeated call makes no device->host sync. ``auto`` picks Triton
for CUDA tensors. Tuning: :mod:`.config` (``ScoresConfig``, ``SelectConfig``, ``TopkConfig``); input checks:
:mod:`.inputs`.

Decode inside a CUDA graph: :func:`plan_decode_topk` + :func:`index_topk_decode` preallocate the workspace
and the outputs once; each call then only launches kernels (no sync, no allocation).

DeepGEMM-style paged logits (:mod:`.deepgemm_compat`): ``fp8_paged_mqa_logits`` for plain fp8 pools and
``centred_paged_mqa_logits`` / ``deepgemm_centred_paged_mqa_logits`` (DeepGEMM's positional order) for
page-centred pools. Every name that needs triton is imported on first use (triton is optional).
"""

from __future__ import annotations

import torch

from ...batch import PagedBatch, check_batch, check_batch_queries, check_k
from ...formats import is_centred
from ...pool import PageSummaries
from ..._memory import check_bool, check_instance
from .._backend import resolve_backend
from .config import MAX_K, HierarchyConfig, ScoresConfig, SelectConfig, TopkConfig
from .reference import hierarchical_topk as hierarchical_topk_reference
from .reference import index_scores as index_scores_reference
from .reference import index_scores_dense
from .reference import index_topk as index_topk_reference
from .reference import select_topk as select_topk_reference
from .reference import topk_to_slots


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
        from .scores import index_scores_triton  # imported lazily: triton is an optional dependency

        return index_scores_triton(q, weights, batch, config=config)
    return index_scores_reference(q, weights, batch)


def select_topk(scores: torch.Tensor, k: int, *, backend: str = "auto") -> torch.Tensor:
    """scores fp32 [T, N] -> int32 [T, k] indices (rules of :mod:`dsakit.ops.indexer.reference`)."""
    chosen = resolve_backend(backend, scores)
    if chosen == "triton":
        from .select import select_topk_triton  # imported lazily: triton is an optional dependency

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


def hierarchical_topk(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int, *,
                      summaries: PageSummaries | None = None, config: HierarchyConfig | None = None,
                      backend: str = "auto", return_slots: bool = False, return_pages: bool = False):
    """Top-k entries per query chosen in two stages: page representatives, then exact scores inside the
    pages kept (docs/hierarchy.md) -> int32 [T, k] entry indices (-1 padded), as :func:`index_topk`.

    Stage 1 keeps each query's best ``config.pages_for(k)`` pages by the score of their representative
    (a centred pool's stored centre, else ``summaries.centre``), plus its first and last pages; stage 2
    returns the exact top-k among the entries of those pages, in :func:`index_topk`'s order and tie rule.
    ``HierarchyConfig(exact=True)`` also scores every page whose bound (``summaries.lower`` / ``upper``)
    reaches the k-th score, so the result is the flat top-k. ``summaries`` (:class:`dsakit.pool.PageSummaries`
    kept by the store, ``PagedCache(..., summaries=True)``; default: ``batch.summaries``) is needed for plain
    formats and for the exact mode.
    ``return_slots`` adds the global slots; ``return_pages`` adds int64 [T]: the pages stage 2 scored per query.

    >>> cache = PagedCache(KeyFormat.FP8, num_pages=64, summaries=True)   # the store keeps page summaries
    >>> idx = hierarchical_topk(q, w, cache.batch(), 512)                   # default HierarchyConfig()
    """
    check_bool("return_slots", return_slots)
    check_bool("return_pages", return_pages)
    check_batch(batch)
    check_batch_queries(q, weights, batch)
    check_k(k, MAX_K)
    config = check_instance("config", config or HierarchyConfig(), HierarchyConfig, label="HierarchyConfig or None")
    if summaries is None:
        summaries = batch.summaries  # PagedCache(..., summaries=True).batch() carries its table
    if summaries is not None:
        check_instance("summaries", summaries, PageSummaries, label="dsakit.pool.PageSummaries or None")
        summaries.check_for(batch.pool)
    elif config.exact or not is_centred(batch.fmt):
        need = "the exact mode" if config.exact else f"a {batch.fmt.name} pool (no stored centres)"
        raise ValueError(f"hierarchical_topk needs summaries (PageSummaries kept by the store) for {need}")
    chosen = resolve_backend(backend, q, batch.pool)
    if chosen == "triton":
        from .hierarchy import hierarchical_topk_triton

        indices, slots, pages = hierarchical_topk_triton(q, weights, batch, k, config, summaries,
                                                         return_slots=return_slots)
    else:
        indices, pages = hierarchical_topk_reference(q, weights, batch, k, config, summaries)
        slots = topk_to_slots(indices, batch.block_table.cpu(), batch.query_seq.cpu()) if return_slots else None
    out = (indices,) + ((slots,) if return_slots else ()) + ((pages,) if return_pages else ())
    return out[0] if len(out) == 1 else out


def index_scores_kernels() -> dict:
    """The Triton kernels behind ``index_scores`` by name ({"group": ..., "tile": ...}), for tools that
    inspect their compiled code (benchmarks/sm90_registers.py). Needs triton."""
    from . import _kernels

    return {"group": _kernels._index_scores_group_kernel, "tile": _kernels._index_scores_tile_kernel}


# names that need triton, by the module that holds them: imported on first use
LAZY = {
    "DecodeTopkPlan": "plans", "plan_decode_topk": "plans", "index_topk_decode": "triton",
    "fp8_paged_mqa_logits": "deepgemm_compat", "deepgemm_fp8_paged_mqa_logits": "deepgemm_compat",
    "centred_paged_mqa_logits": "deepgemm_compat", "deepgemm_centred_paged_mqa_logits": "deepgemm_compat",
    "fp8_mqa_logits": "deepgemm_compat",
}


def __getattr__(name: str):
    if name in LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["index_scores", "index_topk", "hierarchical_topk", "select_topk", "topk_to_slots", "index_scores_dense",
           "index_scores_reference", "index_topk_reference", "hierarchical_topk_reference", "select_topk_reference",
           "index_scores_kernels", "ScoresConfig", "SelectConfig", "TopkConfig", "HierarchyConfig", *LAZY]
