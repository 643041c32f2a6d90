"""The recall lab engine: needle sweeps, the recall horizon and fault rows, through dsakit's own ops.

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

The *horizon* uses the cheapest faithful path: each haystack is stored once per format through the
store op and read back dequantized; a batch of trials (each its own needle entry, direction and queries,
one query token at the end of the context) is scored with ``index_scores_dense`` and the needle's entries
are patched in from their own store. ``rank < k`` is exactly "in the reference top-k".
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..cache import PagedCache, read_entries
from ..formats import ENTRIES_PER_PAGE, KeyFormat
from ..ops import scores as scores_ops
from ..ops import store as store_ops
from ..ops import topk as topk_ops
from ..ops._backend import resolve_backend, triton_available
from ..ops.scores.reference import visible_counts
from ..presets import KeyTransform
from ..transforms import RopeLayout
from . import metrics
from .faults import FAULTS, Fault, decode_fp8_entries
from .synthetic import (Haystack, SyntheticConfig, make_haystack, make_queries, model_weights, needle_direction,
                        needle_entry_for_depth, place_needle, place_needles, prepare_queries,
                        query_positions)

ALL_FORMATS = ("bf16", "fp8", "fp8-ue8m0", "fp4", "fp4-rne")
DEFAULT_FORMATS = ("bf16", "fp8", "fp4")
DEFAULT_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


# --------------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------------


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class RecallSettings:
    """Everything a recall sweep depends on (recorded with every JSONL row)."""

    config: SyntheticConfig = field(default_factory=SyntheticConfig)
    formats: tuple[str, ...] = DEFAULT_FORMATS
    topks: tuple[int, ...] = (512,)
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    trials: int = 1
    horizon: bool = True
    horizon_topks: tuple[int, ...] = (128, 256, 512, 1024)
    horizon_trials: int = 200
    horizon_quantile: float = 0.99
    horizon_min: int = 512
    horizon_max: int = 65536
    horizon_steps_per_octave: int = 4
    faults: tuple[str, ...] = tuple(FAULTS)
    fault_format: str = "bf16"
    fault_contexts: tuple[int, ...] = (4096, 16384)
    fault_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    fault_trials: int = 1
    seed: int = 0
    backend: str = "reference"

    def __post_init__(self):
        if not isinstance(self.config, SyntheticConfig):
            raise ValueError(f"config must be a SyntheticConfig, got {type(self.config).__name__}")
        for name in ("formats", "topks", "contexts", "depths", "horizon_topks", "faults", "fault_contexts",
                     "fault_depths"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):  # "bf16" is not a list of names
                raise ValueError(f"{name} must be a sequence (tuple or list), got {value!r}")
            object.__setattr__(self, name, tuple(value))  # frozen: stored as tuples, hashable and JSON-ready
        for name in self.formats + (self.fault_format,):
            KeyFormat.parse(name)
        if not self.formats:
            raise ValueError("formats must name at least one key format")
        for what, ks in (("topks", self.topks), ("horizon_topks", self.horizon_topks)):
            if not ks or any(not _is_int(k) or k < 1 for k in ks):
                raise ValueError(f"{what} must be positive ints, got {ks!r}")
        ratio = self.config.ratio
        for what, ctxs in (("contexts", self.contexts), ("fault_contexts", self.fault_contexts)):
            for c in ctxs:
                if not _is_int(c) or c < ratio or c % ratio or c < self.config.query_tokens:
                    raise ValueError(f"{what}: context {c!r} must be a positive multiple of the compression "
                                     f"ratio {ratio} and at least query_tokens={self.config.query_tokens}")
        for what, ds in (("depths", self.depths), ("fault_depths", self.fault_depths)):
            for d in ds:
                if not _is_number(d) or not 0.0 <= d <= 1.0:
                    raise ValueError(f"{what}: depth {d!r} must be a number in [0, 1]")
        for what, n in (("trials", self.trials), ("horizon_trials", self.horizon_trials),
                        ("fault_trials", self.fault_trials), ("horizon_steps_per_octave", self.horizon_steps_per_octave)):
            if not _is_int(n) or n < 1:
                raise ValueError(f"{what} must be a positive int, got {n!r}")
        if not _is_number(self.horizon_quantile) or not 0.0 < self.horizon_quantile <= 1.0:
            raise ValueError(f"horizon_quantile must be in (0, 1], got {self.horizon_quantile!r}")
        if not (_is_int(self.horizon_min) and _is_int(self.horizon_max)
                and ratio <= self.horizon_min <= self.horizon_max):
            raise ValueError(f"need ratio <= horizon_min <= horizon_max, got {self.horizon_min!r}, {self.horizon_max!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        for name in self.faults:
            if name not in FAULTS:
                raise ValueError(f"unknown fault {name!r}; choose from {sorted(FAULTS)}")
        resolved_backend(self.backend)  # 'triton' on a machine that cannot run it fails here, not mid-sweep

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["config"] = self.config.as_dict()
        return d


# --------------------------------------------------------------------------------------------------
# Helpers: deterministic generators, op calls with backend=, devices
# --------------------------------------------------------------------------------------------------


def generator_for(seed: int, *labels) -> torch.Generator:
    """A CPU torch.Generator seeded from the run seed and labels (independent of loop order and formats)."""
    text = "/".join(str(x) for x in (seed,) + labels)
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1)


@functools.lru_cache(maxsize=None)
def _accepts_backend(fn: Callable) -> bool:
    try:
        return "backend" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


_FALLBACK_WARNED: set[str] = set()


def call_op(fn: Callable, backend: str, **kwargs):
    """Call a public op with keyword arguments, passing ``backend=`` when the op takes it.

    An op without the keyword only has its reference; asking it for Triton warns once and runs the reference.
    """
    if _accepts_backend(fn):
        return fn(**kwargs, backend=backend)
    if backend == "triton" and fn.__name__ not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(fn.__name__)
        warnings.warn(f"{fn.__module__}.{fn.__name__} has no backend= argument yet; ran its reference",
                      RuntimeWarning, stacklevel=2)
    return fn(**kwargs)


def op_backends(backend: str) -> dict[str, str]:
    """Which implementation each op used, for the records ('auto' resolved for the lab's device)."""
    used = resolved_backend(backend)
    out = {}
    for fn in (store_ops.store_index_keys, scores_ops.index_scores, topk_ops.index_topk):
        out[fn.__name__] = used if _accepts_backend(fn) else "reference"
    return out


def lab_device(backend: str) -> torch.device:
    """Where caches and queries live: CUDA for Triton on a GPU, the CPU otherwise (TRITON_INTERPRET=1 too)."""
    resolve_backend(backend)  # validates the name
    if backend in ("triton", "auto") and torch.cuda.is_available() and triton_available():
        return torch.device("cuda")
    return torch.device("cpu")


def resolved_backend(backend: str) -> str:
    """'reference' | 'triton': what ``backend`` runs as on the lab's device; ValueError if it cannot run there
    (``triton`` without CUDA and without TRITON_INTERPRET=1)."""
    return resolve_backend(backend, torch.empty(0, device=lab_device(backend)))


def swapped_layout(layout: RopeLayout) -> RopeLayout:
    other = "half-split" if layout.pairing == "interleaved" else "interleaved"
    return RopeLayout(other, layout.placement)


def key_transform_for(config: SyntheticConfig, fault: Fault) -> KeyTransform:
    tr = config.geometry.key_transform
    if fault.key_rope_swap:
        tr = dataclasses.replace(tr, rope_layout=swapped_layout(tr.rope_layout))
    return tr


def _pages_for(entries: int) -> int:
    return max(1, (entries + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE)


def _finite_or_none(x: float | None) -> float | None:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return None
    return float(x)


# --------------------------------------------------------------------------------------------------
# One haystack stored in every format; runs of needles against it
# --------------------------------------------------------------------------------------------------


class StoredHaystack:
    """A haystack stored through the store op in one paged cache per format (with a fault's key conventions)."""

    def __init__(self, haystack: Haystack, formats: Sequence[str], fault: Fault, rope_cos_sin: torch.Tensor,
                 backend: str, device: torch.device):
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
            cache = PagedCache(fmt, _pages_for(n), device=device)
            seq = cache.add_sequence()
            slots = cache.append(seq, n)
            self.caches[fmt.name] = (cache, seq, slots)
            self._store(fmt.name, haystack.keys, self.entry_positions, slots)

    def _store(self, fmt_name: str, keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        cache = self.caches[fmt_name][0]
        call_op(store_ops.store_index_keys, self.backend, keys=keys.to(self.device),
                positions=positions.to(self.device), slots=slots.to(self.device), pool=cache.pool, fmt=cache.fmt,
                rope_cos_sin=self.table_dev, norm_weight=self.haystack.norm_weight.to(self.device),
                transform=self.key_transform)

    def op_kwargs(self, fmt_name: str, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor) -> dict:
        """Keyword arguments of ``index_scores`` / ``index_topk`` for queries q [T, H, D], weights [T, H] and
        positions [T] against the stored haystack of one format (one sequence, on the lab's device)."""
        cache, seq, _ = self.caches[fmt_name]
        return dict(q=q.to(self.device), weights=weights.to(self.device), pool=cache.pool, fmt=cache.fmt,
                    block_table=cache.block_table([seq]), entry_counts=cache.entry_counts([seq]),
                    query_seq=torch.zeros(q.shape[0], dtype=torch.int32, device=self.device),
                    query_positions=positions.to(self.device), ratio=self.config.ratio)

    def _scores_and_topk(self, fmt_name: str, q: torch.Tensor, weights: torch.Tensor, op_positions: torch.Tensor,
                         ks: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        cache, seq, slots = self.caches[fmt_name]
        if self.fault.custom_reader:
            values, scales = read_entries(cache.pool, cache.fmt, slots)
            keys = decode_fp8_entries(values, scales, self.fault)
            scores = scores_ops.index_scores_dense(q, weights, keys, op_positions, self.config.ratio)
            return scores, {k: topk_ops.select_topk(scores, k) for k in ks}
        common = self.op_kwargs(fmt_name, q, weights, op_positions)
        scores = call_op(scores_ops.index_scores, self.backend, **common).float().cpu()
        if resolve_backend(self.backend, cache.pool) == "reference":
            # index_topk's reference is select_topk(index_scores(...)): reuse the scores instead of a second pass
            topk = {k: topk_ops.select_topk(scores, k) for k in ks}
        else:
            topk = {k: call_op(topk_ops.index_topk, self.backend, **common, k=k).cpu() for k in ks}
        return scores, topk

    def run_depth(self, depth: float, generator: torch.Generator, ks: Sequence[int]) -> list[dict]:
        """Place one needle at ``depth`` and run every stored format and every k; one record per (format, k)."""
        cfg = self.config
        geo = cfg.geometry
        hay = self.haystack
        ctx = hay.context_tokens
        qpos = query_positions(cfg, ctx)
        ratio = cfg.ratio
        correct_visible = visible_counts(torch.full((qpos.numel(),), hay.num_entries), qpos, ratio)
        entry = needle_entry_for_depth(depth, int(correct_visible[-1]))
        needle = place_needle(hay, entry, needle_direction(hay, generator))
        q_pre, weights = make_queries(hay, needle, qpos, generator)
        tr = geo.key_transform
        q_exact = prepare_queries(q_pre, qpos, self.table, tr.rope_layout, tr.rope_dim, tr.hadamard)
        q_fmt = prepare_queries(q_pre, qpos, self.table, tr.rope_layout, tr.rope_dim,
                                tr.hadamard and self.fault.query_hadamard)
        exact_keys = self.exact_keys.clone()
        exact_keys[needle.entries] = store_ops.prepare_index_keys(
            keys=needle.keys, positions=needle.entries * ratio, rope_cos_sin=self.table,
            norm_weight=hay.norm_weight, transform=tr)
        exact_scores = scores_ops.index_scores_dense(q_exact, weights, exact_keys, qpos, ratio)
        exact_topk = {k: topk_ops.select_topk(exact_scores, k) for k in ks}
        exact_rank = metrics.needle_rank(exact_scores[-1], needle.entries)
        op_positions = qpos + self.fault.visibility_shift * ratio
        records = []
        for fmt_name, (cache, seq, slots) in self.caches.items():
            needle_slots = slots[needle.entries.to(slots.device)]
            self._store(fmt_name, needle.keys, needle.entries * ratio, needle_slots)
            try:
                scores, topk = self._scores_and_topk(fmt_name, q_fmt, weights, op_positions, ks)
            finally:  # put the haystack's own entries back: the next depth starts from a clean cache
                self._store(fmt_name, hay.keys[needle.entries], needle.entries * ratio, needle_slots)
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
                    "margin": _finite_or_none(metrics.score_margin(scores[-1], needle.entries)),
                    "exact_margin": _finite_or_none(metrics.score_margin(exact_scores[-1], needle.entries)),
                    "nan_fraction": metrics.nan_fraction(scores[-1]),
                    "leaked": metrics.future_selected(topk[k], correct_visible),
                    "needle_score_ratio": _finite_or_none(
                        metrics.needle_score_ratio(scores[-1], exact_scores[-1], needle.entries)),
                    "query_tokens": int(qpos.numel()),
                })
        return records


# --------------------------------------------------------------------------------------------------
# Sweeps
# --------------------------------------------------------------------------------------------------


class _HaystackPool:
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


def rope_table(settings: RecallSettings, max_context: int) -> torch.Tensor:
    return settings.config.geometry.rope.cos_sin_table(max_context + 1)


ProgressFn = Callable[[dict], None]


def run_sweep(settings: RecallSettings, on_run: ProgressFn | None = None) -> list[dict]:
    """The needle sweep: contexts x depths x trials x formats x topks through the ops. One record per run."""
    device = lab_device(settings.backend)
    pool = _HaystackPool(settings)
    table = rope_table(settings, max(settings.contexts))
    none = FAULTS["none"]
    records = []
    for ctx in settings.contexts:
        for trial in range(settings.trials):
            stored = StoredHaystack(pool.get(ctx, trial), settings.formats, none, table, settings.backend, device)
            for d_index, depth in enumerate(settings.depths):
                gen = generator_for(settings.seed, "needle", ctx, trial, d_index)
                for rec in stored.run_depth(depth, gen, settings.topks):
                    rec["trial"] = trial
                    records.append(rec)
                    if on_run:
                        on_run(rec)
    return records


def fault_carriers(settings: RecallSettings) -> list[tuple[Fault, KeyFormat]]:
    """(fault, format) pairs of the fault rows.

    Convention faults run on ``fault_format`` (bf16 by default, so the fault is the only error in the row);
    the fp8 read faults run on it when it is an fp8 format and on fp8 otherwise. Each carrier format gets its
    own baseline row ('none').
    """
    carrier = KeyFormat.parse(settings.fault_format)
    fp8_carrier = carrier if carrier.kind == "fp8" else KeyFormat.FP8
    pairs: list[tuple[Fault, KeyFormat]] = []
    for name in settings.faults:
        fault = FAULTS[name]
        fmt = fp8_carrier if fault.fp8_only else carrier
        if fault.name != "none" and (FAULTS["none"], fmt) not in pairs:
            pairs.append((FAULTS["none"], fmt))
        if (fault, fmt) not in pairs:
            pairs.append((fault, fmt))
    return pairs


def run_faults(settings: RecallSettings, on_run: ProgressFn | None = None) -> list[dict]:
    """Fault rows: each fault of ``settings.faults`` at the fault contexts and depths (see fault_carriers)."""
    pairs = fault_carriers(settings)
    if not pairs:
        return []
    device = lab_device(settings.backend)
    pool = _HaystackPool(settings)
    table = rope_table(settings, max(settings.fault_contexts))
    k = settings.topks[0]
    records = []
    for ctx in settings.fault_contexts:
        for trial in range(settings.fault_trials):
            hay = pool.get(ctx, trial)
            for fault, fmt in pairs:
                stored = StoredHaystack(hay, [fmt.name], fault, table, settings.backend, device)
                for d_index, depth in enumerate(settings.fault_depths):
                    gen = generator_for(settings.seed, "fault-needle", ctx, trial, d_index)
                    for rec in stored.run_depth(depth, gen, [k]):
                        rec["trial"] = trial
                        rec["kind"] = "fault"
                        records.append(rec)
                        if on_run:
                            on_run(rec)
    return records


# --------------------------------------------------------------------------------------------------
# Recall horizon
# --------------------------------------------------------------------------------------------------


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
        cache = PagedCache(fmt, _pages_for(keys.shape[0]), device=self.device)
        seq = cache.add_sequence()
        slots = cache.append(seq, keys.shape[0])
        call_op(store_ops.store_index_keys, self.backend, keys=keys.to(self.device), positions=positions.to(self.device),
                slots=slots.to(self.device), pool=cache.pool, fmt=fmt, rope_cos_sin=self.table.to(self.device),
                norm_weight=self.haystack.norm_weight.to(self.device), transform=self.haystack.config.geometry.key_transform)
        return cache.gather(seq)

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
            needle_rows = self._stored(fmt, needle_keys, needle_positions)
            scores = scores_ops.index_scores_dense(q, w, self.keys(fmt)[:n])  # [trials, n]
            # every trial against every trial's needle rows [trials, rows]; each keeps its own
            needle_scores = scores_ops.index_scores_dense(q, w, needle_rows)
            ranks = []
            for i, nd in enumerate(needles):
                scores[i, nd.entries] = needle_scores[i, bounds[i]:bounds[i + 1]]
                ranks.append(metrics.needle_rank(scores[i], nd.entries))
            out[fmt.name] = ranks
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
