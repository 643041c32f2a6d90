"""Context-parallel indexer prefill (dsakit.distributed) on the GPUs of one host against one GPU.

Workload of one configuration (context L tokens, key format, top-K):
  one sequence, a full causal prefill from position 0: T = L query tokens at positions 0..L-1, ratio 4, so
  N = L / 4 compressed entries (65536 at 256K tokens, 262144 at 1M); every query gets the top-K of the
  entries it sees ((pos + 1) // 4 of them). H = 64 heads, D = 128; fp8 keys with fp8 e4m3 queries (scale
  folded into the head weights), bf16 keys with bf16 queries (benchmarks/_common.make_queries); keys as
  random valid page bytes (benchmarks/_common.timing_pool).
  The queries are run in calls of --rows-per-call (8192) rows, each output reduced to a per-row checksum
  before the next call (an engine consumes each chunk's indices in the same layer), so memory stays bounded.

  1 GPU   rank 0 alone runs all T rows on GPU 0 (the other rank waits on the CPU).
  G GPUs  zigzag split (rank r owns query chunks r and 2G-1-r of 2G); each rank starts with only its own
          page-aligned zigzag share of the entries in its pool (the others zeroed), and its timed step is
          all_gather_pages (the cache exchange) + its calls. The step time is the slowest rank's.

Reported per configuration: time (ms), throughput (query tokens / s), speedup and scaling efficiency
(speedup / G), the exchange's time and share of the step, bytes moved (CommStats), per-rank compute time
(load balance), peak memory per GPU (torch.cuda.max_memory_allocated: absolute, and above what was allocated
before the step), and an exactness check: the per-row checksums of the G-GPU run (gathered with gather_rows)
equal the 1-GPU run's, and every pool equals the full pool byte for byte after the exchange.
Targets: >= 1.8x the 1-GPU throughput at 1M tokens on 2 GPUs, exchange < 5 % of the step.

Usage (one host, G GPUs; the script spawns one process per GPU itself, or runs under torchrun):
    PYTHONPATH=. python3 benchmarks/bench_distributed.py --out DIR [--gpus 2] [--commit SHA]
    PYTHONPATH=. torchrun --nproc_per_node=2 benchmarks/bench_distributed.py --out DIR
    PYTHONPATH=. python3 benchmarks/bench_distributed.py --out DIR --device cpu --smoke   # gloo, toy sizes
A result file DIR/distributed_<gpus>gpu.json is rewritten after every configuration; a configuration that
would start after --budget-s seconds is skipped (recorded as skipped).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, make_queries, timing_pool, write_json  # noqa: E402

from dsakit.distributed import ContextParallelPlan, all_gather_pages, context_parallel_index_topk  # noqa: E402
from dsakit import PagedBatch  # noqa: E402
from dsakit.distributed import gather_rows, zigzag_ranges  # noqa: E402
from dsakit.formats import ENTRIES_PER_PAGE, KeyFormat  # noqa: E402

RATIO = 4
DIM = 128
# NVLink multicast stays off on shared hosts (it can take the GPUs out of service); children inherit these.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def log(*parts) -> None:
    print(*parts, flush=True)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def row_checksums(idx: torch.Tensor) -> torch.Tensor:
    """int64 [R]: order-sensitive checksum of each row of indices int32 [R, K]."""
    weight = torch.arange(1, idx.shape[1] + 1, device=idx.device, dtype=torch.int64)
    return ((idx.long() + 2) * weight).sum(1)


class Workload:
    """One configuration's inputs on this rank: the full pool (reference copy), queries, the batch."""

    def __init__(self, tokens: int, fmt: KeyFormat, heads: int, rows_per_call: int, device: str, backend: str):
        self.tokens, self.fmt, self.device, self.backend = tokens, fmt, device, backend
        self.entries = tokens // RATIO
        self.rows_per_call = rows_per_call
        pool, table, counts = timing_pool(fmt, [self.entries], device, seed=7)  # same bytes on every rank
        self.full_pool = pool.clone()
        self.pool, self.table, self.counts = pool, table, counts
        # one bank of rows_per_call query rows: query t uses bank row t % rows_per_call (its position differs).
        # fp8 keys on CUDA get fp8 e4m3 q (the fp8 tensor-core path) with its per-(row, head) scale folded into
        # the head weights (relu(c x) = c relu(x), c > 0); other formats bf16 q.
        self.q, self.w, q_scale = make_queries(fmt.kind, rows_per_call, heads, device, seed=11)
        if q_scale is not None:
            self.w = self.w * q_scale
        self.query_seq = torch.zeros(tokens, dtype=torch.int32, device=device)
        self.positions = torch.arange(tokens, dtype=torch.int64, device=device)

    def batch(self):
        return PagedBatch.build(self.pool, self.fmt, self.table, self.counts, self.query_seq, self.positions, RATIO)

    def owned_pages(self, world: int, rank: int) -> torch.Tensor:
        pages = []
        for lo, hi in zigzag_ranges(self.entries, world, rank, align=ENTRIES_PER_PAGE):
            pages.append(self.table[0, lo // ENTRIES_PER_PAGE: -(-hi // ENTRIES_PER_PAGE)].long())
        return torch.cat(pages)

    def keep_only(self, pages: torch.Tensor) -> None:
        """The rank's pool before the exchange: its own pages, every other page zeroed."""
        self.pool.zero_()
        self.pool.index_copy_(0, pages, self.full_pool.index_select(0, pages))


def run_rows(work: Workload, k: int, plan: ContextParallelPlan, batch, out: torch.Tensor) -> None:
    """This rank's rows in calls of rows_per_call; out int64 [T_r] gets each row's checksum."""
    step = work.rows_per_call
    for start in range(0, plan.num_local, step):
        stop = min(plan.num_local, start + step)
        idx = context_parallel_index_topk(work.q[: stop - start], work.w[: stop - start], batch, k, plan,
                                          backend=work.backend, local_rows=slice(start, stop))
        out[start:stop] = row_checksums(idx.to(out.device))


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0


def timed_step(work: Workload, k: int, plan: ContextParallelPlan, pages: torch.Tensor | None, group) -> dict:
    """One measured prefill step on this rank (pages None = single GPU, nothing to exchange)."""
    device = work.device
    if pages is not None:
        work.keep_only(pages)
    out = torch.empty(plan.num_local, dtype=torch.int64, device=device)
    batch = work.batch()
    sync(device)
    base = torch.cuda.memory_allocated() if device == "cuda" else 0
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if group is not None:
        dist.barrier(group=group)
    t0 = time.perf_counter()
    stats = None
    if pages is not None:
        stats = all_gather_pages(work.pool, work.fmt, pages)
        sync(device)
    t1 = time.perf_counter()
    run_rows(work, k, plan, batch, out)
    sync(device)
    t2 = time.perf_counter()
    return {"exchange_ms": (t1 - t0) * 1e3, "compute_ms": (t2 - t1) * 1e3, "total_ms": (t2 - t0) * 1e3,
            "peak_gib": peak_gib(device), "peak_extra_gib": (peak_gib(device) - base / 2**30),
            "stats": stats, "checksums": out}


def gather_floats(values: list[float], group) -> list[list[float]]:
    """Every rank's list of floats (CPU, over the gloo group)."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [o.tolist() for o in out]


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def worker(rank: int, world: int, port: int | None, args: argparse.Namespace) -> None:
    """One rank. port None: launched by torchrun (MASTER_ADDR / MASTER_PORT already set)."""
    os.environ.update(SAFE_ENV)
    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    backend_name = "nccl" if device == "cuda" else "gloo"
    if device == "cpu":
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        torch.set_num_threads(1)
    dist.init_process_group(backend_name, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    cpu_group = dist.new_group(backend="gloo")  # barriers and timing exchange on the CPU
    # the first collective sets up the communicator: do it before anything is timed
    dist.all_reduce(torch.zeros(1, device=torch.device("cuda", rank) if device == "cuda" else "cpu"))
    started = time.monotonic()
    report = {"environment": environment(device, args.commit), "gpus": world, "ratio": RATIO,
              "heads": args.heads, "rows_per_call": args.rows_per_call, "backend": args.backend,
              "workload": ("one sequence, full causal prefill from position 0: T = L query tokens at positions "
                           "0..L-1, N = L/4 entries; queries in calls of rows_per_call rows; fp8 keys with fp8 "
                           "q (q scale folded into the weights), bf16 keys with bf16 q; G GPUs: zigzag query "
                           "split + all_gather_pages of each rank's page-aligned zigzag share of the entries"),
              "results": [], "skipped": []}
    out_path = Path(args.out) / f"distributed_{world}gpu.json"
    try:
        for tokens in args.contexts:
            for fmt_name in args.formats:
                fmt = KeyFormat.parse(fmt_name)
                if rows_misaligned(tokens, world, args.rows_per_call):
                    raise SystemExit(f"rows_per_call {args.rows_per_call} must divide L / (2 * gpus) = "
                                     f"{tokens // (2 * world)}")
                work = Workload(tokens, fmt, args.heads, args.rows_per_call, device, args.backend)
                plan1 = ContextParallelPlan.zigzag(work.query_seq, 1, 0)
                plan = ContextParallelPlan.zigzag(work.query_seq, world, rank)
                pages = work.owned_pages(world, rank)
                for k in args.ks:
                    elapsed = time.monotonic() - started
                    if elapsed > args.budget_s:
                        report["skipped"].append({"tokens": tokens, "fmt": fmt.name, "k": k,
                                                  "why": f"budget {args.budget_s} s spent ({elapsed:.0f} s)"})
                        if rank == 0:
                            log(f"skip L={tokens} {fmt.name} K={k}: budget spent")
                            write_json(out_path, report)
                        continue
                    row = run_config(work, k, plan1, plan, pages, rank, world, cpu_group, args)
                    if rank == 0:
                        report["results"].append(row)
                        write_json(out_path, report)
                        log(summary_line(row))
                del work
                if device == "cuda":
                    torch.cuda.empty_cache()
        if rank == 0:
            report["targets"] = targets(report["results"], world)
            report["wall_s"] = round(time.monotonic() - started, 1)
            write_json(out_path, report)
            log(f"wrote {out_path} ({report['wall_s']} s)")
        dist.barrier(group=cpu_group)
    finally:
        dist.destroy_process_group()


def rows_misaligned(tokens: int, world: int, rows_per_call: int) -> bool:
    # query t uses bank row t % rows_per_call; every call starts at a multiple of rows_per_call when the
    # zigzag chunks (L / 2G rows) are multiples of it, so the 1-GPU and G-GPU runs score the same rows
    return tokens % (2 * world) != 0 or (tokens // (2 * world)) % rows_per_call != 0


def run_config(work: Workload, k: int, plan1, plan, pages, rank: int, world: int, cpu_group, args) -> dict:
    device = work.device
    reps = args.reps if args.reps else (1 if work.tokens > 300_000 else 3)
    tag = f"L={work.tokens} {work.fmt.name} K={k}"
    # warm-up (compiles the kernels for this format and K): one call of the most expensive rows
    warm = ContextParallelPlan.zigzag(work.query_seq, 1, 0)
    batch = work.batch()
    n = min(work.rows_per_call, work.tokens)
    context_parallel_index_topk(work.q[:n], work.w[:n], batch, k, warm, backend=work.backend,
                                local_rows=slice(work.tokens - n, work.tokens))
    work.keep_only(pages)
    all_gather_pages(work.pool, work.fmt, pages)  # untimed: first use of this buffer size on the group
    sync(device)
    # 1 GPU: rank 0 alone
    single = []
    if rank == 0:
        log(f"{tag}: 1 GPU x {reps} ...")
        work.pool.copy_(work.full_pool)
        for _ in range(reps):
            single.append(timed_step(work, k, plan1, None, None))
    dist.barrier(group=cpu_group)
    # G GPUs
    if rank == 0:
        log(f"{tag}: {world} GPUs x {reps} ...")
    multi = []
    for _ in range(reps):
        step = timed_step(work, k, plan, pages, cpu_group)
        step["pool_ok"] = bool(torch.equal(work.pool, work.full_pool))
        multi.append(step)
    # exactness: the G-GPU checksums, gathered in batch order, equal the 1-GPU ones
    gathered = gather_rows(multi[-1]["checksums"], plan)
    mine = ([s["total_ms"] for s in multi] + [s["compute_ms"] for s in multi] + [s["exchange_ms"] for s in multi]
            + [max(s["peak_gib"] for s in multi), max(s["peak_extra_gib"] for s in multi),
               float(all(s["pool_ok"] for s in multi))])
    ranks = gather_floats(mine, cpu_group)
    if rank != 0:
        return {}
    total = [r[:reps] for r in ranks]
    compute = [r[reps: 2 * reps] for r in ranks]
    exchange_ms = [r[2 * reps: 3 * reps] for r in ranks]
    per_rank = [(median(total[i]), median(compute[i]), median(exchange_ms[i])) + tuple(ranks[i][3 * reps:])
                for i in range(world)]
    exact = bool(torch.equal(gathered.to(single[-1]["checksums"].device), single[-1]["checksums"]))
    t1 = median([s["total_ms"] for s in single])
    # a step lasts as long as its slowest rank: max over ranks per rep, then the median over reps
    tg = median([max(total[i][j] for i in range(world)) for j in range(reps)])
    exchange = median([max(exchange_ms[i][j] for i in range(world)) for j in range(reps)])
    stats = multi[-1]["stats"]
    return {
        "tokens": work.tokens, "entries": work.entries, "fmt": work.fmt.name, "k": k, "reps": reps,
        "one_gpu": {"ms": round(t1, 2), "tokens_per_s": work.tokens / t1 * 1e3,
                    "peak_gib": round(single[-1]["peak_gib"], 3),
                    "peak_extra_gib": round(single[-1]["peak_extra_gib"], 3),
                    "all_ms": [round(s["total_ms"], 2) for s in single]},
        "multi_gpu": {"gpus": world, "ms": round(tg, 2), "tokens_per_s": work.tokens / tg * 1e3,
                      "per_rank_total_ms": [round(r[0], 2) for r in per_rank],
                      "per_rank_compute_ms": [round(r[1], 2) for r in per_rank],
                      "per_rank_exchange_ms": [round(r[2], 3) for r in per_rank],
                      "peak_gib_per_gpu": [round(r[3], 3) for r in per_rank],
                      "peak_extra_gib_per_gpu": [round(r[4], 3) for r in per_rank],
                      "load_imbalance": round(max(r[1] for r in per_rank) / max(1e-9, min(r[1] for r in per_rank)), 4)},
        "speedup": round(t1 / tg, 3), "efficiency": round(t1 / tg / world, 3),
        "exchange_ms": round(exchange, 3), "exchange_share": round(exchange / tg, 5),
        "bytes_moved": stats.as_dict() if stats is not None else None,
        "exact": {"checksums_equal": exact, "pools_equal": all(r[5] == 1.0 for r in per_rank)},
    }


def summary_line(row: dict) -> str:
    m = row["multi_gpu"]
    return (f"L={row['tokens']:>8} {row['fmt']:>5} K={row['k']:>4}  1 GPU {row['one_gpu']['ms']:9.1f} ms  "
            f"{m['gpus']} GPUs {m['ms']:9.1f} ms  speedup {row['speedup']:.3f} (eff {row['efficiency']:.3f})  "
            f"exchange {row['exchange_ms']:.2f} ms = {100 * row['exchange_share']:.2f} %  "
            f"moved {row['bytes_moved']['bytes_per_rank'] / 2**20:.1f} MiB/rank  "
            f"imbalance {m['load_imbalance']:.3f}  exact {row['exact']}")


def targets(results: list[dict], world: int) -> dict:
    big = [r for r in results if r["tokens"] >= 1 << 20]
    if not big:
        return {"note": "no 1M-token result"}
    return {"speedup_at_1m_min": min(r["speedup"] for r in big), "speedup_target": 1.8 if world == 2 else None,
            "speedup_met": all(r["speedup"] >= 1.8 for r in big) if world == 2 else None,
            "exchange_share_at_1m_max": max(r["exchange_share"] for r in big), "exchange_share_target": 0.05,
            "exchange_met": all(r["exchange_share"] < 0.05 for r in big),
            "all_exact": all(r["exact"]["checksums_equal"] and r["exact"]["pools_equal"] for r in results)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for distributed_<G>gpu.json")
    p.add_argument("--gpus", type=int, default=2, help="processes / GPUs of the context-parallel group")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--smoke", action="store_true", help="toy sizes (with --device cpu: gloo, reference backend)")
    p.add_argument("--contexts", default=None,
                   help="comma list of context tokens (default 1048576,262144: the targets first)")
    p.add_argument("--formats", default="fp8,bf16")
    p.add_argument("--ks", default=None, help="comma list of top-K (default 512,2048)")
    p.add_argument("--rows-per-call", type=int, default=None, help="query rows per top-k call (default 8192)")
    p.add_argument("--heads", type=int, default=None, help="index heads (default 64)")
    p.add_argument("--reps", type=int, default=0, help="measured steps per config (0: 3 below 300K tokens, else 1)")
    p.add_argument("--budget-s", type=float, default=200.0, help="start no configuration after this many seconds")
    p.add_argument("--commit", default=None)
    args = p.parse_args(argv)
    smoke = args.smoke
    args.contexts = [int(x) for x in (args.contexts or ("2048,4096" if smoke else "1048576,262144")).split(",")]
    args.formats = args.formats.split(",")
    args.ks = [int(x) for x in (args.ks or ("8,32" if smoke else "512,2048")).split(",")]
    args.rows_per_call = args.rows_per_call or (256 if smoke else 8192)
    args.heads = args.heads or (4 if smoke else 64)
    args.backend = "auto"  # Triton on CUDA, the reference on the CPU
    args.commit = args.commit or git_commit()
    if args.gpus < 1:
        p.error("--gpus must be >= 1")
    if "LOCAL_RANK" in os.environ:  # torchrun started the processes: one per GPU
        args.gpus = int(os.environ["WORLD_SIZE"])
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        p.error(f"--gpus {args.gpus} but {torch.cuda.device_count()} CUDA devices are visible")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.update(SAFE_ENV)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    log(f"bench_distributed: {args.gpus} x {args.device}, contexts {args.contexts}, formats {args.formats}, "
        f"K {args.ks}, rows/call {args.rows_per_call}, H {args.heads}")
    if "LOCAL_RANK" in os.environ:
        rank = int(os.environ["RANK"])
        worker(rank, args.gpus, None, args)
        if rank != 0:
            return 0
    else:
        mp.spawn(worker, args=(args.gpus, free_port(), args), nprocs=args.gpus, join=True)
    report = Path(args.out) / f"distributed_{args.gpus}gpu.json"
    import json

    data = json.loads(report.read_text())
    bad = [r for r in data["results"] if not (r["exact"]["checksums_equal"] and r["exact"]["pools_equal"])]
    if bad:
        log(f"EXACTNESS FAILED in {len(bad)} configurations")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
