"""Host side of the eager indexer calls (issue 32, "without the GPU machine"), counted on the CPU under
TRITON_INTERPRET=1 (tests/_host_counts.py): Triton launches, torch kernels, allocations and device->host reads
per call, and results equal to the paths they replace. Counts, not times: these say nothing of H200 speed.

* ``index_topk`` on a decode-shaped batch launches what ``index_topk_decode`` launches through a plan cached by
  shape, and allocates only its outputs;
* ``PagedCache.batch`` packs a decode step's metadata into one host buffer (one upload, positions included);
* ``select_topk_triton`` allocates only its output (counts and candidate buffers cached by shape);
* tile plans read from an unchecked batch's ``query_seq`` cost one sync per batch object, not per call.
"""

from __future__ import annotations

import pytest
import torch

from _host_counts import count_host_work
from dsakit import PagedBatch, PagedCache
from dsakit.formats import KeyFormat
from dsakit.ops.indexer import SelectConfig, TopkConfig, index_topk

H, K = 16, 8  # H 16: the smallest head count of the decode group kernel


def _cache_and_inputs(fmt="fp8", lengths=(70, 100, 130, 40), next_n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = PagedCache(KeyFormat.parse(fmt), num_pages=4 * len(lengths) + 4)
    seqs = []
    for n in lengths:
        s = cache.add_sequence()
        cache.write(cache.append(s, n), torch.randn(n, 128, generator=g))
        seqs.append(s)
    rows = len(lengths) * next_n
    q = torch.randn(rows, H, 128, generator=g).to(torch.bfloat16)
    w = torch.rand(rows, H, generator=g) + 0.1
    return cache, seqs, q, w


def _steady(fn):
    """Counts of the third call (the first two compile and fill the caches)."""
    fn()
    fn()
    with count_host_work() as counts:
        result = fn()
    return counts, result


@pytest.mark.parametrize("return_slots", [False, True])
def test_eager_decode_index_topk_launches_what_the_plan_launches(triton_backend, return_slots):
    from dsakit.ops.indexer import index_topk_decode, plan_decode_topk
    from dsakit.ops.indexer.triton import release_workspaces

    release_workspaces()
    cache, seqs, q, w = _cache_and_inputs()
    batch = cache.batch(seqs)
    eager, got = _steady(lambda: index_topk(q, w, batch, K, backend="triton", return_slots=return_slots))
    plan = plan_decode_topk(len(seqs), 1, 256, K, "fp8", "cpu", num_heads=H, return_slots=return_slots)
    planned, want = _steady(lambda: index_topk_decode(q, w, batch, K, plan=plan))
    assert eager.launches == planned.launches and eager.torch_kernels == planned.torch_kernels == 0, eager.ops
    assert eager.allocations == planned.allocations + (2 if return_slots else 1), eager.ops  # its outputs only
    assert eager.syncs == planned.syncs == 0, eager.ops
    got, want = (got, want) if return_slots else ((got,), (want,))
    for mine, theirs in zip(got, want):
        assert torch.equal(mine, theirs)
    # the chunked path (a workspace bound below one row forces it) selects the same entries
    chunked = index_topk(q, w, batch, K, backend="triton", return_slots=return_slots,
                         config=TopkConfig(workspace_bytes=1))
    for mine, theirs in zip(got, chunked if return_slots else (chunked,)):
        assert torch.equal(mine, theirs)


def test_eager_decode_plan_is_cached_by_shape_and_fresh_batches_reuse_it(triton_backend):
    from dsakit.ops.indexer import triton as topk_triton

    topk_triton.release_workspaces()
    cache, seqs, q, w = _cache_and_inputs(next_n=2)
    first = index_topk(q, w, cache.batch(seqs, query_lens=[2] * 4), K, backend="triton")
    assert len(topk_triton._DECODE_PLANS) == 1
    # a fresh batch per step, one entry longer: the same plan (width rounded up to a power of two)
    cache.append(seqs[0], 1)
    fresh, again = _steady(lambda: index_topk(q, w, cache.batch(seqs, query_lens=[2] * 4), K, backend="triton"))
    assert len(topk_triton._DECODE_PLANS) == 1 and fresh.syncs == 0 and fresh.launches == 3 + 1, fresh.ops
    reference = index_topk(q.float(), w, cache.batch(seqs, query_lens=[2] * 4), K, backend="reference")
    assert torch.equal((again >= 0).sum(1), (reference >= 0).sum(1))
    # another k is another shape
    index_topk(q, w, cache.batch(seqs, query_lens=[2] * 4), K * 2, backend="triton")
    assert len(topk_triton._DECODE_PLANS) == 2
    assert first.shape == again.shape == (8, K)


def test_fresh_decode_batch_is_one_packed_upload(device, monkeypatch):
    import dsakit.batch

    uploads = []
    monkeypatch.setattr(dsakit.batch, "upload", lambda host, where: uploads.append(host.numel()) or host.to(where))
    cache, seqs, _, _ = _cache_and_inputs()
    positions = torch.tensor([68, 99, 129, 39])
    counts, batch = _steady(lambda: cache.batch(seqs, query_positions=positions, ratio=1))
    assert uploads == [4 * 3 + 4 + 4 + 8] * 3  # table 4 x 3 pages, counts, query rows, positions as int32 pairs
    # the CPU "upload" is the packed buffer itself: no torch kernel at all beyond packing the positions in
    assert counts.syncs == 0 and counts.launches == 0 and counts.torch_kernels <= 2, counts.ops
    plain, _ = _steady(lambda: cache.batch(seqs))
    assert plain.torch_kernels == 0 and plain.allocations == 0, plain.ops  # a view of one host array
    # one storage holds the table, counts, query rows and positions
    storages = {t.untyped_storage().data_ptr() for t in (batch.block_table, batch.entry_counts, batch.query_seq,
                                                         batch.query_positions)}
    assert len(storages) == 1
    built = PagedBatch.build(cache.pool, cache.fmt, cache.block_table(seqs), cache.entry_counts(seqs),
                             torch.arange(4, dtype=torch.int32), positions)
    for field in ("block_table", "entry_counts", "query_seq", "query_positions"):
        assert torch.equal(getattr(batch, field), getattr(built, field)), field
    assert (batch.max_entries, batch.query_lens, batch.next_n) == (built.max_entries, built.query_lens, 1)


def test_cache_batch_grouped_query_lens_and_bad_input(device):
    cache, seqs, _, _ = _cache_and_inputs()
    batch = cache.batch(seqs, query_lens=[2, 0, 1, 3])
    assert batch.query_seq.tolist() == [0, 0, 2, 3, 3, 3] and batch.query_lens == (2, 0, 1, 3)
    assert batch.next_n is None and batch.rows_sorted
    with pytest.raises(ValueError, match="query_lens must be 4 non-negative ints"):
        cache.batch(seqs, query_lens=[1, 1, -1, 1])
    with pytest.raises(ValueError, match="ratio"):
        cache.batch(seqs, ratio=0)
    with pytest.raises(ValueError, match="unknown sequence id"):
        cache.batch([seqs[0], 99])


@pytest.mark.parametrize("algorithm", ["auto", "multipass"])
def test_select_topk_triton_allocates_only_its_output(triton_backend, algorithm):
    from dsakit.ops.indexer.reference import select_topk as reference_select
    from dsakit.ops.indexer.select import select_topk_triton

    scores = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    config = SelectConfig(algorithm=algorithm)
    counts, got = _steady(lambda: select_topk_triton(scores, K, config=config))
    assert counts.allocations == 1 and counts.torch_kernels == 0 and counts.syncs == 0, counts.ops
    assert torch.equal(got, reference_select(scores, K))
    # row counts given: one sync checks both bounds
    limits = torch.tensor([300, 0, 5, 299, 100, 7])
    checked, got = _steady(lambda: select_topk_triton(scores, K, row_counts=limits, config=config))
    assert checked.syncs == 1, checked.ops
    masked = torch.where(torch.arange(300)[None, :] < limits[:, None], scores, torch.tensor(float("-inf")))
    assert torch.equal(got, reference_select(masked, K))


def test_unchecked_batch_reads_query_seq_once_per_batch_object(triton_backend):
    cache, seqs, q, w = _cache_and_inputs()
    unchecked = PagedBatch.build(cache.pool, cache.fmt, cache.block_table(seqs), cache.entry_counts(seqs),
                                 torch.tensor([0, 1, 2, 3]), validate=False, max_entries=130)
    with count_host_work() as first:
        got = index_topk(q, w, unchecked, K, backend="triton")
    counts, again = _steady(lambda: index_topk(q, w, unchecked, K, backend="triton"))
    assert first.syncs == 1 and counts.syncs == 0, (first.ops, counts.ops)
    assert torch.equal(got, again)
    assert torch.equal(got, index_topk(q, w, cache.batch(seqs), K, backend="triton"))
