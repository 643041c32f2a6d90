"""Combine the needle sweeps of models/tools/niah.sh into one table and one heatmap figure.

Reads ``RUNS/<format>_k<topk>/results.jsonl`` (``dsakit niah`` rows) and writes into ``--out``:

* ``table.md``: found fraction per (format, top-k) row and context length column (all depths and trials),
  plus the number of scored needles; needles cut by ``max_tokens`` count as not scored;
* ``table.json``: the same numbers, per depth as well;
* ``heatmaps.png``: one depth x length heatmap per (format, top-k).

    python models/tools/niah_report.py --runs models/dsakit-v4-tiny/eval/niah --out models/dsakit-v4-tiny/eval/niah
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

FORMAT_ORDER = ("bf16", "fp8", "fp8-ue8m0", "fp4", "fp4-rne", "fp8-centred", "fp4-centred")
RUN_NAME = re.compile(r"^(?P<fmt>[a-z0-9-]+)_k(?P<k>\d+)$")


def load_runs(root: Path) -> dict[tuple[str, int], list[dict]]:
    runs = {}
    for path in sorted(root.glob("*/results.jsonl")):
        match = RUN_NAME.match(path.parent.name)
        if not match:
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        runs[(match["fmt"], int(match["k"]))] = rows
    return runs


def order(key: tuple[str, int]):
    fmt, k = key
    return (FORMAT_ORDER.index(fmt) if fmt in FORMAT_ORDER else len(FORMAT_ORDER), fmt, k)


def summarise(rows: list[dict]) -> dict:
    """-> {"by_length": {L: [found, scored]}, "by_cell": {(L, depth): [found, scored]}}."""
    by_length: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    by_cell: dict[tuple[int, float], list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        for needle in row["needles"]:
            if needle["found"] is None:
                continue
            for acc in (by_length[row["length"]], by_cell[(row["length"], needle["depth"])]):
                acc[0] += bool(needle["found"])
                acc[1] += 1
    return {"by_length": dict(by_length), "by_cell": dict(by_cell)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    runs = load_runs(Path(args.runs))
    if not runs:
        print(f"no <format>_k<topk>/results.jsonl under {args.runs}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    keys = sorted(runs, key=order)
    summaries = {key: summarise(runs[key]) for key in keys}
    lengths = sorted({n for s in summaries.values() for n in s["by_length"]})
    depths = sorted({d for s in summaries.values() for (_, d) in s["by_cell"]})
    header = "| index keys | top-k | " + " | ".join(f"{n} tok" for n in lengths) + " | all |"
    lines = [header, "|" + "---|" * (len(lengths) + 3)]
    table = []
    for key in keys:
        s = summaries[key]
        cells = []
        total = [0, 0]
        for n in lengths:
            found, scored = s["by_length"].get(n, [0, 0])
            total[0] += found
            total[1] += scored
            cells.append(f"{found / scored:.2f} ({found}/{scored})" if scored else "-")
        all_cell = f"{total[0] / total[1]:.2f} ({total[0]}/{total[1]})" if total[1] else "-"
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(cells) + f" | {all_cell} |")
        table.append({"format": key[0], "topk": key[1],
                      "by_length": {str(n): v for n, v in s["by_length"].items()},
                      "by_cell": {f"{n}@{d}": v for (n, d), v in s["by_cell"].items()}})
    (out / "table.md").write_text("found fraction (found / scored needles) per context length, all depths and "
                                  "trials\n\n" + "\n".join(lines) + "\n")
    (out / "table.json").write_text(json.dumps(table, indent=1) + "\n")
    print("\n".join(lines))
    plot(keys, summaries, lengths, depths, out / "heatmaps.png")
    return 0


def plot(keys, summaries, lengths, depths, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    topks = sorted({k for _, k in keys})
    formats = sorted({f for f, _ in keys}, key=lambda f: order((f, 0)))
    fig, axes = plt.subplots(len(topks), len(formats), figsize=(2.6 * len(formats), 2.4 * len(topks)),
                             squeeze=False)
    for r, k in enumerate(topks):
        for c, fmt in enumerate(formats):
            ax = axes[r][c]
            grid = np.full((len(depths), len(lengths)), np.nan)
            s = summaries.get((fmt, k))
            if s is not None:
                for (n, d), (found, scored) in s["by_cell"].items():
                    if scored:
                        grid[depths.index(d), lengths.index(n)] = found / scored
            ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
            for i in range(len(depths)):
                for j in range(len(lengths)):
                    if not np.isnan(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
            ax.set_title(f"{fmt}, top-{k}", fontsize=8)
            if c == 0:
                ax.set_ylabel("needle depth", fontsize=7)
            if r == len(topks) - 1:
                ax.set_xlabel("context (tokens)", fontsize=7)
    fig.suptitle("dsakit-v4-tiny: passkey found fraction (dsakit niah against dsakit serve)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
