"""Input checks of the indexer's launchers, and the launch arguments and buffer caching they share: q /
weights / q_scale against a batch (scores, fused top-k, decode), a scores matrix (select), decode rows
([B * next_n, H] or [B, next_n, H])."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from ..._memory import INDEX_DTYPES, check_bool, check_tensor
from ...batch import PagedBatch, check_batch_queries, check_same_device


def lru_get(cache: OrderedDict, key, kept: int, make: Callable[[], object]):
    """cache[key], made with make() on a miss; the ``kept`` most recently used entries stay (so a
    long-running process that sees many shapes keeps only the latest few)."""
    found = cache.get(key)
    if found is None:
        found = make()
        cache[key] = found
        while len(cache) > kept:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return found


# Buffers reused across calls, keyed by (role, device, shape, dtype); bounded so that a long-running process
# that sees many shapes keeps only the latest few.
_BUFFERS: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_BUFFERS_KEPT = 12


def cached_buffer(role: str, shape: tuple, dtype: torch.dtype, device: torch.device,
                  make: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """A reusable buffer for ``role`` (allocated once per shape and device): uninitialized, or ``make()``'s
    tensor (for a constant buffer; its role and shape must then name its contents)."""
    return lru_get(_BUFFERS, (role, device, shape, dtype), _BUFFERS_KEPT,
                   make or (lambda: torch.empty(shape, dtype=dtype, device=device)))


def check_scores_matrix(scores, sort=False) -> None:
    """scores must be an fp32 [T, W] tensor with unit stride along W (the selects read rows as vectors), and
    ``sort`` a bool, else ValueError."""
    check_tensor("scores", scores, dims=2, dtypes=torch.float32, message="scores must be an fp32 [T, W] tensor")
    if scores.shape[1] > 1 and scores.stride(1) != 1:
        raise ValueError(f"scores must have unit stride along W, got strides {scores.stride()}")
    check_bool("sort", sort)


def row_counts_int32(scores: torch.Tensor, row_counts: torch.Tensor | None) -> torch.Tensor:
    """Entries each row of scores [T, W] considers, int32 [T]: W everywhere when row_counts is None, else
    row_counts checked (int [T] on the scores' device, values in 0..W: one sync)."""
    t, w = scores.shape
    if row_counts is None:
        # every row's full width: one constant buffer per (T, W), never written by a kernel
        device = scores.device
        return cached_buffer(f"row_counts={w}", (t,), torch.int32, device,
                             lambda: torch.full((t,), w, dtype=torch.int32, device=device))
    check_tensor("row_counts", row_counts, shape=(t,), dtypes=INDEX_DTYPES, device=scores.device,
                 owner="scores", message=f"row_counts must be int [T] = [{t}]")
    if t and bool(((row_counts < 0) | (row_counts > w)).any()):  # one sync for both bounds
        raise ValueError(f"row_counts must be in 0..{w} (the scores width), got range "
                         f"{int(row_counts.min())}..{int(row_counts.max())}")
    return row_counts.to(torch.int32).contiguous()


def slot_args(out: torch.Tensor, counts: torch.Tensor, slots: torch.Tensor | None, seq: torch.Tensor | None,
              block_table: torch.Tensor | None) -> tuple:
    """The (slots_ptr, stride_slots, seq_ptr, table_ptr, stride_table) kernel arguments of a select that
    also maps its indices to global slots; without slots, placeholders that the kernels never read
    (WITH_SLOTS = False)."""
    if slots is None:
        return out, 0, counts, counts, 0
    return slots, slots.stride(0), seq, block_table, block_table.stride(0)


def check_q_inputs(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, q_scale: torch.Tensor | None) -> None:
    """q / weights / q_scale against the batch: shapes, dtypes (q in batch.QUERY_DTYPES, weights in
    batch.WEIGHT_DTYPES: :func:`dsakit.batch.check_batch_queries`, shared with the reference), devices (no sync)."""
    check_batch_queries(q, weights, batch)
    t, num_heads, _ = q.shape
    if q_scale is not None:
        check_tensor("q_scale", q_scale, shape=(t, num_heads), dtypes=torch.float32,
                     message=f"q_scale must be fp32 [T, H] = [{t}, {num_heads}]")
    check_same_device(batch.device, q=q, weights=weights, q_scale=q_scale)


def check_q_scale_values(q_scale: torch.Tensor | None) -> None:
    """q_scale > 0 everywhere (one sync; only paid by callers that pass a q_scale)."""
    if q_scale is not None and q_scale.numel() and not bool((q_scale > 0).all()):
        raise ValueError("q_scale must be > 0 everywhere (it is moved through the relu: relu(c x) = c relu(x))")


def decode_rows(name: str, x, b: int, next_n: int, h: int) -> torch.Tensor | None:
    """A per-head decode input (weights, q_scale) given as [B * next_n, H] or [B, next_n, H] -> [B * next_n, H]
    (None stays None), else ValueError."""
    if x is None and name == "q_scale":
        return None
    check_tensor(name, x)
    if x.shape not in ((b * next_n, h), (b, next_n, h)):
        raise ValueError(f"{name} must be [B * next_n, H] = [{b * next_n}, {h}] or [B, next_n, H], "
                         f"got {list(x.shape)}")
    return x.reshape(b * next_n, h)
