"""Checked inputs of sparse attention: :class:`SparseAttentionInputs`, built once by
:func:`check_sparse_attention_inputs` (shapes, dtypes, devices; no device sync) and trusted by the reference
and the launchers. Index values are not checked: invalid slots are skipped by definition (``reference.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._memory import FLOAT_DTYPES, check_device, check_float, check_tensor
from ...pool import check_pool
from ...formats import ATTENTION_HEAD_DIM, AttentionKVFormat


def _describe(x) -> str:
    return f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


@dataclass(frozen=True)
class SparseAttentionInputs:
    """Checked arguments of :func:`sparse_attention` (formats parsed, scale resolved)."""

    q: torch.Tensor
    kv_cache: torch.Tensor
    kv_format: AttentionKVFormat
    indices: torch.Tensor
    topk_length: torch.Tensor | None
    extra_kv_cache: torch.Tensor | None
    extra_kv_format: AttentionKVFormat | None
    extra_indices: torch.Tensor | None
    extra_topk_length: torch.Tensor | None
    sink: torch.Tensor | None
    softmax_scale: float


def _check_int_tensor(x, what: str, shape: tuple, device: torch.device) -> None:
    check_tensor(what, x, dtypes=torch.int32)
    check_tensor(what, x, shape=shape, device=device, owner="q")


def _check_pool(pool, fmt, what: str, device: torch.device) -> None:
    check_pool(pool, fmt, what)
    check_device(what, pool, device, owner="q")


def check_sparse_attention_inputs(q, kv_cache, indices, *, kv_format, topk_length=None, extra_kv_cache=None,
                                  extra_kv_format=None, extra_indices=None, extra_topk_length=None, sink=None,
                                  softmax_scale=None) -> SparseAttentionInputs:
    """Validate the arguments of :func:`sparse_attention` (ValueError naming the bad value); no device sync.

    Index values are not checked: invalid slots are skipped by definition (see the module docstring)."""
    check_tensor("q", q, dims=3, dtypes=FLOAT_DTYPES,
                 message=f"q must be a bf16 / fp16 / fp32 [T, Hq, {ATTENTION_HEAD_DIM}] tensor")
    fmt = AttentionKVFormat.parse(kv_format)
    t, hq, d = q.shape
    if d != fmt.head_dim:
        raise ValueError(f"q must have head dim {fmt.head_dim} for kv_format {fmt.name}, got {list(q.shape)}")
    device = q.device
    _check_pool(kv_cache, fmt, "kv_cache", device)
    _check_int_tensor(indices, "indices", (t, None), device)
    if topk_length is not None:
        _check_int_tensor(topk_length, "topk_length", (t,), device)
    has_extra = extra_kv_cache is not None or extra_indices is not None
    xfmt = None
    if has_extra:
        if extra_kv_cache is None or extra_indices is None:
            raise ValueError("extra_kv_cache and extra_indices must be given together, got "
                             f"extra_kv_cache={_describe(extra_kv_cache)}, extra_indices={_describe(extra_indices)}")
        xfmt = fmt if extra_kv_format is None else AttentionKVFormat.parse(extra_kv_format)
        if xfmt.head_dim != d:
            raise ValueError(f"extra_kv_format {xfmt.name} has head dim {xfmt.head_dim}, q has {d}")
        _check_pool(extra_kv_cache, xfmt, "extra_kv_cache", device)
        _check_int_tensor(extra_indices, "extra_indices", (t, None), device)
        if extra_topk_length is not None:
            _check_int_tensor(extra_topk_length, "extra_topk_length", (t,), device)
    elif extra_kv_format is not None or extra_topk_length is not None:
        raise ValueError("extra_kv_format / extra_topk_length given without extra_kv_cache and extra_indices")
    if sink is not None:
        check_tensor("sink", sink, shape=(hq,), floating=True, device=device, owner="q",
                     message=f"sink must be a floating [Hq] = [{hq}] tensor")
    scale = d ** -0.5 if softmax_scale is None else check_softmax_scale(softmax_scale)
    return SparseAttentionInputs(q, kv_cache, fmt, indices, topk_length, extra_kv_cache if has_extra else None,
                                 xfmt, extra_indices if has_extra else None,
                                 extra_topk_length if has_extra else None, sink, scale)


def check_softmax_scale(softmax_scale) -> float:
    """softmax_scale as a positive finite float (NaN would turn every output into zeros), else ValueError."""
    scale = check_float("softmax_scale", softmax_scale, positive=True,
                        message="softmax_scale must be a positive finite float")
    return scale


__all__ = ["SparseAttentionInputs", "check_sparse_attention_inputs", "check_softmax_scale"]
