"""DSA ops, one folder per op (``store``, ``indexer``, ``attention``, ``compress``), each of one shape: an
``__init__.py`` that dispatches (``backend="auto" | "reference" | <fast path>``), ``inputs.py`` (the op's
checked-inputs record and checks: ``IndexKeyStore``, ``SparseAttentionInputs``, ...; the indexer's records are
``PagedBatch`` and ``DecodeTopkPlan``), ``reference.py`` (pure PyTorch fp32 spec, CPU), launchers
(``triton.py``; for ``compress``, ``device.py``: torch ops on the tensors' own device), ``_kernels.py`` and
``config.py`` (tuning). The dispatcher checks the inputs once; the reference and the launchers trust them.

The indexer's public names are importable from here (``from dsakit.ops import index_topk``) as well as from
:mod:`dsakit.ops.indexer`: ``index_scores``, ``index_topk``, ``hierarchical_topk`` (with ``HierarchyConfig``;
docs/hierarchy.md), ``select_topk``, ``topk_to_slots``, the
references, ``ScoresConfig`` / ``SelectConfig`` / ``TopkConfig``, the decode plan (``plan_decode_topk``,
``index_topk_decode``, ``DecodeTopkPlan``) and the DeepGEMM-style entry points (``fp8_paged_mqa_logits``, ...).
They are imported on first use, so ``import dsakit.ops`` needs no triton.
"""

from ._backend import BACKENDS, resolve_backend, triton_available, triton_interpreted

# the indexer's public names (dsakit.ops.indexer.__all__), resolved on first use
INDEXER_NAMES = ("index_scores", "index_topk", "hierarchical_topk", "HierarchyConfig", "select_topk", "topk_to_slots",
                 "index_scores_dense", "hierarchical_topk_reference",
                 "index_scores_reference", "index_topk_reference", "select_topk_reference", "index_scores_kernels",
                 "ScoresConfig", "SelectConfig", "TopkConfig", "DecodeTopkPlan", "plan_decode_topk",
                 "index_topk_decode", "fp8_paged_mqa_logits", "deepgemm_fp8_paged_mqa_logits",
                 "centred_paged_mqa_logits", "deepgemm_centred_paged_mqa_logits", "fp8_mqa_logits")


def __getattr__(name: str):
    if name in INDEXER_NAMES:
        from . import indexer

        return getattr(indexer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKENDS", "resolve_backend", "triton_available", "triton_interpreted", *INDEXER_NAMES]
