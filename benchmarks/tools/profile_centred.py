"""One centred decode call and one centred prefill scores call to run under Nsight Compute.

    ncu --clock-control none -k regex:"_page_term|_index_scores" -c 4 --section SpeedOfLight --section Occupancy \
        python3 benchmarks/tools/profile_centred.py [--format fp8-centred] [--n 65536]

decode: B 64 sequences x N entries, one fp8 query (+ q_scale) each, the planned top-k path (``plan_decode_topk``
+ ``index_topk_decode``): the page-term pass, then the page-copy scores kernel. prefill: T 1024 fp8 queries x N
entries of one sequence, ``index_scores_triton``: the tile plan's page-term pass, then the tile kernel. The
pools are built on the device (bench_centred.centred_pool: random valid residual pages plus a bf16
centre per page). Launch order: decode pass, decode scores, (select kernels), prefill pass, prefill scores.

``--decode-graph``: the whole decode step of the plain format and of the centred one, each as one CUDA-graph
replay, for ``ncu --nvtx --nvtx-include "profile/" --graph-profiling node`` (every kernel of the step, no
name filter); it also prints each graph's replay time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the bench_* scripts
from _common import make_queries, timing_pool
from bench_centred import PLAIN, centred_pool

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.indexer.scores import index_scores_triton
from dsakit.ops.indexer.triton import index_topk_decode
from dsakit.ops.indexer.plans import plan_decode_topk


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="fp8-centred", choices=sorted(PLAIN))
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--b", type=int, default=64)
    ap.add_argument("--t", type=int, default=1024)
    ap.add_argument("--decode-graph", action="store_true",
                    help="instead: the decode step of the plain and the centred format, each captured in a CUDA graph, "
                         "timed (CUDA events, 20 replays) and replayed once more inside the NVTX range 'profile'")
    args = ap.parse_args()
    if args.decode_graph:
        return decode_graph(args)
    fmt = KeyFormat.parse(args.format)
    plain = KeyFormat.parse(PLAIN[args.format])
    pool, table, counts = timing_pool(plain, [args.n] * args.b, "cuda", seed=11)
    pool = centred_pool(args.format, pool, seed=13)
    q, w, qs = make_queries("fp8", args.b, 64, "cuda", seed=12)
    batch = PagedBatch.build(pool, fmt, table, counts, torch.arange(args.b, device="cuda", dtype=torch.int32))
    plan = plan_decode_topk(args.b, 1, args.n, 2048, fmt, "cuda", num_heads=64)
    index_topk_decode(q, w, batch, 2048, plan=plan, q_scale=qs)
    torch.cuda.synchronize()
    del batch, plan
    pool, table, counts = timing_pool(plain, [args.n], "cuda", seed=7)
    pool = centred_pool(args.format, pool, seed=8)
    q, w, qs = make_queries("fp8", args.t, 64, "cuda", seed=9)
    batch = PagedBatch.build(pool, fmt, table, counts, torch.zeros(args.t, device="cuda", dtype=torch.int32))
    index_scores_triton(q, w, batch, q_scale=qs)
    torch.cuda.synchronize()
    return 0


def decode_graph(args) -> int:
    """Where a centred decode step spends its time, kernel by kernel, beside the plain one: run under
    ``ncu --nvtx --nvtx-include "profile/" --graph-profiling node`` every kernel node of one replay of each graph
    is profiled (no kernel-name filter, so nothing outside a guessed pattern is missed); without ncu the
    printed replay times show whether the benchmark's centred / plain ratio reproduces."""
    plain_name = PLAIN[args.format]
    pool, table, counts = timing_pool(KeyFormat.parse(plain_name), [args.n] * args.b, "cuda", seed=11)
    pools = {plain_name: pool, args.format: centred_pool(args.format, pool, seed=13)}
    q, w, qs = make_queries("fp8", args.b, 64, "cuda", seed=12)
    seq = torch.arange(args.b, device="cuda", dtype=torch.int32)
    for name in (plain_name, args.format):
        fmt = KeyFormat.parse(name)
        batch = PagedBatch.build(pools[name], fmt, table, counts, seq)
        plan = plan_decode_topk(args.b, 1, args.n, 2048, fmt, "cuda", num_heads=64)
        index_topk_decode(q, w, batch, 2048, plan=plan, q_scale=qs)  # compiles
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            index_topk_decode(q, w, batch, 2048, plan=plan, q_scale=qs)
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"{name}: {start.elapsed_time(end) / 20:.4f} ms per graph replay (B {args.b} x N {args.n}, K 2048)",
              flush=True)
        torch.cuda.nvtx.range_push("profile")
        graph.replay()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        del graph, plan, batch
    return 0


if __name__ == "__main__":
    sys.exit(main())
