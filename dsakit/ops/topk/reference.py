"""Reference (fp32, CPU) of the indexer top-k.

Rules (every kernel follows them):

* Candidates of a row are its entries with score > -inf (masked / invisible entries are never selected).
  NaN counts as a candidate ranking above every number, +inf included (the order ``torch.topk`` and a
  radix select over float bits give): a NaN-producing bug is visible as selected garbage, not hidden.
* The row's output holds the indices of its min(k, candidates) best entries in descending score order;
  equal scores go to the lower index first. The remaining columns are -1.
* Output int32 [T, k]; entry indices are within the query's sequence (0..entry_count-1).
"""

from __future__ import annotations

import torch

from ..._memory import INDEX_DTYPES, check_tensor
from ...batch import PagedBatch, check_k
from .config import MAX_K
from ..scores.reference import index_scores


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores fp32 [T, N] -> int32 [T, k] indices (rules above)."""
    check_tensor("scores", scores, dims=2, message="scores must be a [T, N] tensor")
    check_k(k, MAX_K)
    s = scores.detach().cpu().float()
    t, n = s.shape
    out = torch.full((t, k), -1, dtype=torch.int32)
    if n == 0 or t == 0:
        return out
    is_nan = torch.isnan(s)
    # Two stable passes: by score (NaN as +inf), then NaN first. Stability keeps lower indices first on ties.
    key = torch.where(is_nan, torch.full_like(s, float("inf")), s)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    nan_first = torch.sort(is_nan.gather(1, order).to(torch.int8), dim=1, descending=True, stable=True).indices
    order = order.gather(1, nan_first)
    candidates = (is_nan | (s > float("-inf"))).sum(dim=1)
    take = min(k, n)
    chosen = order[:, :take].to(torch.int32)
    keep = torch.arange(take).unsqueeze(0) < candidates.unsqueeze(1)
    out[:, :take] = torch.where(keep, chosen, torch.full_like(chosen, -1))
    return out


def index_topk(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int) -> torch.Tensor:
    """Top-k entries per query of a ragged batch against paged keys -> int32 [T, k] (-1 padded).

    Arguments as :func:`dsakit.ops.scores.reference.index_scores`. Materializes [T, N] (the reference may).
    """
    check_k(k, MAX_K)
    return select_topk(index_scores(q, weights, batch), k)


def topk_to_slots(indices: torch.Tensor, block_table: torch.Tensor, query_seq: torch.Tensor) -> torch.Tensor:
    """Entry indices int32 [T, K] (-1 padded) -> global slot ids int32 [T, K] (-1 kept) via the block table.

    An index >= 0 must fall in an assigned page of its query's block-table row (else ValueError: it would
    map to a bogus slot).
    """
    for what, t, dims in (("indices", indices, 2), ("block_table", block_table, 2), ("query_seq", query_seq, 1)):
        check_tensor(what, t, dims=dims, dtypes=INDEX_DTYPES, message=f"{what} must be a {dims}-D int32/int64 tensor")
    if query_seq.shape[0] != indices.shape[0]:
        raise ValueError(f"query_seq must be [T] = [{indices.shape[0]}], got {list(query_seq.shape)}")
    if query_seq.numel() and (int(query_seq.min()) < 0 or int(query_seq.max()) >= block_table.shape[0]):
        raise ValueError(f"query_seq values must be in 0..{block_table.shape[0] - 1}, got "
                         f"{int(query_seq.min())}..{int(query_seq.max())}")
    idx = indices.long()
    pages = block_table.long()[query_seq.long()]  # [T, max_pages]
    safe = idx.clamp(min=0)
    page_index = torch.div(safe, 64, rounding_mode="floor")
    beyond = (idx >= 0) & (page_index >= pages.shape[1])
    if bool(beyond.any()):
        raise ValueError(f"entry index {int(idx[beyond][0])} is beyond the block table width "
                         f"({pages.shape[1]} pages = {pages.shape[1] * 64} entries)")
    if pages.shape[1] == 0:  # no pages at all: every index is padding (checked above)
        return torch.full_like(idx, -1).to(torch.int32)
    page = pages.gather(1, page_index.clamp(max=pages.shape[1] - 1))
    unassigned = (idx >= 0) & (page < 0)
    if bool(unassigned.any()):
        raise ValueError(f"entry index {int(idx[unassigned][0])} falls in an unassigned page (-1) of its "
                         f"sequence's block table")
    slots = page * 64 + safe % 64
    return torch.where(idx >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)
