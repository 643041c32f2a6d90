"""The recall horizon: bisection over context length of the longest context where the needle is still found.

The horizon uses the cheapest faithful path: each haystack is stored once per format through the
store op and read back dequantized; a batch of trials (each its own needle entry, direction and queries,
one query token at the end of the context) is scored with ``index_scores_dense`` and the needle's entries
are patched in from their own store. ``rank < k`` is exactly "in the reference top-k".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..cache import PagedCache
from ..formats import ENTRIES_PER_PAGE, KeyFormat, is_centred
from ..ops import indexer as indexer_ops
from ..ops import store as store_ops
from . import metrics
from .haystack import pages_for, needle_rows, with_needle
from .settings import ProgressFn, RecallSettings, generator_for, lab_device, rope_table
from .synthetic import (Haystack, make_haystack, make_queries, model_weights, needle_direction, needle_entry_for_depth,
                        place_needles, prepare_queries, query_positions)


def horizon_grid(settings: RecallSettings) -> list[int]:
    """Context lengths (tokens, multiples of the ratio) from horizon_min to horizon_max, geometric."""
    ratio = settings.config.ratio
    lo, hi = settings.horizon_min, settings.horizon_max
    if lo == hi:
        return [lo - lo % ratio or ratio]
    steps = max(1, round(math.log2(hi / lo) * settings.horizon_steps_per_octave))
    grid = []
    for i in range(steps + 1):
        ctx = lo * (hi / lo) ** (i / steps)
        ctx = max(ratio, int(round(ctx / ratio)) * ratio)
        if not grid or ctx > grid[-1]:
            grid.append(ctx)
    return grid


def haystack_prefix(haystack: Haystack, num_entries: int) -> Haystack:
    """The first ``num_entries`` entries of a haystack as a haystack of its own.

    Pooling is causal (entry j reads tokens up to ratio * (j + 1) - 1), so a prefix of a long haystack is
    exactly the haystack a shorter context would have produced.
    """
    if not 1 <= num_entries <= haystack.num_entries:
        raise ValueError(f"prefix of {num_entries} entries outside 1..{haystack.num_entries}")
    tokens = num_entries * haystack.config.ratio
    return dataclasses.replace(haystack, keys=haystack.keys[:num_entries],
                               gate=None if haystack.gate is None else haystack.gate[:tokens])


class HorizonHaystack:
    """One haystack at the longest horizon length, stored once per format through the store op and read back.

    :meth:`ranks` runs trials at a context length L on its prefix. Trial i draws its relative needle depth,
    needle direction, queries and head weights from a generator of its own index, the same at every length
    (common random numbers): the found-rate then falls smoothly with L and the bisection sees a consistent
    curve. Each trial has one query token at the end of the context (it sees every entry); its needle
    entries go through the store op too and are patched into the scores.
    """

    def __init__(self, haystack: Haystack, rope_cos_sin: torch.Tensor, backend: str, device: torch.device, seed: int):
        self.haystack = haystack
        self.table = rope_cos_sin
        self.backend = backend
        self.device = device
        self.seed = seed
        self._keys: dict[str, torch.Tensor] = {}

    def _stored(self, fmt: KeyFormat, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Store rows through the store op into a fresh cache of ``fmt`` and read them back, fp32 [rows, D]."""
        cache = PagedCache(fmt, pages_for(keys.shape[0]), device=self.device)
        seq = cache.add_sequence()
        slots = cache.append(seq, keys.shape[0])
        store_ops.store_index_keys(keys=keys.to(self.device), positions=positions.to(self.device),
                                   slots=slots.to(self.device), pool=cache.pool, fmt=fmt,
                                   rope_cos_sin=self.table.to(self.device),
                                   norm_weight=self.haystack.norm_weight.to(self.device),
                                   transform=self.haystack.config.geometry.key_transform, backend=self.backend,
                                   summaries=cache.summaries)
        return cache.gather(seq)

    def _patch_pages(self, fmt: KeyFormat, scores: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                     needles: Sequence, n: int) -> None:
        """Page-centred formats: a needle can be its page's entry 0, hence its centre, so each trial's needle
        pages (entries < n) are stored again whole, each page from its entry 0, and all their scores patched."""
        ratio = self.haystack.config.ratio
        blocks = []  # per trial: (rows of its pages, their keys with the needle in place)
        for nd in needles:
            rows = needle_rows(fmt, nd.entries, n)
            blocks.append((rows, with_needle(self.haystack.keys, rows, nd.entries, nd.keys)))
        # one store for all trials: each trial's pages get fresh pages of their own, entries at the same offsets
        slots, start = [], 0
        for rows, _ in blocks:
            pages = torch.unique(rows // ENTRIES_PER_PAGE)
            local = {int(p): start + i for i, p in enumerate(pages.tolist())}
            slots.append(torch.tensor([local[int(r) // ENTRIES_PER_PAGE] * ENTRIES_PER_PAGE + int(r) % ENTRIES_PER_PAGE
                                       for r in rows.tolist()], dtype=torch.long))
            start += pages.numel()
        slots_all = torch.cat(slots)
        cache = PagedCache(fmt, start, device=self.device)
        store_ops.store_index_keys(keys=torch.cat([k for _, k in blocks]).to(self.device),
                                   positions=(torch.cat([r for r, _ in blocks]) * ratio).to(self.device),
                                   slots=slots_all.to(self.device), pool=cache.pool, fmt=fmt,
                                   rope_cos_sin=self.table.to(self.device),
                                   norm_weight=self.haystack.norm_weight.to(self.device),
                                   transform=self.haystack.config.geometry.key_transform, backend=self.backend)
        stored = cache.read(slots_all.to(self.device))
        patch = indexer_ops.index_scores_dense(q, w, stored)  # [trials, all rows]
        first = 0
        for i, (rows, _) in enumerate(blocks):
            scores[i, rows] = patch[i, first: first + rows.numel()]
            first += rows.numel()

    def keys(self, fmt: KeyFormat) -> torch.Tensor:
        if fmt.name not in self._keys:
            hay = self.haystack
            self._keys[fmt.name] = self._stored(fmt, hay.keys, torch.arange(hay.num_entries) * hay.config.ratio)
        return self._keys[fmt.name]

    def ranks(self, formats: Sequence[str], context_tokens: int, trial_ids: Sequence[int]) -> dict[str, list[int | None]]:
        """Needle ranks of the given trials at ``context_tokens`` for each format (None = needle not visible)."""
        cfg = self.haystack.config
        ratio = cfg.ratio
        tr = cfg.geometry.key_transform
        n = context_tokens // ratio
        hay = haystack_prefix(self.haystack, n)
        qpos = query_positions(cfg, context_tokens, 1)
        gens = [generator_for(self.seed, "horizon-trial", trial) for trial in trial_ids]
        entries = [needle_entry_for_depth(float(torch.rand(1, generator=g)), n) for g in gens]
        directions = torch.stack([needle_direction(hay, g) for g in gens])
        needles = place_needles(hay, entries, directions)
        q_pre, w = zip(*(make_queries(hay, nd, qpos, g) for nd, g in zip(needles, gens)))
        q_pre, w = torch.cat(q_pre), torch.cat(w)  # [trials, H, D], [trials, H]
        q = prepare_queries(q_pre, qpos.expand(len(needles)), self.table, tr.rope_layout, tr.rope_dim, tr.hadamard)
        needle_keys = torch.cat([nd.keys for nd in needles])
        needle_positions = torch.cat([nd.entries for nd in needles]) * ratio
        bounds = [0]
        for nd in needles:
            bounds.append(bounds[-1] + nd.entries.numel())
        out: dict[str, list[int | None]] = {}
        for name in formats:
            fmt = KeyFormat.parse(name)
            scores = indexer_ops.index_scores_dense(q, w, self.keys(fmt)[:n])  # [trials, n]
            if is_centred(fmt):
                self._patch_pages(fmt, scores, q, w, needles, n)
            else:
                stored_rows = self._stored(fmt, needle_keys, needle_positions)
                # every trial against every trial's needle rows [trials, rows]; each keeps its own
                needle_scores = indexer_ops.index_scores_dense(q, w, stored_rows)
                for i, nd in enumerate(needles):
                    scores[i, nd.entries] = needle_scores[i, bounds[i]:bounds[i + 1]]
            out[fmt.name] = [metrics.needle_rank(scores[i], nd.entries) for i, nd in enumerate(needles)]
        return out


@dataclass
class HorizonPoint:
    """Trials run at one context length for one format: needle ranks so far (None = needle invisible)."""

    context_tokens: int
    format: str
    ranks: list = field(default_factory=list)
    stopped_early: bool = False

    def failures(self, k: int) -> int:
        return sum(1 for r in self.ranks if r is None or r >= k)


def passes(point: HorizonPoint, k: int, trials: int, quantile: float) -> bool | None:
    """True / False once decided, None while more trials are needed (found in >= quantile of trials)."""
    allowed = math.floor(trials * (1.0 - quantile) + 1e-9)
    if point.failures(k) > allowed:
        return False
    if len(point.ranks) >= trials:
        return True
    return None


def recall_horizon(settings: RecallSettings, formats: Sequence[str] | None = None,
                   on_point: ProgressFn | None = None) -> tuple[list[dict], list[dict]]:
    """Bisection over context length of the longest context where the needle is found in >= quantile of trials.

    Returns (horizon rows, one per (format, k); point rows, one per evaluated (context, format)). One haystack
    of the longest length serves every probe through its prefixes, and trial i is the same draw at every
    length (see :class:`HorizonHaystack`). Trials run in batches of 25; a format stops early at a length once
    even the largest k has failed too often. The first probe is the longest length (a format that passes there
    is done); then bisection on the geometric grid, which assumes the found-rate falls with length.
    """
    formats = [KeyFormat.parse(f).name for f in (formats or settings.formats)]
    ks = sorted(set(settings.horizon_topks))
    grid = horizon_grid(settings)
    device = lab_device(settings.backend)
    table = rope_table(settings, grid[-1])
    norm_weight, ape = model_weights(settings.config, generator_for(settings.seed, "model"))
    trials, quantile = settings.horizon_trials, settings.horizon_quantile
    batch = min(25, trials)
    points: dict[tuple[int, str], HorizonPoint] = {}
    longest = make_haystack(settings.config, grid[-1] // settings.config.ratio,
                            generator_for(settings.seed, "horizon-haystack"), norm_weight, ape)
    probe = HorizonHaystack(longest, table, settings.backend, device, settings.seed)

    def evaluate(index: int, fmts: list[str]) -> None:
        ctx = grid[index]
        todo = [f for f in fmts if (ctx, f) not in points]
        for f in todo:
            points[(ctx, f)] = HorizonPoint(ctx, f)
        b = 0
        while todo:
            size = min(batch, trials - b * batch)
            if size <= 0:
                break
            # trial ids, not formats, fix the draws: results do not depend on which formats are still running
            ranks = probe.ranks(todo, ctx, range(b * batch, b * batch + size))
            for f in todo:
                points[(ctx, f)].ranks.extend(ranks[f])
            b += 1
            still = []
            for f in todo:
                decided = [passes(points[(ctx, f)], k, trials, quantile) for k in ks]
                if all(d is False for d in decided):
                    points[(ctx, f)].stopped_early = len(points[(ctx, f)].ranks) < trials
                elif any(d is None for d in decided):
                    still.append(f)
            todo = still
            if on_point:
                on_point({"context_tokens": ctx, "batch": b})

    state = {(f, k): [-1, len(grid)] for f in formats for k in ks}  # [largest pass, smallest fail]
    while True:
        needed: dict[int, set[str]] = {}
        for (f, k), (lo, hi) in state.items():
            if hi - lo > 1:
                needed.setdefault(_probe_index(lo, hi, len(grid)), set()).add(f)
        if not needed:
            break
        for index in sorted(needed):
            evaluate(index, sorted(needed[index]))
        for (f, k), bounds in state.items():
            lo, hi = bounds
            if hi - lo <= 1:
                continue
            mid = _probe_index(lo, hi, len(grid))
            if (grid[mid], f) not in points:
                continue
            if passes(points[(grid[mid], f)], k, trials, quantile):
                bounds[0] = mid
            else:
                bounds[1] = mid

    rows = []
    for (f, k), (lo, hi) in sorted(state.items(), key=lambda item: (formats.index(item[0][0]), item[0][1])):
        rows.append({
            "kind": "horizon", "format": f, "index_topk": k, "quantile": quantile, "trials": trials,
            "horizon_tokens": grid[lo] if lo >= 0 else None,
            "first_failing_tokens": grid[hi] if hi < len(grid) else None,
            "status": "below-min" if lo < 0 else ("at-max" if lo == len(grid) - 1 else "ok"),
            "grid_min": grid[0], "grid_max": grid[-1],
        })
    point_rows = []
    for (ctx, f), p in sorted(points.items()):
        valid = [r for r in p.ranks if r is not None]
        point_rows.append({
            "kind": "horizon-point", "format": f, "context_tokens": ctx, "trials_run": len(p.ranks),
            "stopped_early": p.stopped_early,
            "found_rate": {str(k): 1.0 - p.failures(k) / len(p.ranks) for k in ks},
            "rank_p50": _quantile(valid, 0.5), "rank_p99": _quantile(valid, 0.99), "rank_max": max(valid) if valid else None,
        })
    return rows, point_rows


def _probe_index(lo: int, hi: int, size: int) -> int:
    """Next grid index to probe: the longest length first, then the middle of the open interval."""
    if lo == -1 and hi == size:
        return size - 1
    return (lo + hi) // 2


def _quantile(values: list[int], q: float) -> float | None:
    if not values:
        return None
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))
