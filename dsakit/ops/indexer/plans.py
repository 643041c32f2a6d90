"""Plans of the indexer's launches, built on the host before any kernel runs: query tile plans
(:class:`QueryTiles`: prefill from a batch's host metadata or with one sync, decode from the shape alone),
the chunk plans of the fused top-k, and the decode top-k plan below.

CUDA-graph-capturable decode top-k: a plan that owns the workspace and the outputs.

The public :func:`dsakit.ops.indexer.index_topk` already reuses cached workspaces and tile plans, so in the
steady state it makes no device->host sync; what it still does per call is allocate its outputs and look
its workspace up. The decode plan moves that into an object built once per batch shape, so that a call
only launches kernels and can be captured in a CUDA graph::

    batch = cache.batch(seq_ids)                       # a PagedBatch: B sequences, one query each
    plan = plan_decode_topk(batch=B, next_n=1, max_entries=W, k=K, fmt="fp8", device="cuda")
    indices = index_topk_decode(q, weights, batch, K, plan=plan)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        index_topk_decode(q, weights, batch, K, plan=plan)
    graph.replay()  # after writing the next step's q / weights / batch tensors into the same tensors

For graph replays the batch's tensors must stay the same tensors: build the batch once over static tensors
with ``PagedBatch.build(..., validate=False, max_entries=W)`` and update them in place.

Shapes (glossary of docs/spec.md): q [B, next_n, H, 128] or [B * next_n, H, 128] (bf16, fp8 e4m3fn with
optional q_scale, or fp32 / fp16 which costs one bf16 conversion per call), weights [B * next_n, H] or
[B, next_n, H]. Row r = b * next_n + i is query i of sequence b (the batch's rows are in that order).

What one call launches (nothing else touches the GPU, nothing is allocated for bf16 / fp8 q):

    1. visible-count kernel    visible[r] = clamp(min(entry_counts[b], (pos[r] + 1) // ratio), 0, limit)
                               limit = min(W, 64 * max_pages): the select never reads past the workspace
                               row, the slot map never past the block-table row
    2. scores group kernel     workspace fp32 [B * next_n, W] (tile plan from the plan)
    3. radix select kernel     indices int32 [B * next_n, K] (+ slots), -1 padded

The plan owns the workspace and the outputs. Memory (bytes, fixed at plan time):

    4 * R * W (scores workspace) + 4 * R * K (indices) [+ 4 * R * K (slots)] + 8 * R (visible counts, tile
    rows) + 12 * B (tile plan),  R = B * next_n
    + the select's scratch: the streaming select's buffers for k <= 4096 (``plan.stream.nbytes``, see
      ``SelectBuffers``), else the multi-pass select's candidates, 8 * R * 2048

e.g. B = 64, next_n = 1, W = 128K, K = 2048: 32 MiB + 0.5 MiB + the streaming select's buffers.

Results are the plan's buffers: a later call with the same plan overwrites them (as the static outputs of a
CUDA graph do); clone them to keep them. Semantics are those of the reference
:func:`dsakit.ops.indexer.reference.index_topk`. The batch carries the value guarantees; a batch built with
``validate=False`` is trusted, and bad values then give wrong indices but never an out-of-bounds access
(every page id and block-table column is clamped in the scores kernel, every visible count to ``limit``).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton

from ..._memory import (INDEX_DTYPES, check_bool, check_choice, check_fits, check_instance, check_int,
                        check_power_of_two, check_tensor, parse_device)
from ...batch import PagedBatch, check_k, check_positive_int, upload
from ...formats import KeyFormat
from .config import MAX_K, ScoresConfig, SelectConfig, TopkConfig
from .select import SelectBuffers


@dataclass(frozen=True)
class DecodeTopkPlan:
    """Preallocated state of :func:`index_topk_decode` for one decode batch shape (see the module docstring).

    batch B, next_n, num_heads H, max_entries W (workspace columns: the largest entry count a call may have),
    k, fmt, sort. Buffers (all on ``device``, R = B * next_n): workspace fp32 [R, W], visible int32 [R],
    indices int32 [R, k], slots int32 [R, k] or None, tiles (scores tile plan), the select's scratch: ``stream``
    (the streaming select's buffers, k <= 4096) or cand_vals fp32 / cand_idx int32 [R, select.cap] (the
    multi-pass select's candidates; None on the streaming path). scores / select: kernel launch configs.
    """

    batch: int
    next_n: int
    num_heads: int
    max_entries: int
    k: int
    fmt: KeyFormat
    sort: bool
    tiles: QueryTiles
    workspace: torch.Tensor
    visible: torch.Tensor
    indices: torch.Tensor
    slots: torch.Tensor | None
    cand_vals: torch.Tensor | None
    cand_idx: torch.Tensor | None
    scores: ScoresConfig
    select: SelectConfig
    stream: SelectBuffers | None = None  # streaming-select scratch (None: the multi-pass select runs)

    @property
    def rows(self) -> int:
        return self.batch * self.next_n

    @property
    def device(self) -> torch.device:
        return self.workspace.device

    @property
    def workspace_bytes(self) -> int:
        """Bytes held by the plan (workspace, candidates, outputs, counts, tile plan)."""
        tensors = [self.workspace, self.visible, self.indices, self.slots, self.cand_vals, self.cand_idx,
                   self.tiles.rows, self.tiles.tile_seq, self.tiles.tile_start, self.tiles.tile_len]
        tensors = [t for t in tensors if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors) + (self.stream.nbytes if self.stream else 0)


def plan_decode_topk(batch: int, next_n: int, max_entries: int, k: int, fmt: "KeyFormat | str",
                     device: "torch.device | str", *, num_heads: int = 64, return_slots: bool = False,
                     sort: bool = True, scores: ScoresConfig | None = None,
                     select: SelectConfig | None = None) -> DecodeTopkPlan:
    """Allocate everything :func:`index_topk_decode` needs for batch B x next_n queries, W = max_entries.

    max_entries: the most entries any sequence may have during the plan's life (workspace width W; a batch
    whose max_entries is larger is refused). num_heads: H of q (picks the scores kernel). return_slots: also
    fill a slots int32 [R, k] output (page * 64 + e via the block table, -1 kept). sort: order each row by
    (score desc, index asc); False keeps the set in a deterministic, unspecified order. scores / select: kernel
    tuning (default: the measured table of the GPU). Building the plan allocates; using it does not.
    """
    batch = check_positive_int("batch", batch, 1)
    next_n = check_positive_int("next_n", next_n, 1)
    max_entries = check_positive_int("max_entries", max_entries, 1)
    num_heads = check_positive_int("num_heads", num_heads, 1)
    check_k(k, MAX_K)
    fmt = KeyFormat.parse(fmt)
    check_bool("return_slots", return_slots)
    check_bool("sort", sort)
    device = parse_device(device)
    select = select or SelectConfig()
    check_instance("select", select, SelectConfig, label="SelectConfig or None")
    rows = batch * next_n
    stream = select.stream_for(rows, max_entries, k) if select.uses_stream(k) else None
    scratch = stream.bytes_per_row(k) if stream is not None else 8 * select.cap
    per_row = 4 * (max_entries + 1 + k * (2 if return_slots else 1)) + scratch
    check_fits(rows * per_row, device, f"a decode plan for {rows:,} rows x max_entries {max_entries:,}")
    multipass = stream is None
    return DecodeTopkPlan(
        batch=batch, next_n=next_n, num_heads=num_heads, max_entries=max_entries, k=k, fmt=fmt, sort=sort,
        tiles=plan_decode_tiles(batch, next_n, num_heads, device),
        workspace=torch.empty((rows, max_entries), dtype=torch.float32, device=device),
        visible=torch.zeros((rows,), dtype=torch.int32, device=device),
        indices=torch.full((rows, k), -1, dtype=torch.int32, device=device),
        slots=torch.full((rows, k), -1, dtype=torch.int32, device=device) if return_slots else None,
        cand_vals=torch.empty((rows, select.cap), dtype=torch.float32, device=device) if multipass else None,
        cand_idx=torch.empty((rows, select.cap), dtype=torch.int32, device=device) if multipass else None,
        scores=scores or ScoresConfig.for_device(device), select=select,
        stream=None if multipass else SelectBuffers.allocate(rows, max_entries, k, device, stream))


# Tile plans of batches seen recently, keyed by shape (device, H, kernel choice, queries per sequence), so a
# steady-state call neither syncs nor uploads a plan.
_TILE_CACHE: "OrderedDict[tuple, QueryTiles]" = OrderedDict()


_TILE_CACHE_SIZE = 32


GROUP_MAX_QUERIES = 4  # the decode kernel handles up to 4 queries of one sequence per program


@dataclass(frozen=True)
class QueryTiles:
    """How the queries of a batch are cut into kernel tiles (a reusable plan; see :func:`plan_query_tiles`).

    Queries are stably sorted by sequence and cut into tiles of at most ``size`` rows that never mix
    sequences. ``kernel`` is "tile" (prefill: BLOCK_T = size) or "group" (decode: GROUP = size).
    rows int32 [T]: original row of each sorted position; tile_seq / tile_start / tile_len int32 [num_tiles].
    """

    kernel: str
    size: int
    rows: torch.Tensor
    tile_seq: torch.Tensor
    tile_start: torch.Tensor
    tile_len: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return int(self.tile_seq.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.rows.shape[0])


def _group_kernel_fits(num_heads: int, max_per_sequence: int) -> bool:
    heads_ok = num_heads >= 16 and num_heads & (num_heads - 1) == 0
    return heads_ok and max_per_sequence <= GROUP_MAX_QUERIES and max_per_sequence * num_heads <= 256


def _choose_kernel(kernel: str, num_heads: int, largest: int) -> str:
    """The scores kernel of a plan: ``kernel`` ("auto" picks the group kernel where it fits), else ValueError
    when "group" is asked for where it does not fit."""
    fits = _group_kernel_fits(num_heads, largest)
    if kernel == "auto":
        return "group" if fits else "tile"
    if kernel == "group" and not fits:
        raise ValueError(f"kernel='group' needs a power-of-two head count >= 16 (got H = {num_heads}) and at most "
                         f"{GROUP_MAX_QUERIES} queries per sequence (got {largest})")
    return kernel


def _tile_size(kernel: str, max_per_sequence: int, block_t: int | None, cap: int = 64) -> int:
    if kernel == "group":
        return max(1, triton.next_power_of_2(max(1, max_per_sequence)))
    return block_t or max(16, min(cap, triton.next_power_of_2(max(1, max_per_sequence))))


def _tiles_from_counts(per_seq: torch.Tensor, rows: torch.Tensor, num_tiles: int, kernel: str,
                       size: int) -> QueryTiles:
    device = per_seq.device
    num_seqs = per_seq.shape[0]
    tiles_per_seq = (per_seq + size - 1) // size
    tile_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), tiles_per_seq, output_size=num_tiles)
    seq_first_row = torch.cumsum(per_seq, 0) - per_seq
    seq_first_tile = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
    tile_in_seq = torch.arange(num_tiles, device=device) - seq_first_tile[tile_seq]
    tile_start = seq_first_row[tile_seq] + tile_in_seq * size
    tile_len = torch.clamp(per_seq[tile_seq] - tile_in_seq * size, max=size)
    return QueryTiles(kernel, size, rows.to(torch.int32), tile_seq.to(torch.int32), tile_start.to(torch.int32),
                      tile_len.to(torch.int32))


def plan_query_tiles(query_seq: torch.Tensor, num_seqs: int, num_heads: int, kernel: str = "auto",
                     block_t: int | None = None, *, cap: int = 64) -> QueryTiles:
    """Tile plan for queries ``query_seq`` int [T] (values 0..num_seqs-1) with H = ``num_heads``.

    One device->host sync. Build it once per batch and pass it as ``tiles=`` to every
    :func:`index_scores_triton` call on that batch (every indexer layer, every chunk of the same rows).
    kernel: "auto" (group kernel when each sequence has <= 4 queries and H is a power of two >= 16),
    "tile" or "group".
    """
    check_choice("kernel", kernel, ("auto", "tile", "group"))
    check_power_of_two("block_t", block_t, 16, allow_none=True)
    check_tensor("query_seq", query_seq, dims=1, dtypes=INDEX_DTYPES, message="query_seq must be int [T]")
    check_int("num_seqs", num_seqs, 0)
    seq = query_seq.long()
    out_of_range = ((seq < 0) | (seq >= num_seqs)).sum()
    # clamped so that bincount never sees a negative value; out-of-range values are refused below
    per_seq = torch.bincount(seq.clamp(0, max(num_seqs - 1, 0)), minlength=num_seqs)[:num_seqs]
    # the range check and every candidate tile size's tile count in the same sync as the largest count
    sizes = (1, 2, 4, 16, 32, 64, 128, 256) if block_t is None else (1, 2, 4, block_t)
    if num_seqs:
        tile_counts = [((per_seq + z - 1) // z).sum() for z in sizes]
        bad, max_per_sequence, *counts = torch.stack([out_of_range, per_seq.max()] + tile_counts).tolist()
    else:
        bad, max_per_sequence, counts = seq.numel(), 0, [0] * len(sizes)
    if bad:
        raise ValueError(f"query_seq values must be in 0..{num_seqs - 1}, got range "
                         f"{int(seq.min())}..{int(seq.max())}")
    choice = _choose_kernel(kernel, num_heads, max_per_sequence)
    size = _tile_size(choice, max_per_sequence, block_t, cap)
    rows = torch.argsort(seq, stable=True)
    return _tiles_from_counts(per_seq, rows, counts[sizes.index(size)], choice, size)


def plan_decode_tiles(batch: int, next_n: int, num_heads: int, device: "torch.device | str") -> QueryTiles:
    """Tile plan of a decode batch (row b * next_n + i = query i of sequence b) built without any host sync.

    Same plan as :func:`plan_query_tiles` on query_seq = repeat_interleave(arange(B), next_n): every sequence
    has next_n rows, so its tiles (cdiv(next_n, size) of them) follow from the shape alone.
    """
    check_int("batch", batch, 0)
    check_int("next_n", next_n, 1)
    kernel = "group" if _group_kernel_fits(num_heads, next_n) else "tile"
    size = _tile_size(kernel, next_n, None)
    tiles_per_seq = -(-next_n // size)
    tile = torch.arange(batch * tiles_per_seq, device=device, dtype=torch.int32)
    tile_seq = tile // tiles_per_seq
    first_row_in_seq = (tile % tiles_per_seq) * size
    return QueryTiles(kernel, size, torch.arange(batch * next_n, device=device, dtype=torch.int32), tile_seq,
                      tile_seq * next_n + first_row_in_seq, torch.clamp(next_n - first_row_in_seq, max=size))


def tiles_from_lens(lens: Sequence[int], num_heads: int, device: torch.device, config: ScoresConfig,
                    rows: torch.Tensor | None = None) -> QueryTiles:
    """Tile plan from host queries-per-sequence ``lens`` [B] (rows grouped by sequence in order unless ``rows``,
    the stable sort of the rows by sequence, is given). No device->host sync; cached when ``rows`` is None."""
    key = None
    if rows is None:
        key = (device, num_heads, config.kernel, config.prefill_block_t, tuple(lens))
        found = _TILE_CACHE.get(key)
        if found is not None:
            _TILE_CACHE.move_to_end(key)
            return found
    largest = max(lens, default=0)
    kernel = _choose_kernel(config.kernel, num_heads, largest)
    size = _tile_size(kernel, largest, None, config.prefill_block_t)
    per_seq = torch.tensor(list(lens), dtype=torch.int64)
    num_tiles = int(((per_seq + size - 1) // size).sum())
    t = int(per_seq.sum())
    host = _tiles_from_counts(per_seq, torch.zeros(0), num_tiles, kernel, size)
    # one asynchronous upload of the three tile arrays (no device sync); rows are made on the device
    packed = upload(torch.stack([host.tile_seq, host.tile_start, host.tile_len]), torch.device(device))
    rows = torch.arange(t, dtype=torch.int32, device=device) if rows is None else rows.to(torch.int32)
    tiles = QueryTiles(kernel, size, rows, packed[0], packed[1], packed[2])
    if key is not None:
        _TILE_CACHE[key] = tiles
        while len(_TILE_CACHE) > _TILE_CACHE_SIZE:
            _TILE_CACHE.popitem(last=False)
    return tiles


# Tile plans read from a batch's query_seq (an unchecked batch has no host metadata, so building one reads
# query_seq back: one sync; rows not grouped by sequence need a device sort), kept with the batch object: a batch
# is immutable and its query_seq is part of its structure, so the ops read it once per batch rather than once
# per call. Entries go away with their batch.
_UNCHECKED_PLANS: "weakref.WeakKeyDictionary[PagedBatch, dict]" = weakref.WeakKeyDictionary()


def _per_batch(batch: PagedBatch, key: tuple, make: Callable[[], object]):
    """make()'s plan for ``batch``, built on the first call with this key and kept with the batch."""
    plans = _UNCHECKED_PLANS.setdefault(batch, {})
    found = plans.get(key)
    if found is None:
        found = plans[key] = make()
    return found


def plan_batch_tiles(batch: PagedBatch, num_heads: int, config: ScoresConfig | None = None) -> QueryTiles:
    """Tile plan of every query of ``batch``: from its host metadata (no sync; cached by shape for a batch whose
    rows are grouped by sequence) or, for an unchecked batch, with :func:`plan_query_tiles` (one sync on the
    first call with this batch object; the plan is kept with the batch, as is that of rows not grouped by
    sequence)."""
    config = config or ScoresConfig.for_device(batch.device)
    if batch.query_lens is None:
        return _per_batch(batch, ("tiles", num_heads, config.kernel, config.prefill_block_t),
                          lambda: plan_query_tiles(batch.query_seq, batch.num_seqs, num_heads, config.kernel,
                                                   cap=config.prefill_block_t))
    if batch.rows_sorted:
        return tiles_from_lens(batch.query_lens, num_heads, batch.device, config)
    return _per_batch(batch, ("tiles", num_heads, config.kernel, config.prefill_block_t),
                      lambda: tiles_from_lens(batch.query_lens, num_heads, batch.device, config,
                                              torch.argsort(batch.query_seq, stable=True)))


def workspace_width(max_entries: int) -> int:
    """Columns of the cached score workspace for W = max_entries: the next power of two (>= 64), so a
    sequence that grows by one entry per decode step reuses the same workspace for many steps."""
    return max(64, triton.next_power_of_2(max(1, max_entries)))


def _chunk_lens(batch: PagedBatch, chunk: int) -> list[Sequence[int]]:
    """Queries per sequence within each chunk of ``chunk`` rows: host arithmetic when the rows are grouped
    by sequence, else one device->host sync for every chunk at once."""
    t, b = batch.num_queries, batch.num_seqs
    starts = range(0, t, chunk)
    if batch.query_lens is not None and chunk >= t:
        return [batch.query_lens]
    if batch.query_lens is not None and batch.rows_sorted:
        out = []
        bounds = [0]
        for n in batch.query_lens:
            bounds.append(bounds[-1] + n)
        for start in starts:
            stop = min(t, start + chunk)
            out.append([max(0, min(stop, bounds[i + 1]) - max(start, bounds[i])) for i in range(b)])
        return out
    which = torch.arange(t, device=batch.device) // chunk
    seq = batch.query_seq.long().clamp(0, max(b - 1, 0))
    flat = torch.bincount(which * b + seq, minlength=len(starts) * b)[: len(starts) * b]
    values = flat.tolist()
    return [values[i * b:(i + 1) * b] for i in range(len(starts))]


def plan_chunks(batch: PagedBatch, chunk: int, num_heads: int, config: TopkConfig) -> list[QueryTiles]:
    """Tile plan of every chunk of ``chunk`` rows (no sync for a batch with rows grouped by sequence; one sync
    on the first call with an unchecked batch object, whose plans are kept with it)."""
    if batch.query_lens is None or not batch.rows_sorted:  # plans read from query_seq: once per batch object
        key = ("chunks", chunk, num_heads, config.scores.kernel, config.scores.prefill_block_t)
        return _per_batch(batch, key, lambda: _plan_chunks(batch, chunk, num_heads, config))
    return _plan_chunks(batch, chunk, num_heads, config)


def _plan_chunks(batch: PagedBatch, chunk: int, num_heads: int, config: TopkConfig) -> list[QueryTiles]:
    if batch.num_queries <= chunk and batch.query_lens is None:
        return [plan_query_tiles(batch.query_seq, batch.num_seqs, num_heads, config.scores.kernel,
                                 cap=config.scores.prefill_block_t)]
    plans = []
    for number, lens in enumerate(_chunk_lens(batch, chunk)):
        rows = None
        if not batch.rows_sorted:
            start = number * chunk
            rows = torch.argsort(batch.query_seq[start:start + chunk], stable=True)
        plans.append(tiles_from_lens(lens, num_heads, batch.device, config.scores, rows))
    return plans



__all__ = ["QueryTiles", "GROUP_MAX_QUERIES", "plan_query_tiles", "plan_decode_tiles", "plan_batch_tiles",
           "tiles_from_lens", "workspace_width", "plan_chunks", "DecodeTopkPlan", "plan_decode_topk"]
