"""Triton top-k (radix select over a bounded workspace) against the reference ``select_topk`` / ``index_topk``.

The selection is exact, so on identical scores the kernel must reproduce the reference bit for bit (same
sets, same order, same -1 padding). The composed ``index_topk(backend="triton")`` scores with the Triton
scores kernel, whose fp32 sums differ from the reference by rounding: there the check is the flashinfer one
(sets equal except near the k-th score, every selected score >= k-th reference score - tol, identical
padding counts).

Kernels run under TRITON_INTERPRET=1 on CPU (./dev.sh test) or on CUDA; small blocks (``block=64``) make
the streaming loops cross several tiles at small N.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.indexer.reference import index_scores as _reference_scores
from dsakit.ops.indexer import SelectConfig, TopkConfig, index_topk, select_topk
from dsakit.ops.indexer.reference import select_topk as reference_select
from dsakit.ops.indexer.reference import topk_to_slots

SMALL_BLOCK = 128  # tile of the streaming passes in tests: N of a few hundred spans several tiles
# A 32-entry candidate buffer and 32 buckets make small rows go through the range-narrowing passes, the
# candidate buffer and its radix select (the default 2048-entry buffer would take them in one step).
SMALL_CAP, SMALL_BINS = 32, 32

# Tolerance on scores for the composed path (Triton scores vs reference scores, same inputs): fp32
# accumulation order and the bf16 rounding of q (see dsakit.ops.indexer.scores).
SCORE_TOL = {"bf16": 2e-2, "fp8": 2e-2, "fp4": 2e-2}


def _select(scores, k, *, row_counts=None, sort=True, **kw):
    from dsakit.ops.indexer.select import select_topk_triton

    kw = {"block": SMALL_BLOCK, "cap": SMALL_CAP, "bins": SMALL_BINS, "algorithm": "multipass", **kw}
    return select_topk_triton(scores, k, row_counts=row_counts, sort=sort, config=SelectConfig(**kw))


def batch_of(pool, fmt, table, counts, seq, pos=None, ratio=1, **kw):
    return PagedBatch.build(pool, fmt, table, counts, seq, pos, ratio, **kw)


def reference_scores(q, w, pool, fmt, table, counts, seq, pos=None, ratio=1):
    """The reference scores on a batch of these (CPU) tensors."""
    return _reference_scores(q.cpu(), w.cpu(), batch_of(pool.cpu(), fmt, table.cpu(), counts.cpu(), seq.cpu(),
                                                        None if pos is None else pos.cpu(), ratio))


def _device(triton_backend):
    return "cuda" if torch.cuda.is_available() else "cpu"


def _crafted(n: int, rows: int = 6) -> torch.Tensor:
    """Rows that exercise every rule: ties, NaN, +-inf, -0.0 vs +0.0, fully masked, denormals, few candidates."""
    if n < 16:
        raise ValueError(f"crafted rows need n >= 16, got {n}")
    s = torch.randn(rows, n)
    s[0, 3: n // 2] = 1.25                      # a long run of ties around the k-th score
    s[1, ::3] = float("-inf")                   # masked entries are never selected
    s[2, 5] = float("nan")                      # NaN ranks above +inf
    s[2, 7] = float("inf")
    s[2, 9] = -0.0                              # -0.0 == +0.0: index order decides
    s[2, 11] = 0.0
    s[2, 13] = float("nan")
    s[3] = float("-inf")                        # no candidate at all -> all -1
    s[4] = -torch.rand(n) * 1e-40               # negative denormals
    s[4, ::4] = -0.0
    s[5] = float("-inf")
    s[5, n - 3:] = torch.tensor([2.0, -1.0, 2.0])  # 3 candidates at the row's end
    return s


@pytest.mark.parametrize("n,k", [(16, 1), (16, 64), (37, 7), (300, 1), (300, 7), (300, 64)])
def test_select_matches_reference_exactly(triton_backend, n, k):
    scores = _crafted(n).to(_device(triton_backend))
    got = _select(scores, k)
    assert got.dtype == torch.int32 and got.shape == (scores.shape[0], k)
    assert torch.equal(got.cpu(), reference_select(scores.cpu(), k))


def test_select_single_entry_rows(triton_backend):
    scores = torch.tensor([[0.5], [float("-inf")], [float("nan")], [-0.0]], device=_device(triton_backend))
    assert torch.equal(_select(scores, 3).cpu(), reference_select(scores.cpu(), 3))


def test_select_k_larger_than_row(triton_backend):
    scores = _crafted(50).to(_device(triton_backend))
    got = _select(scores, 128).cpu()
    ref = reference_select(scores.cpu(), 128)
    assert torch.equal(got, ref)
    assert bool((got[:, 50:] == -1).all()) and bool((got[3] == -1).all())


def test_select_heavy_ties_multi_level(triton_backend):
    # Few distinct values: every radix level is needed and the equal-key rank decides across tiles.
    scores = torch.randint(0, 3, (3, 300)).float()
    scores[1] = torch.randint(-2, 2, (300,)).float() * 2.0 ** -20
    scores[2, 150:] = float("-inf")
    scores = scores.to(_device(triton_backend))
    for k in (5, 120):
        assert torch.equal(_select(scores, k).cpu(), reference_select(scores.cpu(), k)), k


def test_select_row_counts_ignore_the_tail(triton_backend):
    device = _device(triton_backend)
    scores = torch.randn(4, 257)
    counts = torch.tensor([257, 0, 100, 3], dtype=torch.int32)
    masked = scores.clone()
    masked[torch.arange(257)[None, :] >= counts[:, None]] = float("-inf")
    scores[1] = float("nan")  # beyond the count: must never be read as a candidate
    got = _select(scores.to(device), 16, row_counts=counts.to(device)).cpu()
    assert torch.equal(got, reference_select(masked, 16))


def test_select_unsorted_is_same_set(triton_backend):
    scores = _crafted(300).to(_device(triton_backend))
    ordered = _select(scores, 30).cpu()
    unsorted = _select(scores, 30, sort=False).cpu()
    for row_sorted, row_unsorted in zip(ordered, unsorted):
        kept = row_unsorted[row_unsorted >= 0]
        assert set(kept.tolist()) == set(row_sorted[row_sorted >= 0].tolist())
        assert int((row_unsorted < 0).sum()) == int((row_sorted < 0).sum())


def test_select_is_deterministic(triton_backend):
    scores = torch.randint(0, 5, (2, 300)).float().to(_device(triton_backend))
    first = _select(scores, 30)
    second = _select(scores, 30)
    assert torch.equal(first, second)


@pytest.mark.parametrize("cap,bins", [(64, 64), (2048, 128)])
def test_select_other_buffer_sizes(triton_backend, cap, bins):
    scores = _crafted(300).to(_device(triton_backend))
    got = _select(scores, 40, cap=cap, bins=bins)
    assert torch.equal(got.cpu(), reference_select(scores.cpu(), 40))


def test_select_default_block_and_dispatcher(triton_backend):
    rows, n = 6, 8192 + 300
    assert SelectConfig().resolve(rows)[0] == 8192  # the decode-regime default tile: n spans two tiles
    scores = _crafted(n, rows).to(_device(triton_backend))
    got = select_topk(scores, 20, backend="triton")
    assert torch.equal(got.cpu(), reference_select(scores.cpu(), 20))


# The fixture only decides skip-or-run (no state), so sharing it across examples is safe.
@settings(max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_select_property(triton_backend, data):
    n = data.draw(st.integers(1, 150), label="n")
    k = data.draw(st.integers(1, 40), label="k")
    seed = data.draw(st.integers(0, 2 ** 31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    # Small integer scores (many ties) scaled by a power of two, with -inf / NaN sprinkled in.
    scores = torch.randint(-4, 5, (3, n), generator=gen).float() * 2.0 ** data.draw(st.integers(-30, 30))
    special = torch.rand(3, n, generator=gen)
    scores[special < 0.15] = float("-inf")
    scores[special > 0.97] = float("nan")
    got = _select(scores.to(_device(triton_backend)), k).cpu()
    assert torch.equal(got, reference_select(scores, k))


def test_select_rejects_bad_input(triton_backend):
    from dsakit.ops.indexer.select import select_topk_triton

    scores = torch.randn(2, 10, device=_device(triton_backend))
    with pytest.raises(ValueError, match="k must be"):
        select_topk_triton(scores, 0)
    with pytest.raises(ValueError, match="fp32"):
        select_topk_triton(scores.double(), 3)
    with pytest.raises(ValueError, match="row_counts"):
        select_topk_triton(scores, 3, row_counts=torch.tensor([1, 11], dtype=torch.int32, device=scores.device))
    with pytest.raises(ValueError, match="unit stride"):
        select_topk_triton(scores.t().contiguous().t(), 3)
    # the collect pass packs two ranks per tile into one int32: a tile of 32768 would overflow it
    with pytest.raises(ValueError, match="block must be"):
        select_topk_triton(scores, 3, config=SelectConfig(block=32768))
    with pytest.raises(ValueError, match="block must be"):
        select_topk_triton(scores, 3, config=SelectConfig(block=48))


# ---------------------------------------------------------------------------------------------------------
# Composed path: Triton scores + radix select vs the reference index_topk, per key format.
# ---------------------------------------------------------------------------------------------------------


def _ragged_batch(fmt: KeyFormat, counts: list[int], queries: list[int], heads: int = 4, ratio: int = 4):
    """Paged pool with shuffled pages, a ragged batch of queries at causal positions (last tokens)."""
    pages_per_seq = [max(1, -(-c // 64)) for c in counts]
    num_pages = sum(pages_per_seq) + 1
    keys = torch.randn(num_pages * 64, 128)
    pool = fmt.quantize_pages(keys)
    order = torch.randperm(num_pages)
    table = torch.full((len(counts), max(pages_per_seq)), -1, dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages_per_seq):
        table[b, :p] = order[used: used + p].to(torch.int32)
        used += p
    query_seq = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(queries)).to(torch.int32)
    # Positions spread over each sequence (early queries see few entries, the last one sees all).
    positions = torch.cat([torch.sort(torch.randint(0, c * ratio + ratio, (q,))).values
                           for c, q in zip(counts, queries)]).to(torch.int32)
    t = int(query_seq.numel())
    q = torch.randn(t, heads, 128)
    weights = torch.rand(t, heads) + 0.1
    entry_counts = torch.tensor(counts, dtype=torch.int32)
    return q, weights, pool, table, entry_counts, query_seq, positions


def _check_against_reference(got, ref_scores, k, tol):
    ref = reference_select(ref_scores, k)
    assert got.shape == ref.shape and got.dtype == torch.int32
    for row in range(got.shape[0]):
        g, r = got[row], ref[row]
        assert int((g < 0).sum()) == int((r < 0).sum()), f"row {row}: padding differs"
        chosen = g[g >= 0].long()
        assert chosen.unique().numel() == chosen.numel(), f"row {row}: duplicate index"
        if chosen.numel() == 0:
            continue
        kth = ref_scores[row, r[r >= 0][-1].long()]
        assert bool((ref_scores[row, chosen] >= kth - tol).all()), f"row {row}: a selected score is below the k-th"
        differs = set(chosen.tolist()) ^ set(r[r >= 0].tolist())
        for j in differs:  # only near-ties of the k-th score may swap
            assert abs(float(ref_scores[row, j] - kth)) <= tol, f"row {row}: entry {j} swapped far from the k-th"


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8", "fp4"])
def test_index_topk_triton_matches_reference(triton_backend, fmt_name):
    fmt = KeyFormat.parse(fmt_name)
    # Sequences: 150 entries, empty, 70 entries (K > visible for early queries), 3 entries.
    q, w, pool, table, counts, seq, pos = _ragged_batch(fmt, [150, 0, 70, 3], [5, 2, 4, 2])
    k = 24
    ref_scores = reference_scores(q, w, pool, fmt, table, counts, seq, pos, 4)
    device = _device(triton_backend)
    batch = batch_of(pool.to(device), fmt, table.to(device), counts.to(device), seq.to(device), pos.to(device), 4)
    args = [q.to(device), w.to(device), batch]
    got, slots = index_topk(*args, k, backend="triton", return_slots=True)
    got, slots = got.cpu(), slots.cpu()
    _check_against_reference(got, ref_scores, k, SCORE_TOL[fmt.kind])
    assert torch.equal(slots, topk_to_slots(got, table, seq))
    # the empty sequence's queries select nothing
    assert bool((got[seq == 1] == -1).all())
    # determinism, and a workspace of 3 rows (several chunks) gives the same answer
    again = index_topk(*args, k, backend="triton", config=TopkConfig(workspace_bytes=3 * 4 * 256)).cpu()
    assert torch.equal(again, got)


def test_index_topk_triton_no_positions_and_all_empty(triton_backend):
    fmt = KeyFormat.parse("fp8")
    device = _device(triton_backend)
    q, w, pool, table, counts, seq, _ = _ragged_batch(fmt, [90, 20], [3, 2], ratio=1)
    ref_scores = reference_scores(q, w, pool, fmt, table, counts, seq, None, 1)
    batch = batch_of(pool.to(device), fmt, table.to(device), counts.to(device), seq.to(device))
    got = index_topk(q.to(device), w.to(device), batch, 32, backend="triton").cpu()
    _check_against_reference(got, ref_scores, 32, SCORE_TOL["fp8"])
    empty_batch = batch_of(pool.to(device), fmt, table.to(device), torch.zeros_like(counts).to(device),
                           seq.to(device))
    empty = index_topk(q.to(device), w.to(device), empty_batch, 8, backend="triton")
    assert bool((empty == -1).all()) and empty.shape == (5, 8)


def test_index_topk_triton_rejects_bad_input(triton_backend):
    fmt = KeyFormat.parse("bf16")
    device = _device(triton_backend)
    q, w, pool, table, counts, seq, pos = _ragged_batch(fmt, [10], [2])
    args = [q.to(device), w.to(device), batch_of(pool.to(device), fmt, table.to(device), counts.to(device),
                                                 seq.to(device))]
    with pytest.raises(ValueError, match="k must be"):
        index_topk(*args, 0, backend="triton")
    with pytest.raises(ValueError, match="workspace_bytes"):
        index_topk(*args, 4, backend="triton", config=TopkConfig(workspace_bytes=0))
    with pytest.raises(ValueError, match="return_slots"):
        index_topk(*args, 4, backend="triton", return_slots="yes")
    with pytest.raises(ValueError, match="config must be a TopkConfig"):
        index_topk(*args, 4, backend="triton", config={"workspace_bytes": 10})
    with pytest.raises(ValueError, match="q has 1 rows but the batch has 2"):
        index_topk(args[0][:1], args[1][:1], args[2], 4, backend="triton")
    from dsakit.ops.indexer.triton import index_topk_triton

    with pytest.raises(ValueError, match="q_scale"):
        index_topk_triton(*args, 4, q_scale=-torch.ones(2, 4, device=device))
    bad_table = torch.full_like(table, pool.shape[0] + 5).to(device)  # a page id outside the pool
    with pytest.raises(ValueError, match="block_table"):
        batch_of(pool.to(device), fmt, bad_table, counts.to(device), seq.to(device))  # refused when built


# --------------------------------------------------------------------------------------------------
# Decode plan path (dsakit.ops.indexer.plans): sync-free, preallocated, CUDA-graph-capturable
# --------------------------------------------------------------------------------------------------

DECODE_HEADS = 16  # the smallest H the decode group kernel takes (the real decode kernel, not the tile one)


def _decode_batch(fmt: KeyFormat, counts: list[int], next_n: int, max_pages: int, seed: int, ratio: int = 4):
    """Decode inputs: q [B, next_n, H, 128], weights [B, next_n, H], pool, block table, counts, positions.

    The last query of sequence b sits ``behind[b % 4]`` tokens before the end of its last complete entry
    (position count * ratio - 1 - behind), so causality hides some cached entries (on a block boundary
    when behind % 4 == 0); next_n > 1 gives the rows of one sequence different visible counts."""
    g = torch.Generator().manual_seed(seed)
    b = len(counts)
    num_pages = b * max_pages + 1
    pool = fmt.quantize_pages(torch.randn(num_pages * 64, 128, generator=g))
    table = torch.randperm(num_pages, generator=g)[: b * max_pages].reshape(b, max_pages).to(torch.int32)
    entry_counts = torch.tensor(counts, dtype=torch.int32)
    behind = (1, 0, 8, 5)
    last = torch.tensor([c * ratio - 1 - behind[i % 4] for i, c in enumerate(counts)])
    positions = (last[:, None] - torch.arange(next_n - 1, -1, -1)[None, :]).clamp(min=0).to(torch.int32)
    q = torch.randn(b, next_n, DECODE_HEADS, 128, generator=g).to(torch.bfloat16)
    weights = torch.rand(b, next_n, DECODE_HEADS, generator=g) + 0.1
    return q, weights, pool, table, entry_counts, positions


def _decode_reference_scores(q, weights, pool, fmt, table, counts, positions, ratio):
    b, next_n, h, d = q.shape
    seq = torch.arange(b).repeat_interleave(next_n).to(torch.int32)
    pos = None if positions is None else positions.reshape(-1)
    return reference_scores(q.reshape(-1, h, d).float(), weights.reshape(-1, h), pool, fmt, table, counts, seq,
                            pos, ratio)


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


def _decode_batch_of(device, pool, fmt, table, counts, next_n, positions=None, ratio=1, **kw):
    """The PagedBatch of a decode step: row b * next_n + i is query i of sequence b."""
    seq = torch.arange(table.shape[0], dtype=torch.int32).repeat_interleave(next_n)
    pos = None if positions is None else positions.reshape(-1).to(device)
    return batch_of(pool.to(device), fmt, table.to(device), counts.to(device), seq.to(device), pos, ratio, **kw)


@pytest.mark.parametrize("fmt_name,next_n", [("bf16", 1), ("fp8", 2), ("fp4", 1)])
def test_decode_plan_matches_reference(triton_backend, fmt_name, next_n):
    from dsakit.ops.indexer import index_topk_decode, plan_decode_topk

    fmt = KeyFormat.parse(fmt_name)
    device = _device(triton_backend)
    k, ratio = 24, 4
    # variable lengths: empty, fewer entries than k, one page boundary, several pages
    counts = [0, 7, 64, 150]
    q, w, pool, table, cnt, pos = _decode_batch(fmt, counts, next_n, max_pages=3, seed=1, ratio=ratio)
    q_scale = None
    if fmt.kind == "fp8":  # fp8 q with a per (row, head) scale, folded into the weights by the reference
        q = q.to(torch.float8_e4m3fn)
        q_scale = torch.rand(len(counts), next_n, DECODE_HEADS) + 0.5
    plan = plan_decode_topk(len(counts), next_n, 192, k, fmt, device, num_heads=DECODE_HEADS, return_slots=True)
    plan.workspace.fill_(float("nan"))  # poison: every column a row sees must be written by the kernel
    batch = _decode_batch_of(device, pool, fmt, table, cnt, next_n, pos, ratio)
    got, slots = index_topk_decode(*_on(device, q, w), batch, k, plan=plan,
                                   q_scale=None if q_scale is None else q_scale.to(device))
    assert got.shape == (len(counts) * next_n, k) and got.dtype == torch.int32
    got, slots = got.cpu(), slots.cpu()
    ref_weights = w if q_scale is None else w * q_scale
    ref_scores = _decode_reference_scores(q, ref_weights, pool, fmt, table, cnt, pos, ratio)
    _check_against_reference(got, ref_scores, k, SCORE_TOL[fmt.kind])
    seq = torch.arange(len(counts)).repeat_interleave(next_n).to(torch.int32)
    assert torch.equal(slots, topk_to_slots(got, table, seq))
    assert bool((got[:next_n] == -1).all())  # the empty sequence selects nothing


def test_candidate_buffers_only_on_the_multipass_path(triton_backend):
    """The multi-pass select's candidate buffers are allocated only when that select runs: not by the
    streaming path of index_topk_triton (k <= 4096) nor by a streaming decode plan."""
    from dsakit.ops.indexer import plan_decode_topk
    from dsakit.ops.indexer import triton as topk_triton

    fmt = KeyFormat.parse("bf16")
    device = _device(triton_backend)
    q, w, pool, table, cnt, pos = _decode_batch(fmt, [40, 70], 1, max_pages=2, seed=3)
    batch = _decode_batch_of(device, pool, fmt, table, cnt, 1, pos, 4)
    q, w = _on(device, q.reshape(2, DECODE_HEADS, 128), w.reshape(2, DECODE_HEADS))
    for algorithm, has_candidates in (("auto", False), ("multipass", True)):
        topk_triton.release_workspaces()
        config = TopkConfig(select=SelectConfig(algorithm=algorithm))
        streamed = topk_triton.index_topk_triton(q, w, batch, 8, config=config)
        roles = {key[0] for key in topk_triton._BUFFERS}
        assert "cand_vals" not in roles and "cand_idx" not in roles, roles  # a decode batch: the cached plan's
        (_, cached_plan), = topk_triton._DECODE_PLANS.values()
        assert (cached_plan.cand_vals is not None) == has_candidates and (cached_plan.stream is None) == has_candidates
        plan = plan_decode_topk(2, 1, 128, 8, fmt, device, num_heads=DECODE_HEADS,
                                select=SelectConfig(algorithm=algorithm))
        assert (plan.cand_vals is not None) == has_candidates and (plan.stream is None) == has_candidates
        if algorithm == "auto":
            first = streamed.cpu()
    assert torch.equal(streamed.cpu(), first)  # the same selection either way


def test_decode_plan_reuse_two_batches_and_no_positions(triton_backend):
    from dsakit.ops.indexer import index_topk_decode, plan_decode_topk

    fmt = KeyFormat.parse("fp8")
    device = _device(triton_backend)
    k = 16
    plan = plan_decode_topk(3, 2, 128, k, fmt, device, num_heads=DECODE_HEADS)
    # the memory formula of the docs: 4 R W + 4 R K + 8 R + 12 B bytes (R = B * next_n = 6) + the streaming
    # select's buffers (no multi-pass candidate buffers on the streaming path)
    assert plan.cand_vals is None and plan.cand_idx is None
    assert plan.workspace_bytes == 4 * 6 * 128 + 4 * 6 * k + 8 * 6 + 12 * 3 + plan.stream.nbytes
    results = []
    for seed, counts in ((2, [100, 3, 128]), (3, [40, 128, 0])):  # same shape, different values and lengths
        q, w, pool, table, cnt, _ = _decode_batch(fmt, counts, 2, max_pages=2, seed=seed, ratio=1)
        got = index_topk_decode(*_on(device, q, w), _decode_batch_of(device, pool, fmt, table, cnt, 2), k, plan=plan)
        assert got.data_ptr() == plan.indices.data_ptr()  # the plan's own buffer, no new allocation
        got = got.cpu().clone()
        # without positions every row of a sequence sees all its entries (ratio unused)
        _check_against_reference(got, _decode_reference_scores(q, w, pool, fmt, table, cnt, None, 1), k,
                                 SCORE_TOL["fp8"])
        results.append(got)
    assert not torch.equal(results[0], results[1])
    assert bool((results[1][4:] == -1).all())  # the second batch's empty sequence overwrote the old rows


def test_decode_plan_bad_values_stay_in_bounds(triton_backend):
    """An unchecked batch (validate=False) with counts beyond the workspace and page ids outside the pool: no
    crash, -1 padding kept, every index inside the workspace; a validated batch names the bad value."""
    from dsakit.ops.indexer import index_topk_decode, plan_decode_topk

    fmt = KeyFormat.parse("bf16")
    device = _device(triton_backend)
    q, w, pool, table, cnt, _ = _decode_batch(fmt, [64, 10], 1, max_pages=1, seed=4, ratio=1)
    plan = plan_decode_topk(2, 1, 64, 8, fmt, device, num_heads=DECODE_HEADS, return_slots=True)
    bad_counts = torch.tensor([10_000, -5], dtype=torch.int32)
    bad_table = table.clone()
    bad_table[0, 0] = 10_000
    args = _on(device, q, w)
    unchecked = _decode_batch_of(device, pool, fmt, bad_table, bad_counts, 1, validate=False, max_entries=64)
    got, _ = index_topk_decode(*args, unchecked, 8, plan=plan)
    got = got.cpu()
    assert bool((got[0] >= 0).all()) and bool((got[0] < 64).all()) and bool((got[1] == -1).all())
    with pytest.raises(ValueError, match="entry_counts must be in 0..64"):
        _decode_batch_of(device, pool, fmt, table, bad_counts, 1)
    with pytest.raises(ValueError, match="block_table"):
        _decode_batch_of(device, pool, fmt, bad_table, cnt, 1)
    # a batch with more entries than the plan's workspace is refused on the host (no sync)
    wide_plan = plan_decode_topk(2, 1, 32, 8, fmt, device, num_heads=DECODE_HEADS)
    with pytest.raises(ValueError, match="plan max_entries 32"):
        index_topk_decode(*args, _decode_batch_of(device, pool, fmt, table, cnt, 1), 8, plan=wide_plan)


def test_decode_plan_rejects_bad_input(triton_backend):
    from dsakit.ops.indexer import index_topk_decode, plan_decode_topk

    fmt = KeyFormat.parse("bf16")
    device = _device(triton_backend)
    q, w, pool, table, cnt, pos = _on(device, *_decode_batch(fmt, [20, 30], 1, max_pages=1, seed=5))
    plan = plan_decode_topk(2, 1, 64, 8, fmt, device, num_heads=DECODE_HEADS)
    for bad in (dict(batch=0), dict(next_n=0), dict(max_entries=0), dict(k=0), dict(num_heads=True)):
        kw = {"batch": 2, "next_n": 1, "max_entries": 64, "k": 8, **bad}
        with pytest.raises(ValueError):
            plan_decode_topk(kw["batch"], kw["next_n"], kw["max_entries"], kw["k"], fmt, device,
                             num_heads=kw.get("num_heads", DECODE_HEADS))
    batch = _decode_batch_of(device, pool, fmt, table, cnt, 1)
    with pytest.raises(ValueError, match="plan"):
        index_topk_decode(q, w, batch, 8, plan=None)
    with pytest.raises(ValueError, match="plan was built for k"):
        index_topk_decode(q, w, batch, 4, plan=plan)
    with pytest.raises(ValueError, match="plan was built for fp8"):
        index_topk_decode(q, w, batch, 8, plan=plan_decode_topk(2, 1, 64, 8, "fp8", device, num_heads=DECODE_HEADS))
    with pytest.raises(ValueError, match=r"\[B, next_n, H\]"):
        index_topk_decode(q[:1], w[:1], _decode_batch_of(device, pool, fmt, table[:1], cnt[:1], 1), 8, plan=plan)
    with pytest.raises(ValueError, match="weights"):
        index_topk_decode(q, w[:, :, :4], batch, 8, plan=plan)
    with pytest.raises(ValueError, match="batch"):
        index_topk_decode(q, w, pool, 8, plan=plan)
    with pytest.raises(ValueError, match="q_scale"):
        index_topk_decode(q, w, batch, 8, plan=plan, q_scale=torch.ones(3, device=device))
    with pytest.raises(ValueError, match="entry_counts"):
        _decode_batch_of(device, pool, fmt, table, cnt.float(), 1)
    with pytest.raises(ValueError, match="query_positions"):
        _decode_batch_of(device, pool, fmt, table, cnt, 1, pos[:, :0])
    with pytest.raises(ValueError, match="ratio"):
        _decode_batch_of(device, pool, fmt, table, cnt, 1, ratio=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a CUDA device")
def test_decode_plan_cuda_graph_replay():
    from dsakit.ops.indexer import index_topk_decode, plan_decode_topk

    fmt = KeyFormat.parse("fp8")
    k = 32
    q, w, pool, table, cnt, pos = _on("cuda", *_decode_batch(fmt, [500, 64, 300, 0], 1, max_pages=8, seed=6))
    pos = pos.reshape(-1).long()  # the batch's own dtype: updates in place reach the captured graph
    # static batch tensors, updated in place between replays: an unchecked batch as wide as the plan
    batch = _decode_batch_of("cuda", pool, fmt, table, cnt, 1, pos, 4, validate=False, max_entries=512)
    assert batch.entry_counts.data_ptr() == cnt.data_ptr() and batch.query_positions.data_ptr() == pos.data_ptr()
    plan = plan_decode_topk(4, 1, 512, k, fmt, "cuda", num_heads=DECODE_HEADS)
    eager = index_topk_decode(q, w, batch, k, plan=plan).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index_topk_decode(q, w, batch, k, plan=plan)
    plan.indices.fill_(-7)
    graph.replay()
    assert torch.equal(plan.indices, eager)
    q2, w2, _, _, cnt2, pos2 = _on("cuda", *_decode_batch(fmt, [100, 511, 1, 40], 1, max_pages=8, seed=7))
    for dst, src in ((q, q2), (w, w2), (cnt, cnt2), (pos, pos2.reshape(-1))):
        dst.copy_(src)
    graph.replay()
    fresh = index_topk_decode(q, w, batch, k, plan=plan_decode_topk(4, 1, 512, k, fmt, "cuda", num_heads=DECODE_HEADS))
    assert torch.equal(plan.indices, fresh)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="sync debug mode needs a CUDA device")
@pytest.mark.parametrize("query_lens,positions", [([1] * 8, False), ([16, 3, 30, 1, 16, 8, 2, 20], True)],
                         ids=["decode", "prefill"])
def test_public_index_topk_steady_state_has_no_sync_and_allocates_only_outputs(query_lens, positions):
    """From the second call with the same shapes on, the plain public index_topk makes no device->host sync
    (torch.cuda.set_sync_debug_mode("error") raises on one), also on a freshly built PagedCache.batch, and
    allocates nothing but its output (and the new batch's metadata)."""
    from dsakit import PagedCache

    fmt = KeyFormat.parse("fp8")
    cache = PagedCache(fmt, 256, device="cuda")  # room for every parametrization (up to ~5.1K entries)
    seqs = [cache.add_sequence() for _ in query_lens]
    for i, s in enumerate(seqs):
        n = 300 + 97 * i
        cache.write(cache.append(s, n), torch.randn(n, 128))
    t = sum(query_lens)
    pos = None
    if positions:
        pos = torch.cat([torch.randint(0, cache.length(s), (n,)) for s, n in zip(seqs, query_lens)]).cuda()
    batch = cache.batch(seqs, query_lens=query_lens, query_positions=pos)
    q = torch.randn(t, 64, 128, device="cuda").to(torch.bfloat16)
    w = torch.rand(t, 64, device="cuda")
    k = 128
    first = index_topk(q, w, batch, k)  # compiles the kernels, fills the workspace and plan caches
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = index_topk(q, w, batch, k)
        # a decode loop rebuilds the batch every step: PagedCache.batch uploads its metadata asynchronously
        third = index_topk(q, w, cache.batch(seqs, query_lens=query_lens, query_positions=pos), k)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    output_bytes = -(-t * k * 4 // 512) * 512  # the caching allocator rounds blocks up to 512 bytes
    metadata_bytes = -(-(batch.block_table.numel() + 2 * len(seqs) + 9 * t) * 4 // 512) * 512 + 512
    assert torch.cuda.max_memory_allocated() - before <= 2 * output_bytes + metadata_bytes
    assert torch.equal(again, first) and torch.equal(third, first)
    ref = index_topk(q.cpu(), w.cpu(), batch, k, backend="reference")
    _check_against_reference(first.cpu(), index_scores_ref_of(q, w, batch), k, SCORE_TOL["fp8"])
    assert ref.shape == first.shape


def index_scores_ref_of(q, w, batch):
    """Reference scores of the batch (q as the kernel multiplies it: bf16 values in fp32)."""
    return _reference_scores(q.float().cpu(), w.cpu(), batch)
