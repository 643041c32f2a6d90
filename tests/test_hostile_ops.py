"""Bad input against the public ops and the cache: refused alike by both backends, bounded, never corrupting."""

from __future__ import annotations

import math

import pytest
import torch

from dsakit.ops.attention.reference import sparse_attention_dense, window_topk_indices
from dsakit.presets import KeyTransform


# -- bounds ----------------------------------------------------------------------------------------

def _naive_window(positions, topk, window, num_raw):
    rows = []
    for t, p in enumerate(positions.tolist()):
        raw = sorted(s for s in range(p - window + 1, p + 1) if 0 <= s < num_raw)
        comp = sorted(j + num_raw for j in topk[t].tolist() if j >= 0)
        rows.append((raw, comp))
    return rows


@pytest.mark.parametrize("window", [3, 10, 11, 10 ** 9])
def test_window_longer_than_the_raw_kv_is_clamped_to_the_same_index_set(window):
    positions = torch.tensor([0, 4, 9, 12, -1])
    topk = torch.tensor([[-1, -1], [0, -1], [1, 0], [2, 1], [-1, -1]])
    got = window_topk_indices(positions, topk, window, 10)  # 10**9 used to allocate [T, 10**9] and die
    assert got.shape == (5, min(window, 10) + 2) and got.dtype == torch.int32
    for row, (raw, comp) in zip(got.tolist(), _naive_window(positions, topk, window, 10)):
        assert sorted(j for j in row[:-2] if j >= 0) == raw
        assert sorted(j for j in row[-2:] if j >= 0) == comp
    assert window_topk_indices(positions, topk, 10 ** 9, 0).shape == (5, 2)


# -- numerical edges -------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0, 0.0, "0.1", True])
def test_dense_attention_refuses_a_bad_softmax_scale(scale):
    q, kv = torch.randn(1, 2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="softmax_scale"):
        sparse_attention_dense(q, kv, torch.tensor([[0, 1]]), softmax_scale=scale)


@pytest.mark.parametrize("eps", [math.inf, math.nan, -1e-6, "1e-6", None, True])
def test_key_transform_refuses_a_bad_eps(eps):
    with pytest.raises(ValueError, match="eps"):
        KeyTransform(eps=eps)
    assert KeyTransform(eps=0).eps == 0 and KeyTransform(eps=1e-5).eps == 1e-5
