"""Hierarchical top-k measured against the flat top-k (issue 31 item 4; docs/hierarchy.md, docs/recall.md).

For the same keys, queries and k, the flat ``index_topk`` and ``hierarchical_topk`` run side by side at
several m (pages stage 1 keeps) and in the exact mode. One record per (keys, format, k, mode):

* ``iou_mean`` / ``iou_min``: set IoU |H ∩ F| / |H ∪ F| of the hierarchical (H) and flat (F) index sets, over
  the query rows (``iou_sum`` / ``rows`` to pool records);
* ``needle_found_flat`` / ``needle_found``: whether the needle is in F / H (synthetic: the last query row, as
  the lab's ``found``; captured: every row that sees a needle entry; None without a needle);
* ``pages_scored``: mean over rows of the pages stage 2 scored / the pages the row sees; ``pages_skipped`` = 1
  minus it; ``equal_flat``: H equals F element for element (what the exact mode guarantees).

Sources: :func:`compare_hierarchy` (the lab's synthetic haystacks, stored through the store op with their page
summaries), :func:`compare_hierarchy_captured` (captured tensors of a real model) and
:func:`compare_hierarchy_random` (standard normal keys and queries). :func:`summarize_comparison` pools them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .._memory import check_instance, check_int, check_int_list
from ..batch import visible_counts
from ..cache import PagedCache
from ..formats import KeyFormat
from ..ops.indexer.config import MAX_K, HierarchyConfig
from ..ops import indexer as indexer_ops
from ..transforms import hadamard_transform
from . import metrics
from .captured import CapturedTensors
from .faults import FAULTS
from .haystack import HaystackPool, StoredHaystack, pages_for, visible_pages
from .settings import ProgressFn, RecallSettings, generator_for, lab_device, rope_table

DEFAULT_PAGE_FACTORS = (0.5, 1.0, 2.0)  # m as multiples of HierarchyConfig's default for the k

Select = Callable[[HierarchyConfig | None], tuple[torch.Tensor, torch.Tensor | None]]


def pages_variants(k: int, factors: Sequence[float] = DEFAULT_PAGE_FACTORS, extra: Sequence[int] = ()) -> list[int]:
    """The m values compared for top-k ``k``: ``factors`` times the default m (rounded, >= 1), plus ``extra``."""
    default = HierarchyConfig().pages_for(k)
    values = {max(1, min(MAX_K, round(f * default))) for f in factors}
    return sorted(values | {check_int("pages", m, 1, MAX_K) for m in extra})


def compare_modes(select: Select, k: int, pages: Sequence[int], exact: bool, seen_pages: torch.Tensor,
                  found: Callable[[torch.Tensor], bool | None], base: dict) -> list[dict]:
    """Flat vs hierarchical records for one set of queries: ``select(config)`` runs the flat top-k (None) or
    the hierarchy, -> (indices [T, k], pages scored [T] or None); ``seen_pages`` [T]: pages each row sees;
    ``found(indices)``: whether the needle is selected (None without a needle)."""
    flat, _ = select(None)
    found_flat = found(flat)
    default = HierarchyConfig().pages_for(k)
    runs = [("approximate", m, HierarchyConfig(pages=m)) for m in pages]
    if exact:
        runs.append(("exact", default, HierarchyConfig(exact=True)))
    seen = seen_pages.detach().cpu().double().clamp(min=1)
    records = []
    for mode, m, config in runs:
        chosen, scored = select(config)
        iou = metrics.set_iou(chosen, flat)
        share = scored.detach().cpu().double() / seen
        records.append(dict(base, kind="hierarchy", index_topk=k, mode=mode, pages=m, default_pages=default,
                            rows=len(iou), iou_sum=sum(iou), iou_mean=sum(iou) / len(iou), iou_min=min(iou),
                            needle_found_flat=found_flat, needle_found=found(chosen),
                            pages_scored=float(share.mean()), pages_skipped=float(1.0 - share.mean()),
                            equal_flat=bool(torch.equal(chosen.cpu(), flat.cpu())),
                            seen_pages_max=int(seen_pages.max())))
    return records


def compare_hierarchy(settings: RecallSettings, page_factors: Sequence[float] = DEFAULT_PAGE_FACTORS,
                      exact: bool = True, on_record: ProgressFn | None = None) -> list[dict]:
    """The lab's needle runs (``settings``' contexts x trials x depths x formats x topks, the same haystacks,
    needles and queries as :func:`dsakit.recall.run_sweep`) with the flat and the hierarchical top-k side by
    side: one record per run and mode (module docstring)."""
    device = lab_device(settings.backend)
    pool = HaystackPool(settings)
    table = rope_table(settings, max(settings.contexts))
    ratio = settings.config.ratio
    records: list[dict] = []
    for ctx in settings.contexts:
        for trial in range(settings.trials):
            hay = pool.get(ctx, trial)
            stored = StoredHaystack(hay, settings.formats, FAULTS["none"], table, settings.backend, device,
                                    summaries=True)
            for d_index, depth in enumerate(settings.depths):
                gen = generator_for(settings.seed, "needle", ctx, trial, d_index)  # run_sweep's draws
                entry, needle, qpos, _, weights, q = stored.needle_queries(depth, gen)
                seen = visible_pages(visible_counts(torch.full((qpos.numel(),), hay.num_entries), qpos, ratio))
                for fmt_name in stored.caches:
                    base = {"source": "synthetic", "format": fmt_name, "context_tokens": ctx,
                            "entries": hay.num_entries, "trial": trial, "depth": depth, "needle_entry": entry,
                            "query_tokens": int(qpos.numel())}
                    with stored.needle_in_place(fmt_name, needle):
                        for k in settings.topks:
                            def select(config, fmt_name=fmt_name, k=k):
                                return stored.topk(fmt_name, q, weights, qpos, k, config)

                            def found(chosen):
                                return metrics.topk_contains(chosen[-1], needle.entries)

                            for rec in compare_modes(select, k, pages_variants(k, page_factors), exact, seen,
                                                     found, base):
                                records.append(rec)
                                if on_record:
                                    on_record(rec)
    return records


def _cache_of(fmt: KeyFormat, keys: torch.Tensor, device: torch.device) -> tuple[PagedCache, int]:
    """A cache of ``fmt`` keeping page summaries, holding ``keys`` [N, 128] (the format's codec) in one sequence."""
    cache = PagedCache(fmt, pages_for(keys.shape[0]), device=device, summaries=True)
    seq = cache.add_sequence()
    cache.write(cache.append(seq, keys.shape[0]), keys.to(device))
    return cache, seq


def compare_hierarchy_captured(captured: CapturedTensors, formats: Sequence[str], topks: Sequence[int],
                               page_factors: Sequence[float] = DEFAULT_PAGE_FACTORS, extra_pages: Sequence[int] = (),
                               exact: bool = True, backend: str = "reference", source: str = "captured",
                               on_record: ProgressFn | None = None) -> list[dict]:
    """Captured tensors (q, k, weights of a real indexer; keys written with each format's codec as
    :func:`dsakit.recall.run_captured` does) with the flat and the hierarchical top-k side by side. The needle
    counts as found when every query row that sees a needle entry selects one."""
    check_instance("captured", captured, CapturedTensors, "see load_captured")
    formats = [KeyFormat.parse(name).name for name in formats]
    topks = [check_int("topks", kk, 1, MAX_K) for kk in check_int_list("topks", topks)]
    device = lab_device(backend)
    q, k = captured.q, captured.k
    if not captured.rotated:
        q, k = hadamard_transform(q), hadamard_transform(k)
    t, n = q.shape[0], k.shape[0]
    pos = captured.query_positions
    counts = visible_counts(torch.full((t,), n), pos, captured.ratio).clamp(max=n) if pos is not None \
        else torch.full((t,), n)
    needle = captured.needle_entries
    needle_rows = [] if needle is None else [i for i in range(t) if bool((needle < counts[i]).any())]

    def found(chosen):
        if needle is None or not needle_rows:
            return None
        return all(metrics.topk_contains(chosen[i], needle) for i in needle_rows)

    records: list[dict] = []
    for name in formats:
        cache, seq = _cache_of(KeyFormat.parse(name), k, device)
        batch = cache.batch([seq], query_lens=[t], query_positions=None if pos is None else pos.to(device),
                            ratio=captured.ratio)
        for kk in topks:
            k_run = min(kk, n)

            def select(config, k_run=k_run):
                if config is None:
                    return indexer_ops.index_topk(q.to(device), captured.weights.to(device), batch, k_run,
                                                  backend=backend).cpu(), None
                chosen, scored = indexer_ops.hierarchical_topk(q.to(device), captured.weights.to(device), batch,
                                                               k_run, config=config, backend=backend,
                                                               return_pages=True)
                return chosen.cpu(), scored.cpu()

            base = {"source": source, "format": name, "context_tokens": n * captured.ratio, "entries": n,
                    "query_tokens": t, "needle_rows": len(needle_rows)}
            for rec in compare_modes(select, kk, pages_variants(kk, page_factors, extra_pages), exact,
                                     visible_pages(counts), found, base):
                records.append(rec)
                if on_record:
                    on_record(rec)
    return records


def compare_hierarchy_random(formats: Sequence[str], entries: Sequence[int], topks: Sequence[int],
                             queries: int = 4, heads: int = 64, seed: int = 0,
                             page_factors: Sequence[float] = DEFAULT_PAGE_FACTORS, exact: bool = True,
                             backend: str = "reference", on_record: ProgressFn | None = None) -> list[dict]:
    """Random keys: standard normal keys [N, 128], queries [T, H, 128] and head weights [T, H] (seeded per N),
    every query seeing every entry; flat vs hierarchical as :func:`compare_hierarchy` (no needle)."""
    formats = [KeyFormat.parse(name).name for name in formats]
    entries = check_int_list("entries", entries, 1)
    topks = [check_int("topks", kk, 1, MAX_K) for kk in check_int_list("topks", topks)]
    device = lab_device(backend)
    records: list[dict] = []
    for n in entries:
        gen = generator_for(seed, "random-keys", n)
        keys = torch.randn(n, 128, generator=gen)
        q = torch.randn(queries, heads, 128, generator=gen)
        weights = torch.randn(queries, heads, generator=gen)
        seen = visible_pages(torch.full((queries,), n))
        for name in formats:
            cache, seq = _cache_of(KeyFormat.parse(name), keys, device)
            batch = cache.batch([seq], query_lens=[queries])
            for kk in topks:
                k_run = min(kk, n)

                def select(config, k_run=k_run):
                    if config is None:
                        return indexer_ops.index_topk(q.to(device), weights.to(device), batch, k_run,
                                                      backend=backend).cpu(), None
                    chosen, scored = indexer_ops.hierarchical_topk(q.to(device), weights.to(device), batch, k_run,
                                                                   config=config, backend=backend, return_pages=True)
                    return chosen.cpu(), scored.cpu()

                base = {"source": "random", "format": name, "context_tokens": n * 4, "entries": n,
                        "query_tokens": queries}
                for rec in compare_modes(select, kk, pages_variants(kk, page_factors), exact, seen,
                                         lambda chosen: None, base):
                    records.append(rec)
                    if on_record:
                        on_record(rec)
    return records


def summarize_comparison(records: Sequence[dict]) -> list[dict]:
    """Records pooled per (source, format, context, k, mode, m): IoU mean over every query row and its
    minimum, needles found (flat / hierarchical / runs with a needle), mean pages scored, whether every run
    equalled the flat top-k."""
    groups: dict[tuple, list[dict]] = {}
    for rec in records:
        if rec.get("kind") != "hierarchy":
            continue
        key = (rec["source"], rec["format"], rec["context_tokens"], rec["index_topk"], rec["mode"], rec["pages"])
        groups.setdefault(key, []).append(rec)
    rows = []
    for (source, fmt, ctx, k, mode, m), recs in groups.items():
        needles = [r for r in recs if r["needle_found"] is not None]
        rows.append({
            "source": source, "format": fmt, "context_tokens": ctx, "entries": recs[0]["entries"],
            "index_topk": k, "mode": mode, "pages": m, "default_pages": recs[0]["default_pages"],
            "runs": len(recs), "query_rows": sum(r["rows"] for r in recs),
            "iou_mean": sum(r["iou_sum"] for r in recs) / sum(r["rows"] for r in recs),
            "iou_min": min(r["iou_min"] for r in recs),
            "needle_runs": len(needles),
            "needle_found_flat": sum(bool(r["needle_found_flat"]) for r in needles),
            "needle_found": sum(bool(r["needle_found"]) for r in needles),
            "pages_scored": sum(r["pages_scored"] for r in recs) / len(recs),
            "pages_skipped": sum(r["pages_skipped"] for r in recs) / len(recs),
            "equal_flat": all(r["equal_flat"] for r in recs),
            "seen_pages_max": max(r["seen_pages_max"] for r in recs),
        })
    return rows
