"""Fused store of index keys and V4 main-attention KV into paged caches.

``store_index_keys`` / ``store_attention_kv`` take the reference's arguments plus ``backend="auto" |
"reference" | "triton"``: ``auto`` runs the fused Triton kernel (``triton.py``, one launch, no intermediate
tensor in global memory) when the pool is on a CUDA device, the fp32 CPU reference (``reference.py``, the
spec) otherwise. The Triton path goes through the ``torch.library`` custom ops ``dsakit::store_index_keys``
and ``dsakit::store_attention_kv``, so it can be traced by ``torch.compile`` and captured in a CUDA graph.

Validation, once per call: :meth:`IndexKeyStore.check` / :meth:`AttentionKVStore.check` check every input
and return a frozen record; :func:`store_checked` runs a record (reference writer or kernel launch) without
checking anything again. ``store_index_keys`` / ``store_attention_kv`` are exactly those two steps.
Shapes, dtypes, devices and contiguity are always checked (no device sync). Value checks (slot range and
duplicates, positions inside the rope table) copy to the host, so they run in eager mode only; under
``torch.compile`` or CUDA-graph capture they are skipped and the kernel itself drops rows with an
out-of-range slot or position instead of writing out of bounds.

The trusted path: a caller that makes its slots and positions itself (a layer's own allocator: in range and
distinct by construction) builds the record with ``check_values=False`` and calls :func:`store_checked`:
no host copy, no sync, the same dispatch as the public op. The kernel still drops rows whose slot or
position is out of range, so nothing is written out of bounds either way; the reference backend (CPU)
checks the values regardless, as it has no such guard.
"""

from __future__ import annotations

import torch

from dataclasses import dataclass

from ..._memory import FLOAT_DTYPES, INDEX_DTYPES, check_bool, check_choice, check_instance, check_tensor
from ...pool import PageSummaries, check_centre_order, check_pool, check_slots, check_summaries, num_slots
from ...formats import ATTENTION_HEAD_DIM, INDEX_HEAD_DIM, AttentionKVFormat, KeyFormat
from ...presets import KeyTransform
from ...transforms import NORMS, ROPE_V4, RopeLayout
from .._backend import resolve_backend, triton_available
from . import reference
from .config import StoreConfig
from .reference import check_eps, check_rope_dim, check_rope_positions, prepare_attention_kv, prepare_index_keys

if triton_available():
    # registers the dsakit:: custom ops (the kernels compile lazily, on first use)
    from . import triton as _triton_kernels  # noqa: F401

__all__ = ["store_index_keys", "store_attention_kv", "prepare_index_keys", "prepare_attention_kv", "StoreConfig",
           "IndexKeyStore", "AttentionKVStore", "store_checked"]


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


def store_checked(record: "IndexKeyStore | AttentionKVStore") -> None:
    """Run a checked store record: the reference writer or the fused kernel, nothing checked again.

    Eager Triton launches the kernel directly; under ``torch.compile`` it goes through the traceable
    ``torch.ops.dsakit.*`` custom op (the same launch)."""
    r = record
    if isinstance(r, IndexKeyStore):
        t = r.transform
        if r.backend == "reference":
            reference.store_checked_index_keys(r.keys, r.positions, r.checked_slots, r.pool, r.fmt, r.rope_cos_sin,
                                               r.norm_weight, r.norm_bias, t, r.summaries)
        elif torch.compiler.is_compiling():
            s = r.summaries
            torch.ops.dsakit.store_index_keys(r.keys, r.positions, r.slots, r.pool, r.rope_cos_sin,
                                              r.norm_weight.contiguous(),
                                              None if r.norm_bias is None else r.norm_bias.contiguous(), r.fmt.name,
                                              t.norm, r.layout.name, bool(t.hadamard), float(t.eps),
                                              None if s is None else s.centre, None if s is None else s.lower,
                                              None if s is None else s.upper, r.one_row_per_page)
        else:
            pairing, placement = r.layout.name.rsplit("-", 1)
            _triton_kernels.launch_store_index_keys(
                r.keys, r.positions, r.slots, r.pool, r.rope_cos_sin, r.norm_weight.contiguous(),
                None if r.norm_bias is None else r.norm_bias.contiguous(), r.fmt, t.norm, pairing, placement,
                bool(t.hadamard), float(t.eps), summaries=r.summaries, one_row_per_page=r.one_row_per_page)
        return
    check_instance("record", r, AttentionKVStore, "IndexKeyStore.check or AttentionKVStore.check")
    if r.backend == "reference":
        reference.store_checked_attention_kv(r.kv, r.positions, r.checked_slots, r.pool, r.fmt, r.rope_cos_sin,
                                             r.norm_weight, r.layout, r.eps)
    elif torch.compiler.is_compiling():
        torch.ops.dsakit.store_attention_kv(r.kv, r.positions, r.slots, r.pool, r.rope_cos_sin,
                                            r.norm_weight.contiguous(), r.fmt.name, r.layout.name, r.eps)
    else:
        pairing, placement = r.layout.name.rsplit("-", 1)
        _triton_kernels.launch_store_attention_kv(r.kv, r.positions, r.slots, r.pool, r.rope_cos_sin,
                                                  r.norm_weight.contiguous(), r.fmt, pairing, placement, r.eps)


def store_index_keys(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                     fmt: "KeyFormat | str", rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor,
                     norm_bias: torch.Tensor | None = None, transform: KeyTransform = KeyTransform(), *,
                     backend: str = "auto", summaries: PageSummaries | None = None) -> None:
    """Normalize, rope, rotate, quantize and store index keys in a paged pool (in place).

    keys [N, 128] fp32/bf16/fp16 (pre-norm), positions int [N] (rope position of each row), slots int [N]
    (global slot, < 0 = padding, skipped), pool uint8 [P, fmt.page_bytes] (contiguous, written in place),
    rope_cos_sin fp32 [max_position, rope_dim] (cos then sin), norm_weight [128], norm_bias [128]
    (layernorm only). ``transform`` picks the norm, rope layout / dims, Hadamard and eps.
    Byte layout of the entries: :mod:`dsakit.formats`.

    ``summaries``: the pool's :class:`dsakit.pool.PageSummaries` (bf16 [P, 128] centre / lower / upper), kept
    up to date: every page that gets a row is summarized over its entries 0..e, e its highest entry in the
    call (pages appended in order; docs/store.md, "Page summaries"). A decode append (one row per page)
    does it in the store's own launch.
    """
    store_checked(IndexKeyStore.check(keys, positions, slots, pool, fmt, rope_cos_sin, norm_weight, norm_bias,
                                      transform, backend=backend, summaries=summaries))


def store_attention_kv(kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                       fmt: "AttentionKVFormat | str", rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor,
                       rope_layout: RopeLayout = ROPE_V4, eps: float = 1e-6, *, backend: str = "auto") -> None:
    """RMSNorm + rope + quantize + paged store of V4 main-attention KV [N, 512] (in place); slots < 0 skipped.

    kv [N, 512] fp32/bf16/fp16 (pre-norm), positions int [N], slots int [N], pool uint8 [P, fmt.page_bytes],
    rope_cos_sin fp32 [max_position, rope_dim] (rope_dim = its width), norm_weight [512].
    ``fp8-rope-bf16`` entries: 448 e4m3fn + 64 bf16 values, 7 ue8m0 scale bytes + 1 zero pad byte.
    """
    store_checked(AttentionKVStore.check(kv, positions, slots, pool, fmt, rope_cos_sin, norm_weight, rope_layout,
                                         eps, backend=backend))
