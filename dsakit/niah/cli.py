"""``dsakit niah``: a thin command-line layer over :mod:`dsakit.niah` (``dsakit serve-reference`` is in
:mod:`dsakit.serve.reference`).

Heavy imports (torch, httpx, matplotlib) happen inside the commands so ``dsakit --help`` stays fast.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer


class _ConsoleListener:
    """Prints per-cell lines as cells finish and drives a progress bar with the live found rate."""

    def __init__(self, console, progress_bar: bool):
        self.console = console
        self.progress_bar = progress_bar
        self.progress = None
        self.task = None
        self.found = 0
        self.scored = 0

    def _print(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def _rate(self) -> str:
        return f"found {self.found}/{self.scored}" + (f" ({100 * self.found / self.scored:.0f}%)" if self.scored else "")

    def started(self, total: int, done: int) -> None:
        if done:
            self._print(f"resuming: {done} of {total} cells already have rows, {total - done} to run")
        if self.progress_bar and total > done:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("niah"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=self.console)
            self.progress.start()
            self.task = self.progress.add_task("niah", total=total, completed=done, rate=self._rate())

    def row(self, row: dict) -> None:
        from .report import cell_lines

        for needle in row["needles"]:
            if needle["found"] is not None:
                self.scored += 1
                self.found += int(needle["found"])
        for line in cell_lines(row):
            self._print(line)
        if self.progress is not None:
            self.progress.update(self.task, advance=1, rate=self._rate())

    def error(self, error: dict) -> None:
        where = error.get("cell") or f"length {error.get('length')} ({error.get('stage', 'cell')})"
        self._print(f"  ERROR {where}: {error['error']}")

    def note(self, message: str) -> None:
        self._print(message)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def niah(
    base_url: str = typer.Option(..., "--base-url", help="OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1"),
    model: str = typer.Option(..., "--model", help="model name the server serves"),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help="environment variable holding the API key"),
    lengths: str = typer.Option("1k,2k,4k,8k", "--lengths",
                                help="context lengths in tokens: '1k,2k,4k', 'lin:1k:16k:4', 'log:1k:64k:7', "
                                     "'range:1000:8000:1000'"),
    depths: str = typer.Option("0.05,0.25,0.5,0.75,0.95", "--depths",
                               help="needle depths in [0, 1]: '0.1,0.5', 'lin:11', 'lin:0.05:0.95:5', 'sigmoid:9'"),
    multi_needle: bool = typer.Option(False, "--multi-needle",
                                      help="one prompt per length with a needle at every depth, each scored"),
    trials: int = typer.Option(1, "--trials", help="prompts per cell (different haystack and codes)"),
    seed: int = typer.Option(0, "--seed", help="seed of filler lines and codes (reproducible)"),
    endpoint: str = typer.Option("chat", "--endpoint", help="chat (server applies its chat template) | completions"),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer",
                                            help="tokenizer.json, tokenizer directory, or 'reference': fit prompts "
                                                 "exactly; without it lengths are calibrated from usage"),
    needle_template: Optional[str] = typer.Option(None, "--needle-template", help="needle text with {code}"),
    question_template: Optional[str] = typer.Option(None, "--question-template", help="question (single needle)"),
    multi_question_template: Optional[str] = typer.Option(None, "--multi-question-template",
                                                          help="question (multi-needle; may use {count})"),
    max_tokens: int = typer.Option(64, "--max-tokens", help="answer budget (reasoning models need more)"),
    temperature: float = typer.Option(0.0, "--temperature"),
    stream: bool = typer.Option(False, "--stream", help="use streaming responses"),
    concurrency: int = typer.Option(4, "--concurrency", help="requests in flight"),
    timeout: float = typer.Option(600.0, "--timeout", help="per-request timeout in seconds"),
    max_retries: int = typer.Option(8, "--max-retries", help="retries on 429/5xx/timeouts/connection errors"),
    backoff: float = typer.Option(0.5, "--backoff", help="first retry wait in seconds (doubles, with jitter)"),
    backoff_max: float = typer.Option(30.0, "--backoff-max", help="longest retry wait in seconds"),
    extra_body: Optional[str] = typer.Option(None, "--extra-body", help="JSON object merged into every request"),
    tolerance: float = typer.Option(0.01, "--tolerance", help="calibration target: relative prompt-length error"),
    out: Path = typer.Option(Path("niah-out"), "--out", help="output directory (results.jsonl, summary, heatmap)"),
    resume: bool = typer.Option(False, "--resume", help="continue the run in --out, skipping finished cells"),
    progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help="progress bar (default: on a TTY)"),
    title: Optional[str] = typer.Option(None, "--title", help="title of the summary and heatmap"),
) -> None:
    """Needle-in-a-haystack sweep (context length x depth) against an OpenAI-compatible endpoint."""
    import asyncio

    from rich.console import Console

    from .client import EndpointConfig
    from .grid import parse_depths, parse_lengths
    from .report import RequestedGrid, grouped_report, summary_table, write_heatmap
    from .results import StoreLockedError
    from .sweep import RESULTS_FILE, SweepConfig, run_sweep
    from .text import Templates
    from .tokens import load_counter

    def fail(message: str) -> None:
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(2)

    try:
        api_key = None
        if api_key_env:
            api_key = os.environ.get(api_key_env)
            if not api_key:
                fail(f"--api-key-env {api_key_env}: that environment variable is not set")
        try:
            body = json.loads(extra_body) if extra_body else {}
        except RecursionError:
            fail("--extra-body is nested too deeply to parse (request bodies are flat JSON objects)")
        if not isinstance(body, dict):
            fail("--extra-body must be a JSON object")
        defaults = Templates()
        templates = Templates(needle=needle_template or defaults.needle, question=question_template or defaults.question,
                              multi_question=multi_question_template or defaults.multi_question)
        config = SweepConfig(lengths=tuple(parse_lengths(lengths)), depths=tuple(parse_depths(depths)),
                             multi_needle=multi_needle, trials=trials, seed=seed, templates=templates,
                             tolerance=tolerance, concurrency=concurrency)
        endpoint_cfg = EndpointConfig(base_url=base_url, model=model, api_key=api_key, endpoint=endpoint,
                                      max_tokens=max_tokens, temperature=temperature, stream=stream, timeout_s=timeout,
                                      max_retries=max_retries, backoff_s=backoff, backoff_max_s=backoff_max,
                                      extra_body=body)
        counter = load_counter(tokenizer) if tokenizer else None
    except (ValueError, json.JSONDecodeError) as exc:
        fail(f"--extra-body is not JSON: {exc}" if isinstance(exc, json.JSONDecodeError) else str(exc))

    console = Console(highlight=False)
    listener = _ConsoleListener(console, console.is_terminal if progress is None else progress)
    try:
        outcome = asyncio.run(run_sweep(config, endpoint_cfg, out, counter=counter, tokenizer_spec=tokenizer,
                                        resume=resume, listener=listener))
    except KeyboardInterrupt:
        listener.close()
        typer.echo(f"\ninterrupted: every finished cell is in {out / RESULTS_FILE}; rerun with --resume to finish",
                   err=True)
        raise typer.Exit(130)
    except (ValueError, StoreLockedError) as exc:
        listener.close()
        fail(str(exc))
    finally:
        listener.close()

    if title is None:
        title = f"{model} at {base_url} ({endpoint}{', ' + json.dumps(body) if body else ''})"
    # the whole requested grid, rows or not: failed cells show as missing instead of vanishing from the axes
    grid = RequestedGrid(config.lengths, config.depths, config.trials)
    report = grouped_report(outcome.rows)
    done = {row["cell"] for row in outcome.rows}
    missing = [cell.key for cell in config.cells() if cell.key not in done]
    if missing:
        shown = ", ".join(missing[:20]) + (f", ... ({len(missing) - 20} more)" if len(missing) > 20 else "")
        report.append(f"=== {len(missing)} of {config.cell_count} cell(s) have no row: {shown} ===")
    table = summary_table(outcome.rows, title, grid)
    typer.echo("")
    for line in report:
        typer.echo(line)
    typer.echo("")
    typer.echo(table)
    (out / "summary.txt").write_text("\n".join(report) + "\n\n" + table + "\n")
    heatmap = write_heatmap(outcome.rows, out / "heatmap.png", title, grid)
    typer.echo(f"\nrows: {out / RESULTS_FILE}  summary: {out / 'summary.txt'}  heatmap: {heatmap}")
    if missing:
        typer.echo(f"{len(missing)} cell(s) have no row (errors in {out / 'errors.jsonl'}); rerun with --resume",
                   err=True)
        raise typer.Exit(1)
