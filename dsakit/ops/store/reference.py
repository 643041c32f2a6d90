"""Reference (fp32, CPU) of the fused store: norm -> rope -> (Hadamard) -> quantize -> paged store.

    for each row n with slots[n] >= 0:
        x = keys[n] (fp32)
        x = RMSNorm(x) * w            or  LayerNorm(x) * w + b
        x = rope(x, rope_cos_sin[positions[n]], layout)     # rope_dim dims, see dsakit.transforms
        x = x @ H128 / sqrt(128)        (if hadamard)
        pool[page(slot), ...] = quantize(x)                  # byte layout: dsakit.formats

The attention-KV variant does norm -> rope -> quantize for 512-dim entries (no Hadamard).
"""

from __future__ import annotations

import torch

from ..._memory import FLOAT_DTYPES, INDEX_DTYPES, check_float, check_instance, check_tensor
from ...formats import AttentionKVFormat, KeyFormat
from ...pool import (PageSummaries, check_pool, check_slots, check_summaries, num_slots, store_checked_entries,
                     update_summaries)
from ...presets import KeyTransform
from ...transforms import ROPE_V4, RopeLayout, apply_norm, apply_rope, hadamard_transform


def _check_rows(x: torch.Tensor, dim: int, what: str) -> None:
    check_tensor(what, x, shape=(None, dim), dtypes=FLOAT_DTYPES, message=f"{what} must be an fp32, bf16 or fp16 "
                                                                           f"[N, {dim}] tensor")


def _check_vector(v: torch.Tensor | None, dim: int, what: str) -> None:
    if v is not None:
        check_tensor(what, v, shape=(dim,), dtypes=FLOAT_DTYPES, message=f"{what} must be an fp32, bf16 or fp16 "
                                                                          f"[{dim}] tensor")


def check_rope_dim(rope_dim: int, dim: int) -> None:
    """An even rope width in 2..dim (a table of width 0 would store the entries without rope)."""
    if rope_dim % 2 or not 0 < rope_dim <= dim:
        raise ValueError(f"rope_dim (the rope table's width) must be even and in 2..{dim}, got {rope_dim}")


def _check_store_target(rows: torch.Tensor, dim: int, what: str, slots: torch.Tensor, pool: torch.Tensor,
                        fmt: "KeyFormat | AttentionKVFormat") -> torch.Tensor:
    """Everything about where the rows go, checked before the first byte is written -> the slots as CPU int64."""
    check_pool(pool, fmt)
    _check_rows(rows, dim, what)
    return check_slots(slots, num_slots(pool), length=rows.shape[0])


def check_eps(eps: float) -> None:
    """The norm's epsilon: a finite number >= 0 (a negative one turns small rows into NaN, inf every row
    into zeros)."""
    check_float("eps", eps, 0)


def check_rope_inputs(positions: torch.Tensor, rope_cos_sin: torch.Tensor, n: int, rope_dim: int) -> None:
    check_tensor("positions", positions, shape=(n,), dtypes=INDEX_DTYPES,
                 message=f"positions must be int32/int64 [{n}]")
    check_tensor("rope_cos_sin", rope_cos_sin, shape=(None, rope_dim), dtypes=torch.float32,
                 message=f"rope_cos_sin must be [max_position, {rope_dim}] (cos then sin)")
    check_rope_positions(positions, rope_cos_sin)


def check_rope_positions(positions: torch.Tensor, rope_cos_sin: torch.Tensor) -> None:
    """Every position a row of the rope table (one host copy), else ValueError naming the first that is not."""
    if positions.numel():
        pos = positions.detach().cpu()
        bad = (pos < 0) | (pos >= rope_cos_sin.shape[0])
        if bool(bad.any()):
            raise ValueError(f"position {int(pos[bad][0])} outside the rope table (0..{rope_cos_sin.shape[0] - 1})")


def _rope(x: torch.Tensor, positions: torch.Tensor, rope_cos_sin: torch.Tensor, layout: RopeLayout,
          rope_dim: int) -> torch.Tensor:
    table = rope_cos_sin.detach().cpu().float()[positions.detach().cpu().long()]
    half = rope_dim // 2
    return apply_rope(x, table[:, :half], table[:, half:], layout, rope_dim)


def prepare_index_keys(keys: torch.Tensor, positions: torch.Tensor, rope_cos_sin: torch.Tensor,
                       norm_weight: torch.Tensor, norm_bias: torch.Tensor | None = None,
                       transform: KeyTransform = KeyTransform()) -> torch.Tensor:
    """Pre-norm keys [N, 128] -> fp32 [N, 128] after norm, rope and (optional) Hadamard; not quantized."""
    d = 128
    check_instance("transform", transform, KeyTransform)
    _check_rows(keys, d, "keys")
    _check_vector(norm_weight, d, "norm_weight")
    _check_vector(norm_bias, d, "norm_bias")
    check_rope_inputs(positions, rope_cos_sin, keys.shape[0], transform.rope_dim)
    return _prepare_index_keys(keys, positions, rope_cos_sin, norm_weight, norm_bias, transform)


def _prepare_index_keys(keys, positions, rope_cos_sin, norm_weight, norm_bias, transform) -> torch.Tensor:
    x = apply_norm(keys.detach().cpu().float(), transform.norm, norm_weight.detach().cpu(),
                   None if norm_bias is None else norm_bias.detach().cpu(), transform.eps)
    x = _rope(x, positions, rope_cos_sin, transform.rope_layout, transform.rope_dim)
    return hadamard_transform(x) if transform.hadamard else x


def store_index_keys(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                     fmt: "KeyFormat | str", rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor,
                     norm_bias: torch.Tensor | None = None, transform: KeyTransform = KeyTransform(),
                     summaries: PageSummaries | None = None) -> None:
    """Normalize, rope, rotate, quantize and store index keys in a paged pool (in place).

    keys [N, 128] fp32/bf16 (pre-norm), positions int [N] (rope position of each row), slots int [N]
    (global slot, < 0 = padding, skipped), pool uint8 [P, fmt.page_bytes], rope_cos_sin fp32
    [max_position, rope_dim] (cos then sin), norm_weight [128], norm_bias [128] (layernorm only),
    summaries: the pool's page summaries to keep up to date (:func:`dsakit.pool.update_summaries`) or None.
    """
    fmt = KeyFormat.parse(fmt)
    slots = _check_store_target(keys, 128, "keys", slots, pool, fmt)
    check_summaries(summaries, pool, fmt, slots)
    x = prepare_index_keys(keys, positions, rope_cos_sin, norm_weight, norm_bias, transform)
    store_checked_entries(pool, fmt, slots, x)
    if summaries is not None:
        update_summaries(pool, fmt, slots, summaries)


def prepare_attention_kv(kv: torch.Tensor, positions: torch.Tensor, rope_cos_sin: torch.Tensor,
                         norm_weight: torch.Tensor, rope_layout: RopeLayout = ROPE_V4, eps: float = 1e-6) -> torch.Tensor:
    """Pre-norm KV [N, 512] -> fp32 [N, 512] after RMSNorm and rope on the trailing 64 dims."""
    _check_rows(kv, 512, "kv")
    _check_vector(norm_weight, 512, "norm_weight")
    check_eps(eps)
    rope_dim = rope_cos_sin.shape[1] if isinstance(rope_cos_sin, torch.Tensor) and rope_cos_sin.dim() == 2 else 64
    check_rope_dim(rope_dim, 512)
    check_rope_inputs(positions, rope_cos_sin, kv.shape[0], rope_dim)
    return _prepare_attention_kv(kv, positions, rope_cos_sin, norm_weight, rope_layout, eps)


def _prepare_attention_kv(kv, positions, rope_cos_sin, norm_weight, rope_layout, eps) -> torch.Tensor:
    x = apply_norm(kv.detach().cpu().float(), "rmsnorm", norm_weight.detach().cpu(), None, eps)
    return _rope(x, positions, rope_cos_sin, RopeLayout.parse(rope_layout), rope_cos_sin.shape[1])


def store_attention_kv(kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                       fmt: "AttentionKVFormat | str", rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor,
                       rope_layout: RopeLayout = ROPE_V4, eps: float = 1e-6) -> None:
    """RMSNorm + rope + quantize + paged store of V4 main-attention KV [N, 512] (in place); slots < 0 skipped."""
    fmt = AttentionKVFormat.parse(fmt)
    slots = _check_store_target(kv, 512, "kv", slots, pool, fmt)
    x = prepare_attention_kv(kv, positions, rope_cos_sin, norm_weight, rope_layout, eps)
    store_checked_entries(pool, fmt, slots, x)


def store_checked_index_keys(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                             fmt: KeyFormat, rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor,
                             norm_bias: torch.Tensor | None, transform: KeyTransform,
                             summaries: PageSummaries | None = None) -> None:
    """:func:`store_index_keys` on inputs already checked (``dsakit.ops.store.IndexKeyStore``): ``slots`` are
    the CPU int64 slots :func:`dsakit.pool.check_slots` returned. Nothing is checked again."""
    x = _prepare_index_keys(keys, positions, rope_cos_sin, norm_weight, norm_bias, transform)
    store_checked_entries(pool, fmt, slots, x)
    if summaries is not None:
        update_summaries(pool, fmt, slots, summaries)


def store_checked_attention_kv(kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                               fmt: AttentionKVFormat, rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor,
                               rope_layout: RopeLayout, eps: float) -> None:
    """:func:`store_attention_kv` on inputs already checked (``dsakit.ops.store.AttentionKVStore``)."""
    x = _prepare_attention_kv(kv, positions, rope_cos_sin, norm_weight, rope_layout, eps)
    store_checked_entries(pool, fmt, slots, x)
