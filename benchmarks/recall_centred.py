"""Recall horizon of the page-centred key formats against the plain ones, and where centring stops mattering.

Two measurements with the recall lab's horizon (reference backend, CPU; see docs/recall.md):

1. lab defaults (deepseek-v4-flash, shared ratio 100, needle strength 5, ...), every format of ``--formats``,
   top-k of ``--topks``: the longest context (tokens, up to ``--horizon-max``) at which the needle is found
   in >= 99% of ``--trials`` trials;
2. a sweep of the shared-to-noise ratio |mu| / |z| (``--ratios``) at top-``--sweep-topk`` for the plain and
   centred fp8 / fp4 formats, ``--sweep-trials`` trials per probed length: where the plain formats lose
   their reach and the centred ones keep it, and below which ratio centring changes nothing.

    python benchmarks/recall_centred.py --out benchmarks/results/recall_centred
    python benchmarks/recall_centred.py --horizon-max 4096 --trials 25 --ratios 1,100 --out /tmp/rc  # smoke

Writes DIR/horizon.json, DIR/shared_ratio_sweep.json and DIR/summary.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dsakit.recall.horizon import recall_horizon  # noqa: E402
from dsakit.recall.settings import RecallSettings  # noqa: E402
from dsakit.recall.synthetic import SyntheticConfig  # noqa: E402


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cell(row: dict) -> str:
    if row["status"] == "below-min":
        return f"< {row['grid_min']}"
    if row["status"] == "at-max":
        return f">= {row['horizon_tokens']}"
    return str(row["horizon_tokens"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--formats", default="bf16,fp8,fp4,fp8-centred,fp4-centred")
    parser.add_argument("--topks", default="512", help="top-k values of the default-settings horizon")
    parser.add_argument("--trials", type=int, default=200, help="trials per probed length (defaults table)")
    parser.add_argument("--horizon-max", type=int, default=65536)
    parser.add_argument("--ratios", default="1,3,10,30,100,300", help="shared-to-noise ratios of the sweep")
    parser.add_argument("--sweep-formats", default="fp8,fp8-centred,fp4,fp4-centred")
    parser.add_argument("--sweep-topk", type=int, default=512)
    parser.add_argument("--sweep-trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    meta = {"commit": _commit(), "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "backend": "reference", "device": "cpu"}

    formats = tuple(args.formats.split(","))
    t0 = time.perf_counter()
    settings = RecallSettings(formats=formats, horizon_topks=_ints(args.topks), horizon_trials=args.trials,
                              horizon_max=args.horizon_max, seed=args.seed)
    rows, points = recall_horizon(settings)
    horizon = {"meta": meta, "settings": settings.as_dict(), "seconds": time.perf_counter() - t0,
               "horizon": rows, "points": points}
    (out / "horizon.json").write_text(json.dumps(horizon, indent=1, sort_keys=True))

    sweep_rows = []
    sweep_formats = tuple(args.sweep_formats.split(","))
    t1 = time.perf_counter()
    for ratio in _floats(args.ratios):
        config = dataclasses.replace(SyntheticConfig(), shared_ratio=ratio)
        s = RecallSettings(config=config, formats=sweep_formats, horizon_topks=(args.sweep_topk,),
                           horizon_trials=args.sweep_trials, horizon_max=args.horizon_max, seed=args.seed)
        for row in recall_horizon(s)[0]:
            sweep_rows.append({"shared_ratio": ratio, **row})
        print(f"shared ratio {ratio}: done ({time.perf_counter() - t1:.0f} s)", flush=True)
    sweep = {"meta": meta, "topk": args.sweep_topk, "trials": args.sweep_trials, "horizon_max": args.horizon_max,
             "seconds": time.perf_counter() - t1, "rows": sweep_rows}
    (out / "shared_ratio_sweep.json").write_text(json.dumps(sweep, indent=1, sort_keys=True))

    lines = [f"# Recall horizon of the page-centred key formats (commit {meta['commit']}, CPU reference backend)", "",
             f"Lab defaults (SyntheticConfig()), found in >= 99% of {args.trials} trials, context searched "
             f"{settings.horizon_min}..{args.horizon_max} tokens:", "",
             "| format | " + " | ".join(f"top-{k}" for k in _ints(args.topks)) + " |",
             "|---|" + "---|" * len(_ints(args.topks))]
    for f in formats:
        cells = [_cell(r) for r in rows if r["format"] == f]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    ratios = _floats(args.ratios)
    lines += ["", f"Shared-to-noise ratio sweep (|mu| / |z| of the pooled keys), top-{args.sweep_topk}, "
              f"{args.sweep_trials} trials per length:", "",
              "| format | " + " | ".join(f"ratio {r:g}" for r in ratios) + " |", "|---|" + "---|" * len(ratios)]
    for f in sweep_formats:
        cells = [_cell(r) for ratio in ratios for r in sweep_rows if r["format"] == f and r["shared_ratio"] == ratio]
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    lines += ["", "Synthetic keys (the lab's model of a shared key component), not a trained model: see "
              "docs/formats-centred.md.", ""]
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return {"horizon": horizon, "sweep": sweep}


if __name__ == "__main__":
    main()
