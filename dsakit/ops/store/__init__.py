"""Fused store of index keys and V4 main-attention KV into paged caches.

``store_index_keys`` / ``store_attention_kv`` take the reference's arguments plus ``backend="auto" |
"reference" | "triton"``: ``auto`` runs the fused Triton kernel (``triton.py``, one launch, no intermediate
tensor in global memory) when the pool is on a CUDA device, the fp32 CPU reference (``reference.py``, the
spec) otherwise. The Triton path goes through the ``torch.library`` custom ops ``dsakit::store_index_keys``
and ``dsakit::store_attention_kv``, so it can be traced by ``torch.compile`` and captured in a CUDA graph.

Validation, once per call: :meth:`IndexKeyStore.check` / :meth:`AttentionKVStore.check` (``inputs.py``) check
every input and return a frozen record; :func:`store_checked` runs a record (reference writer or kernel launch) without
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

from ...formats import AttentionKVFormat, KeyFormat
from ...pool import PageSummaries
from ...presets import KeyTransform
from ...transforms import ROPE_V4, RopeLayout
from ..._memory import check_instance
from .._backend import triton_available
from . import reference
from .config import StoreConfig
from .inputs import AttentionKVStore, IndexKeyStore
from .reference import prepare_attention_kv, prepare_index_keys

if triton_available():
    # registers the dsakit:: custom ops (the kernels compile lazily, on first use)
    from . import triton as _triton_kernels  # noqa: F401

__all__ = ["store_index_keys", "store_attention_kv", "prepare_index_keys", "prepare_attention_kv", "StoreConfig",
           "IndexKeyStore", "AttentionKVStore", "store_checked"]


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
