"""Sparse-attention calls to run under Nsight Compute: the prefill and decode shapes of the FlashMLA targets.

    ncu --clock-control none -k regex:"attention" -c 4 --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/tools/profile_attention.py [--kernel auto|triton]

prefill: T 4096 queries, Hq 128, head dim 512, K 2048 random slots of an 8192-token bf16 pool, sink on (the
550 TFLOP/s target's shape); decode: B 64, next_n 1, K 2048 slots of each query's own 8192-token sequence,
bf16 and fp8-rope-bf16 pools. Inputs come from bench_attention.py's builders; one warm-up call per shape
compiles the kernels, then one profiled call each, in the order prefill bf16, decode bf16, decode fp8.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the bench_* scripts
from bench_attention import FORMATS, decode_inputs, prefill_inputs, run_kernel


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="auto", choices=("auto", "triton"),
                    help="auto: Gluon for bf16 pools on sm_90 (the H200 default), triton: the portable kernel")
    ap.add_argument("--heads", type=int, default=128)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(5)
    cases = [(FORMATS["bf16"], prefill_inputs(FORMATS["bf16"], args.heads, 2048, gen))]
    for name in ("bf16", "fp8-rope-bf16"):
        fmt = FORMATS[name]
        cases.append((fmt, decode_inputs(fmt, args.heads, 64, 1, gen)))
    for fmt, (q, pool, idx, sink) in cases:
        run_kernel(q, pool, fmt, idx, sink, kernel=args.kernel)  # compile, outside the profiled launch
        torch.cuda.synchronize()
        run_kernel(q, pool, fmt, idx, sink, kernel=args.kernel)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
