"""dsakit.distributed: zigzag split (single process) and context-parallel top-k on gloo (spawned ranks).

The spawned test starts 3 ranks once (loopback only) and runs every case at world size 3 (the default group)
and 2 (a sub-group of ranks 0 and 1): for every key format and ratio 1 and 4, a ragged batch whose rows are
split zigzag, each rank writing only its share of the entries, the cache exchange, and the context-parallel
top-k compared with the single-process top-k on a fully written cache (indices, order, slots), then decode on
one rank's cache. Keys and queries take values whose scores are exact in fp32 (small multiples of 1/2 and
1/8, scale-exact for each format), so the single-process and per-rank reference results cannot differ by
summation order: any difference is a bug of the distributed code.
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsakit import PagedBatch
from dsakit.cache import PagedCache
from dsakit.distributed import (ContextParallelPlan, all_gather_entries, all_gather_pages,
                                context_parallel_index_topk, gather_rows, zigzag_owner, zigzag_ranges)
from dsakit.ops.indexer import index_topk
from dsakit.formats import ENTRIES_PER_PAGE, KEY_FORMATS, KeyFormat

SPAWN_TIMEOUT_S = 300  # generous: a healthy run takes well under a minute on 2 busy cores
WORLD_MAX = 3


# --------------------------------------------------------------------------------------------------
# Zigzag split (no processes)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_ranges_partition_near_equal_chunks(world):
    for n in range(0, 45):
        chunks = {}
        for rank in range(world):
            first, second = zigzag_ranges(n, world, rank)
            chunks[rank], chunks[2 * world - 1 - rank] = first, second
        ordered = [chunks[c] for c in range(2 * world)]
        assert ordered[0][0] == 0 and ordered[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ordered, ordered[1:]))  # contiguous, no gap, no overlap
        sizes = [b - a for a, b in ordered]
        assert max(sizes) - min(sizes) <= 1


def test_zigzag_ranges_align_splits_at_page_boundaries():
    n = 1000
    for world in (2, 3):
        covered = []
        for rank in range(world):
            for start, stop in zigzag_ranges(n, world, rank, align=64):
                assert start % 64 == 0 and (stop % 64 == 0 or stop == n)
                covered.extend(range(start, stop))
        assert sorted(covered) == list(range(n))


def test_zigzag_balances_causal_work():
    # query i of a causal prefill scores about i + 1 entries: the zigzag pairs an early and a late chunk
    n = 4096
    work = torch.arange(1, n + 1, dtype=torch.float64)
    for world in (2, 3, 4):
        owner = zigzag_owner(torch.zeros(n, dtype=torch.int32), world)
        per_rank = torch.stack([work[owner == r].sum() for r in range(world)])
        assert float(per_rank.max() / per_rank.min()) < 1.01
        contiguous = torch.stack([c.sum() for c in work.chunk(world)])
        assert float(contiguous.max() / contiguous.min()) > 2.9  # what the zigzag avoids (2 * world - 1 ideal)


def test_zigzag_owner_ragged_batch_matches_ranges():
    g = torch.Generator().manual_seed(3)
    lens = [13, 0, 1, 7, 40]
    query_seq = torch.cat([torch.full((n,), b, dtype=torch.int32) for b, n in enumerate(lens)])
    query_seq = query_seq[torch.randperm(query_seq.numel(), generator=g)]  # interleaved sequences
    for world in (2, 3):
        owner = zigzag_owner(query_seq, world)
        for b, n in enumerate(lens):
            rows = torch.nonzero(query_seq == b).flatten()  # batch order = order within the sequence
            for rank in range(world):
                want = [i for lo, hi in zigzag_ranges(n, world, rank) for i in range(lo, hi)]
                assert torch.nonzero(owner[rows] == rank).flatten().tolist() == want


def test_plan_rows_counts_order_and_take():
    query_seq = torch.tensor([0] * 9 + [1] * 4 + [2] * 2, dtype=torch.int64)
    t = query_seq.numel()
    plans = [ContextParallelPlan.zigzag(query_seq, 3, r) for r in range(3)]
    for plan in plans:
        assert plan.num_queries == t and sum(plan.counts) == t
        assert plan.counts[plan.rank] == plan.num_local == plan.rows.numel()
        assert torch.equal(plan.rows, torch.sort(plan.rows).values)
        assert torch.equal(plan.order, torch.cat([p.rows for p in plans]))
    x = torch.arange(t * 2).reshape(t, 2)
    assert torch.equal(torch.cat([p.take(x) for p in plans])[torch.argsort(plans[0].order)], x)
    # sequence 2 has 2 queries for 6 chunks: chunks 2 and 5 hold them -> ranks 2 and 0
    assert plans[0].rows.tolist()[-1] == t - 1 and plans[2].rows.tolist()[-1] == t - 2


def test_plan_digest_and_hand_built_plans():
    query_seq = torch.tensor([0] * 9 + [1] * 4, dtype=torch.int64)
    plans = [ContextParallelPlan.zigzag(query_seq, 2, r) for r in range(2)]
    assert plans[0].digest == plans[1].digest  # one plan, seen from every rank
    assert ContextParallelPlan.zigzag(query_seq[:-1], 2, 0).digest != plans[0].digest  # another batch
    assert ContextParallelPlan.zigzag(query_seq, 3, 0).digest != plans[0].digest  # another world size
    good = dict(world_size=2, rank=0, num_queries=13, rows=plans[0].rows, counts=plans[0].counts,
                order=plans[0].order)
    assert ContextParallelPlan(**good).digest == plans[0].digest
    bad = {"counts": (7, 7), "num_queries": 12, "rows": plans[1].rows, "order": plans[0].order.flip(0),
           "rank": 2}
    for field, value in bad.items():
        with pytest.raises(ValueError, match=field):
            ContextParallelPlan(**{**good, field: value})
    with pytest.raises(ValueError, match="permutation"):
        ContextParallelPlan(**{**good, "order": torch.zeros(13, dtype=torch.int64)})


def test_validation_names_the_bad_value():
    qs = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="world_size"):
        zigzag_ranges(10, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        zigzag_ranges(10, 2, 2)
    with pytest.raises(ValueError, match="align"):
        zigzag_ranges(10, 2, 0, align=0)
    with pytest.raises(ValueError, match="n must be"):
        zigzag_ranges(-1, 2, 0)
    with pytest.raises(ValueError, match="query_seq"):
        zigzag_owner(torch.zeros(4), 2)
    with pytest.raises(ValueError, match=">= 0"):
        zigzag_owner(torch.tensor([0, -1]), 2)
    with pytest.raises(ValueError, match="not initialized"):
        ContextParallelPlan.zigzag(qs)
    plan = ContextParallelPlan.zigzag(qs, 2, 0)
    with pytest.raises(ValueError, match="take"):
        plan.take(torch.zeros(5, 3))
    cache = PagedCache(KeyFormat.FP8, 2)
    seq = cache.add_sequence()
    cache.append(seq, 10)
    batch = cache.batch([seq], query_lens=[4])
    q, w = torch.zeros(2, 4, 128), torch.ones(2, 4)
    with pytest.raises(ValueError, match="plan must be"):
        context_parallel_index_topk(q, w, batch, 4, "plan")
    with pytest.raises(ValueError, match="PagedBatch"):
        context_parallel_index_topk(q, w, (1, 2), 4, plan)
    with pytest.raises(ValueError, match="q must hold"):
        context_parallel_index_topk(torch.zeros(3, 4, 128), w, batch, 4, plan)
    with pytest.raises(ValueError, match="covers 6 queries, the batch has 4"):
        context_parallel_index_topk(q, w, batch, 4, ContextParallelPlan.zigzag(torch.zeros(6, dtype=torch.int32), 2, 0))
    with pytest.raises(ValueError, match="not initialized"):
        all_gather_pages(cache.pool, cache.fmt, torch.tensor([0]))
    with pytest.raises(ValueError, match="local_rows"):
        context_parallel_index_topk(q, w, batch, 4, plan, local_rows=[0, 1])
    with pytest.raises(ValueError, match="not initialized"):  # gather=True is collective (its refusals too)
        context_parallel_index_topk(q, w, batch, 4, plan, local_rows=slice(0, 2), gather=True)
    with pytest.raises(ValueError, match="1 query rows"):
        context_parallel_index_topk(q, w, batch, 4, plan, local_rows=slice(1, None))
    # no collective needed: the local result is the ordinary top-k of the local rows
    local = context_parallel_index_topk(q, w, batch, 4, plan, backend="reference")
    assert local.shape == (2, 4)


# --------------------------------------------------------------------------------------------------
# Spawned gloo ranks
# --------------------------------------------------------------------------------------------------

FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def exact_keys(n: int, fmt: KeyFormat, g: torch.Generator) -> torch.Tensor:
    """Keys [n, 128] that every plain format stores exactly: e2m1-grid values; fp8: one |7| per entry
    (scale 7 / 448 = 2^-6, all values e4m3 codes); fp4: one |6| per 32-element block (scale 1)."""
    grid = torch.tensor(FP4_GRID)
    x = grid[torch.randint(0, len(FP4_GRID), (n, 128), generator=g)]
    x = x * (torch.randint(0, 2, (n, 128), generator=g) * 2 - 1)
    if fmt.kind == "fp4":
        x.view(n, 4, 32)[:, :, 0] = 6.0
    else:
        x[:, 0] = 7.0
    return x


def write_keys(cache: PagedCache, slots: torch.Tensor, x: torch.Tensor) -> None:
    store = getattr(cache.fmt, "store_entries", None)  # formats with per-page data store through their rule
    if store is not None:
        store(cache.pool, slots, x)
    else:
        cache.write(slots, x)


def _case(fmt: KeyFormat, ratio: int, world: int, rank: int, group) -> None:
    g = torch.Generator().manual_seed(zlib.crc32(f"{fmt.name}/{ratio}".encode()))
    tokens = [70, 301, 9, 130] if ratio == 1 else [70, 1301, 9, 530]
    query_lens = [70, 41, 9, 0]  # full prefill, a late chunk, a short one (< 2 * world queries), none
    entries = [n // ratio for n in tokens]
    heads = 4
    keys = [exact_keys(n + 1, fmt, g) for n in entries]  # the extra one is appended for decode
    pages = sum(-(-(n + 1) // ENTRIES_PER_PAGE) for n in entries) + 2

    def new_cache() -> tuple[PagedCache, list[int], list[torch.Tensor]]:
        cache = PagedCache(fmt, pages)
        seqs = [cache.add_sequence() for _ in entries]
        return cache, seqs, [cache.append(s, n) for s, n in zip(seqs, entries)]

    full, seqs, slots = new_cache()
    for sl, x in zip(slots, keys):
        write_keys(full, sl, x[: sl.numel()])

    query_seq = torch.cat([torch.full((t,), b, dtype=torch.int32) for b, t in enumerate(query_lens)])
    positions = torch.cat([torch.arange(n - t, n) for n, t in zip(tokens, query_lens)])
    if ratio == 4:  # interleave the sequences' rows: the split follows batch order within each sequence
        perm = torch.randperm(query_seq.numel(), generator=g)
        query_seq, positions = query_seq[perm], positions[perm]
    t = query_seq.numel()
    q = torch.randint(-2, 3, (t, heads, 128), generator=g).float()
    w = torch.randint(1, 9, (t, heads), generator=g).float() / 8
    k = 16 if ratio == 1 else 8

    def batch_of(cache):
        return PagedBatch.build(cache.pool, fmt, cache.block_table(seqs), cache.entry_counts(seqs), query_seq,
                                positions, ratio)

    want_idx, want_slots = index_topk(q, w, batch_of(full), k, backend="reference", return_slots=True)

    # each rank writes only its share, then the pages are exchanged: byte-identical pools
    mine, _, my_slots = new_cache()
    my_pages = []
    for sl, x in zip(my_slots, keys):
        for lo, hi in zigzag_ranges(sl.numel(), world, rank, align=ENTRIES_PER_PAGE):
            write_keys(mine, sl[lo:hi], x[lo:hi])
            my_pages.append(torch.unique(sl[lo:hi] // ENTRIES_PER_PAGE))
    stats = all_gather_pages(mine.pool, fmt, torch.cat(my_pages), group=group)
    assert torch.equal(mine.pool, full.pool), (fmt.name, ratio, world, rank)
    assert stats.rows == sum(-(-n // ENTRIES_PER_PAGE) for n in entries)
    assert stats.payload_bytes == stats.rows * fmt.page_bytes and stats.world_size == world

    if fmt.page_bytes == ENTRIES_PER_PAGE * (fmt.value_bytes + fmt.scale_bytes):  # entry-granular split
        by_entry, _, entry_slots = new_cache()
        mine_e = []
        for sl, x in zip(entry_slots, keys):
            for lo, hi in zigzag_ranges(sl.numel(), world, rank):
                write_keys(by_entry, sl[lo:hi], x[lo:hi])
                mine_e.append(sl[lo:hi])
        stats = all_gather_entries(by_entry.pool, fmt, torch.cat(mine_e), group=group)
        assert torch.equal(by_entry.pool, full.pool), (fmt.name, ratio, world, rank)
        assert stats.rows == sum(entries) and stats.payload_bytes == sum(entries) * (fmt.value_bytes + fmt.scale_bytes)

    plan = ContextParallelPlan.zigzag(query_seq, group=group)
    assert (plan.world_size, plan.rank) == (world, rank)
    batch = batch_of(mine)
    local = context_parallel_index_topk(plan.take(q), plan.take(w), batch, k, plan, backend="reference")
    assert torch.equal(local, want_idx[plan.rows])
    half = plan.num_local // 2  # the local rows in two calls
    parts = [context_parallel_index_topk(plan.take(q)[part], plan.take(w)[part], batch, k, plan, backend="reference",
                                         local_rows=part) for part in (slice(0, half), slice(half, None))]
    assert torch.equal(torch.cat(parts), local)
    got_idx, got_slots = context_parallel_index_topk(plan.take(q), plan.take(w), batch, k, plan, group=group,
                                                     gather=True, backend="reference", return_slots=True)
    assert torch.equal(got_idx, want_idx) and torch.equal(got_slots, want_slots), (fmt.name, ratio, world, rank)
    assert bool((want_idx == -1).any()) and bool((want_idx >= 0).any())  # padding and real picks both covered

    # decode on one rank's cache after the prefill: append one entry per sequence on both caches
    for cache in (full, mine):
        for s, x, n in zip(seqs, keys, entries):
            write_keys(cache, cache.append(s, 1), x[n:])
    dq = torch.randint(-2, 3, (len(seqs), heads, 128), generator=g).float()
    dw = torch.ones(len(seqs), heads)
    decode = [index_topk(dq, dw, c.batch(seqs), k, backend="reference") for c in (full, mine)]
    assert torch.equal(decode[0], decode[1])


def _collective_errors(world: int, rank: int, group) -> None:
    fmt = KeyFormat.FP8
    cache = PagedCache(fmt, 4)
    seq = cache.add_sequence()
    cache.write(cache.append(seq, 200), torch.randn(200, 128, generator=torch.Generator().manual_seed(rank)))
    before = cache.pool.clone()
    # one rank's bad input: every rank raises, none waits forever, nothing is written
    bad = torch.tensor([99 if rank == 0 else rank])
    with pytest.raises(ValueError, match="pages|refused"):
        all_gather_pages(cache.pool, fmt, bad, group=group)
    # every rank claims page 0: overlap found after the exchange, on every rank, before any write
    with pytest.raises(ValueError, match="overlap"):
        all_gather_pages(cache.pool, fmt, torch.tensor([0]), group=group)
    with pytest.raises(ValueError, match="overlap"):
        all_gather_entries(cache.pool, fmt, torch.tensor([5]), group=group)
    assert torch.equal(cache.pool, before)
    # centred or padded page layouts refuse the entry-granular exchange (collectively)
    extra = [f for f in KEY_FORMATS.values() if f.page_bytes != ENTRIES_PER_PAGE * (f.value_bytes + f.scale_bytes)]
    if extra:
        other = PagedCache(extra[0], 2)
        with pytest.raises(ValueError, match="all_gather_pages"):
            all_gather_entries(other.pool, extra[0], torch.tensor([rank]), group=group)
    # ranks of different formats: the row sizes differ, refused on every rank
    mixed = PagedCache(KeyFormat.BF16 if rank == 0 else KeyFormat.FP8, WORLD_MAX)
    with pytest.raises(ValueError, match="disagree"):
        all_gather_pages(mixed.pool, mixed.fmt, torch.tensor([rank]), group=group)
    # gather_rows puts any per-row tensor back in batch order
    plan = ContextParallelPlan.zigzag(torch.zeros(23, dtype=torch.int32), group=group)
    back, stats = gather_rows(plan.rows, plan, group=group, return_stats=True)
    assert torch.equal(back, torch.arange(23)) and stats.rows == 23 and stats.row_bytes == 8


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        pair = dist.new_group([0, 1])
        for size, group in ((3, None), (2, pair)):
            if rank < size:
                _collective_errors(size, rank, group)
                for fmt in KEY_FORMATS.values():
                    for ratio in (1, 4):
                        _case(fmt, ratio, size, rank, group)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_context_parallel_matches_single_process_on_gloo():
    ctx = mp.start_processes(_worker, args=(WORLD_MAX, _free_port()), nprocs=WORLD_MAX, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ctx.join(timeout=5):  # raises ProcessRaisedException (with the rank's traceback) on a failure
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"gloo ranks did not finish within {SPAWN_TIMEOUT_S} s")
