"""Streaming exact top-k: one pass over the scores in the common case (kernels in ``_select_kernels``).

Rules: those of :func:`dsakit.ops.indexer.reference.select_topk` (candidates are scores > -inf, NaN ranks above
+inf, -0.0 == +0.0, equal scores go to the lower index, descending order, -1 padding), bitwise
deterministic (no atomics; every buffer is written in index order).

Algorithm (details in :mod:`dsakit.ops.indexer._select_kernels`): a threshold per row from a fixed sample of
the row, one streaming pass that keeps the entries above it (and the first ones equal to it) in a per-row
candidate buffer, then an exact select of that buffer with in-register range narrowing and a sort of the k
winners. Rows the sample misjudges (buffer overflow, or fewer than k entries >= the threshold) are
re-selected exactly by whole-row passes in the same launch, so the result never depends on the sample.
A launch whose rows all fit the candidate buffer (width <= cap, e.g. 8K-entry rows at k 2048) skips the
filter: the final kernel selects from the scores directly. Long rows with few of them (decode) are split
over ``splits`` programs per row (each keeps its own buffer
and tie list; the final kernel concatenates them in split order = index order).

Two filter kernels (``StreamConfig.filter``): "warp" (the default: a lane's entries of a tile spread over a
warp, ranks by warp scans) and "thread" (one lane per thread, ranks in registers, float compares, raw fp32 bits
in the candidate buffer; with splits > 1 a threshold kernel samples each row once before the split programs
stream). Both fill the same buffers by the same rules, so the final and sort kernels serve both.

Buffers (``SelectBuffers``; allocated once per shape, reusable, so a decode plan stays sync-free):

    candidates           int64 [R, cap] (key << 32 | index)      cap = clamp(4 * next_pow2(k), 4096, 16384)
    tie lists            int32 [R, splits * lanes * tie_cap]      (tie_cap = max(32, 2 v))
    counters             int32 [R, splits * lanes] x 2 + [R, splits, 8]
    selected             int32 [R, k] x 2 (keys, indices) + [R] counts

e.g. R = 2048 rows, k = 2048 (cap 8192, 1 split): 64 + 16 + 2 + 32 MiB; R = 64 decode rows: 9 MiB.
k up to ``STREAM_MAX_K`` (4096); larger k use the multi-pass kernel of :mod:`dsakit.ops.indexer.triton`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import triton

from ..._memory import check_instance, check_int
from ...batch import check_k
from ._select_kernels import (STATS, _filter_kernel, _filter_thread_kernel, _final_kernel, _order_blocked_kernel,
                              _order_chunk_kernel, _order_kernel, _order_merge_kernel, _threshold_kernel)
from ._topk_kernels import _radix_select_kernel
from .config import MAX_K, STREAM_MAX_K, SelectConfig, StreamConfig, pow2_floor
from .inputs import cached_buffer, check_scores_matrix, lru_get, row_counts_int32, slot_args


@dataclass(frozen=True)
class SelectBuffers:
    """Scratch of one streaming select for up to ``rows`` rows of width <= ``width`` (see module docstring)."""

    rows: int
    width: int
    k: int
    config: StreamConfig
    cand: torch.Tensor
    ties: torch.Tensor
    lane_gt: torch.Tensor
    lane_eq: torch.Tensor
    stats: torch.Tensor
    sel_key: torch.Tensor
    sel_idx: torch.Tensor
    sel_count: torch.Tensor

    @staticmethod
    def allocate(rows: int, width: int, k: int, device, config: StreamConfig | None = None) -> "SelectBuffers":
        """Buffers for ``rows`` x ``width`` and k with ``config`` (default: the launch rule of the device's
        :class:`SelectConfig`)."""
        config = config or SelectConfig.for_device(device).stream_for(rows, width, k)
        check_instance("config", config, StreamConfig)
        r, s, lanes = max(rows, 1), config.splits, config.lanes
        empty = lambda *shape: torch.empty(shape, dtype=torch.int32, device=device)  # noqa: E731
        return SelectBuffers(rows=rows, width=width, k=k, config=config,
                             cand=torch.empty((r, config.cap), dtype=torch.int64, device=device),
                             ties=empty(r, s * lanes * config.tie_cap), lane_gt=empty(r, s * lanes),
                             lane_eq=empty(r, s * lanes), stats=empty(r, s, STATS.value), sel_key=empty(r, k),
                             sel_idx=empty(r, k), sel_count=empty(r))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.cand, self.ties, self.lane_gt,
                                                           self.lane_eq, self.stats, self.sel_key, self.sel_idx,
                                                           self.sel_count))

    def path_counts(self, rows: int) -> dict:
        """Which path each of the first ``rows`` rows took in the last launch (host sync; tests/benchmarks):
        {"buffer": selected from the candidate buffers, "ties": completed from the tie lists, "exact":
        re-selected by whole-row passes}."""
        path = self.stats[:rows, 0, 6].cpu()
        return {"buffer": int((path == 1).sum()), "ties": int((path == 2).sum()), "exact": int((path == 0).sum())}

    def exact_row_stats(self, rows: int, most: int = 4) -> dict:
        """Why the first ``most`` of the first ``rows`` rows that took the exact passes did (host sync;
        benchmarks): {row: per split [entries > thr, entries == thr, any candidate < thr, thr, (split 0: the
        row's shared threshold with the thread filter), fullest lane count]}; a fullest lane above
        ``config.lane_cap`` overflowed, fewer than k entries >= thr with a candidate below it means the sampled
        threshold was too high (the thread filter reports "a candidate below" whenever thr > -inf)."""
        exact = (self.stats[:rows, 0, 6] == 0).nonzero().flatten().tolist()[:most]
        return {row: self.stats[row, :, :6].tolist() for row in exact}


def launch_stream_select(scores: torch.Tensor, counts: torch.Tensor, out: torch.Tensor, k: int, sort: bool,
                         buffers: SelectBuffers, *, slots: torch.Tensor | None = None,
                         seq: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                         stages: str = "all") -> None:
    """Select into ``out`` int32 [R, >= k] (row stride free, unit column stride) from scores fp32 [R, W]
    (unit column stride) with counts int32 [R] (entries per row, <= W). No host sync, no allocation:
    the caller has validated the inputs and sized ``buffers`` for >= R rows, width >= W, the same k.
    slots / seq / block_table: also write global slots (page * 64 + entry % 64), -1 kept.
    ``stages`` (benchmarks): "filter" or "filter+final" launch only those kernels (no filter runs when the
    rows fit the candidate buffer: width <= cap with one split)."""
    rows, width = scores.shape
    if rows == 0:
        return
    cfg = buffers.config
    # rows that fit the candidate buffer whole need no threshold: the final kernel reads them directly
    direct = cfg.reads_directly(width)
    if not direct:
        _launch_filter(scores, counts, buffers)
    if stages == "filter":
        return
    _final_kernel[(rows,)](
        scores, scores.stride(0), counts, buffers.cand, buffers.ties, buffers.lane_gt,
        buffers.lane_eq, buffers.stats, buffers.sel_key, buffers.sel_idx, buffers.sel_count,
        k, SPLITS=cfg.splits, LANES=cfg.lanes, LCAP=cfg.lane_cap, TCAP=cfg.tie_cap, BLOCK=cfg.block,
        BINS=cfg.bins, DIRECT=direct, FLOAT_BITS=cfg.filter == "thread", num_warps=cfg.final_warps)
    if stages == "filter+final":
        return
    _launch_order(out, counts, sort, buffers, slots, seq, block_table)


def _launch_filter(scores: torch.Tensor, counts: torch.Tensor, buffers: SelectBuffers) -> None:
    rows, k, cfg = scores.shape[0], buffers.k, buffers.config
    if cfg.filter == "thread":
        shared = cfg.splits > 1  # one threshold per row for its split programs, sampled by a kernel of its own
        if shared:
            _threshold_kernel[(rows,)](scores, scores.stride(0), counts, buffers.stats, k, SPLITS=cfg.splits,
                                       CAP=cfg.cap, SAMPLE=cfg.sample, BINS=cfg.bins, MARGIN=cfg.sample_margin,
                                       SAMPLE_GROUP=cfg.sample_group,
                                       num_warps=cfg.final_warps)
        _filter_thread_kernel[(rows, cfg.splits)](
            scores, scores.stride(0), counts, buffers.cand, buffers.ties, buffers.lane_gt,
            buffers.lane_eq, buffers.stats, k, SPLITS=cfg.splits, CAP=cfg.cap, LANES=cfg.lanes,
            LCAP=cfg.lane_cap, TCAP=cfg.tie_cap, UNROLL=cfg.unroll, SAMPLE=cfg.sample, BINS=cfg.bins,
            MARGIN=cfg.sample_margin, SAMPLE_GROUP=cfg.sample_group, SHARED_THR=shared, num_warps=cfg.num_warps)
        return
    _filter_kernel[(rows, cfg.splits)](
        scores, scores.stride(0), counts, buffers.cand, buffers.ties, buffers.lane_gt,
        buffers.lane_eq, buffers.stats, k, SPLITS=cfg.splits, CAP=cfg.cap, LANES=cfg.lanes,
        LCAP=cfg.lane_cap, TCAP=cfg.tie_cap, V=cfg.v, SAMPLE=cfg.sample, BINS=cfg.bins,
        MARGIN=cfg.sample_margin,  # 5 standard deviations for split rows, 4 for whole rows (StreamConfig)
        SAMPLE_GROUP=cfg.sample_group,
        num_warps=cfg.num_warps)


def _launch_order(out: torch.Tensor, counts: torch.Tensor, sort: bool, buffers: SelectBuffers,
                  slots: torch.Tensor | None, seq: torch.Tensor | None, block_table: torch.Tensor | None) -> None:
    rows, k, cfg = out.shape[0], buffers.k, buffers.config
    k_pad = triton.next_power_of_2(k)
    chunks = cfg.sort_chunks(k)
    if sort and chunks > 1:
        chunk = k_pad // chunks
        # the candidate buffer (int64 [R, cap >= k_pad]) is free once the final kernel has read it
        _order_chunk_kernel[(rows, chunks)](buffers.sel_key, buffers.sel_idx, buffers.sel_count, buffers.cand,
                                            buffers.cand.stride(0), k, CHUNK=chunk, num_warps=cfg.order_warps)
        _order_merge_kernel[(rows, chunks)](
            out, out.stride(0), buffers.cand, buffers.cand.stride(0), buffers.sel_count,
            *slot_args(out, counts, slots, seq, block_table), k, CHUNK=chunk, LOG_CHUNK=chunk.bit_length() - 1,
            CHUNKS=chunks, WITH_SLOTS=slots is not None, num_warps=cfg.order_warps)
        return
    if sort and cfg.register_sort:
        # 4 rows of the [rows, regs] tile per thread (16-byte loads): the sequence's low log2(regs) + 2 bits
        # are registers when rows = 128 x warps
        tile_rows = min(k_pad, 128 * cfg.order_warps)
        _order_blocked_kernel[(rows,)](
            out, out.stride(0), buffers.sel_key, buffers.sel_idx, buffers.sel_count,
            *slot_args(out, counts, slots, seq, block_table), k, ROWS=tile_rows, REGS=k_pad // tile_rows,
            WITH_SLOTS=slots is not None, num_warps=cfg.order_warps)
        return
    _order_kernel[(rows,)](
        out, out.stride(0), buffers.sel_key, buffers.sel_idx, buffers.sel_count,
        *slot_args(out, counts, slots, seq, block_table),
        k, K_PAD=k_pad, SORT=sort, WITH_SLOTS=slots is not None, num_warps=cfg.order_warps)


_CACHE: "OrderedDict[tuple, SelectBuffers]" = OrderedDict()
_CACHE_KEPT = 2


def release_select_buffers() -> None:
    """Free the buffers kept by :func:`cached_select_buffers`."""
    _CACHE.clear()


def cached_select_buffers(rows: int, width: int, k: int, device, config: StreamConfig) -> SelectBuffers:
    """Buffers for >= rows x width (both rounded up to powers of two, so that a growing width or a short
    last chunk reuses them), k, launched with ``config``; the last few shapes are kept. Not for CUDA-graph
    capture (an entry may be evicted): a graph's caller keeps its own :meth:`SelectBuffers.allocate`."""
    rows, width = triton.next_power_of_2(max(rows, 1)), triton.next_power_of_2(max(width, 1))
    return lru_get(_CACHE, (torch.device(device), rows, width, k, config), _CACHE_KEPT,
                   lambda: SelectBuffers.allocate(rows, width, k, device, config))


def launch_stream_select_cached(scores: torch.Tensor, counts: torch.Tensor, out: torch.Tensor, k: int,
                                sort: bool, *, slots: torch.Tensor | None = None, seq: torch.Tensor | None = None,
                                block_table: torch.Tensor | None = None, select: SelectConfig | None = None,
                                budget: int | None = None) -> None:
    """:func:`launch_stream_select` with cached buffers of at most ~``budget`` bytes (default
    ``select.cached_bytes``): rows beyond what they hold are selected in consecutive launches over row slices."""
    rows, width = scores.shape
    if rows == 0:
        return
    select = select or SelectConfig()
    budget = select.cached_bytes if budget is None else budget
    # one launch configuration for the whole call (picked by the launch's rows, and the buffers' width)
    config = select.stream_for(triton.next_power_of_2(rows), triton.next_power_of_2(max(width, 1)), k)
    step = min(triton.next_power_of_2(rows), pow2_floor(max(1, budget // config.bytes_per_row(k))))
    buffers = cached_select_buffers(step, width, k, scores.device, config)
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        launch_stream_select(scores[start:stop], counts[start:stop], out[start:stop], k, sort, buffers,
                             slots=None if slots is None else slots[start:stop],
                             seq=None if seq is None else seq[start:stop], block_table=block_table)


def select_topk_stream(scores: torch.Tensor, k: int, *, row_counts: torch.Tensor | None = None,
                       sort: bool = True, config: StreamConfig | None = None,
                       buffers: SelectBuffers | None = None) -> torch.Tensor:
    """Exact top-k per row of scores fp32 [T, W] -> int32 [T, k] (rules of the reference ``select_topk``).

    row_counts int [T] (optional): row t considers only its first row_counts[t] entries. sort=False returns
    each row's set in a deterministic order (the index order of the candidate buffer), skipping the sort.
    config: launch parameters (default: :meth:`SelectConfig.stream_for` of the device's select config);
    buffers: reusable scratch (:meth:`SelectBuffers.allocate`), else allocated here. k <= STREAM_MAX_K.
    """
    check_scores_matrix(scores, sort)
    check_int("k", k, 1, STREAM_MAX_K, message=f"k must be an int in 1..{STREAM_MAX_K} for the streaming select")
    t, w = scores.shape
    counts = row_counts_int32(scores, row_counts)
    if buffers is None:
        buffers = SelectBuffers.allocate(t, w, k, scores.device, config)
    elif config is not None and config != buffers.config:
        raise ValueError("pass either config or buffers (the buffers carry their config)")
    if buffers.rows < t or buffers.width < w or buffers.k != k or buffers.cand.device != scores.device:
        raise ValueError(f"buffers sized for rows {buffers.rows}, width {buffers.width}, k {buffers.k} on "
                         f"{buffers.cand.device}; need rows >= {t}, width >= {w}, k = {k} on {scores.device}")
    out = torch.empty((t, k), dtype=torch.int32, device=scores.device)
    launch_stream_select(scores, counts, out, k, sort, buffers)
    return out


def launch_select(scores: torch.Tensor, counts: torch.Tensor, out: torch.Tensor, k: int, sort: bool, *,
                  config: SelectConfig | None = None, slots: torch.Tensor | None = None,
                  seq: torch.Tensor | None = None, block_table: torch.Tensor | None = None,
                  cand_vals: torch.Tensor | None = None, cand_idx: torch.Tensor | None = None,
                  stream_buffers=None) -> None:
    """Launch the radix select of scores fp32 [R, W] (row r considers its first counts[r] entries) into
    out int32 [R, k] (and slots, through seq [R] and block_table, when given). No checks, no sync; the
    candidate buffers (fp32 / int32 [>= R, cap]) are cached ones when not given. With the streaming select
    (``config.algorithm``), ``stream_buffers`` (a ``SelectBuffers``) or cached ones are used."""
    config = config or SelectConfig()
    if config.uses_stream(k):
        if stream_buffers is None:
            launch_stream_select_cached(scores, counts, out, k, sort, slots=slots, seq=seq, block_table=block_table,
                                        select=config)
        else:
            launch_stream_select(scores, counts, out, k, sort, stream_buffers, slots=slots, seq=seq,
                                 block_table=block_table)
        return
    block, num_warps, bins = config.resolve(scores.shape[0])
    cap = config.cap
    rows = scores.shape[0]
    if rows == 0:
        return
    if cand_vals is None or cand_vals.shape[0] < rows or cand_vals.shape[1] != cap:
        # cached by shape (rows rounded up to a power of two): an eager call allocates only its output
        shape = (triton.next_power_of_2(rows), cap)
        cand_vals = cached_buffer("cand_vals", shape, torch.float32, scores.device)
        cand_idx = cached_buffer("cand_idx", shape, torch.int32, scores.device)
    _radix_select_kernel[(rows,)](
        scores, scores.stride(0), counts, out, out.stride(0), cand_vals, cand_idx,
        *slot_args(out, counts, slots, seq, block_table),
        k, BLOCK=block, BINS=bins, CAP=cap, K_PAD=triton.next_power_of_2(k), SORT=sort,
        WITH_SLOTS=slots is not None, num_warps=num_warps)


def select_topk_triton(scores: torch.Tensor, k: int, *, row_counts: torch.Tensor | None = None,
                       sort: bool = True, config: SelectConfig | None = None) -> torch.Tensor:
    """Exact top-k per row of scores fp32 [T, W] -> int32 [T, k] (rules of the reference ``select_topk``).

    ``row_counts`` int [T] (optional): row t considers only its first row_counts[t] entries (the rest is
    treated as masked and never read; checking the values costs one sync). ``sort=False`` returns the same
    set per row in a deterministic order (index order for the multi-pass select; the streaming select's
    buffer order otherwise) and skips the final sort. ``config``: select tuning (:class:`SelectConfig`).
    Memory: the [T, k] output (the only allocation of a repeated call) plus scratch cached by shape: the
    multi-pass select's candidates (8 * cap bytes per row) or the streaming select's buffers, and the counts.
    """
    check_scores_matrix(scores, sort)
    check_k(k, MAX_K)
    t = scores.shape[0]
    counts = row_counts_int32(scores, row_counts)
    out = torch.empty((t, k), dtype=torch.int32, device=scores.device)
    launch_select(scores, counts, out, k, sort, config=config)
    return out



__all__ = ["SelectBuffers", "cached_select_buffers", "release_select_buffers",
           "launch_stream_select", "launch_stream_select_cached",
           "select_topk_stream", "launch_select", "select_topk_triton"]
