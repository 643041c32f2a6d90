"""How often the streaming select's sampled threshold sends a row to the exact whole-row passes when scores
come in runs of similar values, by sample layout (CPU only, no GPU, seconds).

Rows: each 64-entry page carries an offset drawn with standard deviation ``sigma`` (in units of the entries'
own spread), like the page term of the centred formats or the locality of neighbouring tokens:
``score = sigma * N(0, 1)[page] + N(0, 1)[entry]``. For each launch shape the script reproduces, in torch,
what decides the path in the kernels (``dsakit/ops/indexer/_select_kernels.py``): the sample positions of
``_sample_threshold`` for a sample group size, the sample rank m + MARGIN sqrt(m) + 2, the candidates above the
threshold, and each lane's count against its buffer (split s streams the tiles s, s + splits, ... of
lanes * v entries; lane l owns entries l * v .. l * v + v - 1 of each tile). A row takes the exact passes when a lane overflows or fewer than k entries pass.
``--check`` runs the real select (Triton interpreter: TRITON_INTERPRET=1) on a few rows of one case and
compares its path counts with the emulation's, row by row.

    PYTHONPATH=. python3 benchmarks/tools/select_sample_groups.py [--rows 1000] [--out DIR]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/tools/select_sample_groups.py --check   # ~3 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

from dsakit.ops.indexer.config import SelectConfig, StreamConfig

SIGMAS = (0.0, 0.5, 1.0, 3.0)
# (name, rows of the launch, entries per row, k, filter of the launch)
CASES = [("decode 64 x 65536", 64, 65536, 2048, "thread"), ("decode 64 x 131072", 64, 131072, 2048, "thread"),
         ("prefill 8192 x 65536, warp filter", 8192, 65536, 2048, "warp"),
         ("prefill 8192 x 65536, thread filter", 8192, 65536, 2048, "thread")]


def clustered_rows(rows: int, n: int, sigma: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    page = torch.randn(rows, -(-n // 64), generator=g) * sigma
    return (page.repeat_interleave(64, dim=1)[:, :n] + torch.randn(rows, n, generator=g)).contiguous()


def sample_positions(n: int, sample: int, group: int, offsets: bool) -> torch.Tensor:
    """The kernel's sample positions (offsets=True); offsets=False: the layout before session 8 (groups of
    ``group`` at the start of each slice)."""
    lane = torch.arange(sample)
    groups = sample // group
    g = lane // group
    pos = g * n // groups + lane % group
    if offsets:
        pos = pos + (g * 7 * group) % (max(n // groups - group, 0) + 1)
    return pos


def exact_rows(scores: torch.Tensor, k: int, cfg: StreamConfig, offsets: bool = True) -> torch.Tensor:
    """bool [rows]: which rows the kernels would send to the exact passes (continuous scores: no ties)."""
    rows, n = scores.shape
    m = cfg.sample * k / n
    rank = int(m + cfg.sample_margin * math.sqrt(m) + 1.0) + 1
    thr = scores[:, sample_positions(n, cfg.sample, cfg.sample_group, offsets)].topk(rank, dim=1).values[:, -1:]
    above = scores > thr
    i = torch.arange(n)
    # split s streams tiles s, s + splits, ... of lanes * v entries (both filters); lane l owns the v entries
    # l * v .. l * v + v - 1 of each tile
    tile = cfg.lanes * cfg.v
    lane = ((i // tile) % cfg.splits) * cfg.lanes + (i % tile) // cfg.v
    counts = torch.zeros(rows, cfg.splits * cfg.lanes, dtype=torch.long)
    counts.scatter_add_(1, lane.expand(rows, n), above.long())
    return (counts > cfg.lane_cap).any(1) | (above.sum(1) < k)


def layouts(cfg: StreamConfig) -> dict[str, tuple[StreamConfig, bool]]:
    return {"groups of 32 (before)": (dataclasses.replace(cfg, sample_group=32), False),
            "groups of 8, walking offset (default)": (dataclasses.replace(cfg, sample_group=8), True),
            "single entries, walking offset": (dataclasses.replace(cfg, sample_group=1), True)}


def emulate(rows: int) -> list[dict]:
    out = []
    for name, launch_rows, n, k, filt in CASES:
        cfg = SelectConfig(stream_filter=filt).stream_for(launch_rows, n, k)
        for sigma in SIGMAS:
            scores = clustered_rows(rows, n, sigma, seed=int(10 * sigma))
            row = {"case": name, "sigma": sigma, "rows": rows, "splits": cfg.splits, "lanes": cfg.lanes,
                   "v": cfg.v, "sample": cfg.sample, "lane_cap": cfg.lane_cap}
            for label, (layout, offsets) in layouts(cfg).items():
                row[label] = float(exact_rows(scores, k, layout, offsets).float().mean())
            print(row, flush=True)
            out.append(row)
    return out


def check(rows: int) -> bool:
    """The real select (interpreter) against the emulation: decode-like launch, sigma 3, groups of 8 and 32."""
    from dsakit.ops.indexer.select import SelectBuffers, launch_stream_select

    n, k, ok = 65536, 2048, True
    scores = clustered_rows(rows, n, 3.0, seed=30)
    counts = torch.full((rows,), n, dtype=torch.int32)
    base = SelectConfig().stream_for(64, n, k)  # the decode launch of 64 rows, run on fewer rows
    for group in (8, 32):
        cfg = dataclasses.replace(base, sample_group=group)
        buffers = SelectBuffers.allocate(rows, n, k, "cpu", cfg)
        out = torch.empty((rows, k), dtype=torch.int32)
        launch_stream_select(scores, counts, out, k, True, buffers)
        kernel = buffers.path_counts(rows)["exact"]
        emulated = int(exact_rows(scores, k, cfg).sum())
        exact_values = bool(torch.equal(torch.gather(scores, 1, out.long()), scores.topk(k, dim=1).values))
        print({"sample_group": group, "kernel_exact_rows": kernel, "emulated_exact_rows": emulated,
               "selection_exact": exact_values}, flush=True)
        ok &= kernel == emulated and exact_values
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1000, help="rows per case and sigma")
    ap.add_argument("--check", action="store_true", help="the interpreter cross-check instead (16 rows)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.check:
        return 0 if check(16) else 1
    rows = emulate(args.rows)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"what": "fraction of rows the kernels' path decision sends to the exact whole-row passes, "
                        "reproduced in torch on the CPU", "timing": "none: no kernel is timed (CPU emulation)",
                "rows_per_case": args.rows, "torch": torch.__version__}
        (args.out / "select_sample_groups.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
