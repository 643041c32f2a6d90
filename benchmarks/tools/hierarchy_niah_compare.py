"""Needle recall of each hierarchical rule against the flat top-k, from benchmarks/tools/hierarchy_niah_tiny.sh's runs.

Reads ``ROOT/<rule>/<format>_k<topk>/results.jsonl`` (``dsakit niah`` rows) and pairs every row of a rule with
the flat run's row of the same cell (length, depth, trial) holding the same needle code (the niah seed being
fixed, that is the same prompt). Per (rule, format, top-k, length): needles found by the flat top-k and by the rule over the paired
cells (found = niah's ``found`` is true; "unscored" = niah left it unscored: the answer ran into max_tokens,
not the needle), and how many answers are the same text. Writes ``ROOT/compare.md`` and ``ROOT/compare.json``.

    python benchmarks/tools/hierarchy_niah_compare.py benchmarks/results/hierarchy/niah_tiny_<commit>
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

FORMATS = ("bf16", "fp8", "fp8-centred", "fp4", "fp4-centred")
RUN = re.compile(r"^(?P<fmt>[a-z0-9-]+)_k(?P<k>\d+)$")


def load(rule_dir: Path) -> dict:
    """{(format, k): {cell: row}} of one rule's runs."""
    runs = {}
    for path in sorted(rule_dir.glob("*/results.jsonl")):
        match = RUN.match(path.parent.name)
        if match:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            runs[(match["fmt"], int(match["k"]))] = {row["cell"]: row for row in rows}
    return runs


def compare(root: Path) -> list[dict]:
    flat = load(root / "flat")
    out = []
    for rule_dir in sorted(p for p in root.iterdir() if p.is_dir() and p.name != "flat"):
        for (fmt, k), rows in sorted(load(rule_dir).items(), key=lambda x: (FORMATS.index(x[0][0]), x[0][1])):
            base = flat.get((fmt, k), {})
            by_length = defaultdict(lambda: {"cells": 0, "flat_found": 0, "found": 0, "unscored": 0, "same_answer": 0})
            for cell, row in rows.items():
                codes = [n["code"] for n in row["needles"]]
                if cell not in base or [n["code"] for n in base[cell]["needles"]] != codes:
                    continue  # paired only on the very same needle (and so the same prompt)
                stats = by_length[row["length"]]
                stats["cells"] += 1
                stats["flat_found"] += int(base[cell]["found"] is True)
                stats["found"] += int(row["found"] is True)
                stats["unscored"] += int(row["found"] is None)  # niah: the answer ran into max_tokens
                stats["same_answer"] += int(base[cell]["answer"] == row["answer"])
            for length, stats in sorted(by_length.items()):
                out.append({"rule": rule_dir.name, "format": fmt, "topk": k, "length": length, **stats})
    return out


def table(rows: list[dict]) -> str:
    lines = ["| rule | format | top-k | length | cells | found flat | found rule | rule unscored | same answer |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rule']} | {r['format']} | {r['topk']} | {r['length']} | {r['cells']} | "
                     f"{r['flat_found']} | {r['found']} | {r['unscored']} | {r['same_answer']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        sys.exit("usage: python benchmarks/tools/hierarchy_niah_compare.py ROOT (a directory holding flat/ and the rules)")
    root = Path(argv[0])
    rows = compare(root)
    (root / "compare.json").write_text(json.dumps(rows, indent=1) + "\n")
    (root / "compare.md").write_text(table(rows))
    print(table(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
