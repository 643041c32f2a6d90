"""Host cost of the public top-k call: plain ``dsakit.ops.indexer.index_topk`` against the planned decode path.

Cases: B = 64 sequences, one query each, N = 65536 and 131072 entries per sequence (every entry visible),
H 64, bf16 q, fp8 keys, K 2048 (and 512). The batch is a ``PagedCache.batch`` of the sequences (host metadata,
no sync). Per case (triton.testing.do_bench medians, ms):

  public        index_topk(q, w, batch, K): cached workspaces and tile plans, fresh outputs per call
  plan eager    index_topk_decode(q, w, batch, K, plan=plan) launched from Python
  plan graph    the same call captured in a CUDA graph, replayed

Recorded checks: the public call from its second call on passes ``torch.cuda.set_sync_debug_mode("error")``
(no device->host sync) and allocates no more than its output (peak memory above the level before the call);
public and plan results are equal bit for bit; ``public_over_plan`` = public / plan eager (target <= 1.2).

Usage: PYTHONPATH=. python3 benchmarks/bench_host.py --out DIR [--commit SHA]
       (``--device cpu --smoke`` under TRITON_INTERPRET=1: toy sizes, no graphs, no timing claims)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import DIM, bench_parser, environment, median_ms, sync_and_alloc, write_json

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.indexer import index_topk
from dsakit.ops.indexer.triton import index_topk_decode
from dsakit.ops.indexer.plans import plan_decode_topk


def default_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def random_pool(fmt: KeyFormat, b: int, n: int, device: str, seed: int):
    """Random fp8 pages (e4m3 values, fp32 scales in [0.5, 1.5)) and a shuffled page table for B x N entries."""
    g = torch.Generator(device=device).manual_seed(seed)
    pages_per = -(-n // 64)
    num_pages = b * pages_per
    pool = torch.empty(num_pages, fmt.page_bytes, dtype=torch.uint8, device=device)
    pool[:, : fmt.scale_offset_in_page].copy_(
        torch.randn(num_pages, 64 * DIM, device=device, generator=g).to(torch.float8_e4m3fn).view(torch.uint8))
    pool[:, fmt.scale_offset_in_page:].copy_((torch.rand(num_pages, 64, device=device, generator=g) + 0.5)
                                             .view(torch.uint8))
    table = torch.randperm(num_pages, device=device, generator=g).to(torch.int32).reshape(b, pages_per)
    return pool, table


def sync_and_alloc_check(fn, device: str) -> dict:
    """Run fn() under sync debug mode "error": whether it passed, and the peak bytes it allocated."""
    if device != "cuda":
        fn()
        return {"sync_free": None, "alloc_peak_bytes": None}
    return sync_and_alloc(fn)


def run_case(n: int, k: int, b: int, heads: int, device: str, rep_ms: int, smoke: bool) -> dict:
    fmt = KeyFormat.FP8
    pool, table = random_pool(fmt, b, n, device, seed=n + k)
    counts = torch.full((b,), n, dtype=torch.int32, device=device)
    seq = torch.arange(b, dtype=torch.int32, device=device)
    # what PagedCache.batch builds from host metadata (no sync): every sequence full, one query each
    batch = PagedBatch.from_host(pool, fmt, table.cpu().tolist(), [n] * b)
    static = PagedBatch.build(pool, fmt, table, counts, seq, validate=False, max_entries=n)  # for the graph
    g = torch.Generator(device=device).manual_seed(7)
    q = torch.randn(b, heads, DIM, device=device, generator=g).to(torch.bfloat16)
    w = torch.rand(b, heads, device=device, generator=g) + 0.05
    plan = plan_decode_topk(b, 1, n, k, fmt, device, num_heads=heads)

    def public():
        return index_topk(q, w, batch, k)

    def planned():
        return index_topk_decode(q, w, static, k, plan=plan)

    first = public().clone()  # compiles, fills the workspace and plan caches
    row = {"case": "decode", "format": fmt.name, "q": str(q.dtype), "B": b, "next_n": 1, "N": n, "H": heads, "K": k,
           "output_bytes": b * k * 4, **sync_and_alloc_check(public, device)}
    row["public_equals_plan"] = bool(torch.equal(first, planned()))
    row["public_ms"] = median_ms(public, device, rep_ms, warmup=10)
    row["plan_eager_ms"] = median_ms(planned, device, rep_ms, warmup=10)
    if device == "cuda" and not smoke:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            planned()
        graph.replay()
        torch.cuda.synchronize()
        row["graph_equals_public"] = bool(torch.equal(plan.indices, first))
        row["plan_graph_ms"] = median_ms(graph.replay, device, rep_ms, warmup=10)
        del graph
    row["public_over_plan"] = row["public_ms"] / row["plan_eager_ms"]
    print(row, flush=True)
    return row


def main() -> int:
    args = bench_parser(commit_default=None).parse_args()
    device, smoke = args.device, args.smoke
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    b, heads = (4, 16) if smoke else (64, 64)
    ns = [300] if smoke else [65536, 131072]
    ks = [32] if smoke else [2048, 512]
    rep_ms = 5 if smoke else 100
    report = {"meta": {**environment(device, args.commit or default_commit()), "B": b, "H": heads, "D": DIM,
                       "N": ns, "K": ks, "format": "fp8", "timing": "triton.testing.do_bench median, ms"},
              "cases": []}
    start = time.time()
    for n in ns:
        for k in ks:
            report["cases"].append(run_case(n, k, b, heads, device, rep_ms, smoke))
            write_json(out_dir / "host.json", report)
            if device == "cuda":
                torch.cuda.empty_cache()
    report["meta"]["total_s"] = time.time() - start
    write_json(out_dir / "host.json", report)
    print("\nN       K     public  plan    graph   public/plan  sync-free  alloc-peak  equal")
    failures = 0
    for r in report["cases"]:
        ok = r["public_equals_plan"] and r.get("sync_free") is not False and r.get("graph_equals_public", True)
        failures += not ok
        print(f"{r['N']:7} {r['K']:5} {r['public_ms']:7.3f} {r['plan_eager_ms']:7.3f} {r.get('plan_graph_ms', 0):7.3f} "
              f"{r['public_over_plan']:11.2f}  {r.get('sync_free')!s:9}  {r.get('alloc_peak_bytes')!s:10}  {ok}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
