"""Collectives of the context-parallel indexer: cache bytes into every rank's pool, rows back to [T, ...].

Each goes through ``all_gather_into_tensor`` (``all_gather_single`` in newer torch) of a padded uint8 row
buffer, so it runs on NCCL (CUDA tensors) and on gloo (CPU tensors) alike. Every rank must make the same
calls in the same order.

Two ways to fill every rank's pool after each rank wrote its share:

* :func:`all_gather_pages` (any format, cheapest): each rank names the pages it wrote in full; their raw
  bytes travel (values, scales and any per-page data such as a page centre), one buffer row per page::

      [ page bytes (page_bytes) | page id, int64 little endian ]

* :func:`all_gather_entries` (formats whose page is nothing but its 64 entries' values and scales): any
  split of the entries, one buffer row per entry::

      [ value bytes (value_bytes) | scale bytes (scale_bytes) | global slot, int64 little endian ]

  so an fp8 key entry travels as 128 + 4 + 8 = 140 bytes, a bf16 one as 256 + 8 = 264 bytes.

Validation is collective: a rank whose input is bad makes every rank raise ValueError (none is left waiting
in a collective), and ids that are out of range or claimed twice across the ranks are refused on every rank
before any byte is written. An exchange costs two collectives (a 24-byte header per rank, then the rows)
and three device->host syncs: it is made for a prefill, not for a CUDA-graph-captured decode step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache import check_pool, check_slots, num_slots
from ..formats import ENTRIES_PER_PAGE, EntryFormat, KeyFormat
from .split import ContextParallelPlan

_ID_BYTES = 8


@dataclass(frozen=True)
class CommStats:
    """What one collective moved (the same numbers on every rank).

    rows: real rows over all ranks (pages, entries or query rows); payload_bytes: their data bytes (no ids,
    no padding); padded_rows: rows each rank contributes (the largest rank's count); row_bytes: bytes of one
    buffer row (data + id); bytes_per_rank: bytes each rank receives, (world_size - 1) * padded_rows *
    row_bytes (its own buffer reaches the world_size - 1 others: the same amount leaves it); total_bytes:
    over all ranks; control_bytes: the count / status exchange before it (24 bytes per rank)."""

    collective: str
    world_size: int
    rows: int
    payload_bytes: int
    padded_rows: int
    row_bytes: int
    bytes_per_rank: int
    total_bytes: int
    control_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _dist():
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("torch.distributed is not initialized: call torch.distributed.init_process_group first")
    return dist


def comm_device(group=None) -> torch.device:
    """Device of the tensors a group's collectives take: the current CUDA device for NCCL, else the CPU."""
    dist = _dist()
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_gather(dist, out: torch.Tensor, buf: torch.Tensor, group) -> None:
    # all_gather_single is the newer name of all_gather_into_tensor (deprecated since); same collective
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, buf, group=group)


def _stats(collective: str, world: int, counts, padded: int, row_bytes: int, data_bytes: int,
           control: int = 0) -> CommStats:
    per_rank = (world - 1) * padded * row_bytes
    return CommStats(collective=collective, world_size=world, rows=int(sum(counts)),
                     payload_bytes=int(sum(counts)) * data_bytes, padded_rows=padded, row_bytes=row_bytes,
                     bytes_per_rank=per_rank, total_bytes=world * per_rank, control_bytes=control)


def _exchange(what: str, check, data_bytes: int, id_limit: int, group):
    """Collective core: every rank's (ids int64 [n], rows uint8 [n, data_bytes]) to every rank.

    ``check()`` validates the local input and returns (ids, rows_fn) with rows_fn(buf) filling buf [n, data]
    (or raises ValueError). Returns (ids int64 [R], rows uint8 [R, data_bytes]) of all ranks' real rows on
    the group's device (ids validated: in 0..id_limit-1, no duplicates) and the CommStats.
    """
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = comm_device(group)
    error, ids, fill = None, None, None
    try:
        ids, fill = check(device)
    except ValueError as exc:
        error = str(exc)
    n = int(ids.shape[0]) if error is None else 0
    header = torch.tensor([n, error is not None, data_bytes], dtype=torch.int64, device=device)
    headers = torch.empty(3 * world, dtype=torch.int64, device=device)
    _all_gather(dist, headers, header, group)
    counts, failed, widths = headers.view(world, 3).cpu().unbind(1)
    if error is not None:
        raise ValueError(f"{what} (rank {rank}): {error}")
    if bool(failed.any()):
        raise ValueError(f"{what}: rank {int(torch.nonzero(failed)[0])} refused its input (its own error says "
                         f"why); nothing was exchanged")
    if bool((widths != data_bytes).any()):
        raise ValueError(f"{what}: the ranks' rows differ in size ({sorted(set(widths.tolist()))} bytes: different "
                         f"formats or pool shapes); nothing was exchanged")
    counts = [int(c) for c in counts]
    padded = max(counts)
    row_bytes = data_bytes + _ID_BYTES
    stats = _stats(what, world, counts, padded, row_bytes, data_bytes, control=24 * world)
    if padded == 0:
        return torch.zeros(0, dtype=torch.int64, device=device), \
            torch.zeros(0, data_bytes, dtype=torch.uint8, device=device), stats
    buf = torch.empty(padded, row_bytes, dtype=torch.uint8, device=device)
    buf[n:] = 0xFF  # padding rows: id -1 (their data bytes are never read)
    if n:
        fill(buf[:n, :data_bytes])
        buf[:n, data_bytes:] = ids.to(device=device, dtype=torch.int64).view(torch.uint8).view(n, _ID_BYTES)
    gathered = torch.empty(world * padded, row_bytes, dtype=torch.uint8, device=device)
    _all_gather(dist, gathered, buf, group)
    all_ids = gathered[:, data_bytes:].contiguous().view(torch.int64).view(-1)
    real = torch.nonzero(all_ids >= 0).flatten()
    all_ids = all_ids.index_select(0, real)
    # every rank checks the same gathered ids, so every rank raises or none does
    try:
        check_slots(all_ids.cpu(), id_limit, what="ids (all ranks)", allow_padding=False)
    except ValueError as exc:
        raise ValueError(f"{what}: the ranks' ids overlap or are out of range, pool unchanged: {exc}") from None
    return all_ids, gathered.index_select(0, real)[:, :data_bytes], stats


def _check_ids(ids, limit: int, what: str, device: torch.device) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{what} must be a 1-D int tensor, got {type(ids).__name__}")
    check_slots(ids, limit, what=what, allow_padding=False)
    return ids.to(device=device, dtype=torch.int64)


def _check_pool_on(pool, fmt, device: torch.device) -> None:
    check_pool(pool, fmt)
    if pool.device != device:
        raise ValueError(f"pool is on {pool.device} but the group's collectives run on {device}")


def _parse_format(fmt) -> EntryFormat:
    fmt = KeyFormat.parse(fmt) if isinstance(fmt, str) else fmt
    if not isinstance(fmt, EntryFormat):
        raise ValueError(f"fmt must be an EntryFormat or a key format name, got {fmt!r}")
    return fmt


def all_gather_pages(pool: torch.Tensor, fmt: "EntryFormat | str", pages: torch.Tensor, *,
                     group=None) -> CommStats:
    """Copy the pages every rank wrote into every rank's pool: in place, collective over ``group``.

    pool uint8 [P, page_bytes] (same shape and page allocation on every rank, on the group's device: CUDA
    for NCCL, CPU for gloo); pages int [M_r] (>= 0, no duplicates): the page ids this rank wrote, the
    pages of different ranks disjoint. Raw page bytes travel, so it works for every format (a page centre
    included). Split a sequence's entries at page boundaries (``zigzag_ranges(n, w, r, align=64)``) so that
    each page has one writer. Other pages are untouched. Returns :class:`CommStats`.
    """
    def check(device):
        fmt_ = _parse_format(fmt)
        _check_pool_on(pool, fmt_, device)
        ids = _check_ids(pages, pool.shape[0], "pages", device)
        return ids, lambda buf: buf.copy_(pool.index_select(0, ids))

    page_bytes = pool.shape[1] if isinstance(pool, torch.Tensor) and pool.dim() == 2 else 0
    ids, rows, stats = _exchange("all_gather_pages", check, page_bytes, _pool_pages(pool), group)
    if ids.numel():
        pool.index_copy_(0, ids, rows)
    return stats


def _pool_pages(pool) -> int:
    return pool.shape[0] if isinstance(pool, torch.Tensor) and pool.dim() == 2 else 0


def _page_views(pool: torch.Tensor, fmt: EntryFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Views [P, 64, value_bytes] and [P, 64, scale_bytes] into the pool's value and scale regions."""
    p = pool.shape[0]
    start = fmt.scale_offset_in_page
    values = pool[:, :start].view(p, ENTRIES_PER_PAGE, fmt.value_bytes)
    scales = pool[:, start: start + ENTRIES_PER_PAGE * fmt.scale_bytes].view(p, ENTRIES_PER_PAGE, fmt.scale_bytes)
    return values, scales


def all_gather_entries(pool: torch.Tensor, fmt: "EntryFormat | str", slots: torch.Tensor, *,
                       group=None) -> CommStats:
    """Copy the entries every rank wrote into every rank's pool: in place, collective over ``group``.

    pool uint8 [P, page_bytes] (same shape and page allocation on every rank, on the group's device);
    slots int [N_r] (>= 0, no duplicates): the global slots this rank wrote (e.g. the entries of its own
    tokens), the slots of different ranks disjoint. Only the entries' value and scale bytes travel, so the
    format's page must hold nothing else: a format with per-page data (a page centre) is refused, use
    :func:`all_gather_pages`. Other bytes are untouched. Returns :class:`CommStats`.
    """
    fmt_ok = None

    def check(device):
        nonlocal fmt_ok
        fmt_ = _parse_format(fmt)
        entry_part = ENTRIES_PER_PAGE * (fmt_.value_bytes + fmt_.scale_bytes)
        if fmt_.page_bytes != entry_part:
            raise ValueError(f"format {fmt_.name} keeps {fmt_.page_bytes - entry_part} bytes per page beyond its "
                             f"entries (e.g. a page centre): exchange whole pages with all_gather_pages")
        _check_pool_on(pool, fmt_, device)
        ids = _check_ids(slots, num_slots(pool), "slots", device)
        values, scales = _page_views(pool, fmt_)
        page, entry = ids // ENTRIES_PER_PAGE, ids % ENTRIES_PER_PAGE
        fmt_ok = fmt_

        def fill(buf):
            buf[:, : fmt_.value_bytes] = values[page, entry]
            buf[:, fmt_.value_bytes:] = scales[page, entry]

        return ids, fill

    try:
        parsed = _parse_format(fmt)
        data_bytes = parsed.value_bytes + parsed.scale_bytes
    except ValueError:
        data_bytes = 0  # the rank's check() reports it, collectively
    ids, rows, stats = _exchange("all_gather_entries", check, data_bytes, _pool_pages(pool) * ENTRIES_PER_PAGE,
                                 group)
    if ids.numel():
        values, scales = _page_views(pool, fmt_ok)
        page, entry = ids // ENTRIES_PER_PAGE, ids % ENTRIES_PER_PAGE
        values[page, entry] = rows[:, : fmt_ok.value_bytes]
        if fmt_ok.scale_bytes:
            scales[page, entry] = rows[:, fmt_ok.value_bytes:]
    return stats


def gather_rows(local: torch.Tensor, plan: ContextParallelPlan, *, group=None, return_stats: bool = False):
    """Every rank's rows back into one [T, ...] tensor in the batch's order (collective over ``group``).

    local [T_r, ...]: this rank's rows (T_r = plan.num_local, in plan.rows order), same trailing shape and
    dtype on every rank. Returns [T, ...] on the group's device (CUDA for NCCL, CPU for gloo), or
    ``(rows, CommStats)`` with ``return_stats=True``. The row counts come from the plan (no count exchange).
    """
    dist = _dist()
    if not isinstance(plan, ContextParallelPlan):
        raise ValueError(f"plan must be a ContextParallelPlan, got {type(plan).__name__}")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if (world, rank) != (plan.world_size, plan.rank):
        raise ValueError(f"plan is for rank {plan.rank} of {plan.world_size}, the group has rank {rank} of {world}")
    if not isinstance(local, torch.Tensor) or local.dim() < 1 or local.shape[0] != plan.num_local:
        raise ValueError(f"local must be a tensor with plan.num_local = {plan.num_local} rows, got "
                         f"{list(local.shape) if isinstance(local, torch.Tensor) else type(local).__name__}")
    device = comm_device(group)
    trailing = tuple(local.shape[1:])
    padded = max(plan.counts)
    buf = torch.zeros((padded,) + trailing, dtype=local.dtype, device=device)
    buf[: plan.num_local] = local.to(device)
    gathered = torch.empty((world * padded,) + trailing, dtype=local.dtype, device=device)
    if padded:
        _all_gather(dist, gathered, buf, group)
    keep = torch.cat([torch.arange(r * padded, r * padded + c) for r, c in enumerate(plan.counts)])
    out = torch.empty((plan.num_queries,) + trailing, dtype=local.dtype, device=device)
    out[plan.order.to(device)] = gathered.index_select(0, keep.to(device))
    if not return_stats:
        return out
    row_bytes = local.element_size() * math.prod(trailing)
    return out, _stats("gather_rows", world, plan.counts, padded, row_bytes, row_bytes)
