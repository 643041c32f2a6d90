"""The recall lab's hierarchy option and its flat-vs-hierarchical comparison (issue 31 item 4), at toy sizes."""

import pytest
import torch

from dsakit.formats import ENTRIES_PER_PAGE
from dsakit.pool import PageSummaries, summarize_pages
from dsakit.recall import RecallSettings, report, run_sweep
from dsakit.recall.faults import FAULTS
from dsakit.recall.haystack import HaystackPool, StoredHaystack
from dsakit.recall.hierarchy import (compare_hierarchy, compare_hierarchy_captured, compare_hierarchy_random,
                                     pages_variants, summarize_comparison)
from dsakit.recall.captured import CapturedTensors
from dsakit.recall.settings import generator_for, rope_table


def _settings(**kw):
    base = dict(formats=("fp8", "fp8-centred"), contexts=(2048,), depths=(0.5,), topks=(16,), horizon=False,
                faults=())
    base.update(kw)
    return RecallSettings(**base)


def test_comparison_iou_one_when_m_covers_every_page_and_exact_equals_flat():
    # 2048 tokens = 512 entries = 8 pages; k 16: default m 16 covers them all, 0.25x (4) does not
    records = compare_hierarchy(_settings(), page_factors=(0.25, 1.0))
    rows = {(r["format"], r["mode"], r["pages"]): r for r in summarize_comparison(records)}
    for fmt in ("fp8", "fp8-centred"):
        full = rows[(fmt, "approximate", 16)]
        assert full["seen_pages_max"] == 8
        assert full["iou_mean"] == 1.0 and full["equal_flat"] and full["pages_scored"] == 1.0
        assert full["needle_found"] == full["needle_found_flat"]
        half = rows[(fmt, "approximate", 4)]
        assert half["pages_scored"] < 1.0 and half["iou_mean"] < 1.0
        exact = rows[(fmt, "exact", 16)]
        assert exact["equal_flat"] and exact["iou_mean"] == 1.0 and exact["pages_skipped"] >= 0.0


def test_sweep_hierarchy_option_matches_flat_when_every_page_is_kept():
    flat = run_sweep(_settings())
    hier = run_sweep(_settings(hierarchy=True, hierarchy_pages=16))
    exact = run_sweep(_settings(hierarchy=True, hierarchy_pages=1, hierarchy_exact=True))
    assert [r["selection"] for r in hier] == ["hierarchical"] * len(hier)
    for f, h, e in zip(flat, hier, exact):
        assert f["selection"] == "flat" and f["pages_scored"] is None
        assert (h["found"], h["set_recall"], h["pages_scored"]) == (f["found"], f["set_recall"], 1.0)
        assert (e["found"], e["set_recall"]) == (f["found"], f["set_recall"])
    with pytest.raises(ValueError, match="hierarchy_pages"):
        _settings(hierarchy_pages=8)  # without hierarchy=True it would change nothing


def test_needle_rewrite_keeps_page_summaries_of_whole_pages():
    # the store op summarizes a page over its entries up to the highest one stored; a needle written inside a
    # full page must leave the summary of the whole page (fails if only the store op's upkeep runs)
    settings = _settings(formats=("fp8",))
    hay = HaystackPool(settings).get(2048, 0)
    stored = StoredHaystack(hay, ["fp8"], FAULTS["none"], rope_table(settings, 2048), "reference",
                            torch.device("cpu"), summaries=True)
    _, needle, *_ = stored.needle_queries(0.3, generator_for(0, "test"))
    cache, _, slots = stored.caches["fp8"]
    pages = torch.arange(cache.pool.shape[0])
    counts = torch.bincount(slots.long() // ENTRIES_PER_PAGE, minlength=pages.numel())

    def full_page_summaries():
        want = PageSummaries.zeros(pages.numel())
        summarize_pages(cache.pool, cache.fmt, pages, counts, want)
        return want

    assert int(needle.entries.max()) % ENTRIES_PER_PAGE < ENTRIES_PER_PAGE - 1  # inside a page
    with stored.needle_in_place("fp8", needle):
        want = full_page_summaries()
        for field in ("centre", "lower", "upper"):
            assert torch.equal(getattr(cache.summaries, field), getattr(want, field))
    want = full_page_summaries()
    assert torch.equal(cache.summaries.centre, want.centre) and torch.equal(cache.summaries.upper, want.upper)


def test_captured_and_random_comparisons():
    gen = torch.Generator().manual_seed(0)
    n, t = 640, 3  # 10 pages
    captured = CapturedTensors(q=torch.randn(t, 4, 128, generator=gen), k=torch.randn(n, 128, generator=gen),
                               weights=torch.rand(t, 4, generator=gen), needle_entries=torch.tensor([300]),
                               query_positions=torch.tensor([2555, 2558, 2559]), ratio=4, rotated=False)
    rows = summarize_comparison(compare_hierarchy_captured(captured, ["bf16"], [16], page_factors=(1.0,),
                                                           extra_pages=(2,)))
    by_m = {(r["mode"], r["pages"]): r for r in rows}
    assert by_m[("approximate", 16)]["iou_mean"] == 1.0 and by_m[("exact", 16)]["equal_flat"]
    assert by_m[("approximate", 2)]["pages_scored"] <= 5 / 10 + 1e-9  # m 2 + first + 2 recent of 10 pages
    random_rows = summarize_comparison(compare_hierarchy_random(["fp8"], [512], [16], queries=2))
    assert all(r["equal_flat"] for r in random_rows if r["mode"] == "exact")
    assert pages_variants(512) == [16, 32, 64] and pages_variants(16, (1.0,), (2, 4)) == [2, 4, 16]


def test_cli_hierarchy_options(tmp_path):
    from typer.testing import CliRunner

    from dsakit.cli import app

    common = ["recall", "--contexts", "1024", "--depths", "0.5", "--topk", "16", "--formats", "bf16",
              "--no-horizon", "--faults", "off", "--no-plot", "--quiet"]
    result = CliRunner().invoke(app, common + ["--hierarchy", "--hierarchy-pages", "4", "--out", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    runs = [r for r in report.read_jsonl(tmp_path / "a" / "runs.jsonl") if r["kind"] == "run"]
    assert runs and all(r["selection"] == "hierarchical" and r["settings"]["hierarchy_pages"] == 4 for r in runs)
    result = CliRunner().invoke(app, common + ["--compare-hierarchy", "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert "hierarchical vs flat" in result.output
    rows = report.read_jsonl(tmp_path / "b" / "runs.jsonl")
    assert {r["mode"] for r in rows} == {"approximate", "exact"} and all(r["iou_mean"] == 1.0 for r in rows)
