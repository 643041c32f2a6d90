"""Output of a sweep: per-cell lines, the found-rate summary table and the depth x length heatmap PNG.

Per-cell line (one per needle; multi-needle cells print one line per needle with that needle's depth)::

      lines= 300 depth=0.05 prompt_tok= 4509 found=True  finish=stop ans='ZEBRA-4492-OMEGA'

``found`` is True, False, or None (cut by a ``length`` stop before the code appeared: not scored).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ANSWER_CHARS = 80


def depth_label(depth: float) -> str:
    return "START" if depth < 1 / 3 else ("MIDDLE" if depth < 2 / 3 else "END")


def _answer(text: str) -> str:
    text = (text or "").strip()
    return text if len(text) <= ANSWER_CHARS else text[: ANSWER_CHARS - 3] + "..."


def needle_line(row: dict, needle: dict) -> str:
    """The per-cell line of one needle of a row."""
    tokens = row.get("prompt_tokens")
    tok = f"{tokens:5d}" if isinstance(tokens, int) else "    ?"
    found = str(needle.get("found"))
    return (f"  lines={row['lines']:4d} depth={needle['depth']:.2f} prompt_tok={tok} found={found:<5} "
            f"finish={row.get('finish')} ans={_answer(row.get('answer', ''))!r}")


def cell_lines(row: dict) -> list[str]:
    return [needle_line(row, n) for n in row["needles"]]


def grouped_report(rows: list[dict]) -> list[str]:
    """All rows as per-cell lines under '=== needle at ... ===' headers, lengths ascending in each group."""
    out: list[str] = []
    single = [r for r in rows if not r.get("multi")]
    multi = [r for r in rows if r.get("multi")]
    groups: dict[tuple[float, int], list[dict]] = defaultdict(list)
    for r in single:
        groups[(r["depths"][0], r["trial"])].append(r)
    trials = {t for _, t in groups}
    for (depth, trial) in sorted(groups):
        suffix = f", trial {trial}" if len(trials) > 1 else ""
        out.append(f"=== needle at {depth_label(depth)} (depth {depth:.2f}), distinct filler, sweep length{suffix} ===")
        for r in sorted(groups[(depth, trial)], key=lambda r: r["length"]):
            out.extend(cell_lines(r))
    by_trial: dict[int, list[dict]] = defaultdict(list)
    for r in multi:
        by_trial[r["trial"]].append(r)
    for trial in sorted(by_trial):
        first = by_trial[trial][0]
        depths = ", ".join(f"{d:.2f}" for d in first["depths"])
        suffix = f", trial {trial}" if len(by_trial) > 1 else ""
        out.append(f"=== {len(first['depths'])} needles at depths {depths} (multi-needle), distinct filler, "
                   f"sweep length{suffix} ===")
        for r in sorted(by_trial[trial], key=lambda r: r["length"]):
            out.extend(cell_lines(r))
            out.append(f"    -> {r['found_count']}/{len(r['needles'])} needles found")
    return out


def found_matrix(rows: list[dict]) -> tuple[list[int], list[float], dict[tuple[float, int], tuple[int, int, int]]]:
    """(lengths, depths, {(depth, length): (found, scored, unknown)}) over every needle of every row."""
    stats: dict[tuple[float, int], list[int]] = defaultdict(lambda: [0, 0, 0])
    for r in rows:
        for n in r["needles"]:
            s = stats[(n["depth"], r["length"])]
            if n["found"] is None:
                s[2] += 1
            else:
                s[1] += 1
                s[0] += int(bool(n["found"]))
    lengths = sorted({k[1] for k in stats})
    depths = sorted({k[0] for k in stats})
    return lengths, depths, {k: tuple(v) for k, v in stats.items()}


def _rate(found: int, scored: int, unknown: int) -> str:
    if scored == 0:
        return "cut" if unknown else "-"
    text = f"{100 * found / scored:.0f}%"
    return text + "*" if unknown else text


def summary_table(rows: list[dict], title: str = "") -> str:
    """Plain-text table: found rate per depth (rows) and length in tokens (columns), plus totals."""
    lengths, depths, stats = found_matrix(rows)
    if not rows:
        return "no finished cells"
    width = max(7, *(len(str(n)) + 1 for n in lengths))
    head = f"{'depth':>7} |" + "".join(f"{n:>{width}}" for n in lengths) + f" | {'all':>6}"
    lines = [title] if title else []
    lines += ["found rate per needle depth (rows) x context length in tokens (columns)", head, "-" * len(head)]
    for d in depths:
        cells = [stats.get((d, n), (0, 0, 0)) for n in lengths]
        total = tuple(sum(c[i] for c in cells) for i in range(3))
        lines.append(f"{d:>7.2f} |" + "".join(f"{_rate(*c):>{width}}" for c in cells) + f" | {_rate(*total):>6}")
    lines.append("-" * len(head))
    cols = [tuple(sum(stats.get((d, n), (0, 0, 0))[i] for d in depths) for i in range(3)) for n in lengths]
    grand = tuple(sum(c[i] for c in cols) for i in range(3))
    lines.append(f"{'all':>7} |" + "".join(f"{_rate(*c):>{width}}" for c in cols) + f" | {_rate(*grand):>6}")
    unknown = grand[2]
    if unknown:
        lines.append(f"* {unknown} needle(s) cut by finish_reason=length before the code appeared: not scored "
                     f"(raise --max-tokens)")
    return "\n".join(lines)


def write_heatmap(rows: list[dict], path: "str | Path", title: str = "") -> Path:
    """PNG heatmap of the found rate, depth (y, top = start) x length (x), like the standard needle test."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths, depths, stats = found_matrix(rows)
    if not lengths:
        raise ValueError("no rows to draw")
    grid = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            found, scored, _ = stats.get((d, n), (0, 0, 0))
            if scored:
                grid[i, j] = found / scored
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.2 + 0.45 * len(depths)), dpi=110)
    try:  # pyplot keeps every open figure alive: close it on errors too
        return _draw_heatmap(fig, ax, grid, lengths, depths, title, Path(path))
    finally:
        plt.close(fig)


def _draw_heatmap(fig, ax, grid, lengths: list[int], depths: list[float], title: str, path: Path) -> Path:
    import matplotlib
    import numpy as np

    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#cccccc")  # grey = no scored needle
    image = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45, ha="right")
    ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0%}", ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, label="found rate")
    ax.set_title(title or "needle in a haystack", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path
