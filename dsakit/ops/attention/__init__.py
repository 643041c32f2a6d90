"""Sparse attention over paged V4 main-KV pools: ``sparse_attention(..., backend="auto" | "reference" | "triton")``.

``auto`` runs the Triton kernel (``triton.py``) when q is on a CUDA device, the fp32 CPU reference
(``reference.py``, the spec) otherwise. Inputs are validated once here (shapes, dtypes, devices, the
softmax scale; no device sync). Index values are not checked: a slot outside [0, num_slots) or a position at
or beyond ``topk_length`` is skipped like -1 padding, by the reference and the kernel alike, and never read.
"""

from __future__ import annotations

import torch

from ...formats import AttentionKVFormat
from .._backend import resolve_backend
from . import reference
from .config import ATTENTION_DEFAULTS, TRITON_HEADS, AttentionConfig
from .inputs import SparseAttentionInputs, check_sparse_attention_inputs
from .reference import sparse_attention_dense, window_topk_indices

__all__ = ["sparse_attention", "sparse_attention_dense", "window_topk_indices", "AttentionConfig",
           "ATTENTION_DEFAULTS", "TRITON_HEADS", "SparseAttentionInputs", "check_sparse_attention_inputs"]


def sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, *,
                     kv_format: "AttentionKVFormat | str", topk_length: torch.Tensor | None = None,
                     extra_kv_cache: torch.Tensor | None = None,
                     extra_kv_format: "AttentionKVFormat | str | None" = None,
                     extra_indices: torch.Tensor | None = None, extra_topk_length: torch.Tensor | None = None,
                     sink: torch.Tensor | None = None, softmax_scale: float | None = None,
                     backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention of q over the entries selected from one or two paged KV pools (shared K = V).

    q [T, Hq, 512] bf16 / fp16 / fp32 (Triton: Hq in {64, 128}); kv_cache uint8 [P, page_bytes] in
    ``kv_format`` ("bf16": 1024 B/token, "fp8-rope-bf16": 584 B/token); indices int32 [T, K] global slots
    ``page * 64 + offset`` (-1 = skip); topk_length int32 [T]: only indices[t, :topk_length[t]] count;
    extra_kv_cache / extra_kv_format (default kv_format) / extra_indices int32 [T, K'] / extra_topk_length:
    a second pool and index set (V4: compressed entries); sink fp32 [Hq]: per-head sink logit (absorbs mass,
    no value); softmax_scale default 512 ** -0.5.

    -> (out [T, Hq, 512] in q.dtype on q's device, lse fp32 [T, Hq] over the selected entries, sink excluded;
    an empty index set gives out 0 and lse -inf). The reference computes in fp32; the kernel computes
    q . kv and p @ kv with bf16 operands and fp32 accumulation (see docs/attention.md for the tolerance).
    """
    a = check_sparse_attention_inputs(q, kv_cache, indices, kv_format=kv_format, topk_length=topk_length,
                                      extra_kv_cache=extra_kv_cache, extra_kv_format=extra_kv_format,
                                      extra_indices=extra_indices, extra_topk_length=extra_topk_length, sink=sink,
                                      softmax_scale=softmax_scale)
    if resolve_backend(backend, q, kv_cache) == "triton":
        from .triton import sparse_attention_triton

        return sparse_attention_triton(a)
    out, lse = reference.sparse_attention(
        q, kv_cache, indices, kv_format=a.kv_format, topk_length=topk_length, extra_kv_cache=extra_kv_cache,
        extra_kv_format=a.extra_kv_format, extra_indices=extra_indices, extra_topk_length=extra_topk_length,
        sink=sink, softmax_scale=a.softmax_scale)
    return out.to(q.device, q.dtype), lse.to(q.device)
