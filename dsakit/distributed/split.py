"""Zigzag split of a ragged batch's query rows over the ranks of a context-parallel group.

With a causal mask the query at position p scores about p / ratio entries, so cutting a sequence's queries
into ``world`` contiguous pieces gives the last rank almost twice the average work (2 * world - 1 times
the first rank's). The zigzag split cuts each sequence's queries (in batch order) into ``2 * world`` chunks
of near-equal size and gives rank r chunks r and 2 * world - 1 - r: an early chunk and a late chunk whose
costs add up to about the same total on every rank::

    world = 2, chunks 0 1 2 3:   rank 0 -> 0, 3     rank 1 -> 1, 2
    world = 3, chunks 0 .. 5:    rank 0 -> 0, 5     rank 1 -> 1, 4     rank 2 -> 2, 3

Chunk c of a sequence with n queries holds its queries i with floor(c * n / (2 * world)) <= i <
floor((c + 1) * n / (2 * world)): sizes differ by at most one when n is not divisible; a sequence with fewer
than 2 * world queries leaves some chunks empty. Each sequence is split on its own, so ragged batches stay
balanced per sequence. The balance assumes a sequence's queries appear in increasing position order (as a
prefill lays them out); the results never depend on it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import torch

from .._memory import INDEX_DTYPES, check_instance, check_int, check_int_list, check_tensor


def _check_world(world_size, rank) -> None:
    check_int("world_size", world_size, 1, message="world_size must be a positive int")
    check_int("rank", rank, 0, world_size - 1)


def zigzag_ranges(n: int, world_size: int, rank: int, *, align: int = 1) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two [start, stop) ranges of ``n`` ordered items that ``rank`` owns: chunks rank and
    2 * world_size - 1 - rank of 2 * world_size near-equal chunks (module docstring).

    ``align``: chunk boundaries are rounded down to multiples of it (the last one stays n), e.g. ``align=64``
    splits a sequence's cache entries at page boundaries so that each page has exactly one writer rank.
    """
    check_int("n", n, 0, message="n must be a non-negative int")
    check_int("align", align, 1, message="align must be a positive int")
    _check_world(world_size, rank)
    parts = 2 * world_size

    def bound(c: int) -> int:
        return n if c == parts else (n * c // parts) // align * align

    return (bound(rank), bound(rank + 1)), (bound(parts - 1 - rank), bound(parts - rank))


def zigzag_owner(query_seq: torch.Tensor, world_size: int) -> torch.Tensor:
    """int64 [T] on the CPU: the rank that owns each query row of a ragged batch (query_seq int [T])."""
    check_int("world_size", world_size, 1, message="world_size must be a positive int")
    check_tensor("query_seq", query_seq, dims=1, dtypes=INDEX_DTYPES,
                 message="query_seq must be an int32/int64 tensor [T]")
    seq = query_seq.detach().cpu().long()  # metadata: one copy to the host
    t = seq.shape[0]
    if t == 0:
        return torch.zeros(0, dtype=torch.long)
    if int(seq.min()) < 0:
        raise ValueError(f"query_seq values must be >= 0, got {int(seq.min())}")
    order = torch.argsort(seq, stable=True)
    per_seq = torch.bincount(seq)
    starts = torch.cumsum(per_seq, 0) - per_seq
    index_in_seq = torch.empty(t, dtype=torch.long)
    index_in_seq[order] = torch.arange(t) - starts[seq[order]]
    n = per_seq[seq]
    parts = 2 * world_size
    # chunk c holds i with floor(c n / parts) <= i, i.e. c n < parts (i + 1): the largest such c
    chunk = (parts * (index_in_seq + 1) - 1) // n
    return torch.where(chunk < world_size, chunk, parts - 1 - chunk)


@dataclass(frozen=True, eq=False)
class ContextParallelPlan:
    """Which query rows of a ragged batch each rank of a context-parallel group owns (zigzag split).

    rows: int64 [T_r] (CPU) rows of the full batch owned by ``rank``, ascending (the local batch keeps the
    batch order); counts: T_r of every rank; order: int64 [T] (CPU) the rows of rank 0, then rank 1, ...
    (what :func:`dsakit.distributed.gather_rows` puts back in place). A plan built by hand is checked for
    consistency (order a permutation of 0..T-1 whose rank-r part is rank r's rows).
    """

    world_size: int
    rank: int
    num_queries: int
    rows: torch.Tensor
    counts: tuple[int, ...]
    order: torch.Tensor

    @classmethod
    def zigzag(cls, query_seq: torch.Tensor, world_size: int | None = None, rank: int | None = None, *,
               group=None) -> "ContextParallelPlan":
        """Plan for the batch's query_seq int [T]; world_size / rank default to the process group's."""
        if world_size is None or rank is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError("world_size and rank are needed when torch.distributed is not initialized")
            world_size = dist.get_world_size(group) if world_size is None else world_size
            rank = dist.get_rank(group) if rank is None else rank
        _check_world(world_size, rank)
        owner = zigzag_owner(query_seq, world_size)
        per_rank = [torch.nonzero(owner == r).flatten() for r in range(world_size)]
        return cls(world_size=world_size, rank=rank, num_queries=int(owner.shape[0]), rows=per_rank[rank],
                   counts=tuple(int(r.numel()) for r in per_rank),
                   order=torch.cat(per_rank) if per_rank else torch.zeros(0, dtype=torch.long))

    def __post_init__(self) -> None:
        _check_world(self.world_size, self.rank)
        counts = self.counts
        check_instance("counts", counts, tuple)
        check_int_list("counts", counts, 0, length=self.world_size,
                       message=f"counts must be a tuple of {self.world_size} non-negative ints")
        if isinstance(self.num_queries, bool) or not isinstance(self.num_queries, int) \
                or self.num_queries != sum(counts):
            raise ValueError(f"num_queries must be sum(counts) = {sum(counts)}, got {self.num_queries!r}")
        for what, x, n in (("rows", self.rows, counts[self.rank]), ("order", self.order, self.num_queries)):
            check_tensor(what, x, shape=(n,), dtypes=torch.int64, device=torch.device("cpu"), owner="the plan",
                         message=f"{what} must be an int64 CPU tensor [{n}]")
        order = self.order
        if order.numel() and (int(order.min()) < 0 or int(order.max()) >= self.num_queries
                              or bool((torch.bincount(order, minlength=self.num_queries) != 1).any())):
            raise ValueError(f"order must be a permutation of 0..{self.num_queries - 1}")
        start = sum(counts[: self.rank])
        if not torch.equal(self.rows, order[start: start + counts[self.rank]]):
            raise ValueError(f"rows must be rank {self.rank}'s part of order (order[{start}:"
                             f"{start + counts[self.rank]}])")

    @cached_property
    def digest(self) -> str:
        """16 hex digits of a hash of world_size, counts and order: equal on every rank of one plan (the rank
        is left out), so that the collectives can check that the ranks hold the same plan before any data
        moves."""
        h = hashlib.blake2b(digest_size=8)
        h.update(repr((self.world_size, self.counts)).encode())
        h.update(self.order.contiguous().numpy().tobytes())
        return h.hexdigest()

    @property
    def num_local(self) -> int:
        return self.counts[self.rank]

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a per-query tensor x [T, ...] (q, weights, positions): x[rows] on x's device."""
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != self.num_queries:
            raise ValueError(f"take() needs a tensor with {self.num_queries} rows (one per query), got "
                             f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        return x.index_select(0, self.rows.to(x.device))
