"""Reference (fp32, CPU) of DSA sparse attention with a shared K = V head and per-head attention sinks.

    for query t, head h, over its index set I_t (valid entries of indices[t], then of extra_indices[t]):
        kv[j] = dequantize(pool bytes of slot j)                  fp32 [D], D = 512
        s_j   = softmax_scale * q[t, h] . kv[j]                   j in I_t
        lse   = log(sum_j exp(s_j))                               (-inf if I_t is empty)
        denom = exp(lse) + exp(sink[h])                           (sink term only if sink is given)
        out[t, h] = sum_j exp(s_j) / denom * kv[j]                (the sink has no value: it only absorbs mass)

Non-finite inputs propagate as IEEE arithmetic makes them, never hidden (the kernel's online softmax gives
the same): a NaN score s_j (a NaN in q[t, h] or in a gathered kv row, Inf * 0, Inf - Inf) or a +inf score (an
infinite q or kv, a product overflowing fp32) makes out[t, h] and lse[t, h] NaN; a NaN sink[h] makes
out[t, h] NaN (lse excludes the sink); a score of -inf only weighs 0; a row with no valid index stays out = 0,
lse = -inf whatever q holds (a NaN sink still makes its out NaN).
The kernel multiplies q in bf16, so an fp32 q value beyond the bf16 range (it rounds to +-Inf) counts as
+-Inf here too (:func:`sparse_attention`; :func:`sparse_attention_dense` keeps fp32 q as given).

Index j = indices[t, i] is valid iff i < topk_length[t] (when given) and 0 <= j < num_slots of its pool
(P * 64); anything else (-1 padding, an out-of-range slot) is skipped, never read. The Triton kernel applies
the same rule, so out-of-range slots need no host-side check on the hot path. A row with no valid index gives
out = 0 and lse = -inf. Duplicate indices in a row count twice (the caller dedups).

Returns (out fp32 [T, Hq, D], lse fp32 [T, Hq]); ``lse`` covers the selected entries only (sink excluded), so
partial results over disjoint index sets can be merged before the sink is applied.

Two entry points:

* :func:`sparse_attention` takes paged KV pools (uint8 [P, page_bytes] in an :class:`AttentionKVFormat`) and
  global slots ``page * 64 + offset``, plus an optional second pool with its own index set (V4: the raw
  sliding window in one pool, the compressed entries in the other). It is the contract the kernel implements.
* :func:`sparse_attention_dense` takes a dense fp32 kv [N, D] and indices into it (tests, and the conformance
  check against transformers' eager attention). :func:`window_topk_indices` builds the V4 index set over the
  concatenation [raw kv ; compressed kv] for it.
"""

from __future__ import annotations

import torch

from ..._memory import INDEX_DTYPES, check_int, check_tensor
from ...pool import num_slots
from ...formats import AttentionKVFormat
from .inputs import check_softmax_scale, check_sparse_attention_inputs

__all__ = ["sparse_attention", "sparse_attention_dense", "window_topk_indices"]


# --------------------------------------------------------------------------------------------------
# Reference math
# --------------------------------------------------------------------------------------------------


def _attend(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor | None,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q [T, Hq, D], gathered kv [T, I, D], valid bool [T, I], sink [Hq] | None -> (out, lse)."""
    logits = torch.einsum("thd,tid->thi", q, kv) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [T, Hq], -inf for empty rows
    # a +inf score has no softmax (inf / inf): NaN, not the +inf torch.logsumexp reports (see the docstring)
    lse = lse.masked_fill(torch.isposinf(lse), float("nan"))
    total = lse if sink is None else torch.logaddexp(lse, sink.unsqueeze(0))
    probs = torch.exp(logits - total.unsqueeze(-1))
    # no mass at all (no valid entry or every score -inf, sink absent or -inf): out = 0, the only case where
    # exp(-inf - -inf) = NaN is replaced; every other NaN (from a NaN or infinite q, kv or sink) stays
    probs = probs.masked_fill(torch.isneginf(total).unsqueeze(-1), 0.0)
    out = torch.einsum("thi,tid->thd", probs, kv)
    return out, lse


def gather_entries(pool: torch.Tensor, fmt: AttentionKVFormat, indices: torch.Tensor,
                   length: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized entries of the index set: (kv fp32 [T, I, D] (0 where invalid), valid bool [T, I]).

    pool uint8 [P, page_bytes], indices int [T, I] (global slots), length int [T] | None (valid prefix)."""
    idx = indices.detach().cpu().long()
    t, k = idx.shape
    valid = (idx >= 0) & (idx < num_slots(pool))
    if length is not None:
        valid &= torch.arange(k).unsqueeze(0) < length.detach().cpu().long().unsqueeze(1)
    # each distinct slot is dequantized once (a prefill's windows name every slot up to 128 times), then one
    # gather lays the rows out; row `len(slots)` is the zero row of the invalid positions
    slots, where = torch.unique(idx[valid], return_inverse=True)
    value_start, scale_start = fmt.byte_offsets(slots)
    flat = pool.detach().cpu().reshape(-1)
    values = flat[value_start.unsqueeze(1) + torch.arange(fmt.value_bytes)]
    scales = flat[scale_start.unsqueeze(1) + torch.arange(fmt.scale_bytes)]
    rows = torch.cat([fmt.dequantize(values, scales), torch.zeros(1, fmt.head_dim)])
    pick = torch.full((t, k), len(slots), dtype=torch.long)
    pick[valid] = where
    return rows[pick], valid


def sparse_attention(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, *,
                     kv_format: "AttentionKVFormat | str", topk_length: torch.Tensor | None = None,
                     extra_kv_cache: torch.Tensor | None = None,
                     extra_kv_format: "AttentionKVFormat | str | None" = None,
                     extra_indices: torch.Tensor | None = None, extra_topk_length: torch.Tensor | None = None,
                     sink: torch.Tensor | None = None,
                     softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention over paged KV pools (the spec; see the module docstring).

    q [T, Hq, 512] float; kv_cache uint8 [P, page_bytes] in ``kv_format``; indices int32 [T, K] global slots
    (-1 = skip); topk_length int32 [T] | None; extra_kv_cache uint8 [P', page_bytes'] in ``extra_kv_format``
    (default: kv_format) with extra_indices int32 [T, K'] and extra_topk_length int32 [T] | None; sink [Hq] |
    None; softmax_scale default 512 ** -0.5. -> (out fp32 [T, Hq, 512] on the CPU, lse fp32 [T, Hq])."""
    a = check_sparse_attention_inputs(q, kv_cache, indices, kv_format=kv_format, topk_length=topk_length,
                                      extra_kv_cache=extra_kv_cache, extra_kv_format=extra_kv_format,
                                      extra_indices=extra_indices, extra_topk_length=extra_topk_length, sink=sink,
                                      softmax_scale=softmax_scale)
    kv, valid = gather_entries(a.kv_cache, a.kv_format, a.indices, a.topk_length)
    if a.extra_kv_cache is not None:
        xkv, xvalid = gather_entries(a.extra_kv_cache, a.extra_kv_format, a.extra_indices, a.extra_topk_length)
        kv, valid = torch.cat([kv, xkv], dim=1), torch.cat([valid, xvalid], dim=1)
    sink_f = None if a.sink is None else a.sink.detach().cpu().float()
    return _attend(_bf16_range(q.detach().cpu().float()), kv, valid, sink_f, a.softmax_scale)


def _bf16_range(q: torch.Tensor) -> torch.Tensor:
    """fp32 q with every finite value that bf16 cannot hold (it rounds to +-Inf, |q| >= 2^128 (1 - 2^-9)) made
    +-Inf: the kernel multiplies q in bf16, so such a q is an infinite input there (see the module docstring)."""
    overflow = torch.isfinite(q) & torch.isinf(q.to(torch.bfloat16))
    return torch.where(overflow, q.sign() * float("inf"), q) if bool(overflow.any()) else q


def sparse_attention_dense(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor | None = None,
                           softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense variant: q [T, Hq, Dh], kv [N, Dh] (shared K = V), indices int [T, I] into kv (-1 ignored; any
    other value outside [0, N) is a ValueError), sink [Hq] or None -> (out fp32 [T, Hq, Dh], lse fp32 [T, Hq])."""
    check_tensor("q", q, dims=3, floating=True, message="q must be a floating [T, Hq, Dh] tensor")
    t, hq, dh = q.shape
    check_tensor("kv", kv, shape=(None, dh), floating=True, message=f"kv must be a floating [N, Dh] = [N, {dh}] tensor")
    check_tensor("indices", indices, shape=(t, None), dtypes=INDEX_DTYPES, message=f"indices must be int [T={t}, I]")
    n = kv.shape[0]
    idx = indices.detach().cpu().long()
    if idx.numel() and (bool((idx >= n).any()) or bool((idx < -1).any())):
        bad = idx[(idx >= n) | (idx < -1)][0]
        raise ValueError(f"index {int(bad)} out of range for kv of {n} entries (-1 = none)")
    if sink is not None:
        check_tensor("sink", sink, shape=(hq,), message=f"sink must be [Hq] = [{hq}]")
    scale = dh ** -0.5 if softmax_scale is None else check_softmax_scale(softmax_scale)
    kvf = kv.detach().cpu().float()
    valid = idx >= 0
    gathered = kvf[idx.clamp(min=0)] if n else torch.zeros(t, idx.shape[1], dh)  # [T, I, Dh]
    sink_f = None if sink is None else sink.detach().cpu().float()
    return _attend(q.detach().cpu().float(), gathered, valid, sink_f, scale)


def window_topk_indices(query_positions: torch.Tensor, topk_indices: torch.Tensor, window: int,
                        num_raw: int) -> torch.Tensor:
    """Index set [T, W + K] over [raw kv (num_raw rows) ; compressed kv]: the last ``window`` raw tokens
    up to each query's position, then the top-k compressed entries offset by ``num_raw``; -1 where none.

    query_positions int [T], topk_indices int [T, K] (-1 padded), window >= 0, num_raw >= 0.
    W = min(window, num_raw): no query sees more raw rows than there are, so a longer window gives the same
    index set in num_raw columns (ending at the last raw row a query sees) instead of a [T, window] buffer."""
    check_tensor("query_positions", query_positions, dims=1, dtypes=INDEX_DTYPES,
                 message="query_positions must be an int32/int64 [T] tensor")
    t = query_positions.shape[0]
    check_tensor("topk_indices", topk_indices, shape=(t, None), dtypes=INDEX_DTYPES,
                 message=f"topk_indices must be an int32/int64 [T={t}, K] tensor")
    for what, value in (("window", window), ("num_raw", num_raw)):
        check_int(what, value, 0, message=f"{what} must be a non-negative int")
    if topk_indices.numel() and bool((topk_indices < -1).any()):
        raise ValueError(f"topk_indices must be >= -1 (-1 = none), got {int(topk_indices.min())}")
    query_positions, topk_indices = query_positions.detach().cpu(), topk_indices.detach().cpu()
    pos = query_positions.long().unsqueeze(1)  # [T, 1]
    width = min(window, num_raw)
    # the window ends at the query's position; clamped, at the last raw row it can see (same valid rows)
    last = pos if width == window else pos.clamp(max=num_raw - 1)
    offsets = torch.arange(width - 1, -1, -1).unsqueeze(0)  # width-1 .. 0
    raw = last - offsets
    raw = torch.where((raw >= 0) & (raw < num_raw) & (raw > pos - window), raw, torch.full_like(raw, -1))
    comp = topk_indices.long()
    comp = torch.where(comp >= 0, comp + num_raw, comp)
    return torch.cat([raw, comp], dim=1).to(torch.int32)
