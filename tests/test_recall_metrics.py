"""Recall-lab metrics on hand-made score rows: needle placed at a known rank."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsakit.ops.indexer import select_topk
from dsakit.recall import metrics


def _row_with_needle_at(rank: int, n: int = 20, needle: int = 7) -> torch.Tensor:
    """Scores 0..n-1 descending by index except the needle, which gets exactly `rank` entries above it."""
    others = [i for i in range(n) if i != needle]
    scores = torch.empty(n)
    for position, entry in enumerate(others):
        scores[entry] = float(n - position)  # strictly descending, all > 0
    scores[needle] = float(n - rank) + 0.5  # between the rank-1-th and rank-th other entry
    return scores


@pytest.mark.parametrize("rank", [0, 1, 5, 18])
def test_needle_rank_known_position(rank):
    scores = _row_with_needle_at(rank)
    assert metrics.needle_rank(scores, [7]) == rank
    for k in sorted({1, max(rank, 1), rank + 1, 19}):
        top = select_topk(scores.unsqueeze(0), k)
        assert metrics.topk_contains(top[0], [7]) == (rank < k)


def test_needle_rank_best_of_several_entries_and_invisible():
    scores = _row_with_needle_at(6)
    scores[3] = 100.0  # second needle entry, best of all
    assert metrics.needle_rank(scores, [7, 3]) == 0
    hidden = scores.clone()
    hidden[3] = float("-inf")
    hidden[7] = float("-inf")
    assert metrics.needle_rank(hidden, [7, 3]) is None


def test_needle_rank_tie_rule_and_nan_first():
    scores = torch.tensor([1.0, 2.0, 2.0, 0.5])
    assert metrics.needle_rank(scores, [2]) == 1  # tie with entry 1: the lower index goes first
    assert metrics.needle_rank(scores, [1]) == 0
    with_nan = torch.tensor([1.0, float("nan"), 3.0, 0.5])
    assert metrics.needle_rank(with_nan, [2]) == 1  # NaN ranks above every number
    assert metrics.needle_rank(with_nan, [1]) == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=2, max_size=30), st.integers(0, 29), st.integers(1, 30))
def test_rank_agrees_with_select_topk(values, needle, k):
    """rank < k exactly when the reference top-k holds the needle (ties included)."""
    scores = torch.tensor(values, dtype=torch.float32)
    needle = needle % len(values)
    top = select_topk(scores.unsqueeze(0), k)[0]
    assert (metrics.needle_rank(scores, [needle]) < k) == metrics.topk_contains(top, [needle])


def test_set_recall_hand_made():
    exact = torch.tensor([[0, 1, 2, 3], [4, 5, -1, -1]])
    fmt = torch.tensor([[0, 1, 9, 8], [5, 4, -1, -1]])
    assert metrics.set_recall(fmt, exact) == pytest.approx((2 / 4 + 2 / 2) / 2)
    assert metrics.set_recall(exact, exact) == 1.0
    empty = torch.full((1, 3), -1)
    assert metrics.set_recall(empty, empty) == 1.0
    assert metrics.set_recall(torch.tensor([[1, -1, -1]]), empty) == 0.0
    with pytest.raises(ValueError, match="same T"):
        metrics.set_recall(fmt, exact[:1])


def test_score_margin_units_of_distractor_spread():
    others = torch.tensor([0.0, 1.0, 2.0, 3.0])  # std = 1.2910
    scores = torch.cat([others, torch.tensor([5.0])])
    assert metrics.score_margin(scores, [4]) == pytest.approx((5.0 - 3.0) / float(others.std()))
    below = torch.cat([others, torch.tensor([1.5])])
    assert metrics.score_margin(below, [4]) < 0
    assert math.isnan(metrics.score_margin(torch.tensor([0.0, float("nan"), 1.0]), [2]))
    assert metrics.score_margin(torch.tensor([float("-inf"), float("-inf"), 1.0]), [2]) == math.inf


def test_nan_fraction_future_selected_and_score_ratio():
    row = torch.tensor([1.0, float("nan"), float("-inf"), 2.0])
    assert metrics.nan_fraction(row) == pytest.approx(1 / 3)
    top = torch.tensor([[0, 3, 5], [1, -1, -1]])
    assert metrics.future_selected(top, torch.tensor([4, 1])) == 2  # 5 >= 4 in row 0, 1 >= 1 in row 1
    with pytest.raises(ValueError, match="same T"):  # one count must not silently apply to every row
        metrics.future_selected(top, torch.tensor([4]))
    with pytest.raises(ValueError, match="1-D"):  # a [T, K] set is not one row: flattening it mixed rows
        metrics.topk_contains(top, [5])
    exact = torch.tensor([1.0, 0.0, 4.0])
    assert metrics.needle_score_ratio(exact / 2, exact, [2]) == pytest.approx(0.5)
    assert math.isnan(metrics.needle_score_ratio(torch.tensor([1.0, 0.0, float("nan")]), exact, [2]))


def test_metric_inputs_are_validated():
    with pytest.raises(ValueError, match="1-D"):
        metrics.needle_rank(torch.zeros(2, 3), [0])
    with pytest.raises(ValueError, match="outside"):
        metrics.needle_rank(torch.zeros(3), [3])
    with pytest.raises(ValueError, match="empty"):
        metrics.score_margin(torch.zeros(3), [])


def test_worst_rank_index_counts_a_lost_needle_as_worst():
    # run_captured reports the worst visible row; a row whose needle scored -inf (rank None) lost it
    assert metrics.worst_rank_index([3, None, 7]) == 1
    assert metrics.worst_rank_index([3, 9, 7, 9]) == 1
    assert metrics.worst_rank_index([0]) == 0
    assert metrics.worst_rank_index([]) is None
