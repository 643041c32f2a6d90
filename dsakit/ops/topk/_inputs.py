"""Input checks, launch arguments and buffer caching shared by the two select launchers (multi-pass radix
select in :mod:`dsakit.ops.topk.triton`, streaming select in :mod:`dsakit.ops.topk._select_stream`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from ..._memory import INDEX_DTYPES, check_bool, check_tensor


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
        return torch.full((t,), w, dtype=torch.int32, device=scores.device)
    check_tensor("row_counts", row_counts, shape=(t,), dtypes=INDEX_DTYPES, device=scores.device,
                 owner="scores", message=f"row_counts must be int [T] = [{t}]")
    if t and (bool((row_counts < 0).any()) or bool((row_counts > w).any())):
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
