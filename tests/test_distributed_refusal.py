"""dsakit.distributed: a rank with bad input never leaves another rank waiting or aborting.

Three gloo ranks are spawned once for the module (a file:// store, loopback only) and serve every test: a test
sends one case to ranks 0..world-1 (world 3: the default group; world 2: a sub-group of ranks 0 and 1) and
collects what each rank's call did within ``CASE_TIMEOUT_S``. In every case some rank's input is bad (or the
ranks' inputs disagree); every rank must raise ValueError (the bad rank its own message, the others
"rank r refused its input: <reason>", or all of them "the ranks' inputs disagree"), leave its pool as it was,
and then still take part in a healthy collective (proof that the ranks' collective sequences stayed in step).
A rank that blocks (the others raised before the collective) fails the test by the timeout, a rank that dies
(gloo aborts on a size mismatch) by its exit code; either way the ranks are killed and the next test starts
new ones.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import re
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dsakit import PagedBatch
from dsakit.cache import PagedCache
from dsakit.distributed import (ContextParallelPlan, all_gather_entries, all_gather_pages,
                                context_parallel_index_topk, gather_rows)
from dsakit.formats import KeyFormat

WORLD_MAX = 3
START_TIMEOUT_S = 240  # three spawned interpreters importing torch on two busy cores
CASE_TIMEOUT_S = 45  # a healthy case takes well under a second; a hang waits this long, then fails


# --------------------------------------------------------------------------------------------------
# What runs on the ranks
# --------------------------------------------------------------------------------------------------

QUERY_SEQ = torch.tensor([0] * 9 + [1] * 6 + [2] * 2, dtype=torch.int32)  # ragged: 17 query rows


def _topk_inputs(world: int, rank: int, group):
    """A small fp8 cache (two sequences), its full batch, the plan, this rank's q / weights (4 heads)."""
    g = torch.Generator().manual_seed(7)
    cache = PagedCache(KeyFormat.FP8, 4)
    seqs = [cache.add_sequence() for _ in range(3)]
    for s, n in zip(seqs, (90, 40, 5)):
        cache.write(cache.append(s, n), torch.randn(n, 128, generator=g))
    batch = cache.batch(seqs, query_lens=[9, 6, 2])
    q, w = torch.randn(QUERY_SEQ.numel(), 4, 128, generator=g), torch.rand(QUERY_SEQ.numel(), 4, generator=g)
    plan = ContextParallelPlan.zigzag(batch.query_seq, group=group)
    return batch, plan, q, w


def _healthy_gather(group) -> None:
    plan = ContextParallelPlan.zigzag(QUERY_SEQ, group=group)
    back = gather_rows(plan.rows, plan, group=group)
    assert torch.equal(back, torch.arange(QUERY_SEQ.numel())), "the group is out of step after the refusal"


def _pages_pool(world: int, rank: int, pages: int, fmt: KeyFormat = KeyFormat.FP8) -> PagedCache:
    cache = PagedCache(fmt, pages)
    seq = cache.add_sequence()
    cache.write(cache.append(seq, 64 * min(pages, 3)), torch.randn(64 * min(pages, 3), 128,
                                                                    generator=torch.Generator().manual_seed(rank)))
    return cache


def case_topk_short_q(world, rank, group):
    batch, plan, q, w = _topk_inputs(world, rank, group)
    q_local = plan.take(q)[:-1] if rank == world - 1 else plan.take(q)
    context_parallel_index_topk(q_local, plan.take(w), batch, 8, plan, group=group, gather=True, backend="reference")


def case_topk_other_plan(world, rank, group):
    batch, plan, q, w = _topk_inputs(world, rank, group)
    if rank == world - 1:
        plan = ContextParallelPlan.zigzag(batch.query_seq, world, 0)
    context_parallel_index_topk(plan.take(q), plan.take(w), batch, 8, plan, group=group, gather=True,
                                backend="reference")


def case_topk_k_differs(world, rank, group):
    batch, plan, q, w = _topk_inputs(world, rank, group)
    context_parallel_index_topk(plan.take(q), plan.take(w), batch, 8 if rank == 0 else 16, plan, group=group,
                                gather=True, backend="reference")


def case_topk_return_slots_differs(world, rank, group):
    batch, plan, q, w = _topk_inputs(world, rank, group)
    context_parallel_index_topk(plan.take(q), plan.take(w), batch, 8, plan, group=group, gather=True,
                                backend="reference", return_slots=rank == 0)


def case_topk_local_rows_with_gather(world, rank, group):
    batch, plan, q, w = _topk_inputs(world, rank, group)
    rows = slice(0, 1) if rank == world - 1 else None
    q_local, w_local = (plan.take(q), plan.take(w)) if rows is None else (plan.take(q)[rows], plan.take(w)[rows])
    context_parallel_index_topk(q_local, w_local, batch, 8, plan, group=group, gather=True, backend="reference",
                                local_rows=rows)


def case_topk_bad_k(world, rank, group):
    # the top-k op itself refuses (after every argument check of the distributed layer passed)
    batch, plan, q, w = _topk_inputs(world, rank, group)
    context_parallel_index_topk(plan.take(q), plan.take(w), batch, -1 if rank == world - 1 else 8, plan,
                                group=group, gather=True, backend="reference")


def _rows_inputs(group):
    plan = ContextParallelPlan.zigzag(QUERY_SEQ, group=group)
    return plan, plan.take(torch.arange(QUERY_SEQ.numel() * 2).view(-1, 2))


def case_rows_wrong_count(world, rank, group):
    plan, x = _rows_inputs(group)
    gather_rows(x[:-1] if rank == world - 1 else x, plan, group=group)


def case_rows_not_a_tensor(world, rank, group):
    plan, x = _rows_inputs(group)
    gather_rows(x.tolist() if rank == world - 1 else x, plan, group=group)


def case_rows_dtype_differs(world, rank, group):
    plan, x = _rows_inputs(group)
    gather_rows(x.float() if rank == world - 1 else x, plan, group=group)


def case_rows_width_differs(world, rank, group):
    plan, x = _rows_inputs(group)
    gather_rows(torch.cat([x, x], 1) if rank == world - 1 else x, plan, group=group)


def case_rows_batch_differs(world, rank, group):
    plan, x = _rows_inputs(group)
    if rank == world - 1:  # this rank's plan is of a batch with one more query (its rows match its plan)
        plan = ContextParallelPlan.zigzag(torch.cat([QUERY_SEQ, QUERY_SEQ[-1:]]), group=group)
        x = plan.take(torch.arange(plan.num_queries * 2).view(-1, 2))
    gather_rows(x, plan, group=group)


def _refused_exchange(cache: PagedCache, call) -> None:
    before = cache.pool.clone()
    try:
        call()
    finally:
        assert torch.equal(cache.pool, before), "a refused exchange changed the pool"


def case_pages_on_meta(world, rank, group):
    cache = _pages_pool(world, rank, 4)
    pages = torch.tensor([rank])
    _refused_exchange(cache, lambda: all_gather_pages(cache.pool, cache.fmt, pages.to("meta") if rank == world - 1
                                                      else pages, group=group))


def case_entries_on_meta(world, rank, group):
    cache = _pages_pool(world, rank, 4)
    slots = torch.tensor([rank])
    _refused_exchange(cache, lambda: all_gather_entries(cache.pool, cache.fmt, slots.to("meta") if rank == world - 1
                                                        else slots, group=group))


def case_pages_pool_sizes_differ(world, rank, group):
    # rank 0's pool has 8 pages and claims page 6; the others' pools have 4 (page 6 does not exist there)
    cache = _pages_pool(world, rank, 8 if rank == 0 else 4)
    _refused_exchange(cache, lambda: all_gather_pages(cache.pool, cache.fmt, torch.tensor([6 if rank == 0 else rank]),
                                                      group=group))


def case_pages_formats_differ(world, rank, group):
    # fp8 and fp8-ue8m0 pages have the same size: only the format names tell them apart
    cache = _pages_pool(world, rank, 4, KeyFormat.FP8 if rank == 0 else KeyFormat.FP8_UE8M0)
    _refused_exchange(cache, lambda: all_gather_pages(cache.pool, cache.fmt, torch.tensor([rank]), group=group))


# name -> (case, the bad rank (None: the ranks disagree), its message, the other ranks' message)
REFUSED = r"rank {bad} refused its input: "
CASES = {
    "topk_short_q": (case_topk_short_q, -1, r"q must hold", REFUSED + r".*q must hold"),
    "topk_other_plan": (case_topk_other_plan, -1, r"plan is for rank 0", REFUSED + r".*plan is for rank 0"),
    "topk_k_differs": (case_topk_k_differs, None, r"disagree.*\*, 8\].*\*, 16\]", None),
    "topk_return_slots_differs": (case_topk_return_slots_differs, None, r"disagree", None),
    "topk_local_rows_with_gather": (case_topk_local_rows_with_gather, -1, r"local_rows=None",
                                    REFUSED + r".*local_rows=None"),
    "topk_bad_k": (case_topk_bad_k, -1, r"k", REFUSED + r".*k"),
    "rows_wrong_count": (case_rows_wrong_count, -1, r"plan.num_local", REFUSED + r".*plan.num_local"),
    "rows_not_a_tensor": (case_rows_not_a_tensor, -1, r"local must be a tensor", REFUSED + r".*list"),
    "rows_dtype_differs": (case_rows_dtype_differs, None, r"disagree.*int64.*float32", None),
    "rows_width_differs": (case_rows_width_differs, None, r"disagree.*\*, 2\].*\*, 4\]", None),
    "rows_batch_differs": (case_rows_batch_differs, None, r"disagree.*plan", None),
    "pages_on_meta": (case_pages_on_meta, -1, r"NotImplementedError|meta", REFUSED + r".*(NotImplementedError|meta)"),
    "entries_on_meta": (case_entries_on_meta, -1, r"NotImplementedError|meta",
                        REFUSED + r".*(NotImplementedError|meta)"),
    "pages_pool_sizes_differ": (case_pages_pool_sizes_differ, None, r"disagree.*\[8, 8448\].*\[4, 8448\]", None),
    "pages_formats_differ": (case_pages_formats_differ, None, r"disagree.*fp8 .*fp8-ue8m0", None),
}


def case_rows_of_any_dtype_and_shape(world, rank, group):
    # the rows travel as bytes: every dtype and trailing shape comes back exact (zero-width and 1-D included)
    plan = ContextParallelPlan.zigzag(QUERY_SEQ, group=group)
    t = QUERY_SEQ.numel()
    g = torch.Generator().manual_seed(5)
    for full in (torch.randn(t, 3, 2, generator=g).to(torch.bfloat16), torch.rand(t, 5, generator=g) > 0.5,
                 torch.randint(0, 255, (t, 3), generator=g, dtype=torch.uint8), torch.randn(t, dtype=torch.float64, generator=g),
                 torch.zeros(t, 0, dtype=torch.int32), torch.randn(t, 2, dtype=torch.complex64, generator=g)):
        back, stats = gather_rows(plan.take(full), plan, group=group, return_stats=True)
        assert back.dtype == full.dtype and torch.equal(back, full), full.dtype
        assert stats.row_bytes == full[0].numel() * full.element_size() and stats.rows == t


HEALTHY = {"rows_of_any_dtype_and_shape": case_rows_of_any_dtype_and_shape}


def _run_case(name: str, world: int, rank: int, group) -> tuple[str, str]:
    """One case on this rank -> (what its call did: an exception type or 'returned', the message)."""
    try:
        (HEALTHY[name] if name in HEALTHY else CASES[name][0])(world, rank, group)
        outcome = ("returned", "")
    except Exception as exc:  # noqa: BLE001 -- reported to the test, which names what it expected
        outcome = (type(exc).__name__, str(exc))
    _healthy_gather(group)
    return outcome


def _rank_main(rank: int, world: int, store: str, commands, results) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=4 * CASE_TIMEOUT_S))
    pair = dist.new_group([0, 1])
    results.put((rank, "ready", ""))
    try:
        while (command := commands.get()) is not None:
            name, size = command
            try:
                kind, message = _run_case(name, size, rank, None if size == world else pair)
            except Exception as exc:  # noqa: BLE001 -- the follow-up check failed: report it, keep serving
                kind, message = "follow-up " + type(exc).__name__, str(exc)
            results.put((rank, kind, message))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# The test side: one set of ranks for the module, new ones after a failure
# --------------------------------------------------------------------------------------------------


class Ranks:
    def __init__(self, world: int, workdir: str):
        self.world, self.workdir = world, workdir
        self.procs: list = []

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        store = tempfile.mktemp(prefix="store-", dir=self.workdir)  # a fresh file: a FileStore is single-use
        self.commands = [ctx.Queue() for _ in range(self.world)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, args=(r, self.world, store, self.commands[r], self.results),
                                  daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()
        self._collect(range(self.world), START_TIMEOUT_S, "start")

    def _collect(self, ranks, timeout_s: float, what: str) -> dict[int, tuple[str, str]]:
        got: dict[int, tuple[str, str]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < len(ranks):
            try:
                rank, kind, message = self.results.get(timeout=0.5)
                got[rank] = (kind, message)
                continue
            except queue.Empty:
                pass
            dead = {r: p.exitcode for r, p in enumerate(self.procs) if p.exitcode is not None}
            if dead or time.monotonic() > deadline:
                self.stop()
                waiting = sorted(set(ranks) - set(got))
                pytest.fail(f"{what}: ranks died {dead} (negative: killed by that signal, e.g. -6 SIGABRT) or "
                            f"ranks {waiting} still blocked after {timeout_s} s; answers so far: {got}")
        return got

    def run(self, name: str, world: int) -> dict[int, tuple[str, str]]:
        if not self.procs:
            self.start()
        for r in range(world):
            self.commands[r].put((name, world))
        return self._collect(range(world), CASE_TIMEOUT_S, f"case {name} on {world} ranks")

    def stop(self) -> None:
        procs, self.procs = self.procs, []
        for p in procs:
            if p.is_alive():
                p.kill()  # a rank blocked in a collective never reads its next command
            p.join(timeout=10)

    def close(self) -> None:
        if self.procs and all(p.is_alive() for p in self.procs):
            for c in self.commands:
                c.put(None)
            for p in self.procs:
                p.join(timeout=20)
        self.stop()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    group = Ranks(WORLD_MAX, str(tmp_path_factory.mktemp("gloo")))
    yield group
    group.close()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_refuses_and_none_blocks(ranks, name, world):
    _, bad, bad_message, other_message = CASES[name]
    outcomes = ranks.run(name, world)
    bad = None if bad is None else bad % world
    for rank in range(world):
        kind, message = outcomes[rank]
        assert kind == "ValueError", (rank, outcomes)
        want = bad_message if bad is None or rank == bad else other_message.format(bad=bad)
        assert re.search(want, message, re.S), (rank, want, outcomes)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", list(HEALTHY))
def test_healthy_calls_return_on_every_rank(ranks, name, world):
    outcomes = ranks.run(name, world)
    assert all(outcomes[r] == ("returned", "") for r in range(world)), outcomes
