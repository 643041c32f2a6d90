"""Streaming exact top-k (dsakit.ops.topk._select_stream) against the reference ``select_topk``.

The select is exact, so on identical scores it must reproduce the reference bit for bit: same sets, same
order, same -1 padding. Tiny launch configurations (32-entry buffers and samples, 64-entry tiles) make rows
of a few hundred entries take every path: the candidate buffer, the tie lists (rows made mostly of exact
zeros), and the exact whole-row fallback when the sampled threshold misjudges a row; ``path_counts``
checks that each path really ran.
"""

from __future__ import annotations

import pytest
import torch

from dsakit.ops.topk.reference import select_topk as reference_select

TINY = dict(cap=64, lanes=4, v=8, tie_cap=16, sample=32, num_warps=4, final_warps=4, order_warps=4, bins=32)


def _config(splits: int = 1):
    from dsakit.ops.topk._select_stream import StreamConfig

    return StreamConfig(splits=splits, **TINY)


def _run(scores, k, splits=1, **kw):
    from dsakit.ops.topk._select_stream import SelectBuffers, select_topk_stream

    buffers = SelectBuffers.allocate(scores.shape[0], scores.shape[1], k, scores.device,
                                     _config(splits))
    return select_topk_stream(scores, k, buffers=buffers, **kw), buffers.path_counts(scores.shape[0])


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rows(n: int) -> torch.Tensor:
    """One row per rule: randn, ties at the k-th score, NaN / +-inf / -0.0, masked, shifted by +100, relu
    zeros (the top-k needs zeros: lowest indices win), only 3 candidates, rising (top entries at the end)."""
    s = torch.randn(8, n)
    s[0, 3: n // 2] = 1.25
    s[1, ::3] = float("-inf")
    s[1, 5], s[1, 7], s[1, 13] = float("nan"), float("inf"), float("nan")
    s[1, 9], s[1, 11] = -0.0, 0.0
    s[2] += 100.0
    s[3] = torch.relu(torch.randn(n) - 2.0)
    s[4] = 0.0
    s[5] = float("-inf")
    s[5, n - 3:] = torch.tensor([2.0, -1.0, 2.0])
    s[6] = torch.randn(n) + torch.linspace(0, 8, n)
    s[7] = torch.where(torch.rand(n) < 0.5, 0.0, -torch.rand(n))  # half zeros, rest negative
    return s


@pytest.mark.parametrize("splits", [1, 2])
def test_stream_select_equals_reference(triton_backend, splits):
    scores = _rows(256).to(_device())
    got, paths = _run(scores, 12, splits)
    assert torch.equal(got.cpu(), reference_select(scores.cpu(), 12))
    # every path ran: buffer (randn-like rows), tie lists (zeros), exact fallback (ties / few candidates)
    assert paths["buffer"] > 0 and paths["ties"] > 0 and paths["exact"] > 0, paths


def test_stream_select_counts_unsorted_and_deterministic(triton_backend):
    scores = _rows(200).to(_device())
    counts = torch.tensor([200, 150, 7, 0, 33, 200, 199, 64], dtype=torch.int32, device=scores.device)
    got, _ = _run(scores, 40, row_counts=counts)
    masked = scores.cpu().clone()
    for row, c in enumerate(counts.tolist()):
        masked[row, c:] = float("-inf")
    expected = reference_select(masked, 40)  # k > visible entries in several rows: -1 padding
    assert torch.equal(got.cpu(), expected)
    unsorted, _ = _run(scores, 40, row_counts=counts, sort=False)
    again, _ = _run(scores, 40, row_counts=counts, sort=False)
    assert torch.equal(unsorted, again)  # bitwise deterministic without the sort too
    assert torch.equal(torch.sort(unsorted.cpu(), dim=1).values, torch.sort(expected, dim=1).values)


def test_relu_zero_rows_same_set_on_every_backend(triton_backend):
    """Rows made mostly of exact zeros: every run and every backend selects the reference's set (the
    positive entries, then the lowest-index zeros), in the same order."""
    from dsakit.ops.topk import select_topk
    from dsakit.ops.topk.config import SelectConfig
    from dsakit.ops.topk.triton import select_topk_triton

    torch.manual_seed(3)
    scores = torch.relu(torch.randn(4, 300) - 1.8).to(_device())
    expected = reference_select(scores.cpu(), 48)
    first, paths = _run(scores, 48)
    second, _ = _run(scores, 48)
    assert paths["ties"] > 0
    assert torch.equal(first, second)
    assert torch.equal(first.cpu(), expected)
    multipass = SelectConfig(block=64, cap=32, bins=32, algorithm="multipass")
    assert torch.equal(select_topk_triton(scores, 48, config=multipass).cpu(), expected)
    assert torch.equal(select_topk(scores, 48, backend="triton").cpu(), expected)  # default: streaming select
    assert torch.equal(select_topk(scores.cpu(), 48, backend="reference"), expected)


def test_stream_select_rejects_bad_input(triton_backend):
    from dsakit.ops.topk._select_stream import STREAM_MAX_K, StreamConfig, select_topk_stream

    scores = torch.randn(2, 64, device=_device())
    with pytest.raises(ValueError, match="k must be"):
        select_topk_stream(scores, 0)
    with pytest.raises(ValueError, match="k must be"):
        select_topk_stream(scores, STREAM_MAX_K + 1)
    with pytest.raises(ValueError, match="fp32"):
        select_topk_stream(scores.double(), 4)
    with pytest.raises(ValueError, match="row_counts"):
        select_topk_stream(scores, 4, row_counts=torch.tensor([65, 1], device=scores.device))
    with pytest.raises(ValueError, match="power of two"):
        select_topk_stream(scores, 4, config=StreamConfig(splits=3, **TINY))


def test_default_config_tie_lists_reach_the_second_tile():
    """Every lane's tie list reaches its second tile (tie_cap >= 2 v), so a relu row of zeros is completed
    from the tie lists instead of the exact whole-row passes; every lane holds >= 32 candidates."""
    from dsakit.ops.topk._select_stream import StreamConfig

    for rows, width, k in [(64, 131072, 2048), (256, 131072, 2048), (64, 65536, 512), (8192, 65536, 2048)]:
        cfg = StreamConfig.default(rows, width, k)
        cfg.validate()
        assert cfg.lane_cap >= 32 and cfg.tie_cap >= 2 * cfg.v, cfg


def test_cached_launch_in_row_slices(triton_backend):
    """A cached-buffer launch bounded to a few rows selects in consecutive row slices: same result."""
    from dsakit.ops.topk._select_stream import launch_stream_select_cached, release_select_buffers

    scores = _rows(96).to(_device())
    counts = torch.tensor([96, 50, 96, 96, 3, 96, 96, 96], dtype=torch.int32, device=scores.device)
    out = torch.empty((8, 5), dtype=torch.int32, device=scores.device)
    release_select_buffers()
    launch_stream_select_cached(scores, counts, out, 5, True, budget=1)  # one row per launch
    masked = scores.cpu().clone()
    for row, c in enumerate(counts.tolist()):
        masked[row, c:] = float("-inf")
    assert torch.equal(out.cpu(), reference_select(masked, 5))


# Rank order with small blocks: several programs per row (cdiv(k, 16)) and several compare chunks per
# program, so block edges, partial blocks and padding-only programs all run.
RANK = dict(rank_order=True, rank_block_i=16, rank_block_j=16, rank_warps=4)


def _run_order(scores, k, splits, rank, counts=None, slot_map=None):
    """Sorted select of scores through launch_stream_select with the rank order (rank=True) or the bitonic
    order; slot_map (seq, block_table): also returns the global slots."""
    import dataclasses

    from dsakit.ops.topk._select_stream import SelectBuffers, launch_stream_select

    rows, width = scores.shape
    config = dataclasses.replace(_config(splits), **(RANK if rank else {}))
    buffers = SelectBuffers.allocate(rows, width, k, scores.device, config)
    if counts is None:
        counts = torch.full((rows,), width, dtype=torch.int32, device=scores.device)
    out = torch.full((rows, k), 7, dtype=torch.int32, device=scores.device)  # 7: columns never written show
    slots = None
    if slot_map is not None:
        slots = torch.full((rows, k), 7, dtype=torch.int32, device=scores.device)
    launch_stream_select(scores, counts, out, k, True, buffers, slots=slots,
                         seq=None if slot_map is None else slot_map[0],
                         block_table=None if slot_map is None else slot_map[1])
    return out.cpu(), None if slots is None else slots.cpu()


@pytest.mark.parametrize("splits, k", [(1, 40), (2, 23)])
def test_rank_order_equals_bitonic_and_reference(triton_backend, splits, k):
    """Random rows, many equal keys (ties at the k-th score, relu zeros: lower index first), NaN / +inf /
    -0.0, rows with fewer candidates than k (-1 padding), k not a power of two: the rank order is the
    bitonic order and the reference, bit for bit."""
    torch.manual_seed(11)
    scores = _rows(256).to(_device())
    expected = reference_select(scores.cpu(), k)
    ranked, _ = _run_order(scores, k, splits, rank=True)
    bitonic, _ = _run_order(scores, k, splits, rank=False)
    assert torch.equal(ranked, expected)
    assert torch.equal(ranked, bitonic)
    assert (expected[5] == -1).sum() == k - 3  # the 3-candidate row is padded


def test_rank_order_counts_and_slots(triton_backend):
    """Row counts (rows with fewer visible entries than k, an empty row) and the global slots through a
    block table, with splits > 1: rank order == bitonic order == reference."""
    from dsakit.ops.topk.reference import topk_to_slots

    torch.manual_seed(5)
    device = _device()
    scores = _rows(192).to(device)
    counts = torch.tensor([192, 150, 7, 0, 33, 192, 191, 64], dtype=torch.int32, device=device)
    k = 36
    seq = torch.tensor([2, 0, 1, 2, 0, 1, 1, 2], dtype=torch.int32, device=device)
    block_table = torch.randperm(12, dtype=torch.int32).reshape(3, 4).to(device)  # 3 sequences x 4 pages
    masked = scores.cpu().clone()
    for row, c in enumerate(counts.tolist()):
        masked[row, c:] = float("-inf")
    expected = reference_select(masked, k)
    expected_slots = topk_to_slots(expected, block_table.cpu(), seq.cpu())
    ranked, ranked_slots = _run_order(scores, k, 2, rank=True, counts=counts, slot_map=(seq, block_table))
    bitonic, bitonic_slots = _run_order(scores, k, 2, rank=False, counts=counts, slot_map=(seq, block_table))
    assert torch.equal(ranked, expected) and torch.equal(bitonic, expected)
    assert torch.equal(ranked_slots, expected_slots) and torch.equal(bitonic_slots, expected_slots)
    assert bool((expected[3] == -1).all()) and bool((expected[2, 7:] == -1).all())


def test_rank_order_is_the_default_for_few_rows(triton_backend):
    """The default configuration orders few rows (decode) with the rank kernel, many rows with the sort; the
    default launch (real block sizes, blocks clamped to a small k) matches the reference."""
    from dsakit.ops.topk._select_stream import StreamConfig, select_topk_stream

    assert StreamConfig.default(64, 65536, 2048).rank_order
    assert not StreamConfig.default(8192, 65536, 2048).rank_order
    torch.manual_seed(2)
    scores = _rows(160)[:4].to(_device())
    assert torch.equal(select_topk_stream(scores, 20).cpu(), reference_select(scores.cpu(), 20))


@pytest.mark.parametrize("field, value, message", [
    ("rank_block_i", 24, "rank_block_i must be a power of two, got 24"),
    ("rank_block_j", 0, "rank_block_j must be a power of two, got 0"),
    ("rank_block_i", True, "rank_block_i must be a power of two, got True"),
    ("rank_block_j", 8, "rank_block_j must be in 16..4096, got 8"),
    ("rank_block_i", 8192, "rank_block_i must be in 16..4096, got 8192"),
    ("rank_block_j", 4096, r"rank_block_i \* rank_block_j must be <= 65536 .*, got 128 \* 4096"),
    ("rank_warps", 3, "rank_warps must be 1..32 .*, got 3"),
    ("rank_order", 1, "rank_order must be a bool, got 1"),
])
def test_rank_order_config_rejected(triton_backend, field, value, message):
    import dataclasses

    from dsakit.ops.topk._select_stream import select_topk_stream

    bad = dataclasses.replace(_config(), **{**RANK, "rank_block_i": 128, field: value})
    with pytest.raises(ValueError, match=message):
        bad.validate()
    with pytest.raises(ValueError, match=message):
        select_topk_stream(torch.randn(2, 64, device=_device()), 4, config=bad)
