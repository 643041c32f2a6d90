"""``dsakit recall``: the needle-in-a-haystack recall lab on the command line (a thin layer over dsakit.recall)."""

import dataclasses
import stat
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..formats import KEY_FORMATS
from .faults import FAULTS, parse_faults
from .horizon import recall_horizon
from .settings import ALL_FORMATS, DEFAULT_CONTEXTS, DEFAULT_DEPTHS, DEFAULT_FORMATS, RecallSettings, op_backends
from .sweep import fault_carriers, run_faults, run_sweep
from .synthetic import SyntheticConfig


def _numbers(text: str, what: str, kind: type = int) -> tuple:
    """'1,2,4' -> (1, 2, 4) with ``kind`` = int or float; BadParameter naming the option otherwise."""
    try:
        values = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        noun = "integers" if kind is int else "numbers"
        raise typer.BadParameter(f"{what} must be comma-separated {noun}, got {text!r}") from err
    if not values:
        raise typer.BadParameter(f"{what} is empty")
    return values


def _formats(text: str) -> tuple:
    if text.strip().lower() == "all":
        return ALL_FORMATS
    names = tuple(x.strip().lower() for x in text.split(",") if x.strip())
    for name in names:
        if name not in KEY_FORMATS:
            raise typer.BadParameter(f"unknown key format {name!r}; choose from {', '.join(ALL_FORMATS)} or 'all'")
    if not names:
        raise typer.BadParameter("no key format given")
    return names


def recall(
    formats: str = typer.Option(",".join(DEFAULT_FORMATS), "--formats",
                                help=f"Key formats, comma-separated, or 'all' ({', '.join(ALL_FORMATS)})."),
    topk: str = typer.Option("512", "--topk", help="index_topk value(s) of the sweep, comma-separated."),
    contexts: str = typer.Option(",".join(map(str, DEFAULT_CONTEXTS)), "--contexts",
                                 help="Context lengths in tokens (multiples of the compression ratio)."),
    depths: str = typer.Option(",".join(map(str, DEFAULT_DEPTHS)), "--depths",
                               help="Needle depths in [0, 1] (0 = oldest entry, 1 = newest complete entry)."),
    trials: int = typer.Option(1, "--trials", help="Haystacks per context length in the sweep."),
    horizon: bool = typer.Option(True, "--horizon/--no-horizon", help="Bisect the recall horizon per format and top-k."),
    horizon_topk: str = typer.Option("128,256,512,1024", "--horizon-topk", help="Top-k values of the horizon table."),
    horizon_trials: int = typer.Option(200, "--horizon-trials", help="Trials per probed length (found in >= 99%)."),
    horizon_min: int = typer.Option(512, "--horizon-min", help="Shortest context of the horizon search (tokens)."),
    horizon_max: int = typer.Option(65536, "--horizon-max", help="Longest context of the horizon search (tokens)."),
    faults: str = typer.Option("all", "--faults",
                               help=f"Fault rows: 'all', 'off' or names ({', '.join(FAULTS)})."),
    fault_format: str = typer.Option("bf16", "--fault-format",
                                     help="Format carrying the convention faults (fp8 faults always run on an fp8 format)."),
    fault_contexts: str = typer.Option("4096,16384", "--fault-contexts", help="Context lengths of the fault rows."),
    preset: str = typer.Option("deepseek-v4-flash", "--preset", help="Geometry: deepseek-v4-flash | deepseek-v4-pro | deepseek-v3.2."),
    shared_ratio: float = typer.Option(100.0, "--shared-ratio",
                                       help="|mu| / |z| of the pooled keys: shared component vs individual spread."),
    needle_strength: float = typer.Option(5.0, "--needle-strength",
                                          help="Needle margin along the query direction, in distractor standard deviations."),
    outlier_channels: int = typer.Option(0, "--outlier-channels", help="Key-norm channels scaled by --outlier-scale."),
    outlier_scale: float = typer.Option(8.0, "--outlier-scale", help="Scale of the outlier channels."),
    head_weight_spread: float = typer.Option(0.5, "--head-weight-spread",
                                             help="Log-normal spread of the head weights (0 = equal heads)."),
    query_noise: float = typer.Option(0.5, "--query-noise", help="Per-head query noise relative to the needle direction."),
    query_tokens: int = typer.Option(4, "--query-tokens", help="Query tokens at the end of the context per run."),
    compressor: bool = typer.Option(True, "--compressor/--no-compressor",
                                    help="Pool keys from token states through the V4 compressor (off: draw entries directly)."),
    captured: Optional[Path] = typer.Option(None, "--captured",
                                            help="Run on a captured safetensors file (q, k, weights[, needle_entries]) instead."),
    hierarchy: bool = typer.Option(False, "--hierarchy/--no-hierarchy",
                                   help="Sweep (and --captured) top-k through hierarchical_topk instead of the flat "
                                        "index_topk (docs/hierarchy.md); the horizon and the fault rows stay flat."),
    hierarchy_pages: Optional[int] = typer.Option(None, "--hierarchy-pages",
                                                  help="m, the pages stage 1 keeps (default: max(16, 4 ceil(k/64)))."),
    hierarchy_exact: bool = typer.Option(False, "--hierarchy-exact",
                                         help="The hierarchy's exact mode (equal to the flat top-k)."),
    compare_hierarchy: bool = typer.Option(False, "--compare-hierarchy",
                                           help="Only measure hierarchical vs flat top-k (IoU, needle found, pages "
                                                "scored; 0.5x / 1x / 2x default m and the exact mode) on the sweep's "
                                                "contexts x depths x formats x --topk, or on --captured."),
    backend: str = typer.Option("reference", "--backend", help="reference (CPU) | triton (GPU) | auto."),
    seed: int = typer.Option(0, "--seed", help="Seed of every random draw (same seed, same numbers)."),
    out: Path = typer.Option(Path("recall-out"), "--out", help="Output folder: runs.jsonl and heatmap.png."),
    quiet: bool = typer.Option(False, "--quiet", help="No per-run lines, only the tables."),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="Write the PNG heatmap."),
) -> None:
    """Needle-in-a-haystack recall lab for DSA index-key formats.

    Plants a needle in a synthetic haystack of V4-compressed index keys (or uses your captured tensors), runs
    it through dsakit's store, score and top-k ops in each key format, and reports per run the needle's rank
    under the format and under exact fp32 scoring, whether top-k found it, the top-k set recall against exact
    scoring and the score margin. Then: the recall horizon (longest context with the needle found in >= 99% of
    trials) per format and top-k, and fault rows for the known failure classes. With no arguments it runs the
    default sweep (about a minute on 2 CPU cores). Outputs: console tables, OUT/runs.jsonl, OUT/heatmap.png.
    """
    from . import report

    console = Console()
    if console.width < 140:  # piped output defaults to 80 columns, too narrow for the tables
        console = Console(width=140)
    started = time.time()
    try:
        sweep_formats = _formats(formats)
        topks = _numbers(topk, "--topk")
        if captured is not None:
            _check_captured_path(captured)
            if compare_hierarchy:
                _compare_captured_cli(console, captured, sweep_formats, topks, backend, seed, out)
                return
            config = RecallSettings(hierarchy=hierarchy, hierarchy_pages=hierarchy_pages, hierarchy_exact=hierarchy_exact,
                                    horizon=False, faults=()).hierarchy_config()
            _run_captured_cli(console, captured, sweep_formats, topks, backend, seed, out, quiet, config)
            return
        config = SyntheticConfig(preset=preset, shared_ratio=shared_ratio, needle_strength=needle_strength,
                                 outlier_channels=outlier_channels, outlier_scale=outlier_scale,
                                 head_weight_spread=head_weight_spread, query_noise=query_noise,
                                 query_tokens=query_tokens, compressed=compressor)
        settings = RecallSettings(
            config=config, formats=sweep_formats, topks=topks, contexts=_numbers(contexts, "--contexts"),
            depths=_numbers(depths, "--depths", float), trials=trials, horizon=horizon,
            horizon_topks=_numbers(horizon_topk, "--horizon-topk"), horizon_trials=horizon_trials,
            horizon_min=horizon_min, horizon_max=horizon_max,
            faults=tuple(f.name for f in parse_faults(faults)), fault_format=fault_format,
            fault_contexts=_numbers(fault_contexts, "--fault-contexts"), seed=seed, backend=backend,
            hierarchy=hierarchy, hierarchy_pages=hierarchy_pages, hierarchy_exact=hierarchy_exact)
        common = {"seed": seed, "versions": report.versions(), "commit": report.git_commit(),
                  "settings": settings.as_dict(), "ops_backend": op_backends(backend)}
        # opened before the sweep (a bad --out fails now, not after it); records are written as they finish
        writer = report.RunWriter(out / report.JSONL_NAME, common)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    if compare_hierarchy:
        from .hierarchy import compare_hierarchy as compare, summarize_comparison

        with writer:
            rows = compare(settings, on_record=writer.write)
        console.print(_comparison_table(summarize_comparison(rows), "hierarchical vs flat top-k (synthetic)"))
        console.print(f"runs: {writer.path}")
        return
    with writer:
        _run_synthetic(console, settings, topks, writer, quiet, plot, out, preset, shared_ratio, needle_strength,
                       backend, seed)
    console.print(f"done in {time.time() - started:.0f} s. Synthetic keys model one mechanism (a shared key "
                  f"component under per-entry scaling), not a trained model: see docs/recall.md.")


def _run_synthetic(console: Console, settings: RecallSettings, topks: tuple, writer, quiet: bool, plot: bool,
                   out: Path, preset: str, shared_ratio: float, needle_strength: float, backend: str,
                   seed: int) -> None:
    from . import report

    console.print(f"[bold]dsakit recall[/]: preset {preset}, formats {', '.join(settings.formats)}, top-k "
                  f"{', '.join(map(str, topks))}, contexts {settings.contexts[0]}..{settings.contexts[-1]} tokens, "
                  f"shared_ratio {shared_ratio:g}, needle_strength {needle_strength:g}, backend {backend}, seed {seed}",
                  soft_wrap=True)
    records: list[dict] = []
    n_sweep = len(settings.contexts) * settings.trials * len(settings.depths) * len(settings.formats) * len(topks)
    n_faults = (len(fault_carriers(settings)) * len(settings.fault_contexts) * settings.fault_trials
                * len(settings.fault_depths))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("needle sweep", total=n_sweep)

        def on_run(rec: dict) -> None:
            writer.write(rec)
            if not quiet:
                progress.console.print(report.format_run_line(rec), highlight=False, soft_wrap=True)
            progress.advance(task)

        records += run_sweep(settings, on_run)
        if settings.faults:
            task = progress.add_task("fault rows", total=n_faults)
            records += run_faults(settings, on_run)
        horizon_rows: list[dict] = []
        if settings.horizon:
            task = progress.add_task("horizon bisection (probes)", total=None)
            horizon_rows, point_rows = recall_horizon(settings, on_point=lambda _: progress.advance(task))
            records += horizon_rows + point_rows
            for rec in horizon_rows + point_rows:
                writer.write(rec)

    for k in topks:
        console.print(report.summary_table(records, k))
    if horizon_rows:
        console.print(report.horizon_table(horizon_rows))
    if settings.faults:
        console.print(report.fault_table(records))
        for line in report.fault_signatures(records):
            console.print(f"  {line}", highlight=False, soft_wrap=True)
    console.print(f"runs: {writer.path}")
    if plot:
        console.print(f"heatmap: {report.plot_heatmap(records, out / report.HEATMAP_NAME)}")


def _check_captured_path(path: Path) -> None:
    """ValueError saying what ``--captured`` names when it exists but is no regular file (a device, a FIFO):
    it is not missing, and reading /dev/zero or a FIFO would never end."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return  # missing or unreadable: load_captured says which
    if stat.S_ISDIR(mode) or stat.S_ISREG(mode):
        return
    kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
            else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise ValueError(f"--captured {str(path)!r} is {kind}, not a captured tensor file: pass a .safetensors file "
                     f"holding q [T,H,D], k [N,D] and weights [T,H]")


def _comparison_table(rows: list, title: str):
    from rich.table import Table

    table = Table(title=title)
    for name in ("source", "format", "ctx tokens", "top-k", "mode", "m", "IoU mean", "IoU min", "needle flat",
                 "needle hier", "pages scored", "= flat"):
        table.add_column(name, justify="left" if name in ("source", "format", "mode") else "right")
    for r in rows:
        table.add_row(r["source"], r["format"], str(r["context_tokens"]), str(r["index_topk"]), r["mode"],
                      str(r["pages"]), f"{r['iou_mean']:.3f}", f"{r['iou_min']:.3f}",
                      f"{r['needle_found_flat']}/{r['needle_runs']}", f"{r['needle_found']}/{r['needle_runs']}",
                      f"{r['pages_scored']:.3f}", str(r["equal_flat"]))
    return table


def _compare_captured_cli(console: Console, path: Path, formats: tuple, topks: tuple, backend: str, seed: int,
                          out: Path) -> None:
    from . import report
    from .captured import load_captured
    from .hierarchy import compare_hierarchy_captured, summarize_comparison

    captured = load_captured(path)
    common = {"seed": seed, "versions": report.versions(), "commit": report.git_commit(),
              "settings": {"captured": str(path), "formats": list(formats), "topks": list(topks), "backend": backend,
                           "compare_hierarchy": True}}
    with report.RunWriter(out / report.JSONL_NAME, common) as writer:
        rows = compare_hierarchy_captured(captured, formats, topks, backend=backend, source=str(path),
                                          on_record=writer.write)
    console.print(_comparison_table(summarize_comparison(rows), f"hierarchical vs flat top-k ({path})"))
    console.print(f"runs: {writer.path}")


def _run_captured_cli(console: Console, path: Path, formats: tuple, topks: tuple, backend: str, seed: int,
                      out: Path, quiet: bool, hierarchy=None) -> None:
    from rich.table import Table

    from . import report
    from .captured import load_captured, run_captured

    captured = load_captured(path)
    common = {"seed": seed, "versions": report.versions(), "commit": report.git_commit(),
              "settings": {"captured": str(path), "formats": list(formats), "topks": list(topks), "backend": backend,
                           "ratio": captured.ratio, "rotated": captured.rotated,
                           "hierarchy": None if hierarchy is None else dataclasses.asdict(hierarchy)}}
    with report.RunWriter(out / report.JSONL_NAME, common) as writer:  # a bad --out fails before the work
        records = run_captured(captured, formats, topks, backend=backend, source=str(path), on_run=writer.write,
                               hierarchy=hierarchy)
    table = Table(title=f"captured tensors {path} (T={captured.q.shape[0]}, N={captured.k.shape[0]}, "
                        f"rotated={captured.rotated})")
    for name in ("format", "top-k", "needle rank", "exact rank", "found", "set recall", "margin", "NaN", "leaked"):
        table.add_column(name, justify="left" if name == "format" else "right")
    for r in records:
        table.add_row(r["format"], str(r["index_topk"]), str(r["needle_rank"]), str(r["exact_rank"]), str(r["found"]),
                      f"{r['set_recall']:.3f}", "-" if r["margin"] is None else f"{r['margin']:+.2f}",
                      f"{r['nan_fraction']:.2%}", str(r["leaked"]))
    console.print(table)
    console.print(f"runs: {writer.path}")
