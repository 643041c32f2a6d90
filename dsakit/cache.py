"""Paged cache: one uint8 pool [P, page_bytes] of a given entry format, a page allocator and block tables.

Byte layout of a page: see :mod:`dsakit.formats`. A *slot* is a global entry index: page = slot // 64,
entry = slot % 64. A sequence owns a list of pages (its block table); its i-th entry lives at
slot = block_table[i // 64] * 64 + i % 64.

The low-level functions (:func:`write_entries`, :func:`read_entries`, :func:`sequence_slots`) work on a raw
pool tensor, like the kernels do, and live one floor down in :mod:`dsakit.pool` (re-exported here);
:class:`PagedCache` adds allocation and bookkeeping on top. Every check runs before the first byte is
written, so bad input leaves the pool unchanged.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from ._memory import check_bool, check_fits, check_int, check_int_list, parse_device
from .batch import PagedBatch, check_ratio, check_table_size
from .formats import ENTRIES_PER_PAGE, EntryFormat, KeyFormat, is_centred
# the raw pool access lives one floor down (dsakit.pool); these names stay importable from here
from .pool import (PageSummaries, check_pool, check_slots, check_summaries, dequantize_entries,  # noqa: F401
                   num_slots, read_entries, sequence_slots, store_entries, summarize_pages, write_entries)


# --------------------------------------------------------------------------------------------------
# PagedCache: allocator + block tables
# --------------------------------------------------------------------------------------------------


class PagedCache:
    """A page pool of one format with a free-list allocator and per-sequence block tables.

    >>> cache = PagedCache(KeyFormat.FP8, num_pages=10)
    >>> seq = cache.add_sequence(); slots = cache.append(seq, 100)   # reserves 2 pages
    >>> cache.write(slots, torch.randn(100, 128)); cache.gather(seq).shape
    torch.Size([100, 128])

    ``summaries=True`` (index-key formats): ``cache.summaries`` is the pool's
    :class:`dsakit.pool.PageSummaries` (768 B per page), kept by :meth:`write` and by the store ops given
    ``summaries=cache.summaries``, and carried by :meth:`batch`. A page given back (:meth:`truncate`,
    :meth:`free_sequence`) keeps its stale row until its next owner stores into it: every store recomputes
    the row of each page it writes from entry 0 (the table's rule), and no batch reads a page past its
    sequence's length. A :meth:`truncate` that keeps part of a page recomputes that page's row over the entries
    kept. Otherwise ``cache.summaries`` is None.
    """

    def __init__(self, fmt: "EntryFormat | str", num_pages: int, device: "str | torch.device" = "cpu",
                 summaries: bool = False):
        fmt = _entry_format(fmt)
        check_int("num_pages", num_pages, 1, message="num_pages must be a positive int")
        check_bool("summaries", summaries)
        device = parse_device(device)
        check_fits(num_pages * (fmt.page_bytes + (768 if summaries else 0)), device,
                   f"a {fmt.name} cache of {num_pages:,} pages")
        self.fmt = fmt
        self.pool = torch.zeros(num_pages, fmt.page_bytes, dtype=torch.uint8, device=device)
        self.summaries = PageSummaries.zeros(num_pages, device) if summaries else None
        check_summaries(self.summaries, self.pool, fmt, None)  # index-key formats only
        self._free = list(range(num_pages - 1, -1, -1))  # stack: pops the lowest page first
        self._tables: dict[int, list[int]] = {}
        # int32 host arrays of the tables for PagedCache.batch, extended when pages are appended and dropped when
        # a table shrinks (a decode step adds a page every 64 entries, so a batch of long sequences does not
        # convert every list every step; concatenating arrays is a memory copy)
        self._table_rows: dict[int, array] = {}
        self._lengths: dict[int, int] = {}
        self._next_id = 0

    # -- capacity -----------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.pool.shape[0]

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def bytes_per_token(self, compress_ratio: int = 1) -> float:
        """Cache bytes per context token: entry bytes / compress_ratio (page padding included)."""
        return bytes_per_token(self.fmt, compress_ratio)

    # -- sequences ----------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self._tables[seq_id] = []
        self._lengths[seq_id] = 0
        return seq_id

    def _check_seq(self, seq_id: int) -> None:
        check_int("seq_id", seq_id, message="a sequence id is an int from add_sequence()")
        if seq_id not in self._tables:
            raise ValueError(f"unknown sequence id {seq_id!r}; live sequences: {sorted(self._tables)}")

    def _seq_list(self, seq_ids) -> list[int]:
        """A list of sequence ids (default: all); a single id or a string is a ValueError, not a TypeError."""
        if seq_ids is None:
            return self.sequences
        if isinstance(seq_ids, (str, bytes)) or not isinstance(seq_ids, Sequence):
            raise ValueError(f"seq_ids must be a list of sequence ids (e.g. [{seq_ids!r}]), got {seq_ids!r}")
        ids = list(seq_ids)
        tables = self._tables
        for s in ids:
            if type(s) is not int or s not in tables:  # the common case costs one lookup per id
                self._check_seq(s)
        return ids

    @property
    def sequences(self) -> list[int]:
        return sorted(self._tables)

    def length(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return self._lengths[seq_id]

    def append(self, seq_id: int, n: int) -> torch.Tensor:
        """Reserve n more entries for a sequence; returns their slots int64 [n]. All or nothing."""
        self._check_seq(seq_id)
        check_int("n", n, 0, message="number of entries to append must be a non-negative int")
        old = self._lengths[seq_id]
        new = old + n
        table = self._tables[seq_id]
        pages_needed = (new + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE - len(table)
        if pages_needed > len(self._free):
            raise ValueError(f"page pool exhausted: sequence {seq_id} needs {pages_needed} more pages for "
                             f"{n} entries, {len(self._free)} of {self.num_pages} are free")
        for _ in range(pages_needed):
            table.append(self._free.pop())
        self._lengths[seq_id] = new
        return self.slots(seq_id, old, new)

    def truncate(self, seq_id: int, length: int) -> None:
        """Shorten a sequence to its first ``length`` entries; pages no longer needed go back to the pool.

        Undoes an :meth:`append` whose entries could not be written (their bytes are left as they are)."""
        self._check_seq(seq_id)
        current = self._lengths[seq_id]
        check_int("length", length, 0, current,
                  message=f"truncate length must be an int in 0..{current} (sequence {seq_id})")
        table = self._tables[seq_id]
        keep = (length + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
        self._table_rows.pop(seq_id, None)
        self._release(table[keep:])
        del table[keep:]
        self._lengths[seq_id] = length
        tail = length % ENTRIES_PER_PAGE
        if self.summaries is not None and tail and length < current:  # the kept part of the last page
            summarize_pages(self.pool, self.fmt, torch.tensor([table[-1]]), torch.tensor([tail]), self.summaries)

    def free_sequence(self, seq_id: int) -> None:
        self._check_seq(seq_id)
        self._table_rows.pop(seq_id, None)
        self._release(self._tables.pop(seq_id))
        del self._lengths[seq_id]

    def _release(self, pages: list[int]) -> None:
        """Pages back to the free list. A page-centred page also loses its start mark (entry 0's scale bytes
        zeroed: one small device write), so the next sequence that gets it must store its entry 0 before any
        other entry, as on a fresh page (:func:`dsakit.pool.check_centre_order`), instead of coding entries
        against the previous owner's centre."""
        if pages and is_centred(self.fmt):
            start = self.fmt.scale_offset_in_page
            index = torch.tensor(pages, dtype=torch.long, device=self.pool.device)
            self.pool[index, start: start + self.fmt.scale_bytes] = 0
        self._free.extend(reversed(pages))

    def slots(self, seq_id: int, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Slots int64 [end - start] of a sequence's entries start..end-1."""
        self._check_seq(seq_id)
        length = self._lengths[seq_id]
        end = length if end is None else end
        for what, value in (("start", start), ("end", end)):
            check_int(what, value, message=f"{what} must be an int entry index")
        if not 0 <= start <= end <= length:
            raise ValueError(f"entry range {start}..{end} outside sequence {seq_id} of length {length}")
        # only the pages of start..end-1 (an append to a long sequence costs O(appended), not O(length)),
        # expanded to their 64 slots each in one broadcast op
        first = start // ENTRIES_PER_PAGE
        pages = torch.tensor(self._tables[seq_id][first:(end + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE],
                             dtype=torch.long)
        page_slots = (pages.unsqueeze(1) * ENTRIES_PER_PAGE + torch.arange(ENTRIES_PER_PAGE)).view(-1)
        return page_slots[start - first * ENTRIES_PER_PAGE: end - first * ENTRIES_PER_PAGE]

    def block_table(self, seq_ids: Sequence[int] | None = None, width: int | None = None) -> torch.Tensor:
        """int32 [B, max_pages] page ids per sequence (rows padded with -1), on the pool's device."""
        seq_ids = self._seq_list(seq_ids)
        for s in seq_ids:
            self._check_seq(s)
        widest = max((len(self._tables[s]) for s in seq_ids), default=0)
        width = widest if width is None else width
        check_int("width", width, message="block table width must be an int")
        if width < widest:
            raise ValueError(f"block table width {width} is smaller than the longest table ({widest} pages)")
        check_table_size(len(seq_ids), width, self.pool.device)
        out = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        for row, s in enumerate(seq_ids):
            pages = self._tables[s]
            out[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
        return out.to(self.pool.device)

    def entry_counts(self, seq_ids: Sequence[int] | None = None) -> torch.Tensor:
        """int32 [B] number of entries of each sequence, on the pool's device."""
        seq_ids = self._seq_list(seq_ids)
        return torch.tensor([self.length(s) for s in seq_ids], dtype=torch.int32, device=self.pool.device)

    def batch(self, seq_ids: Sequence[int] | None = None, query_lens: Sequence[int] | None = None,
              query_positions: torch.Tensor | None = None, ratio: int = 1) -> PagedBatch:
        """A :class:`dsakit.PagedBatch` of these sequences (default: all), from host metadata: no device sync.

        query_lens: host ints, queries per sequence (default 1 each: decode); the rows of q are grouped by
        sequence in ``seq_ids`` order. query_positions: int [T] absolute token positions or None (every query
        sees all entries of its sequence). ratio: tokens per entry.
        """
        seq_ids = self._seq_list(seq_ids)
        if not isinstance(self.fmt, KeyFormat):
            raise ValueError(f"a PagedBatch reads index keys; this cache holds {self.fmt.name} attention entries")
        check_ratio(ratio)
        b = len(seq_ids)
        if query_lens is None:
            query_lens = (1,) * b
        else:
            query_lens = tuple(check_int_list("query_lens", query_lens, 0, length=b, message=f"query_lens must be "
                                              f"{b} non-negative ints (queries per sequence)"))
        rows = [self._table_row(s) for s in seq_ids]
        width = max(map(len, rows), default=0)
        t = sum(query_lens)
        check_table_size(b, width, self.pool.device, queries=t)
        # the whole host side in one int32 array (block table rows padded with -1, counts, query rows' sequence),
        # uploaded by PagedBatch in one asynchronous copy
        packed = array("i")
        padding = array("i", [-1]) * width
        for row in rows:
            packed += row
            packed += padding[: width - len(row)]
        lengths = [self._lengths[s] for s in seq_ids]
        packed += array("i", lengths)
        if all(n == 1 for n in query_lens):
            packed += array("i", range(b))
        else:
            for number, n in enumerate(query_lens):
                packed += array("i", [number]) * n
        host = torch.frombuffer(packed, dtype=torch.int32) if len(packed) else torch.empty(0, dtype=torch.int32)
        return PagedBatch._from_packed(self.pool, self.fmt, host, b, width, max(lengths, default=0), query_lens,
                                       query_positions, ratio, summaries=self.summaries)

    def _table_row(self, seq_id: int) -> array:
        """int32 host array [pages] of a sequence's table (cached; appends only add pages, truncate / free drop
        it)."""
        pages = self._tables[seq_id]
        row = self._table_rows.get(seq_id)
        if row is None or len(row) > len(pages):
            row = array("i", pages)
            self._table_rows[seq_id] = row
        elif len(row) < len(pages):  # pages appended since: extend, the prefix is unchanged
            row.extend(pages[len(row):])
        return row

    # -- data (reference path) -----------------------------------------------------------------------
    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize fp32 entries x [N, head_dim] with the reference codec and store them at slots [N]
        (centred formats under their page-centre rule: :func:`dsakit.pool.store_entries`), keeping
        ``summaries`` when the cache has them (pages appended in order: :func:`dsakit.pool.check_summary_order`)."""
        store_entries(self.pool, self.fmt, slots, x, self.summaries)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """fp32 [N, head_dim] dequantized entries at slots [N]."""
        return dequantize_entries(self.pool, self.fmt, slots)

    def gather(self, seq_id: int) -> torch.Tensor:
        """fp32 [length, head_dim]: a sequence's entries back in order, dequantized."""
        return self.read(self.slots(seq_id))


def _check_compress_ratio(compress_ratio: int) -> None:
    check_int("compress_ratio", compress_ratio, 1, message="compress_ratio must be a positive int")


def _entry_format(fmt) -> EntryFormat:
    """An EntryFormat, or the name of a key or attention-KV format, as an EntryFormat (else ValueError)."""
    if isinstance(fmt, EntryFormat):
        return fmt
    if isinstance(fmt, str):
        try:
            return KeyFormat.parse(fmt)
        except ValueError:
            from .formats import AttentionKVFormat

            try:
                return AttentionKVFormat.parse(fmt)
            except ValueError:
                pass
            raise
    raise ValueError(f"fmt must be an EntryFormat or a format name like 'fp8', got {fmt!r}")


def bytes_per_token(fmt: "EntryFormat | str", compress_ratio: int = 1) -> float:
    """Cache bytes per context token of one layer: page_bytes / 64 / compress_ratio."""
    fmt = _entry_format(fmt)
    _check_compress_ratio(compress_ratio)
    return fmt.page_bytes / ENTRIES_PER_PAGE / compress_ratio


def tokens_that_fit(fmt: "EntryFormat | str", nbytes: int, compress_ratio: int = 1) -> int:
    """Context tokens whose entries fit in ``nbytes`` of whole pages (one layer)."""
    fmt = _entry_format(fmt)
    check_int("nbytes", nbytes, 0)
    _check_compress_ratio(compress_ratio)
    return (int(nbytes) // fmt.page_bytes) * ENTRIES_PER_PAGE * compress_ratio
