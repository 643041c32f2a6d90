"""Checked inputs of the store op: :class:`IndexKeyStore` and :class:`AttentionKVStore`, each built once by its
``check`` classmethod (every argument checked, values too where allowed) and run by
:func:`dsakit.ops.store.store_checked` without checking anything again."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._memory import FLOAT_DTYPES, INDEX_DTYPES, check_bool, check_choice, check_instance, check_tensor
from ...pool import PageSummaries, check_centre_order, check_pool, check_slots, check_summaries, num_slots
from ...formats import ATTENTION_HEAD_DIM, INDEX_HEAD_DIM, AttentionKVFormat, KeyFormat
from ...presets import KeyTransform
from ...transforms import NORMS, ROPE_V4, RopeLayout
from .._backend import resolve_backend
from .reference import check_eps, check_rope_dim, check_rope_positions


def _value_checks_allowed(*tensors: torch.Tensor) -> bool:
    """Host-side value checks need a device sync: only in eager mode, never while tracing or capturing."""
    if torch.compiler.is_compiling():
        return False
    on_cuda = any(t.is_cuda for t in tensors if isinstance(t, torch.Tensor))
    return not (on_cuda and torch.cuda.is_current_stream_capturing())


def _check_common(rows: torch.Tensor, dim: int, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                  rope_cos_sin: torch.Tensor, rope_dim: int, what: str, backend: str,
                  check_values: bool) -> torch.Tensor | None:
    """Shapes, dtypes and devices of the rows, positions, slots and rope table; the values too when asked and
    allowed (always for the reference) -> the slots as CPU int64 when their values were checked, else None."""
    device = pool.device
    tensor = dict(device=device, owner="the pool")
    check_tensor(what, rows, shape=(None, dim), dtypes=FLOAT_DTYPES, **tensor)
    n = rows.shape[0]
    check_tensor("positions", positions, shape=(n,), dtypes=INDEX_DTYPES, **tensor)
    check_tensor("slots", slots, shape=(n,), dtypes=INDEX_DTYPES, **tensor)
    check_tensor("rope_cos_sin", rope_cos_sin, shape=(None, rope_dim), dtypes=(torch.float32,), **tensor)
    check_rope_dim(rope_dim, dim)
    if rope_cos_sin.shape[0] == 0:
        raise ValueError("rope_cos_sin has no rows (max_position = 0)")
    if backend == "reference" or (check_values and n and _value_checks_allowed(rows, pool)):
        checked = check_slots(slots, num_slots(pool))
        check_rope_positions(positions, rope_cos_sin)
        return checked
    return None


@dataclass(frozen=True, eq=False)
class IndexKeyStore:
    """Checked inputs of :func:`store_index_keys` (argument meanings there); build with :meth:`check`.

    ``backend`` is resolved ('reference' | 'triton'); ``checked_slots`` is the slots as CPU int64 when their
    values were checked (always on the reference backend), else None (the kernel's bounds guard holds).
    ``summaries``: the pool's page summaries the store keeps, or None; ``one_row_per_page``: no page gets two
    rows (known from the checked slots, or a single row), so the Triton store summarizes in its own launch."""

    keys: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    pool: torch.Tensor
    fmt: KeyFormat
    rope_cos_sin: torch.Tensor
    norm_weight: torch.Tensor
    norm_bias: torch.Tensor | None
    transform: KeyTransform
    layout: RopeLayout
    backend: str
    checked_slots: torch.Tensor | None
    summaries: PageSummaries | None = None
    one_row_per_page: bool = False

    @classmethod
    def check(cls, keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
              fmt: "KeyFormat | str", rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor,
              norm_bias: torch.Tensor | None = None, transform: KeyTransform = KeyTransform(), *,
              backend: str = "auto", check_values: bool = True,
              summaries: PageSummaries | None = None) -> "IndexKeyStore":
        """Check every input once -> the record :func:`store_checked` runs. ``check_values=False``: no host
        copy of slots / positions on the Triton path (the trusted path; module docstring). ``summaries``:
        checked against the pool (:meth:`PageSummaries.check_for`) and, with the slots' values, the call
        against their in-order precondition (:func:`dsakit.pool.check_summary_order`)."""
        fmt = KeyFormat.parse(fmt)
        check_pool(pool, fmt)
        check_instance("transform", transform, KeyTransform)
        check_choice("norm", transform.norm, NORMS)
        if transform.norm == "rmsnorm" and norm_bias is not None:
            raise ValueError("rmsnorm takes no bias; pass norm_bias=None or use norm='layernorm'")
        layout = RopeLayout.parse(transform.rope_layout)
        check_bool("check_values", check_values)
        chosen = resolve_backend(backend, keys, pool)
        # the same checks for both backends, so they accept and refuse the same inputs
        checked = _check_common(keys, INDEX_HEAD_DIM, positions, slots, pool, rope_cos_sin, transform.rope_dim,
                                "keys", chosen, check_values)
        if checked is not None:  # page-centred pages: entry 0 first (the kernel drops rows that break it)
            check_centre_order(pool, fmt, checked, in_row_order=True)
        several = check_summaries(summaries, pool, fmt, checked)
        one_row_per_page = summaries is not None and (keys.shape[0] <= 1 or (checked is not None and not several))
        check_tensor("norm_weight", norm_weight, shape=(INDEX_HEAD_DIM,), dtypes=FLOAT_DTYPES, device=pool.device,
                     owner="the pool")
        if norm_bias is not None:
            check_tensor("norm_bias", norm_bias, shape=(INDEX_HEAD_DIM,), dtypes=FLOAT_DTYPES, device=pool.device,
                         owner="the pool")
        return cls(keys, positions, slots, pool, fmt, rope_cos_sin, norm_weight, norm_bias, transform, layout,
                   chosen, checked, summaries, one_row_per_page)


@dataclass(frozen=True, eq=False)
class AttentionKVStore:
    """Checked inputs of :func:`store_attention_kv` (argument meanings there); build with :meth:`check`
    (fields as :class:`IndexKeyStore`)."""

    kv: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    pool: torch.Tensor
    fmt: AttentionKVFormat
    rope_cos_sin: torch.Tensor
    norm_weight: torch.Tensor
    layout: RopeLayout
    eps: float
    backend: str
    checked_slots: torch.Tensor | None

    @classmethod
    def check(cls, kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
              fmt: "AttentionKVFormat | str", rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor,
              rope_layout: RopeLayout = ROPE_V4, eps: float = 1e-6, *, backend: str = "auto",
              check_values: bool = True) -> "AttentionKVStore":
        """Check every input once -> the record :func:`store_checked` runs (``check_values``: as
        :meth:`IndexKeyStore.check`)."""
        fmt = AttentionKVFormat.parse(fmt)
        check_pool(pool, fmt)
        check_eps(eps)
        layout = RopeLayout.parse(rope_layout)
        check_bool("check_values", check_values)
        chosen = resolve_backend(backend, kv, pool)
        # the same checks for both backends (the reference once stored entries with a rope table of width 0)
        check_tensor("rope_cos_sin", rope_cos_sin, dims=2)
        checked = _check_common(kv, ATTENTION_HEAD_DIM, positions, slots, pool, rope_cos_sin,
                                rope_cos_sin.shape[1], "kv", chosen, check_values)
        check_tensor("norm_weight", norm_weight, shape=(ATTENTION_HEAD_DIM,), dtypes=FLOAT_DTYPES,
                     device=pool.device, owner="the pool")
        return cls(kv, positions, slots, pool, fmt, rope_cos_sin, norm_weight, layout, float(eps), chosen, checked)


__all__ = ["IndexKeyStore", "AttentionKVStore"]
