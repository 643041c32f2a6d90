"""Per-run metrics of the recall lab, computed from score rows and top-k index sets.

Ranking follows the top-k rules of :mod:`dsakit.ops.indexer.reference`: NaN ranks above every number,
then descending score, equal scores go to the lower index first; -inf (invisible) entries are never
candidates. So ``needle_rank(scores, needle) < k`` exactly when the reference top-k of that row holds a
needle entry.
"""

from __future__ import annotations

import math

import torch

from .._memory import check_tensor


def _row(scores: torch.Tensor, what: str = "scores") -> torch.Tensor:
    check_tensor(what, scores, dims=1, message=f"{what} must be a 1-D score row [N]")
    return scores.detach().cpu().float()


def _entries(needle_entries, n: int) -> torch.Tensor:
    idx = torch.as_tensor(needle_entries, dtype=torch.long).flatten().cpu()
    if idx.numel() == 0:
        raise ValueError("needle_entries is empty")
    if bool((idx < 0).any()) or bool((idx >= n).any()):
        raise ValueError(f"needle entries {idx.tolist()} outside 0..{n - 1}")
    return idx


def entries_ahead(scores: torch.Tensor, entry: int) -> int:
    """How many entries of the row [N] rank strictly ahead of ``entry`` under the top-k rules."""
    s = _row(scores)
    e = int(_entries([entry], s.numel())[0])
    mine = s[e]
    index = torch.arange(s.numel())
    nan = torch.isnan(s)
    if bool(torch.isnan(mine)):
        return int((nan & (index < e)).sum())
    ahead = nan | (s > mine) | ((s == mine) & (index < e))
    return int(ahead.sum())


def needle_rank(scores: torch.Tensor, needle_entries) -> int | None:
    """Rank (0 = first) of the best-placed needle entry in a score row [N]; None if no needle entry is visible."""
    s = _row(scores)
    idx = _entries(needle_entries, s.numel())
    visible = [int(e) for e in idx if not (bool(torch.isinf(s[e])) and float(s[e]) < 0)]
    if not visible:
        return None
    return min(entries_ahead(s, e) for e in visible)


def worst_rank_index(ranks: "list[int | None]") -> int | None:
    """Index of the worst needle rank in ``ranks`` (None if empty).

    A None rank (every needle entry scored -inf although visible: the needle was lost) is worse than any
    number; among equal ranks the first wins.
    """
    if not ranks:
        return None
    return max(range(len(ranks)), key=lambda i: math.inf if ranks[i] is None else ranks[i])


def topk_contains(topk_row: torch.Tensor, needle_entries) -> bool:
    """Whether a top-k index row [K] (-1 padded) holds any needle entry."""
    check_tensor("topk_row", topk_row, dims=1, message="topk_row must be a 1-D index row [K]")
    row = topk_row.detach().cpu().long()
    wanted = torch.as_tensor(needle_entries, dtype=torch.long).flatten().cpu()
    return bool(torch.isin(row[row >= 0], wanted).any())


def set_recall(topk: torch.Tensor, topk_exact: torch.Tensor) -> float:
    """Mean over rows of |topk ∩ topk_exact| / |topk_exact| for index sets [T, K] (-1 padded).

    A row whose exact set is empty (nothing visible) counts as 1.0 when the other set is empty too and 0.0
    otherwise.
    """
    if topk.dim() != 2 or topk_exact.dim() != 2 or topk.shape[0] != topk_exact.shape[0]:
        raise ValueError(f"top-k sets must be [T, K] with the same T, got {list(topk.shape)} and "
                         f"{list(topk_exact.shape)}")
    a_all, b_all = topk.detach().cpu().long(), topk_exact.detach().cpu().long()
    if a_all.shape[0] == 0:
        raise ValueError("set_recall needs at least one row")
    total = 0.0
    for a, b in zip(a_all, b_all):
        a, b = a[a >= 0], b[b >= 0]
        if b.numel() == 0:
            total += 1.0 if a.numel() == 0 else 0.0
        else:
            total += float(torch.isin(b, a).sum()) / b.numel()
    return total / a_all.shape[0]


def set_iou(topk: torch.Tensor, topk_other: torch.Tensor) -> list[float]:
    """Per row of two index sets [T, K] (-1 padded): |A ∩ B| / |A ∪ B| (1.0 where both are empty)."""
    if topk.dim() != 2 or topk_other.dim() != 2 or topk.shape[0] != topk_other.shape[0]:
        raise ValueError(f"top-k sets must be [T, K] with the same T, got {list(topk.shape)} and "
                         f"{list(topk_other.shape)}")
    out = []
    for a, b in zip(topk.detach().cpu().long(), topk_other.detach().cpu().long()):
        a, b = torch.unique(a[a >= 0]), torch.unique(b[b >= 0])
        union = torch.unique(torch.cat([a, b])).numel()
        out.append(1.0 if union == 0 else float(torch.isin(a, b).sum()) / union)
    return out


def score_margin(scores: torch.Tensor, needle_entries) -> float:
    """(best needle score - best other visible score) / std of the other visible scores.

    Positive = the needle leads; in units of the distractors' spread. NaN when a NaN score is involved or
    fewer than two other entries are visible; +inf when no other entry is visible.
    """
    s = _row(scores)
    idx = _entries(needle_entries, s.numel())
    mask = torch.ones(s.numel(), dtype=torch.bool)
    mask[idx] = False
    others = s[mask]
    needle = s[idx]
    if bool(torch.isnan(needle).any()) or bool(torch.isnan(others).any()):
        return math.nan
    best_needle = float(needle.max())
    if best_needle == -math.inf:
        return math.nan
    others = others[others > -math.inf]
    if others.numel() == 0:
        return math.inf
    if others.numel() < 2:
        return math.nan
    spread = float(others.std())
    gap = best_needle - float(others.max())
    if spread == 0.0:
        return math.inf if gap > 0 else (-math.inf if gap < 0 else 0.0)
    return gap / spread


def nan_fraction(scores: torch.Tensor) -> float:
    """Fraction of the row's non-masked (not -inf) entries whose score is NaN."""
    s = _row(scores)
    candidates = torch.isnan(s) | (s > -math.inf)
    count = int(candidates.sum())
    return 0.0 if count == 0 else float(torch.isnan(s).sum()) / count


def future_selected(topk: torch.Tensor, visible_counts: torch.Tensor) -> int:
    """Number of selected indices [T, K] that are >= the row's correct visible count [T] (causality leaks)."""
    if topk.dim() != 2 or visible_counts.shape != (topk.shape[0],):
        raise ValueError(f"need topk [T, K] and visible_counts [T] with the same T, got {list(topk.shape)} and "
                         f"{list(visible_counts.shape)}")  # a [1] count would silently broadcast to every row
    idx = topk.detach().cpu().long()
    limit = visible_counts.detach().cpu().long().reshape(-1, 1)
    return int(((idx >= 0) & (idx >= limit)).sum())


def needle_score_ratio(scores: torch.Tensor, scores_exact: torch.Tensor, needle_entries) -> float:
    """Best needle score of a row relative to its exact score (1.0 = same scale; NaN if either is not finite).

    The needle's score is the one large, signal-dominated score of the row, so this ratio shows a global
    rescaling of the scores (halved by an fp8 exponent-bias mix-up, inflated by a forgotten key scale) without
    the relu noise that moves the small scores.
    """
    a, b = _row(scores), _row(scores_exact, "scores_exact")
    idx = _entries(needle_entries, a.numel())
    num, den = float(a[idx].max()), float(b[idx].max())
    if not (math.isfinite(num) and math.isfinite(den)) or den == 0.0:
        return math.nan
    return num / den
