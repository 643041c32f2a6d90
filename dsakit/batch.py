"""A validated, immutable ragged batch of queries against a paged index-key cache: :class:`PagedBatch`.

Every op that reads a paged key cache (``index_scores``, ``index_topk``, the decode plan) takes one
``PagedBatch`` instead of seven loose arguments, and none of them re-checks what the batch guarantees:

    pool             uint8 [P, page_bytes] of ``fmt``, contiguous
    fmt              KeyFormat
    block_table      int32 [B, W] contiguous: page of logical page i of sequence b (-1 = unassigned)
    entry_counts     int32 [B] contiguous: entries of sequence b, 0 <= count <= 64 * W, and the pages
                     holding them are pages of the pool
    query_seq        int32 [T] contiguous: sequence of each query, in 0..B-1
    query_positions  int64 [T] contiguous (absolute token position of each query) or None (every query sees
                     all entries of its sequence)
    ratio            int >= 1: tokens per entry
    num_queries      T (host int); max_entries = max(entry_counts) (host int)
    query_lens       host tuple [B]: queries per sequence, or None when unknown (unchecked batches)
    rows_sorted      True when query_seq is non-decreasing (rows grouped by sequence in order)

Visibility: entry j of the query's sequence is visible iff j < entry_counts[seq] and, when positions are
given, j < (pos + 1) // ratio.

Two ways to get one:

* :meth:`PagedBatch.build` validates explicit tensors once, with at most one device->host sync (one
  ``tolist`` of every statistic at once; int64 values are checked before they are narrowed to int32).
  ``validate=False`` (with ``max_entries``) checks shapes, dtypes and devices only and makes no sync:
  ``query_seq`` is clamped into 0..B-1 (one device op) and the kernels clamp every page id and block-table
  column, so wrong values give wrong scores (or slots) but never an out-of-bounds access. The ops plan their
  tiles from such a batch's ``query_seq`` once per batch object (one sync, the plan kept with the batch):
  ``query_seq`` is part of the batch's structure; to change it, build another batch.
* :meth:`dsakit.PagedCache.batch` builds one from the host-side metadata the cache already holds (no sync).

This module also holds the cheap (sync-free) checks of the query-side inputs shared by every op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ._memory import (INDEX_DTYPES, check_bool, check_fits, check_instance, check_int, check_int_list,  # noqa: F401
                      check_k, check_positive_int, check_ratio, check_same_device, check_tensor, describe)
from .formats import ENTRIES_PER_PAGE, INDEX_HEAD_DIM, KeyFormat
from .pool import PageSummaries, check_pool, check_pool_alignment, check_summaries  # noqa: F401  (as before)

#: dtypes every backend reads for q (fp8 = e4m3fn, DeepGEMM's fp8 q) and for the head weights; an integer or
#: bool weight would be truncated silently, a float64 q is something no kernel reads.
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)
WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device`` without a device sync: through pinned memory and an asynchronous copy on CUDA
    (the caching host allocator keeps the pinned block until the copy is done); a plain copy elsewhere."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def check_batch(batch) -> "PagedBatch":
    """``batch`` if it is a :class:`PagedBatch`, else the one ValueError every op raises for it."""
    return check_instance("batch", batch, PagedBatch, "PagedBatch.build or PagedCache.batch", label="dsakit.PagedBatch")


def check_queries(q: torch.Tensor, weights: torch.Tensor, d: int = INDEX_HEAD_DIM) -> None:
    """q floating [T, H, d] and weights [T, H], else ValueError (shapes and dtypes only: no sync)."""
    check_tensor("q", q, shape=(None, None, d), message=f"q must be [T, H, {d}]")
    if q.dtype not in QUERY_DTYPES:
        raise ValueError(f"q dtype must be one of {[str(d) for d in QUERY_DTYPES]}, got {q.dtype}")
    check_tensor("weights", weights, shape=tuple(q.shape[:2]), message=f"weights must be [T, H] = {list(q.shape[:2])}")
    if weights.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weights must be one of {[str(d) for d in WEIGHT_DTYPES]}, got {weights.dtype}")


def check_batch_queries(q: torch.Tensor, weights: torch.Tensor, batch: "PagedBatch") -> None:
    """q [T, H, 128] and weights [T, H] for the T queries of ``batch`` (no sync)."""
    check_batch(batch)
    check_queries(q, weights)
    if q.shape[0] != batch.num_queries:
        raise ValueError(f"q has {q.shape[0]} rows but the batch has {batch.num_queries} queries")


#: the kernels index rows, block-table cells and slots with int32
MAX_INT32 = 2**31 - 1


def check_table_size(num_seqs: int, width: int, device: torch.device, queries: int = 0) -> None:
    """A block table [num_seqs, width] (+ ``queries`` query rows) that int32 indices can address and the host
    and ``device`` can hold, else ValueError (the allocator would raise a RuntimeError, or the OS kill us)."""
    if queries > MAX_INT32:
        raise ValueError(f"query_lens sum to {queries:,} queries; at most {MAX_INT32:,} (int32 row ids)")
    if num_seqs * width > MAX_INT32:
        raise ValueError(f"a block table of {num_seqs} x {width:,} pages has more than {MAX_INT32:,} cells "
                         f"(int32 indices)")
    nbytes = 4 * (num_seqs * width + num_seqs + queries)
    for where in {torch.device("cpu"), device}:
        check_fits(nbytes, where, f"a block table of {num_seqs} x {width:,} pages and {queries:,} queries")


def visible_counts(entry_counts: torch.Tensor, query_positions: torch.Tensor | None, ratio: int) -> torch.Tensor:
    """int64 [T]: how many leading entries each query sees (entry_counts already gathered per query)."""
    counts = entry_counts.long()
    if query_positions is None:
        return counts
    return torch.minimum(counts, torch.div(query_positions.long() + 1, ratio, rounding_mode="floor").clamp(min=0))


def _as_int_tensor(name: str, value, dims: int) -> torch.Tensor:
    """An int32 / int64 tensor of ``dims`` dimensions, as given (narrowed only after its values are checked:
    an int64 2**32 must not become page 0), else ValueError."""
    if not isinstance(value, torch.Tensor) or value.dim() != dims or value.dtype not in INDEX_DTYPES:
        shape = "[B, W]" if dims == 2 else "[N]"
        raise ValueError(f"{name} must be an int32/int64 {shape} tensor, got {describe(value)}")
    return value


def _int32(value: torch.Tensor) -> torch.Tensor:
    return value.to(torch.int32).contiguous()


def _as_positions(query_positions, t: int) -> torch.Tensor:
    """query_positions as int64 [T] (same device), else ValueError naming it."""
    check_tensor("query_positions", query_positions, shape=(t,), dtypes=INDEX_DTYPES,
                 message=f"query_positions must be int [T] = [{t}] or None")
    return query_positions.to(torch.int64)


def _repeated_page_message(table: torch.Tensor, needed: torch.Tensor) -> str:
    """Names the first block-table row that lists a page twice among the pages its entries need (error path)."""
    for row, (pages, n) in enumerate(zip(table.cpu().tolist(), needed.cpu().tolist())):
        seen: dict[int, int] = {}
        for col, page in enumerate(pages[:n]):
            if page in seen:
                return (f"block_table row {row} lists page {page} twice (columns {seen[page]} and {col}): a "
                        f"sequence's entries need distinct pages")
            seen[page] = col
    return "block_table lists a page twice in one row"


@dataclass(frozen=True, eq=False)
class PagedBatch:
    """Validated ragged batch against a paged key cache (fields: module docstring). Immutable."""

    pool: torch.Tensor
    fmt: KeyFormat
    block_table: torch.Tensor
    entry_counts: torch.Tensor
    query_seq: torch.Tensor
    query_positions: torch.Tensor | None
    ratio: int
    num_queries: int
    max_entries: int
    query_lens: tuple[int, ...] | None = None
    rows_sorted: bool = False
    summaries: PageSummaries | None = None  # the pool's page summaries, for hierarchical selection (optional)
    # ids of the (pool, block table, entry counts) a builder checked: a batch made from a checked one by
    # dataclasses.replace with other tensors is not checked (see __post_init__)
    checked_tensors: tuple = field(default=(), repr=False)

    def __post_init__(self):
        # ``query_lens`` marks a checked batch (the ops trust its pages); another pool or block table swapped in
        # (dataclasses.replace) makes it an unchecked one, whose slots the ops check against its pool
        if self.query_lens is not None and self.checked_tensors != self._tensor_ids():
            object.__setattr__(self, "query_lens", None)
            object.__setattr__(self, "rows_sorted", False)

    def _tensor_ids(self) -> tuple:
        return id(self.pool), id(self.block_table), id(self.entry_counts)

    @property
    def device(self) -> torch.device:
        return self.pool.device

    @property
    def num_seqs(self) -> int:
        return int(self.block_table.shape[0])

    @property
    def next_n(self) -> int | None:
        """n when row b * n + i is query i of sequence b for every b (a decode batch), else None."""
        lens = self.query_lens
        if not self.rows_sorted or not lens or lens[0] < 1 or any(n != lens[0] for n in lens):
            return None
        return lens[0]

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def build(cls, pool: torch.Tensor, fmt: "KeyFormat | str", block_table: torch.Tensor,
              entry_counts: torch.Tensor, query_seq: torch.Tensor, query_positions: torch.Tensor | None = None,
              ratio: int = 1, *, validate: bool = True, max_entries: int | None = None,
              summaries: PageSummaries | None = None) -> "PagedBatch":
        """Validate explicit batch tensors once -> PagedBatch.

        pool uint8 [P, page_bytes], block_table int [B, W], entry_counts int [B], query_seq int [T],
        query_positions int [T] or None, ratio >= 1; every tensor on the pool's device. Integer tensors of
        the other width or with strides are converted (a copy, no sync).

        ``validate=True``: one device->host sync checks every value (counts in 0..64 * W, the pages holding
        each sequence's entries inside the pool, query_seq in 0..B-1) and records max_entries and the
        queries per sequence. ``validate=False`` needs ``max_entries`` (the workspace width of the ops) and
        makes no sync: values are trusted; ``query_seq`` is clamped into 0..B-1 here and the kernels clamp
        every page id and column, so bad values give wrong results but never an out-of-bounds access.

        ``summaries``: the pool's :class:`dsakit.pool.PageSummaries` (checked to belong to it), carried for the
        ops that read them.
        """
        fmt = KeyFormat.parse(fmt)
        check_pool(pool, fmt)
        check_summaries(summaries, pool, fmt, None)
        device = pool.device
        table = _as_int_tensor("block_table", block_table, 2)
        b, width = table.shape
        counts = _as_int_tensor("entry_counts", entry_counts, 1)
        check_tensor("entry_counts", counts, shape=(b,), message=f"entry_counts must be int [B] = [{b}]")
        seq = _as_int_tensor("query_seq", query_seq, 1)
        t = seq.shape[0]
        positions = None
        if query_positions is not None:
            positions = _as_positions(query_positions, t).contiguous()
        check_ratio(ratio)
        check_same_device(device, block_table=table, entry_counts=counts, query_seq=seq,
                          query_positions=positions)
        check_bool("validate", validate)
        if not validate:
            check_int("max_entries", max_entries, 0,
                      message="validate=False needs max_entries, an int >= 0 (the largest entry count)")
            if t and not b:
                raise ValueError(f"query_seq has {t} queries but the block table has no sequences")
            # Unchecked query_seq values are clamped into 0..B-1 (one device op, no sync): the slot mapping
            # gathers block_table[query_seq] and the score kernels index rows by it, so an out-of-range value
            # must become a wrong sequence, never a read next to the block table.
            seq = _int32(seq.clamp(0, b - 1)) if t else _int32(seq)
            return cls(pool, fmt, _int32(table), _int32(counts), seq, positions, ratio, t, max_entries, None, False,
                       summaries)
        if max_entries is not None:
            raise ValueError("max_entries is measured when validate=True; pass it only with validate=False")
        return cls._validated(pool, fmt, table, counts, seq, positions, ratio, summaries)

    @classmethod
    def _validated(cls, pool, fmt, table, counts, seq, positions, ratio, summaries=None) -> "PagedBatch":
        """Value checks of the int32 / int64 tensors as given (checked as int64, narrowed to int32 after),
        gathered into one device->host sync."""
        b, width = table.shape
        t = seq.shape[0]
        device = pool.device
        zero = torch.zeros((), dtype=torch.int64, device=device)
        c64 = counts.long()
        needed = (c64.clamp(min=0) + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
        used = torch.arange(width, device=device)[None, :] < needed[:, None]
        bad_pages = used & ((table < 0) | (table >= pool.shape[0]))
        # A row that lists one page twice would read (and a store would write) the same 64 entries under two
        # entry ranges. Sorting each row's used pages (unused columns get distinct negative stand-ins) puts
        # a repeated page next to itself.
        stand_in = -1 - torch.arange(width, device=device, dtype=torch.int64)[None, :]
        ordered = torch.where(used, table.long(), stand_in).sort(dim=1).values
        repeats = (ordered[:, 1:] == ordered[:, :-1]).sum() if width > 1 else zero
        s64 = seq.long()
        in_range = (s64 >= 0) & (s64 < b)
        per_seq = torch.bincount(s64.clamp(0, max(b - 1, 0)), minlength=b)[:b] if t else \
            torch.zeros(b, dtype=torch.int64, device=device)
        unsorted = (s64[1:] < s64[:-1]).sum() if t > 1 else zero
        position_min = positions.min() if positions is not None and t else zero
        stats = torch.cat([torch.stack([
            c64.min() if b else zero, c64.max() if b else zero, (~in_range).sum() if t else zero,
            bad_pages.sum(), s64.min() if t else zero, s64.max() if t else zero, unsorted, repeats,
            position_min.long()]), per_seq.long()])
        count_min, count_max, bad_seq, bad_page_count, seq_min, seq_max, n_unsorted, n_repeats, pos_min, *lens = \
            stats.tolist()
        check_int("query_positions", pos_min, 0, message="query_positions must be token positions >= 0 (smallest)")
        if count_min < 0 or count_max > width * ENTRIES_PER_PAGE:
            raise ValueError(f"entry_counts must be in 0..{width * ENTRIES_PER_PAGE} (block table width {width} x "
                             f"64), got range {count_min}..{count_max}")
        if bad_seq:
            raise ValueError(f"query_seq values must be in 0..{b - 1}, got range {seq_min}..{seq_max}")
        if bad_page_count:
            row, col = (int(v) for v in torch.nonzero(bad_pages)[0])
            raise ValueError(f"block_table[{row}, {col}] = {int(table[row, col])} is not a page of the pool "
                             f"(0..{pool.shape[0] - 1}) but sequence {row} needs it for its {int(counts[row])} "
                             f"entries")
        if n_repeats:
            raise ValueError(_repeated_page_message(table, needed))
        table, counts = _int32(table), _int32(counts)
        return cls(pool, fmt, table, counts, _int32(seq), positions, ratio, t, int(count_max) if b else 0,
                   tuple(int(n) for n in lens), n_unsorted == 0, summaries, (id(pool), id(table), id(counts)))

    @classmethod
    def from_host(cls, pool: torch.Tensor, fmt: KeyFormat, pages: "Sequence[Sequence[int] | torch.Tensor]",
                  lengths: Sequence[int],
                  query_lens: Sequence[int] | None = None, query_positions: torch.Tensor | None = None,
                  ratio: int = 1, width: int | None = None,
                  summaries: PageSummaries | None = None) -> "PagedBatch":
        """Batch from host metadata known to be valid (page lists inside the pool, lengths that fit them).
        ``summaries``: as :meth:`build`.

        pages[b]: page ids of sequence b (a list or a CPU int tensor); lengths[b]: its entries; query_lens[b]: its queries (default 1);
        rows are grouped by sequence in order. Only host -> device copies, no device->host sync.
        """
        fmt = KeyFormat.parse(fmt)
        check_pool(pool, fmt)
        check_summaries(summaries, pool, fmt, None)
        check_ratio(ratio)
        b = len(pages)
        check_int_list("lengths", lengths, 0, length=b, message=f"lengths must be {b} ints >= 0 (one per sequence)")
        query_lens = [1] * b if query_lens is None else query_lens
        query_lens = check_int_list("query_lens", query_lens, 0, length=b,
                                    message=f"query_lens must be {b} non-negative ints (queries per sequence)")
        widest = max((int(len(p)) for p in pages), default=0)
        width = widest if width is None else width
        check_int("width", width, widest, message=f"block table width must be an int >= {widest} (the longest "
                                                   f"page list)")
        t = sum(query_lens)
        device = pool.device
        check_table_size(b, width, device, queries=t)
        # one host buffer [B * W + B + T] int32 (block table, counts, query_seq), one asynchronous upload
        rows = [p.to(torch.int32) if isinstance(p, torch.Tensor) else torch.tensor(list(p), dtype=torch.int32)
                for p in pages]
        if b and widest == width:
            table = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)
        else:
            table = torch.full((b, width), -1, dtype=torch.int32)
            if b and widest:
                table[:, :widest] = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-1)
        counts = torch.tensor(list(lengths), dtype=torch.int32)
        if all(n == 1 for n in query_lens):
            seq = torch.arange(b, dtype=torch.int32)
        else:
            seq = torch.repeat_interleave(torch.arange(b, dtype=torch.int32),
                                          torch.tensor(query_lens, dtype=torch.long), output_size=t)
        packed = torch.cat([table.reshape(-1), counts, seq])
        return cls._from_packed(pool, fmt, packed, b, width, max(lengths, default=0), tuple(query_lens),
                               query_positions, ratio, summaries)

    @classmethod
    def _from_packed(cls, pool: torch.Tensor, fmt: KeyFormat, packed: torch.Tensor, num_seqs: int, width: int,
                    max_entries: int, query_lens: tuple[int, ...], query_positions: torch.Tensor | None = None,
                    ratio: int = 1, summaries: PageSummaries | None = None) -> "PagedBatch":
        """Batch from host metadata already packed and known to be valid (the last step of :meth:`from_host`
        and of ``PagedCache.batch``; internal: nothing is checked but the positions): packed int32 CPU [B * W + B + T] = the block table [B, W] (-1 padded)
        row by row, the entry counts [B], the sequence of each query [T] (rows grouped by sequence in order);
        max_entries = max(counts); query_lens [B] host ints summing to T. query_positions int [T] or None.

        One host->device copy (asynchronous, from pinned memory on CUDA) carries all of it, query positions
        given on the CPU included; no device->host sync.
        """
        device = pool.device
        t = sum(query_lens)
        positions = None
        if query_positions is not None:
            positions = _as_positions(query_positions, t).contiguous()
        size = packed.numel()
        if positions is not None and positions.device.type == "cpu":
            # host positions ride in the same upload, 8-byte aligned after the int32 values (on a CPU pool too:
            # the batch then owns a copy, as it does of the rest)
            pad = size % 2
            host = torch.cat([packed, packed.new_zeros(pad), positions.view(torch.int32)])
            buf = upload(host, device)
            positions = buf[size + pad:].view(torch.int64)
        else:
            buf = upload(packed, device)
        table = buf[: num_seqs * width].view(num_seqs, width)
        counts, seq = buf[num_seqs * width: num_seqs * width + num_seqs], buf[num_seqs * width + num_seqs: size]
        return cls(pool, fmt, table, counts, seq, positions, ratio, t, max_entries, tuple(query_lens), True,
                   summaries, (id(pool), id(table), id(counts)))

    def __repr__(self) -> str:
        return (f"PagedBatch(fmt={self.fmt.name}, B={self.num_seqs}, T={self.num_queries}, "
                f"max_entries={self.max_entries}, ratio={self.ratio}, positions={self.query_positions is not None}, "
                f"device={self.device})")


__all__ = ["PagedBatch", "upload", "check_batch", "check_batch_queries", "check_pool", "check_queries",
           "check_same_device",
           "check_positive_int", "check_ratio", "check_k", "visible_counts"]
