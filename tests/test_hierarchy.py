"""Hierarchical top-k (page representatives, then exact scores inside the pages kept) against the flat top-k.

The reference is checked against the flat reference (bitwise where the hierarchy keeps every page, and in the
exact mode on random keys, ties and relu-zero rows); the device path (Triton under TRITON_INTERPRET=1) against
the reference, and its exact mode against the flat Triton top-k bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.indexer import HierarchyConfig, hierarchical_topk, index_topk
from dsakit.ops.indexer.reference import forced_pages, page_score_bounds
from dsakit.pool import PageSummaries, dequantize_entries, summarize_pages

FORMATS = ["bf16", "fp8", "fp4", "fp8-centred", "fp4-centred"]
ALL_PAGES = HierarchyConfig(pages=10_000)


def _case(fmt_name: str, counts: list[int], queries: list[int], *, heads: int = 4, ratio: int = 4, seed: int = 0,
          keys: torch.Tensor | None = None, positions: bool = True, device: str = "cpu"):
    """A pool with shuffled pages, its page summaries, and a ragged batch of queries at causal positions."""
    gen = torch.Generator().manual_seed(seed)
    fmt = KeyFormat.parse(fmt_name)
    pages_per_seq = [max(1, -(-c // 64)) for c in counts]
    num_pages = sum(pages_per_seq) + 1
    if keys is None:
        # a shared direction plus noise, as pooled index keys have (docs/formats-centred.md)
        keys = 0.3 * torch.randn(num_pages * 64, 128, generator=gen) + torch.randn(1, 128, generator=gen)
    pool = fmt.quantize_pages(keys)
    order = torch.randperm(num_pages, generator=gen)
    table = torch.full((len(counts), max(pages_per_seq)), -1, dtype=torch.int32)
    summaries = PageSummaries.zeros(num_pages)
    used = 0
    for b, (p, c) in enumerate(zip(pages_per_seq, counts)):
        table[b, :p] = order[used: used + p].to(torch.int32)
        used += p
        full = torch.tensor([min(64, c - 64 * i) for i in range(p)])
        live = full > 0
        summarize_pages(pool, fmt, table[b, :p].long()[live], full[live], summaries)
    seq = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(queries)).to(torch.int32)
    pos = torch.cat([torch.sort(torch.randint(0, c * ratio + ratio, (q,), generator=gen)).values
                     for c, q in zip(counts, queries)]).to(torch.int32)
    t = int(seq.numel())
    q = torch.randn(t, heads, 128, generator=gen)
    w = torch.randn(t, heads, generator=gen)  # negative weights too: the bound must handle both signs
    batch = PagedBatch.build(pool.to(device), fmt, table.to(device), torch.tensor(counts, dtype=torch.int32, device=device),
                             seq.to(device), pos.to(device) if positions else None, ratio)
    moved = PageSummaries(summaries.centre.to(device), summaries.lower.to(device), summaries.upper.to(device))
    return q.to(device), w.to(device), batch, moved


def _on_cpu(q, w, batch, summaries):
    """The same case on the CPU (for the reference)."""
    cpu = PagedBatch.build(batch.pool.cpu(), batch.fmt, batch.block_table.cpu(), batch.entry_counts.cpu(),
                           batch.query_seq.cpu(), None if batch.query_positions is None else batch.query_positions.cpu(),
                           batch.ratio)
    return q.cpu(), w.cpu(), cpu, PageSummaries(summaries.centre.cpu(), summaries.lower.cpu(), summaries.upper.cpu())


def _flat(q, w, batch, k, backend="reference"):
    return index_topk(q, w, batch, k, backend=backend)


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_reference_with_every_page_kept_is_the_flat_top_k(fmt_name):
    q, w, batch, summaries = _case(fmt_name, [300, 0, 70, 5], [4, 1, 3, 2])
    got, pages = hierarchical_topk(q, w, batch, 24, summaries=summaries, config=ALL_PAGES, backend="reference",
                                   return_pages=True)
    assert torch.equal(got, _flat(q, w, batch, 24))
    assert int(pages[4]) == 0  # the empty sequence's query scores no page


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_reference_exact_mode_is_the_flat_top_k(fmt_name):
    q, w, batch, summaries = _case(fmt_name, [640, 200], [5, 3], seed=1)
    config = HierarchyConfig(pages=1, first_pages=0, recent_pages=1, exact=True)
    got, pages = hierarchical_topk(q, w, batch, 16, summaries=summaries, config=config, backend="reference",
                                   return_pages=True)
    assert torch.equal(got, _flat(q, w, batch, 16))
    assert int(pages.min()) >= 1


def test_reference_exact_mode_on_ties_and_relu_zero_rows():
    keys = torch.randn(8 * 64, 128).repeat_interleave(2, dim=0)[: 8 * 64]  # every key twice: exact ties
    q, w, batch, summaries = _case("bf16", [400], [6], keys=keys, seed=2)
    q[0] = -q[0].abs()  # query 0: put keys' shared sign against it...
    keys_sign = torch.ones(128)
    q[1] = 0.0  # query 1: every logit 0 -> every score 0, a row of ties broken by index
    config = HierarchyConfig(pages=1, first_pages=0, recent_pages=1, exact=True)
    got = hierarchical_topk(q, w, batch, 40, summaries=summaries, config=config, backend="reference")
    assert torch.equal(got, _flat(q, w, batch, 40))
    assert keys_sign.sum() == 128


def test_reference_keeps_the_forced_pages_and_selects_inside_kept_pages():
    q, w, batch, summaries = _case("fp8", [64 * 12], [3], positions=False, seed=3)
    config = HierarchyConfig(pages=2, first_pages=1, recent_pages=2)
    got, pages = hierarchical_topk(q, w, batch, 64, summaries=summaries, config=config, backend="reference",
                                   return_pages=True)
    assert pages.tolist() == [5, 5, 5] or all(4 <= p <= 5 for p in pages.tolist())
    forced = forced_pages(torch.tensor([64 * 12] * 3), 12, config)
    assert forced[0].nonzero().flatten().tolist() == [0, 10, 11]
    # 64 entries from at most 5 pages: every chosen entry is in a page of a query's kept set
    assert int((got >= 0).sum(dim=1).min()) == 64


def test_bound_holds_for_every_entry():
    q, w, batch, summaries = _case("fp4", [256], [4], seed=4)
    pages = batch.block_table[0, :4].long()
    bounds = page_score_bounds(q, w, summaries.lower[pages], summaries.upper[pages])  # [T, 4]
    keys = dequantize_entries(batch.pool, batch.fmt, (pages.unsqueeze(1) * 64 + torch.arange(64)).flatten())
    exact = (torch.einsum("thd,nd->thn", q, keys).relu() * w.unsqueeze(-1)).sum(1).view(4, 4, 64)
    assert bool((exact.amax(dim=2) <= bounds).all())


def test_refuses_missing_summaries_and_bad_config():
    q, w, batch, summaries = _case("fp8", [128], [2])
    with pytest.raises(ValueError, match="needs summaries"):
        hierarchical_topk(q, w, batch, 8, backend="reference")
    with pytest.raises(ValueError, match="do not belong"):
        hierarchical_topk(q, w, batch, 8, summaries=PageSummaries.zeros(7), backend="reference")
    with pytest.raises(ValueError, match="recent_pages"):
        HierarchyConfig(recent_pages=0)
    with pytest.raises(ValueError, match="pages"):
        HierarchyConfig(pages=0)
    qc, wc, centred, _ = _case("fp8-centred", [128], [2])
    hierarchical_topk(qc, wc, centred, 8, backend="reference")  # centred pools carry their representatives
    with pytest.raises(ValueError, match="exact mode"):
        hierarchical_topk(qc, wc, centred, 8, config=HierarchyConfig(exact=True), backend="reference")


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8", "fp8-centred"])
def test_device_path_matches_the_reference(triton_backend, device, fmt_name):
    q, w, batch, summaries = _case(fmt_name, [500, 0, 130], [3, 1, 2], seed=5, device=device)
    q = q.bfloat16().float()  # the kernels round q to bf16: give both sides the same products
    config = HierarchyConfig(pages=2, first_pages=1, recent_pages=1)
    ref, ref_pages = hierarchical_topk(*_on_cpu(q, w, batch, summaries)[:3], 24, summaries=_on_cpu(q, w, batch, summaries)[3],
                                       config=config, backend="reference", return_pages=True)
    got, slots, pages = hierarchical_topk(q, w, batch, 24, summaries=summaries, config=config, backend="triton",
                                          return_slots=True, return_pages=True)
    got, slots = got.cpu(), slots.cpu()
    assert torch.equal(pages.cpu(), ref_pages)
    assert torch.equal((got >= 0).sum(1), (ref >= 0).sum(1))
    for row in range(got.shape[0]):  # the same set up to rounding-order swaps at the k-th score (none here)
        assert set(got[row].tolist()) == set(ref[row].tolist()), row
    from dsakit.ops.indexer.reference import topk_to_slots
    assert torch.equal(slots, topk_to_slots(got, batch.block_table.cpu(), batch.query_seq.cpu()))


@pytest.mark.parametrize("fmt_name,queries", [("fp8", [3, 2]), ("fp4", [3, 2]), ("fp8", [7, 1]), ("bf16", [9, 0])])
def test_device_exact_mode_equals_the_flat_device_top_k(triton_backend, device, fmt_name, queries):
    # <= 4 queries per sequence run the flat path's decode kernel, more its prefill tile kernel
    q, w, batch, summaries = _case(fmt_name, [700, 90], queries, seed=6, device=device)
    config = HierarchyConfig(pages=1, first_pages=0, recent_pages=1, exact=True)
    got = hierarchical_topk(q, w, batch, 32, summaries=summaries, config=config, backend="triton")
    assert torch.equal(got, _flat(q, w, batch, 32, backend="triton"))
