"""Collectives of the context-parallel indexer: cache bytes into every rank's pool, rows back to [T, ...].

Each goes through ``all_gather_into_tensor`` (``all_gather_single`` in newer torch) of a padded uint8 row
buffer, so it runs on NCCL (CUDA tensors) and on gloo (CPU tensors) alike. Every rank must make the same
calls in the same order; the inputs of a call are agreed collectively (below).

Two ways to fill every rank's pool after each rank wrote its share:

* :func:`all_gather_pages` (any format, cheapest): each rank names the pages it wrote in full; their raw
  bytes travel (values, scales and any per-page data such as a page centre), one buffer row per page::

      [ page bytes (page_bytes) | page id, int64 little endian ]

* :func:`all_gather_entries` (formats whose page is nothing but its 64 entries' values and scales): any
  split of the entries, one buffer row per entry::

      [ value bytes (value_bytes) | scale bytes (scale_bytes) | global slot, int64 little endian ]

  so an fp8 key entry travels as 128 + 4 + 8 = 140 bytes, a bf16 one as 256 + 8 = 264 bytes.

Every entry point (these two, :func:`gather_rows`, ``context_parallel_index_topk(gather=True)``) agrees
before any data moves: each rank checks its own input without raising (any exception it meets, a
torch's not-implemented error on a meta tensor as much as a ValueError, becomes "refused"), then one all-gather of a
fixed-size header (:data:`HEADER_BYTES`: refused flag, row count, a signature of what must be equal on every
rank, the refusal reason) lets every rank take the same decision:

* a rank refused: that rank raises ValueError with its own message, every other rank ValueError
  "rank r refused its input: <reason>";
* the signatures differ (format, pool shape; row dtype and trailing shape, ``k``, ``return_slots``, the
  plan's digest): every rank raises ValueError "the ranks' inputs disagree (rank 0: ...; rank 1: ...)";
* else the rows move; the exchanges then check the gathered ids on every rank alike (out of range, or
  claimed by two ranks: ValueError on every rank before any byte is written).

So no rank is left waiting in a collective or aborted by a size mismatch, and a refused call leaves every
pool as it was, provided every rank makes the same calls in the same order with the same group (a rank that
skips a call, or passes another group, cannot be detected). An exchange costs two collectives (the
header, then the rows) and three device->host syncs (the local id check, the headers, the gathered ids):
it is made for a prefill, not for a CUDA-graph-captured decode step.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

import torch

from .._memory import check_device, check_instance
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


def _stats(collective: str, world: int, counts, padded: int, row_bytes: int, data_bytes: int) -> CommStats:
    per_rank = (world - 1) * padded * row_bytes
    return CommStats(collective=collective, world_size=world, rows=int(sum(counts)),
                     payload_bytes=int(sum(counts)) * data_bytes, padded_rows=padded, row_bytes=row_bytes,
                     bytes_per_rank=per_rank, total_bytes=world * per_rank, control_bytes=HEADER_BYTES * world)


# --------------------------------------------------------------------------------------------------
# The agreement: one fixed-size header per rank, gathered before any data moves
# --------------------------------------------------------------------------------------------------

_TEXT_BYTES = 256
HEADER_BYTES = 16 + 2 * _TEXT_BYTES
"""Bytes of one rank's header: int64 refused flag (0 / 1), int64 row count (little endian), the signature
(UTF-8, zero padded to 256 bytes: what must be equal on every rank, e.g. ``fp8 pool [8, 8448]`` or
``int32 [*, 16], plan 2 ranks x [9, 8] #<digest>``), the refusal reason (UTF-8, zero padded to 256 bytes)."""


def _text_field(text: str) -> bytes:
    raw = text.encode("utf-8", "replace")
    if len(raw) > _TEXT_BYTES:  # keep a long text distinguishable: its head and a hash of the whole
        tail = f" ... #{hashlib.blake2b(raw, digest_size=8).hexdigest()}".encode()
        raw = raw[: _TEXT_BYTES - len(tail)].decode("utf-8", "ignore").encode() + tail
    return raw.ljust(_TEXT_BYTES, b"\0")


def _reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"


def _agree(what: str, prepare, group):
    """Run this rank's ``prepare(device)`` -> (count, signature, payload) and agree with every rank of
    ``group`` on the outcome before any data moves: one all-gather of a :data:`HEADER_BYTES` header.

    Every rank raises ValueError, or none does: the rank whose ``prepare`` raised (any exception: a
    torch's not-implemented error on a meta tensor counts as much as a ValueError) its own message, every other rank
    "rank r refused its input: <reason>"; if no rank refused but the signatures differ, every rank
    "the ranks' inputs disagree (rank 0: <signature>; ...)". Returns (counts of every rank, payload, device).
    """
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = comm_device(group)
    failure, count, signature, payload = None, 0, "", None
    # any failure (not only ValueError) must still reach the header exchange: the other ranks are already in
    # it, and would wait forever, or abort on a size mismatch in the next collective
    try:
        count, signature, payload = prepare(device)
    except Exception as exc:  # noqa: BLE001
        failure = exc
    header = struct.pack("<qq", failure is not None, count) + _text_field(signature) \
        + _text_field("" if failure is None else _reason(failure))
    headers = torch.empty(world * HEADER_BYTES, dtype=torch.uint8, device=device)
    _all_gather(dist, headers, torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device), group)
    raw = headers.cpu().numpy().tobytes()
    fields = [struct.unpack_from("<qq", raw, r * HEADER_BYTES) for r in range(world)]
    texts = [[raw[r * HEADER_BYTES + 16 + i * _TEXT_BYTES:][:_TEXT_BYTES].rstrip(b"\0").decode("utf-8", "replace")
              for i in (0, 1)] for r in range(world)]
    if failure is not None:
        raise ValueError(f"{what} (rank {rank}): {_reason(failure)}") from failure
    refused = [r for r in range(world) if fields[r][0]]
    if refused:
        raise ValueError(f"{what}: " + "; ".join(f"rank {r} refused its input: {texts[r][1]}" for r in refused)
                         + " (nothing was exchanged)")
    if any(texts[r][0] != texts[0][0] for r in range(world)):
        by_signature: dict[str, list[int]] = {}
        for r in range(world):
            by_signature.setdefault(texts[r][0], []).append(r)
        listing = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {sig}"
                            for sig, rs in by_signature.items())
        raise ValueError(f"{what}: the ranks' inputs disagree ({listing}); nothing was exchanged")
    return [fields[r][1] for r in range(world)], payload, device


def _padded(rows: torch.Tensor, padded: int, fill: int) -> torch.Tensor:
    if rows.shape[0] == padded:
        return rows
    pad = torch.full((padded - rows.shape[0], rows.shape[1]), fill, dtype=torch.uint8, device=rows.device)
    return torch.cat([rows, pad])


def _exchange(what: str, prepare, group):
    """Collective core: every rank's (ids int64 [n], rows uint8 [n, data_bytes]) to every rank.

    ``prepare(device)`` validates the local input and returns (ids int64 [n], rows uint8 [n, data_bytes],
    id_limit, signature): both on the group's device, the signature naming the format and pool shape (so
    that equal signatures mean equal data_bytes and id_limit on every rank). Returns (ids int64 [R], rows
    uint8 [R, data_bytes]) of all ranks' real rows on the group's device (ids validated: in 0..id_limit-1,
    no duplicates) and the CommStats; or raises ValueError on every rank.
    """
    def prepare_rows(device):
        ids, rows, id_limit, signature = prepare(device)
        n, data_bytes = rows.shape
        local = torch.cat([rows, ids.view(torch.uint8).view(n, _ID_BYTES)], 1)
        return n, f"{signature}, ids < {id_limit}", (local, data_bytes, id_limit)

    counts, (local, data_bytes, id_limit), device = _agree(what, prepare_rows, group)
    world, padded, row_bytes = len(counts), max(counts), local.shape[1]
    stats = _stats(what, world, counts, padded, row_bytes, data_bytes)
    if padded == 0:
        return torch.zeros(0, dtype=torch.int64, device=device), \
            torch.zeros(0, data_bytes, dtype=torch.uint8, device=device), stats
    gathered = torch.empty(world * padded, row_bytes, dtype=torch.uint8, device=device)
    dist = _dist()
    _all_gather(dist, gathered, _padded(local, padded, 0xFF), group)  # padding rows: id -1 (data never read)
    all_ids = gathered[:, data_bytes:].contiguous().view(torch.int64).view(-1)
    real = torch.nonzero(all_ids >= 0).flatten()
    all_ids = all_ids.index_select(0, real)
    # every rank checks the same gathered ids against the same limit, so every rank raises or none does
    try:
        check_slots(all_ids.cpu(), id_limit, what="ids (all ranks)", allow_padding=False)
    except ValueError as exc:
        raise ValueError(f"{what}: the ranks' ids overlap or are out of range, pool unchanged: {exc}") from None
    return all_ids, gathered.index_select(0, real)[:, :data_bytes], stats


def _check_ids(ids, limit: int, what: str, device: torch.device) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"{what} must be a 1-D int tensor, got {type(ids).__name__}")
    check_slots(ids, limit, what=what, allow_padding=False)
    return ids.to(device=device, dtype=torch.int64).contiguous()


def _check_pool_on(pool, fmt, device: torch.device) -> None:
    check_pool(pool, fmt)
    check_device("pool", pool, device, owner="the group's collectives")


def _parse_format(fmt) -> EntryFormat:
    fmt = KeyFormat.parse(fmt) if isinstance(fmt, str) else fmt
    if not isinstance(fmt, EntryFormat):
        raise ValueError(f"fmt must be an EntryFormat or a key format name, got {fmt!r}")
    return fmt


def _pool_signature(fmt: EntryFormat, pool: torch.Tensor) -> str:
    return f"{fmt.name} pool {list(pool.shape)}"


def all_gather_pages(pool: torch.Tensor, fmt: "EntryFormat | str", pages: torch.Tensor, *,
                     group=None) -> CommStats:
    """Copy the pages every rank wrote into every rank's pool: in place, collective over ``group``.

    pool uint8 [P, page_bytes] (same format and shape on every rank, and the same page allocation, on the
    group's device: CUDA for NCCL, CPU for gloo); pages int [M_r] (>= 0, no duplicates): the page ids this
    rank wrote, the pages of different ranks disjoint. Raw page bytes travel, so it works for every format
    (a page centre included). Split a sequence's entries at page boundaries (``zigzag_ranges(n, w, r,
    align=64)``) so that each page has one writer. Other pages are untouched. Returns :class:`CommStats`.
    Bad input on any rank (or formats / pool shapes that differ between ranks) raises ValueError on every
    rank with every pool unchanged (module docstring).
    """
    def prepare(device):
        fmt_ = _parse_format(fmt)
        _check_pool_on(pool, fmt_, device)
        ids = _check_ids(pages, pool.shape[0], "pages", device)
        return ids, pool.index_select(0, ids), pool.shape[0], _pool_signature(fmt_, pool)

    ids, rows, stats = _exchange("all_gather_pages", prepare, group)
    if ids.numel():
        pool.index_copy_(0, ids, rows)
    return stats


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

    pool uint8 [P, page_bytes] (same format and shape on every rank, and the same page allocation, on the
    group's device); slots int [N_r] (>= 0, no duplicates): the global slots this rank wrote (e.g. the
    entries of its own tokens), the slots of different ranks disjoint. Only the entries' value and scale
    bytes travel, so the format's page must hold nothing else: a format with per-page data (a page centre)
    is refused, use :func:`all_gather_pages`. Other bytes are untouched. Returns :class:`CommStats`. Bad
    input on any rank raises ValueError on every rank with every pool unchanged (module docstring).
    """
    parsed = None

    def prepare(device):
        nonlocal parsed
        fmt_ = _parse_format(fmt)
        entry_part = ENTRIES_PER_PAGE * (fmt_.value_bytes + fmt_.scale_bytes)
        if fmt_.page_bytes != entry_part:
            raise ValueError(f"format {fmt_.name} keeps {fmt_.page_bytes - entry_part} bytes per page beyond its "
                             f"entries (e.g. a page centre): exchange whole pages with all_gather_pages")
        _check_pool_on(pool, fmt_, device)
        ids = _check_ids(slots, num_slots(pool), "slots", device)
        values, scales = _page_views(pool, fmt_)
        page, entry = ids // ENTRIES_PER_PAGE, ids % ENTRIES_PER_PAGE
        parsed = fmt_
        return ids, torch.cat([values[page, entry], scales[page, entry]], 1), num_slots(pool), \
            _pool_signature(fmt_, pool)

    ids, rows, stats = _exchange("all_gather_entries", prepare, group)
    if ids.numel():
        values, scales = _page_views(pool, parsed)
        page, entry = ids // ENTRIES_PER_PAGE, ids % ENTRIES_PER_PAGE
        values[page, entry] = rows[:, : parsed.value_bytes]
        if parsed.scale_bytes:
            scales[page, entry] = rows[:, parsed.value_bytes:]
    return stats


def _check_plan(plan, world: int, rank: int) -> ContextParallelPlan:
    check_instance("plan", plan, ContextParallelPlan)
    if (world, rank) != (plan.world_size, plan.rank):
        raise ValueError(f"plan is for rank {plan.rank} of {plan.world_size}, the group has rank {rank} of {world}")
    return plan


def _describe(x) -> str:
    return f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)}" if isinstance(x, torch.Tensor) \
        else type(x).__name__


def _row_signature(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} [{', '.join(['*'] + [str(d) for d in t.shape[1:]])}]"


def _gather_rows(what: str, local_rows, plan, group) -> tuple[list[torch.Tensor], CommStats]:
    """Core of :func:`gather_rows`: ``local_rows()`` -> a tuple of this rank's per-row tensors [T_r, ...]
    (called inside the agreement, so whatever it raises is a refusal every rank sees), all of them gathered
    into [T, ...] in batch order by one all-gather of their bytes side by side."""
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)

    def prepare(device):
        _check_plan(plan, world, rank)
        tensors = local_rows()
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != plan.num_local:
                raise ValueError(f"local must be a tensor with plan.num_local = {plan.num_local} rows, got "
                                 f"{_describe(t)}")
        # every tensor's rows as bytes, side by side: [T_r, sum of row bytes] (one collective for all)
        parts = [t.detach().to(device).reshape(plan.num_local, math.prod(t.shape[1:])).contiguous()
                 .view(torch.uint8) for t in tensors]
        data = torch.cat(parts, 1) if parts else torch.zeros(plan.num_local, 0, dtype=torch.uint8, device=device)
        signature = " + ".join(_row_signature(t) for t in tensors)
        signature += f", plan {plan.world_size} ranks x {list(plan.counts)} #{plan.digest}"
        return plan.num_local, signature, (data, [(t.dtype, tuple(t.shape[1:])) for t in tensors])

    counts, (data, layouts), device = _agree(what, prepare, group)
    padded, row_bytes = max(counts), data.shape[1]
    gathered = torch.empty(world * padded, row_bytes, dtype=torch.uint8, device=device)
    if padded and row_bytes:
        _all_gather(dist, gathered, _padded(data, padded, 0), group)
    keep = torch.cat([torch.arange(r * padded, r * padded + c) for r, c in enumerate(counts)])
    rows = torch.empty(plan.num_queries, row_bytes, dtype=torch.uint8, device=device)
    rows[plan.order.to(device)] = gathered.index_select(0, keep.to(device))
    out, offset = [], 0
    for dtype, trailing in layouts:
        nbytes = math.prod(trailing) * dtype.itemsize
        shape = (plan.num_queries,) + trailing
        part = rows[:, offset: offset + nbytes].contiguous()
        out.append(part.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype, device=device))
        offset += nbytes
    return out, _stats(what, world, counts, padded, row_bytes, row_bytes)


def gather_rows(local: torch.Tensor, plan: ContextParallelPlan, *, group=None, return_stats: bool = False):
    """Every rank's rows back into one [T, ...] tensor in the batch's order (collective over ``group``).

    local [T_r, ...]: this rank's rows (T_r = plan.num_local, in plan.rows order), same trailing shape and
    dtype on every rank, and the same plan (its :attr:`~ContextParallelPlan.digest`). Returns [T, ...] on the
    group's device (CUDA for NCCL, CPU for gloo), or ``(rows, CommStats)`` with ``return_stats=True``. Bad
    input on any rank raises ValueError on every rank (module docstring).
    """
    (out,), stats = _gather_rows("gather_rows", lambda: (local,), plan, group)
    return (out, stats) if return_stats else out
