"""Hierarchical selection inside V4Attention (issue 31): ``V4AttentionConfig.hierarchy``.

A CSA block with ``hierarchy=HierarchyConfig(...)`` keeps page summaries in its index-key cache and selects with
``hierarchical_topk``; with ``hierarchy=None`` (the default) it is the flat block. Same weights on both sides:

* pages that cover every page of the sequence (the default m = 16 >= its 4 pages): output equal to the flat
  block's, bit for bit (the reference backend: the same entries, the same arithmetic);
* ``exact=True`` with the fewest pages (m = 1, no first page, one recent page): equal to the flat block;
* the approximate mode with those pages selects from at most 2 pages per query (the flat one from more), so the
  option is really on;
* the summaries the layer cache holds after a chunked prefill (the pool grows twice while it has entries) and
  decode steps equal ``summarize_pages`` of its pool;
* a call that fails after its stores leaves the summaries as they were;
* the block's select stage on the Triton top-k ops (``TRITON_INTERPRET=1`` on the CPU; a few queries: the
  interpreter runs the whole block at ~10 s per 20 tokens): covering pages and the exact mode select the flat
  top-k's entries.
"""

from __future__ import annotations

import pytest
import torch

from dsakit.formats import ENTRIES_PER_PAGE
from dsakit.layers import V4Attention, V4AttentionConfig
from dsakit.ops.indexer import HierarchyConfig
from dsakit.pool import PageSummaries, summarize_pages

HIDDEN, Q_LORA = 64, 32
SEQ, SPLIT = 792, 780  # 198 index entries: 4 pages, the last one partial
FEWEST = dict(pages=1, first_pages=0, recent_pages=1)  # at most 2 pages per query
pytestmark = pytest.mark.usefixtures("one_thread")


def make_layer(fmt: str, hierarchy, *, backend: str = "reference", heads: int = 2, device: str = "cpu",
               query_chunk: int = 4096) -> V4Attention:
    """A CSA block with Gaussian weights from a fixed seed (the same for every hierarchy setting)."""
    with torch.device(device):
        layer = V4Attention("csa", HIDDEN, Q_LORA, num_heads=heads, o_groups=2, o_lora_rank=16, index_heads=4,
                            index_topk=8, index_key_format=fmt, window=16, backend=backend, hierarchy=hierarchy,
                            query_chunk=query_chunk)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
    return layer


def hidden(s: int = SEQ, device: str = "cpu") -> torch.Tensor:
    return torch.randn(s, HIDDEN, generator=torch.Generator().manual_seed(1)).to(device)


def run(layer: V4Attention, x: torch.Tensor, split: int, max_tokens: int = 1024):
    """Prefill x[:split], then decode the rest one token at a time -> (outputs [S, hidden], cache, seq)."""
    cache = layer.new_cache(max_tokens, device=x.device)
    seq = cache.add_sequence()
    with torch.no_grad():
        out = [layer(x[:split], cache, seq)] + [layer(x[t:t + 1], cache, seq) for t in range(split, x.shape[0])]
    return torch.cat(out), cache, seq


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp8-centred", "fp4", "fp4-centred"])
def test_covering_pages_and_the_exact_mode_equal_the_flat_layer(fmt):
    x = hidden()
    flat, flat_cache, _ = run(make_layer(fmt, None), x, SPLIT)
    assert flat_cache.index.summaries is None  # off by default: no side table
    for hierarchy in (HierarchyConfig(), HierarchyConfig(exact=True, **FEWEST)):
        out, cache, _ = run(make_layer(fmt, hierarchy), x, SPLIT)
        assert cache.index.summaries is not None
        assert torch.equal(out, flat), hierarchy


def pages_per_query(layer: V4Attention, x: torch.Tensor) -> torch.Tensor:
    """Distinct index pages among each query's selected entries, after a prefill of x."""
    cache = layer.new_cache(1024)
    seq = cache.add_sequence()
    with torch.no_grad():
        layer(x, cache, seq)
        positions = torch.arange(x.shape[0])
        table = layer.rope_table(x.shape[0], x.device)
        _, q_res = layer.queries(x, positions, table)
        qi, w = layer.index_queries(x, q_res, positions, table)
        entries = layer.select(qi, w, cache, seq, positions)
    slots_to_entry = {int(s): e for e, s in enumerate(cache.slot_map("extra", seq)[1:].tolist()) if s >= 0}
    pages = [{slots_to_entry[int(s)] // ENTRIES_PER_PAGE for s in row if s >= 0} for row in entries]
    return torch.tensor([len(p) for p in pages])


def test_the_approximate_mode_selects_from_the_pages_it_keeps():
    x = hidden(SPLIT)
    flat = pages_per_query(make_layer("fp8", None), x)
    fewest = pages_per_query(make_layer("fp8", HierarchyConfig(**FEWEST)), x)
    assert int(flat.max()) > 2  # the flat top-k spreads over more pages than the hierarchy keeps
    assert int(fewest.max()) <= 2


@pytest.mark.parametrize("fmt", ["fp8", "fp4-centred"])
def test_layer_cache_summaries_equal_summarize_pages_of_its_pool(fmt):
    """Prefill in chunks of 256 tokens (64 entries: a page each) into a cache made for 64 tokens, so the index
    pool grows while it holds entries (its summaries copied with the pages), then decode 12 tokens."""
    layer = make_layer(fmt, HierarchyConfig(pages=2), query_chunk=256)
    _, cache, seq = run(layer, hidden(), SPLIT, max_tokens=64)
    index = cache.index
    assert index.num_pages >= 4  # grew from the 1 page a 64-token cache starts with
    length = index.length(cache.id_in("index", seq))
    pages = index.slots(cache.id_in("index", seq))[::ENTRIES_PER_PAGE] // ENTRIES_PER_PAGE
    counts = torch.clamp(length - torch.arange(pages.numel()) * ENTRIES_PER_PAGE, max=ENTRIES_PER_PAGE)
    expected = PageSummaries.zeros(index.num_pages)
    summarize_pages(index.pool, index.fmt, pages, counts, expected)
    for field in ("centre", "lower", "upper"):
        got, want = getattr(index.summaries, field)[pages], getattr(expected, field)[pages]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), field


def test_triton_selection_in_the_layer(triton_backend, device):
    """The block's select stage on the Triton top-k ops (under the interpreter: 2 queries of a 792-token
    sequence whose 4 index pages a reference-backend block stored): covering pages and the exact mode with the
    fewest pages select the flat top-k's entries; the approximate mode with the fewest pages keeps to 2 pages."""
    layer = make_layer("fp8", HierarchyConfig(), device=device)
    x = hidden(SEQ, device)
    cache = layer.new_cache(1024, device=device)
    seq = cache.add_sequence()
    base = layer.layer_config
    positions = torch.tensor([SPLIT, SEQ - 1], device=device)
    chosen = {}
    with torch.no_grad():
        layer(x, cache, seq)
        table = layer.rope_table(SEQ, device)
        _, q_res = layer.queries(x[positions], positions, table)
        qi, w = layer.index_queries(x[positions], q_res, positions, table)
        for name, hierarchy in (("flat", None), ("covering", HierarchyConfig()),
                                ("exact", HierarchyConfig(exact=True, **FEWEST)), ("fewest", HierarchyConfig(**FEWEST))):
            layer.layer_config = base.replace(backend=triton_backend, hierarchy=hierarchy)
            chosen[name] = layer.select(qi, w, cache, seq, positions).cpu()
    assert torch.equal(chosen["covering"], chosen["flat"]) and torch.equal(chosen["exact"], chosen["flat"])
    entry_of = {s: e for e, s in enumerate(cache.slot_map("extra", seq)[1:].tolist()) if s >= 0}
    for row in chosen["fewest"]:
        assert len({entry_of[int(s)] // ENTRIES_PER_PAGE for s in row if s >= 0}) <= 2


def summaries_of(cache, seq) -> dict:
    index = cache.index
    pages = index.slots(cache.id_in("index", seq))[::ENTRIES_PER_PAGE] // ENTRIES_PER_PAGE
    return {field: getattr(index.summaries, field)[pages].view(torch.int16).clone()
            for field in ("centre", "lower", "upper")}


def test_failed_call_puts_the_summaries_back(monkeypatch):
    """A call that fails after its index keys are stored (in the attention) leaves the summary rows of the
    sequence's pages as they were (its partial last page was re-summarized by the stores, then back over
    the entries kept), and the retry gives the output of a run that never failed."""
    layer = make_layer("fp8", HierarchyConfig(pages=1))
    x = hidden(400)
    clean = layer.new_cache(1024)
    clean_seq = clean.add_sequence()
    cache = layer.new_cache(1024)
    seq = cache.add_sequence()
    with torch.no_grad():
        want = [layer(x[:300], clean, clean_seq), layer(x[300:], clean, clean_seq)]
        assert torch.equal(layer(x[:300], cache, seq), want[0])  # 75 entries: page 1 holds 11
        before = summaries_of(cache, seq)
        attend = layer.attend

        def failing_attend(*args, **kwargs):
            raise RuntimeError("injected failure")

        monkeypatch.setattr(layer, "attend", failing_attend)
        with pytest.raises(RuntimeError, match="injected"):
            layer(x[300:], cache, seq)  # stores 25 more entries into page 1, then fails
        monkeypatch.setattr(layer, "attend", attend)
        after = summaries_of(cache, seq)
        assert all(torch.equal(before[f], after[f]) for f in before)
        assert torch.equal(layer(x[300:], cache, seq), want[1])
    assert all(torch.equal(a, b) for a, b in zip(summaries_of(cache, seq).values(),
                                                 summaries_of(clean, clean_seq).values()))


def test_hierarchy_setting_is_checked():
    config = V4AttentionConfig.from_preset("csa", HIDDEN, Q_LORA, index_key_format="fp8")
    assert config.hierarchy is None
    with pytest.raises(ValueError, match="hierarchy must be a HierarchyConfig or None"):
        config.replace(hierarchy=16)
    with pytest.raises(ValueError, match="'hca' layer has no indexer"):
        V4AttentionConfig.from_preset("hca", HIDDEN, Q_LORA, hierarchy=HierarchyConfig())
    assert config.replace(hierarchy=HierarchyConfig(pages=3)).hierarchy.pages == 3
