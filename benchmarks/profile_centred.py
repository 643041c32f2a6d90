"""One centred decode call and one centred prefill scores call to run under Nsight Compute.

    ncu --clock-control none -k regex:"_page_term|_index_scores" -c 4 --section SpeedOfLight --section Occupancy \
        python3 benchmarks/profile_centred.py [--format fp8-centred] [--n 65536]

decode: B 64 sequences x N entries, one fp8 query (+ q_scale) each, the planned top-k path (``plan_decode_topk``
+ ``index_topk_decode``): the page-term pass, then the page-copy scores kernel. prefill: T 1024 fp8 queries x N
entries of one sequence, ``index_scores_triton``: the tile plan's page-term pass, then the tile kernel. The
pools are built on the device (bench_centred_targets.centred_pool: random valid residual pages plus a bf16
centre per page). Launch order: decode pass, decode scores, (select kernels), prefill pass, prefill scores.
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import make_queries, timing_pool
from bench_centred_targets import PLAIN, centred_pool

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.scores.triton import index_scores_triton
from dsakit.ops.topk.decode import index_topk_decode, plan_decode_topk


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--format", default="fp8-centred", choices=sorted(PLAIN))
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--b", type=int, default=64)
    ap.add_argument("--t", type=int, default=1024)
    args = ap.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
