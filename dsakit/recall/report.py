"""Outputs of the recall lab: per-run console lines, rich tables, the JSONL file and the PNG heatmap."""

from __future__ import annotations

import json
import math
import platform
import statistics
import subprocess
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

from rich.table import Table

from .faults import FAULTS

JSONL_NAME = "runs.jsonl"
HEATMAP_NAME = "heatmap.png"


# --------------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------------


def git_commit(cwd: "str | Path | None" = None) -> str:
    """HEAD commit of the dsakit checkout (``unknown`` outside git), with ``-dirty`` if files changed."""
    where = Path(cwd) if cwd else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    import torch

    import dsakit

    out = {"dsakit": dsakit.__version__, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "not installed"
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
    return out


# --------------------------------------------------------------------------------------------------
# Console
# --------------------------------------------------------------------------------------------------


def _fmt_rank(rank) -> str:
    return "-" if rank is None else str(rank)


def _fmt_float(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_run_line(rec: dict) -> str:
    """One line per run: ``fmt=fp8       ctx_tok=  4096 depth=0.25 needle_rank=   37 found=True  ...``."""
    line = (f"fmt={rec['format']:<9} ctx_tok={rec['context_tokens']:>6} depth={rec['depth']:.2f} "
            f"needle_rank={_fmt_rank(rec['needle_rank']):>5} found={str(rec['found']):<5} "
            f"exact_rank={_fmt_rank(rec['exact_rank']):>4} set_recall={rec['set_recall']:.3f} "
            f"margin={_fmt_float(rec['margin'], '+.2f'):>6} k={rec['index_topk']}")
    if rec.get("fault", "none") != "none":
        line = f"fault={rec['fault']:<20} " + line
    return line


def _cell_color(fraction: float) -> str:
    return "green" if fraction >= 0.99 else ("yellow" if fraction >= 0.5 else "red")


def summary_table(records: Sequence[dict], topk: int) -> Table:
    """Found count per format (rows) and context length (columns) for one top-k, plus the worst rank."""
    runs = [r for r in records if r["kind"] == "run" and r["index_topk"] == topk]
    formats = list(dict.fromkeys(r["format"] for r in runs))
    contexts = sorted({r["context_tokens"] for r in runs})
    table = Table(title=f"needle found (all depths and trials), index_topk={topk}")
    table.add_column("format")
    for c in contexts:
        table.add_column(f"{c} tok", justify="right")
    table.add_column("worst rank", justify="right")
    table.add_column("mean set recall", justify="right")
    for f in formats:
        cells = []
        for c in contexts:
            group = [r for r in runs if r["format"] == f and r["context_tokens"] == c]
            found = sum(r["found"] for r in group)
            frac = found / len(group) if group else 0.0
            cells.append(f"[{_cell_color(frac)}]{found}/{len(group)}[/]")
        mine = [r for r in runs if r["format"] == f]
        ranks = [r["needle_rank"] for r in mine if r["needle_rank"] is not None]
        recall = statistics.fmean(r["set_recall"] for r in mine) if mine else math.nan
        table.add_row(f, *cells, str(max(ranks)) if ranks else "-", f"{recall:.3f}")
    return table


def horizon_label(row: dict) -> str:
    if row["status"] == "below-min":
        return f"< {row['grid_min']}"
    if row["status"] == "at-max":
        return f">= {row['grid_max']}"
    return str(row["horizon_tokens"])


def horizon_table(rows: Sequence[dict]) -> Table:
    """Recall horizon (tokens) per format (rows) and top-k (columns)."""
    ks = sorted({r["index_topk"] for r in rows})
    formats = list(dict.fromkeys(r["format"] for r in rows))
    quantile = rows[0]["quantile"] if rows else 0.99
    trials = rows[0]["trials"] if rows else 0
    table = Table(title=f"recall horizon: longest context (tokens) with the needle found in >= {quantile:.0%} of "
                        f"{trials} trials")
    table.add_column("format")
    for k in ks:
        table.add_column(f"top-{k}", justify="right")
    by_key = {(r["format"], r["index_topk"]): r for r in rows}
    for f in formats:
        table.add_row(f, *[horizon_label(by_key[(f, k)]) if (f, k) in by_key else "-" for k in ks])
    return table


def fault_table(records: Sequence[dict]) -> Table:
    """One row per (fault, format): what the fault did to the runs, and the signature to look for."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        if r["kind"] == "fault":
            groups[(r["fault"], r["format"])].append(r)
    table = Table(title="fault injection (docs/spec.md §5): one convention changed, exact path always correct")
    for name, justify in (("fault", "left"), ("format", "left"), ("found", "right"), ("needle ranks", "right"),
                          ("exact ranks", "right"), ("set recall", "right"), ("margin", "right"),
                          ("needle score x", "right"), ("NaN", "right"), ("leaked", "right")):
        table.add_column(name, justify=justify, overflow="fold")
    for (fault, fmt), group in groups.items():
        found = sum(r["found"] for r in group)
        margins = [r["margin"] for r in group if r["margin"] is not None]
        ratios = [r["needle_score_ratio"] for r in group if r["needle_score_ratio"] is not None]
        table.add_row(
            fault, fmt, f"[{_cell_color(found / len(group))}]{found}/{len(group)}[/]",
            " ".join(_fmt_rank(r["needle_rank"]) for r in group),
            " ".join(_fmt_rank(r["exact_rank"]) for r in group),
            f"{statistics.fmean(r['set_recall'] for r in group):.3f}",
            f"{statistics.median(margins):+.2f}" if margins else "-",
            f"{statistics.median(ratios):.3g}" if ratios else "-",
            f"{max(r['nan_fraction'] for r in group):.2%}",
            str(sum(r["leaked"] for r in group)),
        )
    return table


def fault_signatures(records: Sequence[dict]) -> list[str]:
    """One line per fault present in the records: its name, what it changes and the signature to look for."""
    names = list(dict.fromkeys(r["fault"] for r in records if r["kind"] == "fault"))
    return [f"{name}: {FAULTS[name].description}. Signature: {FAULTS[name].signature}." for name in names
            if name in FAULTS and name != "none"]


# --------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------


def json_safe(value):
    """JSON-safe copy: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class RunWriter:
    """Writes records to a JSONL file as they finish (one line each, flushed), so a run that fails later
    keeps every finished record. Opening it creates the folder and truncates the file: a bad output
    location fails before any work, with a ValueError naming the path.

    >>> with RunWriter(out / JSONL_NAME, common) as writer:
    ...     writer.write(record)
    """

    def __init__(self, path: "str | Path", common: dict):
        self.path = Path(path)
        self.common = common
        folder = self.path.parent
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"output folder {str(folder)!r} is a file: choose a folder for --out")
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("w", encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot write {str(self.path)!r}: {exc.strerror or exc}") from None
        self.count = 0

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(json_safe({**record, **self.common}), sort_keys=True) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "RunWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_jsonl(path: "str | Path", records: Iterable[dict], common: dict) -> Path:
    """One JSON object per line: every record merged with ``common`` (seed, versions, commit, settings)."""
    with RunWriter(path, common) as writer:
        for rec in records:
            writer.write(rec)
    return writer.path


def read_jsonl(path: "str | Path") -> list[dict]:
    with Path(path).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def plot_heatmap(records: Sequence[dict], path: "str | Path", topks: Sequence[int] | None = None) -> Path:
    """PNG heatmap: found fraction by needle depth (rows) x context length (columns), one panel per format
    (columns of panels) and top-k (rows of panels), red = lost, yellow = sometimes, green = found."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in records if r["kind"] == "run"]
    if not runs:
        raise ValueError("no run records to plot")
    topks = sorted({r["index_topk"] for r in runs}) if topks is None else list(topks)
    formats = list(dict.fromkeys(r["format"] for r in runs))
    contexts = sorted({r["context_tokens"] for r in runs})
    depths = sorted({r["depth"] for r in runs})
    fig, axes = plt.subplots(len(topks), len(formats), squeeze=False,
                             figsize=(2.2 + 2.6 * len(formats), 0.8 + 0.45 * len(depths) * len(topks) + 0.6))
    try:  # pyplot keeps every open figure alive: close it on errors too
        return _draw_heatmap(fig, axes, runs, topks, formats, contexts, depths, Path(path))
    finally:
        plt.close(fig)


def _draw_heatmap(fig, axes, runs, topks, formats, contexts, depths, path: Path) -> Path:
    image = None
    for row, k in enumerate(topks):
        for col, f in enumerate(formats):
            ax = axes[row][col]
            grid = [[math.nan] * len(contexts) for _ in depths]
            ranks = [[""] * len(contexts) for _ in depths]
            for i, d in enumerate(depths):
                for j, c in enumerate(contexts):
                    group = [r for r in runs if r["format"] == f and r["index_topk"] == k
                             and r["context_tokens"] == c and r["depth"] == d]
                    if group:
                        grid[i][j] = sum(r["found"] for r in group) / len(group)
                        worst = [r["needle_rank"] for r in group if r["needle_rank"] is not None]
                        ranks[i][j] = str(max(worst)) if worst else "-"
            image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
            for i in range(len(depths)):
                for j in range(len(contexts)):
                    ax.text(j, i, ranks[i][j], ha="center", va="center", fontsize=6)
            ax.set_xticks(range(len(contexts)), [f"{c // 1024}K" if c % 1024 == 0 else str(c) for c in contexts],
                          fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths], fontsize=7)
            ax.set_title(f"{f}, top-{k}", fontsize=9)
            if col == 0:
                ax.set_ylabel("needle depth")
            if row == len(topks) - 1:
                ax.set_xlabel("context (tokens)")
    fig.colorbar(image, ax=axes, shrink=0.8, label="found fraction (cell text: worst needle rank)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
