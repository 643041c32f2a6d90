"""Captured tensors: run the recall lab on q, k and weights dumped from a real deployment.

File format (safetensors, see docs/recall.md)::

    q                 fp32/bf16 [T, H, D]   indexer queries as scored (after rope, and after the Hadamard
                                            rotation if the deployment rotates; see metadata)
    k                 fp32/bf16 [N, D]      index keys before quantization (after norm, rope, rotation)
    weights           fp32      [T, H]      head weights with every constant folded in (D^-0.5 H^-0.5 ...)
    needle_entries    int64     [E]         optional: entries holding the fact the queries look for
    query_positions   int64     [T]         optional: token position of each query (causal mask)
    metadata          {"ratio": "4", "rotated": "true" | "false"}

``rotated = "false"`` (what transformers' DeepseekV4 indexer produces: it applies no Hadamard rotation) makes
the lab rotate both q and k before quantizing, as DeepSeek's reference and the serving engines do; exact
scores are unchanged by it (the rotation is orthogonal), quantization error is not.

:func:`capture_deepseek_v4_indexer` records these tensors from transformers' ``DeepseekV4Indexer`` with
forward hooks; :func:`save_captured` writes the file; :func:`run_captured` runs the formats and top-k values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..batch import visible_counts
from ..cache import PagedCache
from .._memory import check_choice, check_instance, check_int, check_int_list, check_tensor
from ..formats import KeyFormat
from ..ops import indexer as indexer_ops
from ..ops import resolve_backend
from ..ops.indexer.config import MAX_K, HierarchyConfig
from ..transforms import hadamard_transform
from . import metrics


@dataclass
class CapturedTensors:
    """q [T, H, D], k [N, D], weights [T, H] (fp32, CPU); needle_entries [E] or None; query_positions [T] or
    None; ratio; rotated (whether q and k already went through the Hadamard rotation)."""

    q: torch.Tensor
    k: torch.Tensor
    weights: torch.Tensor
    needle_entries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    ratio: int = 4
    rotated: bool = True

    def __post_init__(self):
        q, k, w = self.q, self.k, self.weights
        check_tensor("q", q, dims=3, message="q must be [T, H, D]")
        t, h, d = q.shape
        check_tensor("k", k, shape=(None, d), message=f"k must be [N, {d}] (D of q)")
        if d != 128:
            raise ValueError(f"index head dim must be 128 for the dsakit key formats, got {d}")
        check_tensor("weights", w, shape=(t, h), message=f"weights must be [T, H] = [{t}, {h}]")
        if k.shape[0] == 0 or t == 0:
            raise ValueError(f"need at least one query and one key, got T={t}, N={k.shape[0]}")
        for name in ("q", "k", "weights"):
            x = check_tensor(name, getattr(self, name), floating=True)
            setattr(self, name, x.detach().cpu().float())
        for name in ("needle_entries", "query_positions"):
            x = getattr(self, name)
            if x is not None and not _holds_ints(x):
                # .long() would truncate 3.7 to entry 3 and True to entry 1 without a word
                raise ValueError(f"{name} must hold integers, got {getattr(x, 'dtype', x)!r:.80}")
        if self.needle_entries is not None:
            e = torch.as_tensor(self.needle_entries).detach().cpu().long().flatten()
            if e.numel() == 0 or bool((e < 0).any()) or bool((e >= k.shape[0]).any()):
                raise ValueError(f"needle_entries must be non-empty entry indices in 0..{k.shape[0] - 1}, got {e.tolist()}")
            self.needle_entries = e
        if self.query_positions is not None:
            p = torch.as_tensor(self.query_positions).detach().cpu().long().flatten()
            if p.shape != (t,) or bool((p < 0).any()):
                raise ValueError(f"query_positions must be [T] = [{t}] non-negative ints, got {p.tolist()[:8]}")
            self.query_positions = p
        check_int("ratio", self.ratio, 1, message="ratio must be a positive int")


def _holds_ints(x) -> bool:
    """An integer tensor or array, or a (nested) list of Python ints; floats and bools are not entry indices."""
    if isinstance(x, (list, tuple)):
        return all(_holds_ints(v) for v in x)
    if isinstance(x, (bool, float, complex)):
        return False
    if isinstance(x, int):
        return True
    try:
        t = torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError):
        return False
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def save_captured(path: "str | Path", captured: CapturedTensors) -> Path:
    """Write a captured-tensor file (module docstring)."""
    from safetensors.torch import save_file

    tensors = {"q": captured.q.contiguous(), "k": captured.k.contiguous(), "weights": captured.weights.contiguous()}
    if captured.needle_entries is not None:
        tensors["needle_entries"] = captured.needle_entries.contiguous()
    if captured.query_positions is not None:
        tensors["query_positions"] = captured.query_positions.contiguous()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"ratio": str(captured.ratio), "rotated": str(captured.rotated).lower()})
    return path


def load_captured(path: "str | Path") -> CapturedTensors:
    """Read a captured-tensor file; raises ValueError naming what is missing or malformed."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if path.is_dir():
        raise ValueError(f"captured tensor file {str(path)!r} is a directory; pass the .safetensors file in it")
    if not path.is_file():
        raise ValueError(f"captured tensor file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as fh:
            names = set(fh.keys())
            missing = {"q", "k", "weights"} - names
            if missing:
                raise ValueError(f"{path} lacks tensor(s) {sorted(missing)}; it needs q [T,H,D], k [N,D], "
                                 f"weights [T,H]")
            meta = fh.metadata() or {}
            get = {name: fh.get_tensor(name) for name in names}
    except (SafetensorError, OSError) as exc:  # empty, truncated or not a safetensors file at all
        raise ValueError(f"{path} is not a readable safetensors file ({exc})") from None
    rotated = meta.get("rotated", "true").lower()
    check_choice("rotated", rotated, ("true", "false"), what="metadata 'rotated'")
    try:
        ratio = int(meta.get("ratio", "4"))
    except ValueError as err:
        raise ValueError(f"metadata 'ratio' must be an int, got {meta.get('ratio')!r}") from err
    return CapturedTensors(q=get["q"], k=get["k"], weights=get["weights"], needle_entries=get.get("needle_entries"),
                           query_positions=get.get("query_positions"), ratio=ratio, rotated=rotated == "true")


def run_captured(captured: CapturedTensors, formats: Sequence[str], topks: Sequence[int],
                 backend: str = "reference", source: str = "captured",
                 on_run: "Callable[[dict], None] | None" = None, hierarchy: HierarchyConfig | None = None) -> list[dict]:
    """Quantize the captured keys into a paged cache per format and compare the ops' top-k with exact scoring.

    One record per (format, k), also handed to ``on_run`` as it is made. Needle metrics use, per query row,
    the best needle entry; ``needle_rank`` and ``found`` report the worst row among the rows that can see a
    needle entry (every such row must find it). A k above the number of entries N selects what k = N does
    (the rest is -1 padding, which no metric counts), so it runs as N: a huge k costs nothing.
    ``hierarchy``: the top-k op is ``hierarchical_topk`` with this config (the caches keep page summaries).
    """
    from .haystack import finite_or_none, pages_for
    from .settings import lab_device

    check_instance("captured", captured, CapturedTensors, "see load_captured")
    if isinstance(formats, str) or isinstance(topks, (str, int)):
        raise ValueError(f"formats and topks must be sequences like ['bf16', 'fp8'] and [512], got {formats!r}, "
                         f"{topks!r}")
    formats = [KeyFormat.parse(name).name for name in formats]  # every name checked before any work
    topks = check_int_list("topks", topks, 1, message="topks must be positive ints")
    if any(min(k, captured.k.shape[0]) > MAX_K for k in topks):  # k > N runs as N (below)
        raise ValueError(f"topks: the top-k ops select at most {MAX_K} entries, got {list(topks)!r} over "
                         f"{captured.k.shape[0]} entries")
    if hierarchy is not None:
        check_instance("hierarchy", hierarchy, HierarchyConfig, "HierarchyConfig or None")
    if on_run is not None and not callable(on_run):
        raise ValueError(f"on_run must be callable, got {on_run!r}")
    device = lab_device(backend)
    q, k = captured.q, captured.k
    if not captured.rotated:
        q, k = hadamard_transform(q), hadamard_transform(k)
    t, n = q.shape[0], k.shape[0]
    pos = captured.query_positions
    exact_scores = indexer_ops.index_scores_dense(q, captured.weights, k, pos, captured.ratio)
    counts = visible_counts(torch.full((t,), n), pos, captured.ratio) if pos is not None else torch.full((t,), n)
    needle = captured.needle_entries
    records = []
    for name in formats:
        fmt = KeyFormat.parse(name)
        cache = PagedCache(fmt, pages_for(n), device=device, summaries=hierarchy is not None)
        seq = cache.add_sequence()
        cache.write(cache.append(seq, n), k)  # the format's reference codec: the keys are already transformed
        common = dict(q=q.to(device), weights=captured.weights.to(device),
                      batch=cache.batch([seq], query_lens=[t], query_positions=None if pos is None else pos.to(device),
                                        ratio=captured.ratio))
        scores = indexer_ops.index_scores(**common, backend=backend).float().cpu()
        for kk in topks:
            k_run = min(kk, n)
            exact_topk = indexer_ops.select_topk(exact_scores, k_run)
            if hierarchy is not None:
                topk = indexer_ops.hierarchical_topk(**common, k=k_run, config=hierarchy, backend=backend).cpu()
            elif resolve_backend(backend, cache.pool) == "reference":
                topk = indexer_ops.select_topk(scores, k_run)
            else:
                topk = indexer_ops.index_topk(**common, k=k_run, backend=backend).cpu()
            rec = {"kind": "run", "source": source, "fault": "none", "format": fmt.name, "index_topk": kk,
                   "selection": "flat" if hierarchy is None else "hierarchical",
                   "context_tokens": n * captured.ratio, "entries": n, "query_tokens": t, "depth": None,
                   "set_recall": metrics.set_recall(topk, exact_topk),
                   "nan_fraction": max(metrics.nan_fraction(row) for row in scores),
                   "leaked": metrics.future_selected(topk, counts), "trial": 0}
            if needle is not None:
                rows = [i for i in range(t) if bool((needle < counts[i]).any())]
                ranks = [metrics.needle_rank(scores[i], needle) for i in rows]
                exact_ranks = [metrics.needle_rank(exact_scores[i], needle) for i in rows]
                found = [metrics.topk_contains(topk[i], needle) for i in rows]
                worst = metrics.worst_rank_index(ranks)
                rec.update({
                    "needle_entries": needle.tolist(), "needle_rows": rows, "row_ranks": ranks,
                    "row_exact_ranks": exact_ranks,
                    "needle_rank": None if worst is None else ranks[worst],
                    "exact_rank": None if worst is None else exact_ranks[worst],
                    "found": bool(rows) and all(found),
                    "exact_found": bool(rows) and all(metrics.topk_contains(exact_topk[i], needle) for i in rows),
                    "margin": None if worst is None else finite_or_none(metrics.score_margin(scores[rows[worst]], needle)),
                    "exact_margin": None if worst is None else finite_or_none(
                        metrics.score_margin(exact_scores[rows[worst]], needle)),
                })
            else:
                rec.update({"needle_rank": None, "exact_rank": None, "found": None, "exact_found": None,
                            "margin": None, "exact_margin": None})
            records.append(rec)
            if on_run is not None:
                on_run(rec)
    return records


# --------------------------------------------------------------------------------------------------
# Dump helper for transformers' DeepseekV4 indexer
# --------------------------------------------------------------------------------------------------


@dataclass
class IndexerCapture:
    """Tensors recorded by :func:`capture_deepseek_v4_indexer`, one entry per indexer forward call."""

    calls: list[CapturedTensors]

    @property
    def last(self) -> CapturedTensors:
        if not self.calls:
            raise ValueError("no indexer forward call was recorded (is the layer a compressed-sparse-attention one?)")
        return self.calls[-1]


@contextlib.contextmanager
def capture_deepseek_v4_indexer(indexer: torch.nn.Module, batch_index: int = 0) -> Iterator[IndexerCapture]:
    """Record q, the compressed keys and the head weights of a transformers ``DeepseekV4Indexer`` while the
    model runs inside the ``with`` block.

    Hooks: a forward pre-hook on the indexer keeps ``position_ids``; a forward hook on ``indexer.scorer``
    receives (q [B, S, H, D] after rope, compressed keys [B, N, D] after norm and rope, hidden states) and
    folds the scorer's constants into the weights: ``weights_proj(x) * H^-0.5 * D^-0.5`` (relu commutes
    with the positive ``softmax_scale``). transformers applies no Hadamard rotation: ``rotated=False``.

    >>> layer = model.model.layers[2].self_attn.compressor.indexer      # a CSA layer's indexer
    >>> with capture_deepseek_v4_indexer(layer) as cap:
    ...     model(input_ids)
    >>> save_captured("indexer.safetensors", cap.last)
    """
    scorer = getattr(indexer, "scorer", None)
    if scorer is None or not hasattr(scorer, "weights_proj"):
        raise ValueError(f"{type(indexer).__name__} has no .scorer with weights_proj: pass a DeepseekV4Indexer")
    ratio = int(getattr(indexer, "compress_rate", 4))
    capture = IndexerCapture(calls=[])
    state: dict[str, torch.Tensor | None] = {"positions": None}

    def pre_hook(module, args, kwargs):
        positions = kwargs.get("position_ids")
        if positions is None and len(args) >= 3:
            positions = args[2]
        state["positions"] = None if positions is None else positions.detach()

    def scorer_hook(module, args, output):
        q, compressed, hidden = args[0], args[1], args[2]
        with torch.no_grad():
            weights = module.weights_proj(hidden).float() * module.weights_scaling * module.softmax_scale
        positions = state["positions"]
        capture.calls.append(CapturedTensors(
            q=q[batch_index].detach().float().cpu(), k=compressed[batch_index].detach().float().cpu(),
            weights=weights[batch_index].cpu(),
            query_positions=None if positions is None else positions[min(batch_index, positions.shape[0] - 1)].cpu(),
            ratio=ratio, rotated=False))

    handles = [indexer.register_forward_pre_hook(pre_hook, with_kwargs=True), scorer.register_forward_hook(scorer_hook)]
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()
