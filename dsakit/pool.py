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
from .formats import ENTRIES_PER_PAGE, EntryFormat, centre_of, decode_centres, is_centred


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


def store_entries(pool: torch.Tensor, fmt: EntryFormat, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Reference store of fp32 entries x [N, head_dim] at slots [N] (< 0 = padding): check everything, then
    :func:`store_checked_entries` (quantize, the page-centre rule for centred formats, write)."""
    check_pool(pool, fmt)
    x = fmt.check_entries(x)
    slots = check_slots(slots, num_slots(pool), length=x.shape[0])
    check_centre_order(pool, fmt, slots)
    store_checked_entries(pool, fmt, slots, x)


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
           "store_entries", "write_checked_entries", "write_entries"]
