"""One haystack stored in every format, and the runs of needles against it.

One *run* = one haystack of N entries (context L = N * ratio tokens), one needle at a relative depth, the
last ``query_tokens`` tokens of the context as queries, one key format, one ``index_topk``::

    exact path:  keys -> prepare_index_keys (fp32, correct conventions) -> index_scores_dense -> select_topk
    format path: keys -> store_index_keys (paged cache of the format) -> index_scores / index_topk (ops,
                 ``backend=``), or, for the read faults, read_entries -> the fault's decoder -> scores
    metrics:     needle rank (last query token, which sees every entry) under both paths, found (a needle
                 entry in the op's top-k), set recall of the format's top-k against the exact top-k (mean
                 over the query tokens), score margin, NaN fraction, leaked future entries, score scale.

The needle is written into the cache slots of its entries with the store op before the runs of a depth
and the haystack's own entries are stored back afterwards, like a cache being overwritten in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence

import torch

from .._memory import check_instance
from ..cache import PagedCache
from ..pool import read_centres, read_entries, summarize_pages
from ..formats import ENTRIES_PER_PAGE, KeyFormat, is_centred
from ..ops import indexer as indexer_ops
from ..ops import store as store_ops
from ..ops._backend import resolve_backend
from ..ops.indexer.config import HierarchyConfig
from ..ops.indexer.reference import visible_counts
from ..presets import KeyTransform
from ..transforms import RopeLayout
from . import metrics
from .faults import Fault, decode_fp8_entries
from .settings import RecallSettings, generator_for
from .synthetic import (Haystack, SyntheticConfig, make_haystack, make_queries, model_weights, needle_direction,
                        needle_entry_for_depth, place_needle, prepare_queries, query_positions)


def swapped_layout(layout: RopeLayout) -> RopeLayout:
    other = "half-split" if layout.pairing == "interleaved" else "interleaved"
    return RopeLayout(other, layout.placement)


def key_transform_for(config: SyntheticConfig, fault: Fault) -> KeyTransform:
    tr = config.geometry.key_transform
    if fault.key_rope_swap:
        tr = dataclasses.replace(tr, rope_layout=swapped_layout(tr.rope_layout))
    return tr


def pages_for(entries: int) -> int:
    return max(1, (entries + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE)


def needle_rows(fmt: KeyFormat, entries: torch.Tensor, num_entries: int) -> torch.Tensor:
    """Entries (int64 [R]) to store again when ``entries`` change: themselves, or for a page-centred format
    every entry (< num_entries) of their pages, since a new entry 0 changes its page's centre."""
    entries = entries.long()
    if not is_centred(fmt):
        return entries
    pages = torch.unique(entries // ENTRIES_PER_PAGE)
    rows = (pages[:, None] * ENTRIES_PER_PAGE + torch.arange(ENTRIES_PER_PAGE)).reshape(-1)
    return rows[rows < num_entries]


def with_needle(keys: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor, needle_keys: torch.Tensor) -> torch.Tensor:
    """keys[rows] with the needle's keys in place at its ``entries`` (a subset of rows)."""
    out = keys[rows].clone()
    position = {int(r): i for i, r in enumerate(rows.tolist())}
    out[torch.tensor([position[int(e)] for e in entries.tolist()], dtype=torch.long)] = needle_keys
    return out


def finite_or_none(x: float | None) -> float | None:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return None
    return float(x)


def visible_pages(visible: torch.Tensor) -> torch.Tensor:
    """Pages a query sees (its partial last page included) from its visible entry counts [T]."""
    return (visible.long() + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE


class StoredHaystack:
    """A haystack stored through the store op in one paged cache per format (with a fault's key conventions).

    ``hierarchy``: the top-k op of the runs is ``hierarchical_topk`` with this config instead of the flat
    ``index_topk``; ``summaries`` (implied by ``hierarchy``): the caches keep their page summaries
    (``PagedCache(..., summaries=True)``), also where a needle overwrites entries in place."""

    def __init__(self, haystack: Haystack, formats: Sequence[str], fault: Fault, rope_cos_sin: torch.Tensor,
                 backend: str, device: torch.device, hierarchy: HierarchyConfig | None = None,
                 summaries: bool = False):
        if hierarchy is not None:
            check_instance("hierarchy", hierarchy, HierarchyConfig, "or None")
        self.hierarchy = hierarchy
        self.haystack = haystack
        self.config = haystack.config
        self.fault = fault
        self.backend = backend
        self.device = device
        self.table = rope_cos_sin
        self.table_dev = rope_cos_sin.to(device)
        geo = self.config.geometry
        n = haystack.num_entries
        self.entry_positions = torch.arange(n) * self.config.ratio
        self.exact_keys = store_ops.prepare_index_keys(
            keys=haystack.keys, positions=self.entry_positions, rope_cos_sin=rope_cos_sin,
            norm_weight=haystack.norm_weight, transform=geo.key_transform)
        self.key_transform = key_transform_for(self.config, fault)
        self.caches: dict[str, tuple[PagedCache, int, torch.Tensor]] = {}
        for name in formats:
            fmt = KeyFormat.parse(name)
            cache = PagedCache(fmt, pages_for(n), device=device, summaries=summaries or hierarchy is not None)
            seq = cache.add_sequence()
            slots = cache.append(seq, n)
            self.caches[fmt.name] = (cache, seq, slots)
            self._store(fmt.name, haystack.keys, self.entry_positions, slots)

    def _store(self, fmt_name: str, keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        cache = self.caches[fmt_name][0]
        store_ops.store_index_keys(keys=keys.to(self.device), positions=positions.to(self.device),
                                   slots=slots.to(self.device), pool=cache.pool, fmt=cache.fmt,
                                   rope_cos_sin=self.table_dev, norm_weight=self.haystack.norm_weight.to(self.device),
                                   transform=self.key_transform, backend=self.backend, summaries=cache.summaries)

    def _rewrite(self, fmt_name: str, keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Store rows again in place (a needle and its removal). The store op summarizes a page over its
        entries up to the highest one stored (pages appended in order); a rewrite inside a full page must
        summarize it over every entry it holds, so the touched pages are summarized again."""
        self._store(fmt_name, keys, positions, slots)
        cache, _, all_slots = self.caches[fmt_name]
        if cache.summaries is None:
            return
        page_of = all_slots.detach().cpu().long() // ENTRIES_PER_PAGE
        held = torch.bincount(page_of, minlength=cache.pool.shape[0])  # entries of the haystack per page
        pages = torch.unique(slots.detach().cpu().long() // ENTRIES_PER_PAGE)
        summarize_pages(cache.pool, cache.fmt, pages, held[pages], cache.summaries)

    @contextlib.contextmanager
    def needle_in_place(self, fmt_name: str, needle):
        """Within the block the cache of ``fmt_name`` holds ``needle`` (its entries, or for a page-centred
        format its whole pages stored again: a needle at entry 0 of a page is that page's centre); the
        haystack's own entries are stored back afterwards, so the next needle starts from a clean cache."""
        cache, _, slots = self.caches[fmt_name]
        hay = self.haystack
        rows = needle_rows(cache.fmt, needle.entries, hay.num_entries)
        row_keys = with_needle(hay.keys, rows, needle.entries, needle.keys)
        row_slots = slots[rows.to(slots.device)]
        self._rewrite(fmt_name, row_keys, rows * self.config.ratio, row_slots)
        try:
            yield
        finally:
            self._rewrite(fmt_name, hay.keys[rows], rows * self.config.ratio, row_slots)

    def topk(self, fmt_name: str, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, k: int,
             hierarchy: HierarchyConfig | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(CPU int32 [T, k] entry indices, CPU int64 [T] pages scored or None): the flat ``index_topk``
        (``hierarchy`` None) or ``hierarchical_topk`` with ``hierarchy`` over the stored haystack of one
        format (the caches must keep summaries: ``hierarchy`` or ``summaries=True`` at construction)."""
        common = self.op_kwargs(fmt_name, q, weights, positions)
        if hierarchy is None:
            return indexer_ops.index_topk(**common, k=k, backend=self.backend).cpu(), None
        indices, pages = indexer_ops.hierarchical_topk(**common, k=k, config=hierarchy, backend=self.backend,
                                                       return_pages=True)
        return indices.cpu(), pages.cpu()

    def needle_queries(self, depth: float, generator: torch.Generator):
        """One needle at relative ``depth`` and the run's queries -> (entry, needle, qpos [T], q_pre [T, H, D]
        (before rope), weights [T, H], q [T, H, D] (roped and rotated as the format path scores them))."""
        cfg = self.config
        hay = self.haystack
        qpos = query_positions(cfg, hay.context_tokens)
        correct_visible = visible_counts(torch.full((qpos.numel(),), hay.num_entries), qpos, cfg.ratio)
        entry = needle_entry_for_depth(depth, int(correct_visible[-1]))
        needle = place_needle(hay, entry, needle_direction(hay, generator))
        q_pre, weights = make_queries(hay, needle, qpos, generator)
        tr = cfg.geometry.key_transform
        q_fmt = prepare_queries(q_pre, qpos, self.table, tr.rope_layout, tr.rope_dim,
                                tr.hadamard and self.fault.query_hadamard)
        return entry, needle, qpos, q_pre, weights, q_fmt

    def op_kwargs(self, fmt_name: str, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor) -> dict:
        """Keyword arguments of ``index_scores`` / ``index_topk`` for queries q [T, H, D], weights [T, H] and
        positions [T] against the stored haystack of one format (one sequence, on the lab's device)."""
        cache, seq, _ = self.caches[fmt_name]
        return dict(q=q.to(self.device), weights=weights.to(self.device),
                    batch=cache.batch([seq], query_lens=[q.shape[0]], query_positions=positions.to(self.device),
                                      ratio=self.config.ratio))

    def _scores_and_topk(self, fmt_name: str, q: torch.Tensor, weights: torch.Tensor, op_positions: torch.Tensor,
                         ks: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """(scores [T, N], top-k per k, pages scored [T] per k: only with the hierarchy)."""
        cache, seq, slots = self.caches[fmt_name]
        if self.fault.custom_reader:
            values, scales = read_entries(cache.pool, cache.fmt, slots)
            if cache.fmt.kind == "fp8":
                keys = decode_fp8_entries(values, scales, self.fault)
            else:  # the read faults of fp4 residuals: only a missing centre
                keys = KeyFormat.parse(cache.fmt.kind).dequantize(values, scales)
            if is_centred(cache.fmt) and self.fault.centre:
                keys = keys + read_centres(cache.pool, cache.fmt, slots)  # the fault is in the residual's decoding
            scores = indexer_ops.index_scores_dense(q, weights, keys, op_positions, self.config.ratio)
            return scores, {k: indexer_ops.select_topk(scores, k) for k in ks}, {}
        common = self.op_kwargs(fmt_name, q, weights, op_positions)
        scores = indexer_ops.index_scores(**common, backend=self.backend).float().cpu()
        if self.hierarchy is not None:
            chosen = {k: self.topk(fmt_name, q, weights, op_positions, k, self.hierarchy) for k in ks}
            return scores, {k: c[0] for k, c in chosen.items()}, {k: c[1] for k, c in chosen.items()}
        if resolve_backend(self.backend, cache.pool) == "reference":
            # index_topk's reference is select_topk(index_scores(...)): reuse the scores instead of a second pass
            topk = {k: indexer_ops.select_topk(scores, k) for k in ks}
        else:
            topk = {k: indexer_ops.index_topk(**common, k=k, backend=self.backend).cpu() for k in ks}
        return scores, topk, {}

    def run_depth(self, depth: float, generator: torch.Generator, ks: Sequence[int]) -> list[dict]:
        """Place one needle at ``depth`` and run every stored format and every k; one record per (format, k)."""
        cfg = self.config
        hay = self.haystack
        ctx = hay.context_tokens
        ratio = cfg.ratio
        entry, needle, qpos, q_pre, weights, q_fmt = self.needle_queries(depth, generator)
        correct_visible = visible_counts(torch.full((qpos.numel(),), hay.num_entries), qpos, ratio)
        tr = cfg.geometry.key_transform
        q_exact = prepare_queries(q_pre, qpos, self.table, tr.rope_layout, tr.rope_dim, tr.hadamard)
        exact_keys = self.exact_keys.clone()
        exact_keys[needle.entries] = store_ops.prepare_index_keys(
            keys=needle.keys, positions=needle.entries * ratio, rope_cos_sin=self.table,
            norm_weight=hay.norm_weight, transform=tr)
        exact_scores = indexer_ops.index_scores_dense(q_exact, weights, exact_keys, qpos, ratio)
        exact_topk = {k: indexer_ops.select_topk(exact_scores, k) for k in ks}
        exact_rank = metrics.needle_rank(exact_scores[-1], needle.entries)
        op_positions = qpos + self.fault.visibility_shift * ratio
        records = []
        op_visible = visible_counts(torch.full((qpos.numel(),), hay.num_entries), op_positions, ratio)
        for fmt_name in self.caches:
            with self.needle_in_place(fmt_name, needle):
                scores, topk, pages = self._scores_and_topk(fmt_name, q_fmt, weights, op_positions, ks)
            rank = metrics.needle_rank(scores[-1], needle.entries)
            for k in ks:
                records.append({
                    "kind": "run", "source": "synthetic", "fault": self.fault.name, "format": fmt_name,
                    "index_topk": k, "context_tokens": ctx, "entries": hay.num_entries, "depth": depth,
                    "needle_entry": entry, "needle_entries": needle.entries.tolist(),
                    "needle_rank": rank, "exact_rank": exact_rank,
                    "found": metrics.topk_contains(topk[k][-1], needle.entries),
                    "exact_found": metrics.topk_contains(exact_topk[k][-1], needle.entries),
                    "set_recall": metrics.set_recall(topk[k], exact_topk[k]),
                    "margin": finite_or_none(metrics.score_margin(scores[-1], needle.entries)),
                    "exact_margin": finite_or_none(metrics.score_margin(exact_scores[-1], needle.entries)),
                    "nan_fraction": metrics.nan_fraction(scores[-1]),
                    "leaked": metrics.future_selected(topk[k], correct_visible),
                    "needle_score_ratio": finite_or_none(
                        metrics.needle_score_ratio(scores[-1], exact_scores[-1], needle.entries)),
                    "query_tokens": int(qpos.numel()),
                    "selection": "flat" if self.hierarchy is None else "hierarchical",
                    # share of the visible pages stage 2 scored exactly (mean over the query tokens)
                    "pages_scored": (None if k not in pages else float(
                        (pages[k].double() / visible_pages(op_visible).clamp(min=1).double()).mean())),
                })
        return records


class HaystackPool:
    """Haystacks by (context, trial), drawn once per sweep from seeded generators."""

    def __init__(self, settings: RecallSettings):
        self.settings = settings
        self.norm_weight, self.ape = model_weights(settings.config, generator_for(settings.seed, "model"))
        self._cache: dict[tuple[int, int], Haystack] = {}

    def get(self, ctx: int, trial: int) -> Haystack:
        key = (ctx, trial)
        if key not in self._cache:
            cfg = self.settings.config
            self._cache = {}  # keep one haystack alive at a time (they can be large)
            self._cache[key] = make_haystack(cfg, ctx // cfg.ratio, generator_for(self.settings.seed, "haystack", ctx, trial),
                                             self.norm_weight, self.ape)
        return self._cache[key]
