"""Fused store of index keys and V4 main-attention KV into paged caches.

``store_index_keys`` / ``store_attention_kv`` take the reference's arguments plus ``backend="auto" |
"reference" | "triton"``: ``auto`` runs the fused Triton kernel (``triton.py``, one launch, no intermediate
tensor in global memory) when the pool is on a CUDA device, the fp32 CPU reference (``reference.py``, the
spec) otherwise. The Triton path goes through the ``torch.library`` custom ops ``dsakit::store_index_keys``
and ``dsakit::store_attention_kv``, so it can be traced by ``torch.compile`` and captured in a CUDA graph.

Validation: shapes, dtypes, devices and contiguity are always checked (no device sync). Value checks
(slot range and duplicates, positions inside the rope table) copy to the host, so they run in eager mode
only; under ``torch.compile`` or CUDA-graph capture they are skipped and the kernel itself drops rows with
an out-of-range slot or position instead of writing out of bounds.
"""

from __future__ import annotations

import torch

from ...pool import check_pool, check_slots, num_slots
from ...formats import ATTENTION_HEAD_DIM, INDEX_HEAD_DIM, AttentionKVFormat, KeyFormat
from ...presets import KeyTransform
from ...transforms import NORMS, ROPE_V4, RopeLayout
from .._backend import resolve_backend, triton_available
from . import reference
from .config import StoreConfig
from .reference import check_eps, check_rope_dim, check_rope_inputs, prepare_attention_kv, prepare_index_keys

if triton_available():
    # registers the dsakit:: custom ops (the kernels compile lazily, on first use)
    from . import triton as _triton_kernels  # noqa: F401

__all__ = ["store_index_keys", "store_attention_kv", "prepare_index_keys", "prepare_attention_kv", "StoreConfig"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _value_checks_allowed(*tensors: torch.Tensor) -> bool:
    """Host-side value checks need a device sync: only in eager mode, never while tracing or capturing."""
    if torch.compiler.is_compiling():
        return False
    on_cuda = any(t.is_cuda for t in tensors if isinstance(t, torch.Tensor))
    return not (on_cuda and torch.cuda.is_current_stream_capturing())


def _check_tensor(x, what: str, shape: tuple, dtypes: tuple, device: torch.device) -> None:
    """x must be a tensor of ``shape`` (None = any size) with one of ``dtypes`` on ``device``."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != len(shape) or any(want is not None and got != want for got, want in zip(x.shape, shape)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{what} must have shape [{want}], got {list(x.shape)}")
    if x.dtype not in dtypes:
        raise ValueError(f"{what} must have dtype in {[str(d) for d in dtypes]}, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{what} is on {x.device} but the pool is on {device}: all inputs must share its device")


def _check_common(rows: torch.Tensor, dim: int, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                  rope_cos_sin: torch.Tensor, rope_dim: int, what: str) -> None:
    device = pool.device
    _check_tensor(rows, what, (None, dim), _INPUT_DTYPES, device)
    n = rows.shape[0]
    _check_tensor(positions, "positions", (n,), (torch.int32, torch.int64), device)
    _check_tensor(slots, "slots", (n,), (torch.int32, torch.int64), device)
    _check_tensor(rope_cos_sin, "rope_cos_sin", (None, rope_dim), (torch.float32,), device)
    check_rope_dim(rope_dim, dim)
    if rope_cos_sin.shape[0] == 0:
        raise ValueError("rope_cos_sin has no rows (max_position = 0)")
    if n and _value_checks_allowed(rows, pool):
        check_slots(slots, num_slots(pool))
        check_rope_inputs(positions, rope_cos_sin, n, rope_dim)


def store_index_keys(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                     fmt: "KeyFormat | str", rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor,
                     norm_bias: torch.Tensor | None = None, transform: KeyTransform = KeyTransform(), *,
                     backend: str = "auto") -> None:
    """Normalize, rope, rotate, quantize and store index keys in a paged pool (in place).

    keys [N, 128] fp32/bf16/fp16 (pre-norm), positions int [N] (rope position of each row), slots int [N]
    (global slot, < 0 = padding, skipped), pool uint8 [P, fmt.page_bytes] (contiguous, written in place),
    rope_cos_sin fp32 [max_position, rope_dim] (cos then sin), norm_weight [128], norm_bias [128]
    (layernorm only). ``transform`` picks the norm, rope layout / dims, Hadamard and eps.
    Byte layout of the entries: :mod:`dsakit.formats`.
    """
    fmt = KeyFormat.parse(fmt)
    check_pool(pool, fmt)
    if not isinstance(transform, KeyTransform):
        raise ValueError(f"transform must be a KeyTransform, got {type(transform).__name__}")
    if transform.norm not in NORMS:
        raise ValueError(f"unknown norm {transform.norm!r}; choose one of {NORMS}")
    if transform.norm == "rmsnorm" and norm_bias is not None:
        raise ValueError("rmsnorm takes no bias; pass norm_bias=None or use norm='layernorm'")
    layout = RopeLayout.parse(transform.rope_layout)
    chosen = resolve_backend(backend, keys, pool)
    # the same checks for both backends, so they accept and refuse the same inputs
    _check_common(keys, INDEX_HEAD_DIM, positions, slots, pool, rope_cos_sin, transform.rope_dim, "keys")
    _check_tensor(norm_weight, "norm_weight", (INDEX_HEAD_DIM,), _INPUT_DTYPES, pool.device)
    if norm_bias is not None:
        _check_tensor(norm_bias, "norm_bias", (INDEX_HEAD_DIM,), _INPUT_DTYPES, pool.device)
    if chosen == "reference":
        reference.store_index_keys(keys, positions, slots, pool, fmt, rope_cos_sin, norm_weight, norm_bias,
                                   transform)
        return
    torch.ops.dsakit.store_index_keys(keys, positions, slots, pool, rope_cos_sin, norm_weight.contiguous(),
                                      None if norm_bias is None else norm_bias.contiguous(), fmt.name,
                                      transform.norm, layout.name, bool(transform.hadamard), float(transform.eps))


def store_attention_kv(kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                       fmt: "AttentionKVFormat | str", rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor,
                       rope_layout: RopeLayout = ROPE_V4, eps: float = 1e-6, *, backend: str = "auto") -> None:
    """RMSNorm + rope + quantize + paged store of V4 main-attention KV [N, 512] (in place); slots < 0 skipped.

    kv [N, 512] fp32/bf16/fp16 (pre-norm), positions int [N], slots int [N], pool uint8 [P, fmt.page_bytes],
    rope_cos_sin fp32 [max_position, rope_dim] (rope_dim = its width), norm_weight [512].
    ``fp8-rope-bf16`` entries: 448 e4m3fn + 64 bf16 values, 7 ue8m0 scale bytes + 1 zero pad byte.
    """
    fmt = AttentionKVFormat.parse(fmt)
    check_pool(pool, fmt)
    check_eps(eps)
    layout = RopeLayout.parse(rope_layout)
    chosen = resolve_backend(backend, kv, pool)
    # the same checks for both backends (the reference once stored entries with a rope table of width 0)
    if not isinstance(rope_cos_sin, torch.Tensor) or rope_cos_sin.dim() != 2:
        raise ValueError(f"rope_cos_sin must be a [max_position, rope_dim] tensor, got "
                         f"{list(rope_cos_sin.shape) if isinstance(rope_cos_sin, torch.Tensor) else rope_cos_sin!r}")
    _check_common(kv, ATTENTION_HEAD_DIM, positions, slots, pool, rope_cos_sin, rope_cos_sin.shape[1], "kv")
    _check_tensor(norm_weight, "norm_weight", (ATTENTION_HEAD_DIM,), _INPUT_DTYPES, pool.device)
    if chosen == "reference":
        reference.store_attention_kv(kv, positions, slots, pool, fmt, rope_cos_sin, norm_weight, layout, eps)
        return
    torch.ops.dsakit.store_attention_kv(kv, positions, slots, pool, rope_cos_sin, norm_weight.contiguous(),
                                        fmt.name, layout.name, float(eps))
