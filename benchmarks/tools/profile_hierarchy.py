"""Kernel-time breakdown of hierarchical top-k (torch.profiler, CUDA): decode B 64 x N 131072 and prefill
T 8192 x N 131072, fp8 keys with fp8 q, K 2048, default HierarchyConfig. Writes DIR/profile_hierarchy_<commit>.txt.

    PYTHONPATH=$PWD python3 benchmarks/tools/profile_hierarchy.py --out DIR --commit C
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _common import make_queries, timing_pool  # noqa: E402
from bench_hierarchy import device_summaries  # noqa: E402

from dsakit import PagedBatch  # noqa: E402
from dsakit.formats import KeyFormat  # noqa: E402
from dsakit.ops.indexer import HierarchyConfig  # noqa: E402
from dsakit.ops.indexer.hierarchy import hierarchical_topk_triton  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--commit", required=True)
    args = ap.parse_args()
    fmt = KeyFormat.parse("fp8")
    lines = []
    for case, b, t, n in (("decode", 64, 64, 131072), ("prefill", 1, 8192, 131072)):
        pool, table, counts = timing_pool(fmt, [n] * b, "cuda", seed=11)
        seq = torch.arange(b, device="cuda", dtype=torch.int32).repeat_interleave(t // b)
        q, w, qs = make_queries("fp8", t, 64, "cuda", seed=12)
        batch = PagedBatch.build(pool, fmt, table, counts, seq)
        summaries = device_summaries(pool, fmt)
        config = HierarchyConfig()

        def step():
            return hierarchical_topk_triton(q, w, batch, 2048, config, summaries, q_scale=qs)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        lines.append(f"== {case}: B {b}, T {t}, N {n}, fp8, K 2048, 5 calls ==")
        lines.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
        del pool, batch, summaries
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    Path(args.out, f"profile_hierarchy_{args.commit}.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
