"""The plain and the page-centred store of the same rows, one profiled launch each, for Nsight Compute.

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/tools/profile_store.py [--decode-rows 64] [--prefill-rows 16384]

Cases (those of bench_store.py --centred): a decode append of B rows (B sequences, one page each, filled to a
random level whose earlier entries, entry 0 included, are stored first) and a prefill chunk of N rows from
entry 0 of shuffled pages; fp8 then fp8-centred, then fp4 and fp4-centred. Everything before the profiled
launch (the earlier entries, one warm-up launch that compiles) runs outside the NVTX range "profile".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the bench_* scripts
from bench_store import _launch_v4, scattered_slots

from dsakit.formats import KeyFormat
from dsakit.transforms import RopeConfig


def case_inputs(case: str, size: int, g: torch.Generator):
    """(keys [n, 128] bf16, positions, slots, pages, prior slots or None), as bench_store.centred_timing_rows."""
    if case == "prefill":
        pages = -(-size // 64)
        slots, prior = scattered_slots(size, pages, g), None
        positions = torch.arange(size, device="cuda") * 4
    else:
        pages = size
        fill = torch.randint(1, 64, (size,), generator=g, device="cuda")
        fill[::16] = 0
        page_ids = torch.randperm(pages, generator=g, device="cuda")
        slots, positions = page_ids * 64 + fill, fill * 4
        prior = page_ids[:, None] * 64 + torch.arange(64, device="cuda")[None, :]
        prior = torch.where(torch.arange(64, device="cuda")[None, :] < fill[:, None], prior, -1).reshape(-1)
    keys = torch.randn(size, 128, generator=g, device="cuda").to(torch.bfloat16)
    return keys, positions, slots, pages, prior


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode-rows", type=int, default=64)
    ap.add_argument("--prefill-rows", type=int, default=16384)
    args = ap.parse_args()
    table = RopeConfig(64, 160000.0).cos_sin_table(2**20).cuda()
    w = torch.rand(128, device="cuda") + 0.5
    for case, size in (("decode", args.decode_rows), ("prefill", args.prefill_rows)):
        keys, positions, slots, pages, prior = case_inputs(case, size, torch.Generator(device="cuda").manual_seed(size))
        for name in ("fp8", "fp8-centred", "fp4", "fp4-centred"):
            fmt = KeyFormat.parse(name)
            pool = torch.zeros(pages, fmt.page_bytes, dtype=torch.uint8, device="cuda")
            if prior is not None:
                _launch_v4(fmt, torch.randn(prior.numel(), 128, device="cuda").to(torch.bfloat16),
                           torch.zeros_like(prior), prior, pool, table, w)
            _launch_v4(fmt, keys, positions, slots, pool, table, w)  # compiles
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("profile")
            _launch_v4(fmt, keys, positions, slots, pool, table, w)
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
