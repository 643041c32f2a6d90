"""One decode top-k call (B = 64 sequences x N entries, fp8 keys + fp8 q, K 2048) to run under Nsight Compute.

    ncu --clock-control none -k regex:"_index_scores_group|_filter|_final|_order" -c 8 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        python3 benchmarks/profile_decode.py [--n 131072] [--format fp8]

Warm-up calls compile the kernels first; the profiled launches are those of the last call.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import make_queries, timing_pool

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.topk.decode import index_topk_decode, plan_decode_topk


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--b", type=int, default=64)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--format", default="fp8")
    args = ap.parse_args()
    fmt = KeyFormat.parse(args.format)
    pool, table, counts = timing_pool(fmt, [args.n] * args.b, "cuda", seed=11)
    q, w, qs = make_queries("fp8", args.b, 64, "cuda", seed=12)
    batch = PagedBatch.build(pool, fmt, table, counts, torch.arange(args.b, device="cuda", dtype=torch.int32))
    plan = plan_decode_topk(args.b, 1, args.n, args.k, fmt, "cuda", num_heads=64)
    for _ in range(3):
        index_topk_decode(q, w, batch, args.k, plan=plan, q_scale=qs)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
