"""Reference (fp32, CPU) of DSA sparse attention with a shared K = V head and per-head attention sinks.

    for query t, head h, over its index set I_t (entries of indices[t] that are >= 0):
        s_j   = softmax_scale * q[t, h] . kv[j]                 j in I_t
        lse   = log(sum_j exp(s_j))                             (-inf if I_t is empty)
        denom = exp(lse) + exp(sink[h])                         (sink term only if sink is given)
        out[t, h] = sum_j exp(s_j) / denom * kv[j]              (the sink has no value: it only absorbs mass)

Returns (out fp32 [T, Hq, Dh], lse fp32 [T, Hq]); ``lse`` covers the selected entries only, so partial
results over disjoint index sets can be merged before the sink is applied. A row with no valid index
gives out = 0 and lse = -inf. Duplicate indices in a row count twice (the caller dedups).

V4 CSA layers attend to the last ``window`` raw tokens plus the top-k compressed entries:
:func:`window_topk_indices` builds that index set over the concatenation [raw kv ; compressed kv].
"""

from __future__ import annotations

import torch


def _describe(x) -> str:
    return f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor | None = None,
                     softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, Dh], kv [N, Dh] (shared K = V), indices int [T, I] (-1 ignored), sink [Hq] or None."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a floating [T, Hq, Dh] tensor, got {_describe(q)}")
    if not isinstance(kv, torch.Tensor) or not kv.is_floating_point():
        raise ValueError(f"kv must be a floating [N, Dh] tensor, got {_describe(kv)}")
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"indices must be an int [T, I] tensor, got {_describe(indices)}")
    t, hq, dh = q.shape
    if kv.dim() != 2 or kv.shape[1] != dh:
        raise ValueError(f"kv must be [N, {dh}], got {list(kv.shape)}")
    if indices.dim() != 2 or indices.shape[0] != t or indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices must be int [T={t}, I], got {indices.dtype} {list(indices.shape)}")
    n = kv.shape[0]
    idx = indices.detach().cpu().long()
    if idx.numel() and (bool((idx >= n).any()) or bool((idx < -1).any())):
        bad = idx[(idx >= n) | (idx < -1)][0]
        raise ValueError(f"index {int(bad)} out of range for kv of {n} entries (-1 = none)")
    if sink is not None and (not isinstance(sink, torch.Tensor) or sink.shape != (hq,)):
        raise ValueError(f"sink must be [Hq] = [{hq}], got {_describe(sink)}")
    scale = dh ** -0.5 if softmax_scale is None else float(softmax_scale)

    qf, kvf = q.detach().cpu().float(), kv.detach().cpu().float()
    valid = idx >= 0
    gathered = kvf[idx.clamp(min=0)] if n else torch.zeros(t, idx.shape[1], dh)  # [T, I, Dh]
    logits = torch.einsum("thd,tid->thi", qf, gathered) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [T, Hq], -inf for empty rows
    total = lse if sink is None else torch.logaddexp(lse, sink.detach().cpu().float().unsqueeze(0))
    probs = torch.exp(logits - total.unsqueeze(-1))
    probs = torch.nan_to_num(probs, nan=0.0)  # empty rows without a sink: -inf - -inf
    out = torch.einsum("thi,tid->thd", probs, gathered)
    return out, lse


def window_topk_indices(query_positions: torch.Tensor, topk_indices: torch.Tensor, window: int,
                        num_raw: int) -> torch.Tensor:
    """Index set [T, window + K] over [raw kv (num_raw rows) ; compressed kv]: the last ``window`` raw tokens
    up to each query's position, then the top-k compressed entries offset by ``num_raw``; -1 where none.

    query_positions int [T], topk_indices int [T, K] (-1 padded), window >= 0, num_raw >= 0."""
    if not isinstance(query_positions, torch.Tensor) or query_positions.dim() != 1 \
            or query_positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"query_positions must be an int32/int64 [T] tensor, got "
                         f"{_describe(query_positions)}")
    t = query_positions.shape[0]
    if not isinstance(topk_indices, torch.Tensor) or topk_indices.dim() != 2 or topk_indices.shape[0] != t \
            or topk_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_indices must be an int32/int64 [T={t}, K] tensor, got {_describe(topk_indices)}")
    for what, value in (("window", window), ("num_raw", num_raw)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    if topk_indices.numel() and bool((topk_indices < -1).any()):
        raise ValueError(f"topk_indices must be >= -1 (-1 = none), got {int(topk_indices.min())}")
    query_positions, topk_indices = query_positions.detach().cpu(), topk_indices.detach().cpu()
    pos = query_positions.long().unsqueeze(1)  # [T, 1]
    offsets = torch.arange(window - 1, -1, -1).unsqueeze(0)  # window-1 .. 0
    raw = pos - offsets
    raw = torch.where((raw >= 0) & (raw < num_raw), raw, torch.full_like(raw, -1))
    comp = topk_indices.long()
    comp = torch.where(comp >= 0, comp + num_raw, comp)
    return torch.cat([raw, comp], dim=1).to(torch.int32)
