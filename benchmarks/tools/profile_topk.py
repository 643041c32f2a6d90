"""One indexer top-k call to run under Nsight Compute: decode (B sequences x N entries, K 2048, the planned
path) or prefill (T queries x N entries of one sequence, the chunked ``index_topk_triton`` path).

    ncu --clock-control none -k regex:"_index_scores|_filter|_final|_order" -c 8 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python3 benchmarks/tools/profile_topk.py [--mode decode|prefill] [--n 131072] [--format fp8] \
            [--stream-filter warp|thread]

q is fp8 e4m3 for fp8 / fp4 keys and bf16 for bf16 keys (the benchmarks' convention). Warm-up calls compile
the kernels first; the profiled launches are those of the last call (``-c`` bounds how many ncu records).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from dataclasses import replace

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the bench_* scripts
from _common import make_queries, timing_pool

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.indexer.triton import index_topk_decode
from dsakit.ops.indexer.plans import plan_decode_topk
from dsakit.ops.indexer.config import TopkConfig
from dsakit.ops.indexer.triton import index_topk_triton


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--b", type=int, default=64, help="decode: sequences")
    ap.add_argument("--t", type=int, default=1024, help="prefill: queries (one workspace chunk by default)")
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--format", default="fp8")
    ap.add_argument("--stream-filter", default=None, choices=("warp", "thread"),
                    help="SelectConfig.stream_filter (default: the GPU's table)")
    args = ap.parse_args()
    fmt = KeyFormat.parse(args.format)
    q_kind = "bf16" if args.format == "bf16" else "fp8"
    if args.mode == "decode":
        pool, table, counts = timing_pool(fmt, [args.n] * args.b, "cuda", seed=11)
        q, w, qs = make_queries(q_kind, args.b, 64, "cuda", seed=12)
        seq = torch.arange(args.b, device="cuda", dtype=torch.int32)
        batch = PagedBatch.build(pool, fmt, table, counts, seq)
        select = None
        if args.stream_filter is not None:
            select = replace(TopkConfig.for_device("cuda").select, stream_filter=args.stream_filter)
        plan = plan_decode_topk(args.b, 1, args.n, args.k, fmt, "cuda", num_heads=64, select=select)
        call = lambda: index_topk_decode(q, w, batch, args.k, plan=plan, q_scale=qs)  # noqa: E731
    else:
        pool, table, counts = timing_pool(fmt, [args.n], "cuda", seed=11)
        q, w, qs = make_queries(q_kind, args.t, 64, "cuda", seed=12)
        batch = PagedBatch.build(pool, fmt, table, counts, torch.zeros(args.t, device="cuda", dtype=torch.int32))
        config = TopkConfig.for_device("cuda")
        if args.stream_filter is not None:
            config = replace(config, select=replace(config.select, stream_filter=args.stream_filter))
        call = lambda: index_topk_triton(q, w, batch, args.k, q_scale=qs, config=config)  # noqa: E731
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
