"""Output of a sweep: per-cell lines, the found-rate summary table and the depth x length heatmap PNG.

Per-cell line (one per needle; multi-needle cells print one line per needle with that needle's depth)::

      lines= 300 depth=0.05 prompt_tok= 4509 found=True  finish=stop ans='ZEBRA-4492-OMEGA'

``found`` is True, False, or None (cut by a ``length`` stop before the code appeared: not scored).

The summary table and the heatmap cover the whole requested grid (:class:`RequestedGrid`), not only the cells
that have rows: a needle whose cell has no row (failed, or not run yet) is *missing*, counted as not found in
every rate (so a partial run never reads better than it is) and marked ``!``; a (depth, length) with no row at
all reads ``miss`` (hatched on the heatmap), one whose needles were all cut by ``max_tokens`` reads ``cut``
(grey).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
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


@dataclass(frozen=True)
class RequestedGrid:
    """The grid a sweep asked for: every (depth, length) expects ``trials`` needles (single- and multi-needle)."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int


Stats = tuple[int, int, int, int]  # (found, scored, unknown = cut by max_tokens, missing = no row)


def found_matrix(rows: list[dict], grid: RequestedGrid | None = None
                 ) -> tuple[list[int], list[float], dict[tuple[float, int], Stats]]:
    """(lengths, depths, {(depth, length): (found, scored, unknown, missing)}) over every needle of every row.

    With ``grid`` the axes are the requested lengths and depths (plus any a row adds) and ``missing`` counts the
    needles the grid expects that no row holds; without it the axes come from the rows and nothing is missing."""
    stats: dict[tuple[float, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for r in rows:
        for n in r["needles"]:
            s = stats[(n["depth"], r["length"])]
            if n["found"] is None:
                s[2] += 1
            else:
                s[1] += 1
                s[0] += int(bool(n["found"]))
    lengths = {k[1] for k in stats}
    depths = {k[0] for k in stats}
    if grid is not None:
        lengths |= set(grid.lengths)
        depths |= set(grid.depths)
        for d in grid.depths:
            for n in grid.lengths:
                s = stats[(d, n)]
                s[3] = max(0, grid.trials - s[1] - s[2])
    return sorted(lengths), sorted(depths), {k: tuple(v) for k, v in stats.items()}


def cell_label(found: int, scored: int, unknown: int, missing: int) -> str:
    """Text of one table / heatmap cell: 'miss' (no row), 'cut' (all cut by max_tokens), '-' (nothing asked),
    else found / (scored + missing) in percent, '*' if some were cut, '!' if some are missing."""
    if scored == 0 and missing == 0:
        return "cut" if unknown else "-"
    if scored == 0 and unknown == 0:
        return "miss"
    text = f"{100 * found / (scored + missing):.0f}%"
    return text + ("*" if unknown else "") + ("!" if missing else "")


def _sum(stats: list[Stats]) -> Stats:
    return tuple(sum(s[i] for s in stats) for i in range(4))  # type: ignore[return-value]


def summary_table(rows: list[dict], title: str = "", grid: RequestedGrid | None = None) -> str:
    """Plain-text table: found rate per depth (rows) and length in tokens (columns), plus totals.

    With ``grid`` every requested (depth, length) has its cell, rows or not (see the module docstring)."""
    lengths, depths, stats = found_matrix(rows, grid)
    if not lengths:
        return "no finished cells"
    empty = (0, 0, 0, 0)
    width = max(7, *(len(str(n)) + 1 for n in lengths))
    head = f"{'depth':>7} |" + "".join(f"{n:>{width}}" for n in lengths) + f" | {'all':>6}"
    lines = [title] if title else []
    lines += ["found rate per needle depth (rows) x context length in tokens (columns)", head, "-" * len(head)]
    for d in depths:
        cells = [stats.get((d, n), empty) for n in lengths]
        lines.append(f"{d:>7.2f} |" + "".join(f"{cell_label(*c):>{width}}" for c in cells)
                     + f" | {cell_label(*_sum(cells)):>6}")
    lines.append("-" * len(head))
    cols = [_sum([stats.get((d, n), empty) for d in depths]) for n in lengths]
    grand = _sum(cols)
    lines.append(f"{'all':>7} |" + "".join(f"{cell_label(*c):>{width}}" for c in cols)
                 + f" | {cell_label(*grand):>6}")
    unknown, missing = grand[2], grand[3]
    if unknown:
        lines.append(f"* {unknown} needle(s) cut by finish_reason=length before the code appeared: not scored "
                     f"(raise --max-tokens)")
    if missing:
        lines.append(f"! {missing} of {sum(grand[1:])} requested needle(s) have no row (their cell failed or did not "
                     f"run: see errors.jsonl, rerun with --resume): counted as not found; 'miss' = no row at all")
    return "\n".join(lines)


def write_heatmap(rows: list[dict], path: "str | Path", title: str = "", grid: RequestedGrid | None = None) -> Path:
    """PNG heatmap of the found rate, depth (y, top = start) x length (x), like the standard needle test.

    Each cell shows :func:`cell_label`; the colour is the rate (missing needles count as not found); a cell
    with no row at all is hatched ('miss'), one cut by max_tokens grey ('cut')."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths, depths, stats = found_matrix(rows, grid)
    if not lengths:
        raise ValueError("no rows to draw")
    labels = [[cell_label(*stats.get((d, n), (0, 0, 0, 0))) for n in lengths] for d in depths]
    rates = np.full((len(depths), len(lengths)), np.nan)
    for i, d in enumerate(depths):
        for j, n in enumerate(lengths):
            found, scored, _, missing = stats.get((d, n), (0, 0, 0, 0))
            if labels[i][j] not in ("miss", "cut", "-"):
                rates[i, j] = found / (scored + missing)
    fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.6 + 0.45 * len(depths)), dpi=110)
    try:  # pyplot keeps every open figure alive: close it on errors too
        return _draw_heatmap(fig, ax, rates, labels, lengths, depths, title, Path(path))
    finally:
        plt.close(fig)


def _draw_heatmap(fig, ax, grid, labels, lengths: list[int], depths: list[float], title: str, path: Path) -> Path:
    import matplotlib
    from matplotlib.patches import Rectangle

    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="#cccccc")  # grey = no scored needle (cut)
    image = ax.imshow(grid, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], rotation=45, ha="right")
    ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if labels[i][j] == "miss":  # no row at all: white, hatched, unlike a grey cut cell
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white", edgecolor="#555555",
                                       hatch="xx", linewidth=0))
            if labels[i][j] != "-":
                ax.text(j, i, labels[i][j], ha="center", va="center", fontsize=7)
    fig.colorbar(image, ax=ax, label="found rate")
    fig.text(0.01, 0.01, "grey 'cut': stopped by max_tokens; hatched 'miss': no row; '!': some needles have no "
             "row (counted as not found)", fontsize=6)
    ax.set_title(title or "needle in a haystack", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    return path
