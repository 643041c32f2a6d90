"""The pool floor: what reads and writes the bytes of a paged pool, and the checks of pools and slots.

A *pool* is one uint8 tensor [P, fmt.page_bytes] holding pages of 64 entries of one format (byte layout:
:mod:`dsakit.formats`). A *slot* is a global entry index: page = slot // 64, entry = slot % 64. Everything
here works on raw pool tensors, like the kernels do; :mod:`dsakit.batch` (query batches) and
:mod:`dsakit.cache` (allocation, block tables) sit on top, and the formats below know nothing of pools.

Checks run once: :func:`check_slots` returns the slots as a CPU int64 tensor, and the writers that take such
a checked tensor (:func:`write_checked_entries`, :func:`store_checked_entries`) trust it; the public writers
(:func:`write_entries`, :func:`store_entries`) check and then call them. Every check runs before the first
byte is written, so bad input leaves the pool unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from ._memory import INDEX_DTYPES, check_instance, check_int, check_tensor
from .formats import ENTRIES_PER_PAGE, EntryFormat, KeyFormat, centre_of, decode_centres, is_centred


# --------------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------------


def num_slots(pool: torch.Tensor) -> int:
    """Entries a pool [P, page_bytes] holds: P * 64."""
    return pool.shape[0] * ENTRIES_PER_PAGE


def check_pool(pool: torch.Tensor, fmt, what: str = "pool") -> None:
    """uint8 [P, fmt.page_bytes], contiguous, starting on a 16-byte boundary, else ValueError (no sync).
    ``fmt`` must be a format object: a name is ambiguous here ("bf16" names a key and an attention KV format)."""
    check_instance("fmt", fmt, EntryFormat, "KeyFormat.parse(name) or AttentionKVFormat.parse(name)",
                   label="dsakit.formats.EntryFormat")
    check_tensor(what, pool)  # "pool must be a torch.Tensor, got list"
    # contiguous: cache writes never go through a silent copy
    check_tensor(what, pool, shape=(None, fmt.page_bytes), dtypes=torch.uint8, contiguous=True,
                 message=f"{what} must be uint8 [P, {fmt.page_bytes}] for format {fmt.name}")
    if not torch.compiler.is_compiling():  # the address is not traceable: the store's custom ops check it
        check_pool_alignment(pool, what)


def check_pool_alignment(pool: torch.Tensor, what: str = "pool") -> None:
    """The pool starts on a 16-byte boundary, else ValueError. The kernels read 2-, 4- and 16-byte words and
    bulk-copy 16-byte aligned boxes; every page size is a multiple of 16, so a pool allocated by torch, or
    viewed from one at a page boundary, always passes."""
    if pool.data_ptr() % 16:
        raise ValueError(f"{what} must start on a 16-byte boundary (a view at a page boundary of an allocation "
                         f"is fine), got an address {pool.data_ptr() % 16} bytes past one")


def check_slots(slots: torch.Tensor, num_slots: int, what: str = "slots", allow_padding: bool = True,
                length: int | None = None) -> torch.Tensor:
    """Validate int slots [N] against a pool of ``num_slots`` entries; negative = padding (if allowed).

    ``length``: the N the caller needs (one slot per row). Returns the slots as a CPU int64 tensor: the one
    host copy of a call path, which the writers taking checked slots reuse."""
    need = "a 1-D integer tensor" if length is None else f"an int tensor [N] with N = {length} (one per row)"
    check_tensor(what, slots, shape=(length,), dtypes=INDEX_DTYPES, message=f"{what} must be {need}")
    cpu = slots.detach().cpu().long()
    if cpu.numel():
        bad = cpu >= num_slots
        if not allow_padding:
            bad |= cpu < 0
        if bool(bad.any()):
            first = int(cpu[bad][0])
            raise ValueError(f"{what} out of range: slot {first} (pool holds slots 0..{num_slots - 1}"
                             f"{', negative = padding' if allow_padding else ''})")
        real = cpu[cpu >= 0]
        values, counts = torch.unique(real, return_counts=True)
        if values.numel() != real.numel():
            raise ValueError(f"{what} contains duplicate slot {int(values[counts > 1][0])}")
    return cpu


def _check_encoded_rows(fmt: EntryFormat, n: int, values: torch.Tensor, scales: torch.Tensor) -> None:
    for name, x, width in (("values", values, fmt.value_bytes), ("scales", scales, fmt.scale_bytes)):
        check_tensor(name, x, shape=(n, width), dtypes=torch.uint8,
                     message=f"{name} must be uint8 [{n}, {width}] (encoded bytes, one row per slot)")


# --------------------------------------------------------------------------------------------------
# Reads and writes
# --------------------------------------------------------------------------------------------------


def _byte_index(fmt: EntryFormat, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    value_start, scale_start = fmt.byte_offsets(slots)
    values = value_start.unsqueeze(1) + torch.arange(fmt.value_bytes)
    scales = scale_start.unsqueeze(1) + torch.arange(fmt.scale_bytes)
    return values, scales


def write_checked_entries(pool: torch.Tensor, fmt: EntryFormat, slots: torch.Tensor, values: torch.Tensor,
                          scales: torch.Tensor) -> None:
    """:func:`write_entries` for inputs already checked: ``slots`` from :func:`check_slots` (CPU int64),
    values / scales of matching shape. Negative slots are padding and are skipped."""
    keep = slots >= 0
    if not bool(keep.any()):
        return
    value_idx, scale_idx = _byte_index(fmt, slots[keep])
    flat = pool.view(-1)
    flat[value_idx.reshape(-1).to(pool.device)] = values[keep].reshape(-1).to(pool.device)
    if fmt.scale_bytes:
        flat[scale_idx.reshape(-1).to(pool.device)] = scales[keep].reshape(-1).to(pool.device)


def write_entries(pool: torch.Tensor, fmt: EntryFormat, slots: torch.Tensor, values: torch.Tensor,
                  scales: torch.Tensor) -> None:
    """Write encoded entries (values uint8 [N, value_bytes], scales uint8 [N, scale_bytes]) at slots [N].

    Negative slots are padding and are skipped. Validates everything before writing.
    """
    check_pool(pool, fmt)
    slots = check_slots(slots, num_slots(pool))
    _check_encoded_rows(fmt, slots.shape[0], values, scales)
    write_checked_entries(pool, fmt, slots, values, scales)


def read_entries(pool: torch.Tensor, fmt: EntryFormat, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoded bytes of the entries at slots [N] (all >= 0): (values [N, value_bytes], scales [N, scale_bytes])."""
    check_pool(pool, fmt)
    return read_checked_entries(pool, fmt, check_slots(slots, num_slots(pool), allow_padding=False))


def read_checked_entries(pool: torch.Tensor, fmt: EntryFormat,
                         slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`read_entries` for slots already checked (CPU int64, all in 0..num_slots - 1): no host copy, no
    deduplication."""
    value_idx, scale_idx = _byte_index(fmt, slots)
    flat = pool.view(-1)  # gather on the pool's device: only the requested bytes come to the host
    return flat[value_idx.to(pool.device)].cpu(), flat[scale_idx.to(pool.device)].cpu()


def read_centres(pool: torch.Tensor, fmt, slots: torch.Tensor) -> torch.Tensor:
    """fp32 [N, 128]: the centre of the page of each slot [N] of a centred pool (slots >= 0, checked)."""
    pages = slots.detach().cpu().long() // fmt.entries_per_page
    index = fmt.centre_offsets(pages).unsqueeze(1) + torch.arange(fmt.centre_bytes)
    return decode_centres(pool.view(-1)[index.to(pool.device)].cpu())


def dequantize_entries(pool: torch.Tensor, fmt: EntryFormat, slots: torch.Tensor) -> torch.Tensor:
    """fp32 [N, head_dim] of the entries at slots [N]."""
    values, scales = read_entries(pool, fmt, slots)
    if slots.numel() == 0:
        return torch.zeros(0, fmt.head_dim)
    if is_centred(fmt):  # + the centre of each entry's page
        return fmt.dequantize(values, scales, read_centres(pool, fmt, slots))
    return fmt.dequantize(values, scales)


def store_checked_entries(pool: torch.Tensor, fmt: EntryFormat, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Quantize fp32 entries x [N, head_dim] with the reference codec and write them at checked slots [N]
    (CPU int64 from :func:`check_slots`, < 0 = padding). No checks: the caller's record carries them.

    Centred formats follow the page-centre rule (:class:`dsakit.formats.CentredKeyFormat`): pages whose
    entry 0 is among the slots get the centre of that row; every entry is then encoded against its page's
    centre (new or already in the pool). Everything is computed before the first byte is written.
    """
    if not is_centred(fmt):
        values, scales = fmt.quantize(x)
        write_checked_entries(pool, fmt, slots, values, scales)
        return
    keep = slots >= 0
    slots, x = slots[keep], x[keep]
    if slots.numel() == 0:
        return
    per_page = fmt.entries_per_page
    starts = slots % per_page == 0
    new_raw, new_centre = centre_of(x[starts])
    new_pages = slots[starts] // per_page
    centres = read_centres(pool, fmt, slots)
    # entries of a page (re)started in this call use its new centre
    match = (slots // per_page).unsqueeze(1) == new_pages.unsqueeze(0)  # [N, new pages]
    has_new = match.any(dim=1)
    if bool(has_new.any()):
        centres[has_new] = new_centre[match[has_new].float().argmax(dim=1)]
    values, scales = fmt.quantize(x, centres)
    if new_pages.numel():
        index = fmt.centre_offsets(new_pages).unsqueeze(1) + torch.arange(fmt.centre_bytes)
        pool.view(-1)[index.reshape(-1).to(pool.device)] = new_raw.reshape(-1).to(pool.device)
    write_checked_entries(pool, fmt, slots, values, scales)


def check_centre_order(pool: torch.Tensor, fmt: EntryFormat, slots: torch.Tensor, in_row_order: bool = False) -> None:
    """Page-centred formats: every entry e > 0 to be stored needs its page's centre, which entry 0 brings, so
    the page's entry 0 must be stored in an earlier call or in this one; ValueError otherwise (nothing written).

    slots: checked CPU int64 [N] (< 0 = padding). A page counts as started when its entry 0's scale bytes are
    not all 0 (a stored entry's scale never is; a zeroed pool's are: dsakit.formats.CentredKeyFormat).
    ``in_row_order`` (the store op, whose one-launch kernel looks for entry 0 at a fixed row): when entry 0 is in
    this call, the row of entry e must come e rows after it, i.e. the page's rows run in order from its entry
    0 without padding between them, as a sequence's append gives them. Other formats: nothing to check.
    """
    if not is_centred(fmt) or slots.numel() == 0:
        return
    # numpy on the host copy: a decode step runs this per call, and a few numpy ops cost microseconds where
    # as many small torch ops cost tens of them
    s = slots.numpy()
    per_page = fmt.entries_per_page
    live = s >= 0
    entry = np.where(live, s % per_page, 0)
    page = np.where(live, s // per_page, -1)
    later = live & (entry > 0)
    if not later.any():
        return
    in_call = later & np.isin(page, page[live & (entry == 0)])
    if in_row_order:
        src = np.arange(s.shape[0]) - entry
        bad = in_call & ~((src >= 0) & (s[np.maximum(src, 0)] == s - entry))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"slot {int(s[i])} (row {i}) is entry {int(entry[i])} of page {int(page[i])}, whose "
                             f"entry 0 is in the same call but not {int(entry[i])} rows before it: the store op "
                             f"takes a page-centred page's centre from entry 0's row, so a page's rows must run in "
                             f"order from its entry 0, without padding rows between them (as an append gives them)")
    pending = later & ~in_call
    if not pending.any():
        return
    pages = np.unique(page[pending])
    # entry 0's scale bytes of those pages, gathered on the pool's device (one small copy back)
    marker = (torch.from_numpy(pages).unsqueeze(1) * fmt.page_bytes + fmt.scale_offset_in_page
              + torch.arange(fmt.scale_bytes))
    started = pool.view(-1)[marker.to(pool.device)].cpu().ne(0).any(dim=1).numpy()
    if not started.all():
        p = int(pages[~started][0])
        i = int(np.flatnonzero(pending & (page == p))[0])
        raise ValueError(f"slot {int(s[i])} is entry {int(entry[i])} of page {p}, whose entry 0 was never "
                         f"stored: a page of {fmt.name} takes its centre from its entry 0, so store entry 0 first "
                         f"(in this call or an earlier one); nothing was written")


def store_entries(pool: torch.Tensor, fmt: EntryFormat, slots: torch.Tensor, x: torch.Tensor,
                  summaries: "PageSummaries | None" = None) -> None:
    """Reference store of fp32 entries x [N, head_dim] at slots [N] (< 0 = padding): check everything, then
    :func:`store_checked_entries` (quantize, the page-centre rule for centred formats, write).

    ``summaries``: the pool's :class:`PageSummaries` (index-key pools), brought up to date
    (:func:`update_summaries`; the call must follow :func:`check_summary_order`)."""
    check_pool(pool, fmt)
    x = fmt.check_entries(x)
    slots = check_slots(slots, num_slots(pool), length=x.shape[0])
    check_centre_order(pool, fmt, slots)
    check_summaries(summaries, pool, fmt, slots)
    store_checked_entries(pool, fmt, slots, x)
    if summaries is not None:
        update_summaries(pool, fmt, slots, summaries)


def sequence_slots(block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Slots int64 [length] of a sequence's first ``length`` entries, from its block-table row [max_pages]."""
    check_tensor("block_table_row", block_table_row, dims=1, dtypes=INDEX_DTYPES,
                 message="block_table_row must be a 1-D int32/int64 tensor")
    check_int("sequence length", length, 0, message="sequence length must be a non-negative int")
    pages_needed = (length + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
    row = block_table_row.detach().cpu().long()
    if pages_needed > row.numel():
        raise ValueError(f"sequence of {length} entries needs {pages_needed} pages, block table row has {row.numel()}")
    if pages_needed and bool((row[:pages_needed] < 0).any()):
        raise ValueError(f"block table row has an unassigned page (-1) among the first {pages_needed} pages")
    i = torch.arange(length)
    return row[i // ENTRIES_PER_PAGE] * ENTRIES_PER_PAGE + i % ENTRIES_PER_PAGE


__all__ = ["check_centre_order", "check_pool", "check_pool_alignment", "check_slots", "dequantize_entries", "num_slots",
           "read_centres", "read_checked_entries", "read_entries", "sequence_slots", "store_checked_entries",
           "store_entries", "write_checked_entries", "write_entries", "PageSummaries", "summarize_page",
           "summarize_pages", "check_summaries", "check_summary_order", "touched_pages", "update_summaries"]


# --------------------------------------------------------------------------------------------------
# Page summaries: the side table hierarchical selection reads
# --------------------------------------------------------------------------------------------------


class PageSummaries:
    """Per-page side table of an index-key pool of P pages: what hierarchical top-k reads instead of the keys.

    Three bf16 tensors [P, 128], row p for page p, over the page's stored entries 0..n-1 *as decoded* (the
    values the scores kernels multiply: dequantized codes, plus the page centre for centred formats):

    * ``centre``: the mean, ``bf16_rne(s / n)`` with ``s`` the fp32 sum of the decoded rows added one row
      at a time in entry order (0, 1, ..., n-1) and ``/`` an IEEE fp32 division: a pure function of the
      stored bytes, so a page appended in one call, in chunks or one entry at a time gets the same bytes.
    * ``lower`` / ``upper``: per-dimension min / max of the decoded rows, rounded outward to bf16 (lower
      toward -inf, upper toward +inf), so ``lower <= k_j <= upper`` holds exactly for every stored entry j:
      the box the exact mode bounds scores with. A decoded -0 counts as +0 (equal values; which zero a min
      or max returns is unspecified in torch and on the GPU, so the rule fixes it and the bytes are defined).
    * A NaN (a bf16 pool can hold NaN keys) makes that element of all three rows NaN, stored as the
      canonical bf16 NaN 0x7FC0 (torch's own bf16 casts give 0x7FC0 or 0xFFFF depending on the code path).

    Kept up to date by the store ops (``dsakit.ops.store.store_index_keys(..., summaries=...)``) and by
    :func:`store_entries` with ``summaries``: after a store, every page that got a row is recomputed over its
    entries 0..e, e the highest entry of that page in the call. That is the page's whole content when pages are
    appended in order (entries 0, 1, 2, ... each stored once, in this call or an earlier one), the precondition
    of the table (:func:`check_summary_order` checks the part a call can see: a page's rows in one call run in
    consecutive rows at consecutive entries).

    A page that holds no entry reads zeros (it is never visible to a query). For centred formats the
    page's own stored centre (entry 0's key) is the representative hierarchical selection uses; ``centre``
    is still kept (the mean) and the box serves the exact mode. Memory: 768 B per page (12 B per entry).
    """

    __slots__ = ("centre", "lower", "upper")

    def __init__(self, centre: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor):
        check_tensor("centre", centre, shape=(None, 128), dtypes=(torch.bfloat16,),
                     message="PageSummaries.centre must be a bf16 [P, 128] tensor")
        for what, t in (("lower", lower), ("upper", upper)):
            check_tensor(what, t, shape=tuple(centre.shape), dtypes=(torch.bfloat16,), device=centre.device,
                         owner="centre", message=f"PageSummaries.{what} must be bf16 {list(centre.shape)} like centre")
        self.centre, self.lower, self.upper = centre, lower, upper

    @classmethod
    def zeros(cls, num_pages: int, device: "str | torch.device" = "cpu") -> "PageSummaries":
        check_int("num_pages", num_pages, 1, message="num_pages must be a positive int")
        make = lambda: torch.zeros(num_pages, 128, dtype=torch.bfloat16, device=device)  # noqa: E731
        return cls(make(), make(), make())

    @property
    def num_pages(self) -> int:
        return int(self.centre.shape[0])

    def check_for(self, pool: torch.Tensor) -> None:
        """ValueError unless this table has one row per page of ``pool`` on its device."""
        if self.num_pages != pool.shape[0] or self.centre.device != pool.device:
            raise ValueError(f"page summaries of {self.num_pages} pages on {self.centre.device} do not belong to "
                             f"a pool of {pool.shape[0]} pages on {pool.device}")


def _round_outward(x: torch.Tensor, down: bool) -> torch.Tensor:
    """fp32 -> bf16 rounded toward -inf (down) or +inf: the nearest bf16 on the safe side of x."""
    r = x.to(torch.bfloat16)
    back = r.float()
    step = torch.full_like(r, float("-inf") if down else float("inf"))
    wrong = (back > x) if down else (back < x)
    return torch.where(wrong, torch.nextafter(r, step), r)


CANONICAL_BF16_NAN = 0x7FC0  # the one NaN a summary row stores


def _canonical_nan(x: torch.Tensor) -> torch.Tensor:
    """bf16 x with every NaN as the bits 0x7FC0."""
    bits = torch.where(torch.isnan(x), torch.tensor(CANONICAL_BF16_NAN, dtype=torch.int16), x.view(torch.int16))
    return bits.view(torch.bfloat16)


def summarize_page(decoded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The spec of one page's summary row: decoded fp32 [n, 128] (entries 0..n-1, n >= 1) ->
    (centre, lower, upper) bf16 [128] (rules of :class:`PageSummaries`)."""
    decoded = decoded.float()
    total = torch.zeros(decoded.shape[1], dtype=torch.float32)
    for row in decoded:  # one row at a time, in entry order: the order the store kernels add in
        total = total + row
    centre = (total / decoded.shape[0]).to(torch.bfloat16)
    boxed = torch.where(decoded == 0, torch.zeros_like(decoded), decoded)  # -0 -> +0 (rule above)
    lower = _round_outward(boxed.amin(dim=0), down=True)
    upper = _round_outward(boxed.amax(dim=0), down=False)
    return _canonical_nan(centre), _canonical_nan(lower), _canonical_nan(upper)


def summarize_pages(pool: torch.Tensor, fmt: EntryFormat, pages: torch.Tensor, counts: torch.Tensor,
                    summaries: PageSummaries) -> None:
    """Reference: recompute the summary rows of ``pages`` [M] (page ids) holding ``counts`` [M] entries
    (1..64; entries 0..count-1 are the stored ones) from the pool's bytes into ``summaries``.

    All pages at once, with :func:`summarize_page`'s arithmetic element for element (the rows added one entry
    at a time in entry order, one division, the same min / max and roundings), so the bytes are the same."""
    pages, counts = pages.detach().cpu().long(), counts.detach().cpu().long()
    if pages.numel() == 0:
        return
    entry = torch.arange(int(counts.max()))
    present = entry[None, :] < counts[:, None]  # [M, width]
    decoded = torch.zeros(*present.shape, fmt.head_dim)
    decoded[present] = dequantize_entries(pool, fmt, (pages[:, None] * ENTRIES_PER_PAGE + entry[None, :])[present])
    total = torch.zeros(pages.numel(), fmt.head_dim)
    for j in range(entry.numel()):  # entry order, as summarize_page
        total = torch.where(present[:, j, None], total + decoded[:, j], total)
    centre = (total / counts[:, None].float()).to(torch.bfloat16)
    boxed = torch.where(decoded == 0, torch.zeros_like(decoded), decoded)  # -0 -> +0
    lower = _round_outward(torch.where(present[..., None], boxed, float("inf")).amin(dim=1), down=True)
    upper = _round_outward(torch.where(present[..., None], boxed, -float("inf")).amax(dim=1), down=False)
    device = summaries.centre.device
    index = pages.to(device)
    for field, rows in (("centre", centre), ("lower", lower), ("upper", upper)):
        getattr(summaries, field)[index] = _canonical_nan(rows).to(device)


def check_summaries(summaries: "PageSummaries | None", pool: torch.Tensor, fmt: EntryFormat,
                    slots: torch.Tensor | None) -> bool:
    """ValueError unless ``summaries`` is None or the :class:`PageSummaries` of this index-key pool and, when the
    checked slots are given, the call keeps their precondition (:func:`check_summary_order`). Returns whether
    some page gets more than one row (False without summaries or slots)."""
    if summaries is None:
        return False
    check_instance("summaries", summaries, PageSummaries, "PageSummaries.zeros(num_pages, device)")
    if not isinstance(fmt, KeyFormat):
        raise ValueError(f"page summaries are kept for index-key pools; format {fmt.name} holds attention entries")
    summaries.check_for(pool)
    return False if slots is None else check_summary_order(slots)


def check_summary_order(slots: torch.Tensor) -> bool:
    """The part of the summaries' in-order precondition one call shows: the live rows of each page run in
    consecutive rows at consecutive entries (row i + 1 holds the entry after row i's), as a sequence's append
    gives them; ValueError otherwise (nothing written).

    slots: checked CPU int64 [N] (< 0 = padding). Returns whether some page has more than one row in the call
    (the Triton store then summarizes in a second launch, after every row is stored)."""
    if slots.numel() == 0:
        return False
    s = slots.numpy()
    live = s >= 0
    previous = np.concatenate([[-1], s[:-1]])
    # a row continues the run of the row before it when it holds the next entry of the same page
    continues = live & (s % ENTRIES_PER_PAGE > 0) & (previous == s - 1)
    starts = live & ~continues
    pages = s[starts] // ENTRIES_PER_PAGE
    unique, counts = np.unique(pages, return_counts=True)
    if unique.size != pages.size:
        p = int(unique[counts > 1][0])
        rows = np.flatnonzero(starts & (s // ENTRIES_PER_PAGE == p))
        raise ValueError(f"page {p} gets rows {int(rows[0])} and {int(rows[1])} that are not one run of consecutive "
                         f"rows at consecutive entries: page summaries are kept for pages appended in order (a "
                         f"page's rows in one call must follow each other, entry after entry); nothing was written")
    return bool(continues.any())


def touched_pages(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked CPU int64 slots [N] (< 0 = padding) -> (page ids [M], entry counts [M]): each page that gets a
    row and 1 + the highest entry it gets, the entries 0..count-1 a store recomputes its summary over."""
    live = slots[slots >= 0]
    pages = live // ENTRIES_PER_PAGE
    unique = torch.unique(pages)
    counts = torch.zeros(unique.numel(), dtype=torch.int64).scatter_reduce(
        0, torch.searchsorted(unique, pages), live % ENTRIES_PER_PAGE + 1, reduce="amax")
    return unique, counts


def update_summaries(pool: torch.Tensor, fmt: EntryFormat, slots: torch.Tensor, summaries: PageSummaries) -> None:
    """Reference upkeep after a store at checked slots [N] (CPU int64, < 0 = padding): recompute the summary
    of every page that got a row over its entries 0..e (e its highest entry in the call), from the pool."""
    pages, counts = touched_pages(slots)
    if pages.numel():
        summarize_pages(pool, fmt, pages, counts, summaries)
