"""Needle-in-a-haystack sweeps: grid of cells, prompt fitting, calibration, scoring and the run loop.

A *cell* is (context length in tokens, needle depth(s), trial). Single-needle sweeps have one cell per
(length, depth, trial); multi-needle sweeps put one needle at every depth of the grid into one prompt, so
they have one cell per (length, trial) and score each needle separately.

Prompt length:

* with a token counter (``--tokenizer``) each prompt is fitted directly: the largest number of filler words
  whose prompt has at most ``length`` tokens (binary search), so it lands within a word of the target;
* without one, each length is calibrated against the server: probe requests (``max_tokens = 1``) measure
  ``usage.prompt_tokens`` for a word budget, a line tokens = a + b * words is fitted through all probes so
  far (one probe per length once the first length is done), until the probe is within half the tolerance
  (default 1%) of the target. Every probe's count must be plausible and monotone (:func:`check_probe`), and
  a length whose best probe stays outside the tolerance is refused: its cells get no row (missing), never a
  prompt of the wrong length. Characters per token are recorded per length and used to estimate needle
  token positions.

Every row records the measured prompt tokens (``usage.prompt_tokens``), the target, and per needle its code,
depth, character offset and token offset in the prompt text (the completion prompt, or the chat user message:
tokens a chat template puts before the message are not counted), exact with a tokenizer, estimated otherwise.

Scoring: a needle is found when its code is a substring of the normalized answer (reasoning removed). When
the server stopped on ``length`` and the code is not in the answer, the needle's ``found`` is ``None``
(unknown: reported, excluded from found rates), never silently False.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .._memory import check_int, check_int_list, is_int
from .client import EndpointConfig, EndpointError, OpenAIClient
from .results import ResultStore
from .text import (FillerStream, Haystack, Templates, build_haystack, chat_content, code_found,
                   completion_prompt, needle_codes)
from .tokens import TokenCounter

RESULTS_FILE = "results.jsonl"
ERRORS_FILE = "errors.jsonl"
RUN_FILE = "run.json"
CALIBRATION_FILE = "calibration.json"
DEFAULT_WORDS_PER_TOKEN = 0.75
# Calibration refuses word budgets above MAX_WORDS_PER_TOKEN * target + MAX_EXTRA_WORDS. Real tokenizers give
# about 1.3 tokens per English filler word (at least ~0.5 for tokenizers that merge across spaces); a server
# whose usage.prompt_tokens stays constant or far too small would otherwise make the fitted budget grow by the
# ratio target / reported on every probe (a prompt of billions of words).
MAX_WORDS_PER_TOKEN = 4
MAX_EXTRA_WORDS = 64
# Plausibility of a reported usage.prompt_tokens (no tokenizer makes more tokens than characters, bar the
# few special tokens of a chat template, for which TEMPLATE_TOKENS is generous), and how far two probes may
# disagree with "more words, at least as many tokens" (their cells' needle codes differ a little).
TEMPLATE_TOKENS = 4096
MONOTONE_SLACK_TOKENS = 16
#: Most cells one sweep may have: at a second per request, more than a day of requests. The grid is checked
#: before any cell exists, so a typo like --trials 1000000000 is refused instead of filling the memory.
MAX_CELLS = 100_000
#: Longest context a sweep may ask for (tokens): 16 Mi, far beyond any served model, still a prompt that fits in
#: memory (about 100 MB of text).
MAX_LENGTH = 1 << 24


@dataclass(frozen=True)
class Cell:
    length: int
    depths: tuple[float, ...]
    trial: int
    multi: bool = False

    @property
    def key(self) -> str:
        where = "multi" if self.multi else f"d{self.depths[0]:.4f}"
        return f"L{self.length}-{where}-t{self.trial}"


@dataclass(frozen=True)
class SweepConfig:
    """What to sweep. ``fingerprint`` holds the fields a resumed run must share with the first one."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    multi_needle: bool = False
    trials: int = 1
    seed: int = 0
    templates: Templates = field(default_factory=Templates)
    tolerance: float = 0.01
    max_calibration_probes: int = 8
    concurrency: int = 4

    def __post_init__(self):
        object.__setattr__(self, "lengths", tuple(self.lengths))  # frozen; lists accepted, stored as tuples
        object.__setattr__(self, "depths", tuple(self.depths))
        check_int_list("lengths", self.lengths, 1, message="lengths must be positive token counts")
        if not self.lengths:
            raise ValueError("lengths must be positive token counts, got none")
        too_long = [n for n in self.lengths if n > MAX_LENGTH]
        if too_long:
            raise ValueError(f"lengths {too_long} exceed the longest supported context of {MAX_LENGTH} tokens")
        if not self.depths or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 <= d <= 1.0
                                  for d in self.depths):
            raise ValueError(f"depths must lie in [0, 1], got {self.depths!r}")
        for name in ("trials", "max_calibration_probes", "concurrency"):
            check_int(name, getattr(self, name), 1)
        if not 0 < self.tolerance < 0.5:
            raise ValueError(f"tolerance must be in (0, 0.5), got {self.tolerance}")
        count = self.cell_count
        if count > MAX_CELLS:
            per_trial = count // self.trials
            raise ValueError(f"the sweep would have {count} cells ({self.trials} trials x {per_trial} per trial), "
                             f"more than {MAX_CELLS}: lower --trials or the number of lengths / depths")

    @property
    def cell_count(self) -> int:
        """Cells of the grid, computed without building them."""
        per_trial = len(self.lengths) * (1 if self.multi_needle else len(self.depths))
        return per_trial * self.trials

    def cells(self) -> list[Cell]:
        if self.multi_needle:
            return [Cell(n, tuple(self.depths), t, True) for t in range(self.trials) for n in self.lengths]
        return [Cell(n, (d,), t) for t in range(self.trials) for d in self.depths for n in self.lengths]

    def fingerprint(self, endpoint: EndpointConfig, tokenizer: str | None) -> dict:
        return {"model": endpoint.model, "endpoint": endpoint.endpoint, "max_tokens": endpoint.max_tokens,
                "seed": self.seed, "multi_needle": self.multi_needle, "templates": asdict(self.templates),
                "tokenizer": tokenizer, "extra_body": endpoint.extra_body}


# --------------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    text: str  # completion prompt, or the chat user message
    haystack: Haystack
    words: int


class PromptBuilder:
    """Builds the prompt of a cell for a filler word budget (pure function of the sweep seed)."""

    def __init__(self, config: SweepConfig, endpoint: str):
        self.config = config
        self.endpoint = endpoint
        self._streams: dict[int, FillerStream] = {}

    def stream(self, trial: int) -> FillerStream:
        if trial not in self._streams:
            # one haystack per trial, shared by every length and depth (the usual needle test)
            self._streams[trial] = FillerStream(f"{self.config.seed}:{trial}")
        return self._streams[trial]

    def codes(self, cell: Cell) -> list[str]:
        return needle_codes(len(cell.depths), f"{self.config.seed}:{cell.key}")

    def build(self, cell: Cell, words: int) -> Prompt:
        filler = self.stream(cell.trial).words(max(0, words))
        haystack = build_haystack(filler, self.codes(cell), list(cell.depths), self.config.templates)
        text = chat_content(haystack) if self.endpoint == "chat" else completion_prompt(haystack)
        return Prompt(text, haystack, words)

    def fit(self, cell: Cell, counter: TokenCounter, hint: int | None = None) -> tuple[Prompt, int]:
        """Largest word budget whose prompt has <= cell.length tokens -> (prompt, its token count).

        Token counts grow with the word budget, so: bracket the answer by galloping from a guess (``hint``,
        e.g. the budget of the previous cell of the same haystack, or a words-per-token default), then
        bisect. About 2 log2(guess error) + 2 tokenizer calls per prompt.
        """
        target = cell.length
        cache: dict[int, int] = {}

        def fits(w: int) -> bool:
            if w not in cache:
                cache[w] = counter.count(self.build(cell, w).text, self.endpoint)
            return cache[w] <= target

        if not fits(0):
            raise ValueError(f"target length {target} is shorter than the prompt without filler "
                             f"({cache[0]} tokens): raise the length or shorten the templates")
        guess = max(1, hint if hint else int(target * DEFAULT_WORDS_PER_TOKEN))
        step = max(4, guess // 64)
        if fits(guess):  # gallop up: lo fits, hi does not
            lo, hi = guess, guess + step
            while fits(hi):
                lo, step = hi, step * 2
                hi = lo + step
        else:  # gallop down
            lo, hi = max(0, guess - step), guess
            while not fits(lo):
                hi, step = lo, step * 2
                lo = max(0, hi - step)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return self.build(cell, lo), cache[lo]


@dataclass
class Calibration:
    """Word budget per length found from the server's usage counts (no local tokenizer)."""

    words: dict[int, int] = field(default_factory=dict)
    probes: list[dict] = field(default_factory=list)  # {"length", "words", "chars", "prompt_tokens"}
    chars_per_token: dict[int, float] = field(default_factory=dict)

    def predict_words(self, target: int) -> int:
        """Words for ``target`` tokens from a least-squares line through the probes (or a default ratio)."""
        points = [(p["words"], p["prompt_tokens"]) for p in self.probes]
        if len(points) >= 2 and len({w for w, _ in points}) >= 2:
            n = len(points)
            mw = sum(w for w, _ in points) / n
            mt = sum(t for _, t in points) / n
            var = sum((w - mw) ** 2 for w, _ in points)
            slope = sum((w - mw) * (t - mt) for w, t in points) / var
            if slope > 0:
                return max(0, round(mw + (target - mt) / slope))
        if points:
            w, t = points[-1]
            if t > 0 and w > 0:
                return max(0, round(w * target / t))
        return int(target * DEFAULT_WORDS_PER_TOKEN)

    def to_json(self) -> dict:
        return {"words": {str(k): v for k, v in self.words.items()}, "probes": self.probes,
                "chars_per_token": {str(k): v for k, v in self.chars_per_token.items()}}

    @staticmethod
    def from_json(data: dict) -> "Calibration":
        return Calibration({int(k): int(v) for k, v in data.get("words", {}).items()}, list(data.get("probes", [])),
                           {int(k): float(v) for k, v in data.get("chars_per_token", {}).items()})

    @staticmethod
    def load(path: Path) -> "Calibration":
        """Read ``calibration.json``; ValueError naming the file when it is not one this module wrote."""
        data = _read_json_object(path)
        try:
            calibration = Calibration.from_json(data)
            for p in calibration.probes:
                if not isinstance(p, dict) or not is_int(p.get("words")) or not is_int(p.get("prompt_tokens")):
                    raise ValueError(f"probe {p!r:.80} needs int 'words' and 'prompt_tokens'")
        except (ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path} is not a calibration file ({exc}); delete it to calibrate again") from None
        return calibration


def _read_json_object(path: Path) -> dict:
    """A JSON object from ``path``; ValueError naming the file when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


class CalibrationError(ValueError):
    """The server's usage.prompt_tokens cannot be a token count of the probes sent (or never fit the target)."""


def check_probe(calibration: Calibration, probe: dict) -> None:
    """Refuse a probe whose usage.prompt_tokens no tokenizer could report, against itself and earlier probes.

    Plausible: words / MAX_WORDS_PER_TOKEN <= tokens <= chars + TEMPLATE_TOKENS. Monotone: a probe with more
    filler words than another has at least its tokens (less MONOTONE_SLACK_TOKENS), and gained no more
    tokens than characters. A constant, random, decreasing or absurd count fails one of these."""
    words, tokens, chars = probe["words"], probe["prompt_tokens"], probe["chars"]
    hint = "check the server's token counting or pass --tokenizer to fit prompts locally"
    if tokens > chars + TEMPLATE_TOKENS:
        raise CalibrationError(f"usage.prompt_tokens {tokens} for a prompt of {chars} characters ({words} filler "
                               f"words): more tokens than characters is no token count; {hint}")
    if tokens < words / MAX_WORDS_PER_TOKEN:
        raise CalibrationError(f"usage.prompt_tokens {tokens} for a prompt of {words} filler words: fewer than one "
                               f"token per {MAX_WORDS_PER_TOKEN} words is no token count; {hint}")
    for other in calibration.probes:
        low, high = (other, probe) if other["words"] <= probe["words"] else (probe, other)
        if low["words"] == high["words"]:
            continue
        gained = high["prompt_tokens"] - low["prompt_tokens"]
        if gained < -MONOTONE_SLACK_TOKENS or gained > high["chars"] - low["chars"] + MONOTONE_SLACK_TOKENS:
            raise CalibrationError(f"usage.prompt_tokens {low['prompt_tokens']} for {low['words']} filler words but "
                                   f"{high['prompt_tokens']} for {high['words']}: counts must grow with the prompt, "
                                   f"by at most its characters; {hint}")


async def calibrate_length(cell: Cell, builder: PromptBuilder, client: OpenAIClient, calibration: Calibration,
                           config: SweepConfig) -> int:
    """Word budget that puts ``cell.length`` within tolerance/2 of the server's prompt_tokens (aimed at), within
    the tolerance (required, else :class:`CalibrationError`). Every probe is checked by :func:`check_probe`."""
    target = cell.length
    best: tuple[float, int] | None = None
    tried: set[int] = set()
    for _ in range(config.max_calibration_probes):
        words = calibration.predict_words(target)
        if words in tried:  # the fit repeats itself: nudge by one word towards the target
            last = calibration.probes[-1]
            words += 1 if last["prompt_tokens"] < target else -1
            words = max(0, words)
            if words in tried:
                break
        cap = MAX_WORDS_PER_TOKEN * target + MAX_EXTRA_WORDS
        if words > cap:
            seen = [p["prompt_tokens"] for p in calibration.probes if p["length"] == target][-4:]
            raise ValueError(f"calibrating {target} tokens would need {words} filler words, more than {cap} "
                             f"({MAX_WORDS_PER_TOKEN} per token): the server's usage.prompt_tokens "
                             f"{seen or [p['prompt_tokens'] for p in calibration.probes[-4:]]} do not grow with the "
                             f"prompt as token counts do; check the server or pass --tokenizer")
        tried.add(words)
        prompt = builder.build(cell, words)
        completion = await client.complete(prompt.text, max_tokens=1)
        if completion.prompt_tokens is None:
            raise EndpointError("the server's response has no usage.prompt_tokens: pass --tokenizer to fit "
                                "prompt lengths locally")
        probe = {"length": target, "words": words, "chars": len(prompt.text),
                 "prompt_tokens": completion.prompt_tokens}
        check_probe(calibration, probe)
        calibration.probes.append(probe)
        error = abs(completion.prompt_tokens - target) / target
        if best is None or error < best[0]:
            best = (error, words)
            calibration.chars_per_token[target] = len(prompt.text) / completion.prompt_tokens
        if error <= config.tolerance / 2:
            break
    if best is None or best[0] > config.tolerance:
        seen = [(p["words"], p["prompt_tokens"]) for p in calibration.probes if p["length"] == target]
        got = "no probe" if best is None else f"{best[0]:.1%} at best"
        raise CalibrationError(f"calibrating {target} tokens: no word budget within the tolerance of "
                               f"{config.tolerance:.1%} ({got}; probes as (filler words, usage.prompt_tokens): "
                               f"{seen}); check the server's token counting, raise --tolerance or pass --tokenizer")
    calibration.words[target] = best[1]
    return best[1]


# --------------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------------


def score_needles(codes, answer: str, reasoning: str, finish: str | None) -> list[dict]:
    """Per needle: found (True / False / None when cut by a length stop) and found_in_reasoning."""
    out = []
    for code in codes:
        hit = code_found(code, answer)
        found = True if hit else (None if finish == "length" else False)
        out.append({"code": code, "found": found, "found_in_reasoning": code_found(code, reasoning)})
    return out


def cell_found(needles: list[dict]) -> bool | None:
    values = [n["found"] for n in needles]
    if all(v is True for v in values):
        return True
    if any(v is False for v in values):
        return False
    return None


# --------------------------------------------------------------------------------------------------
# Run
# --------------------------------------------------------------------------------------------------


@dataclass
class SweepOutcome:
    rows: list[dict]  # rows of the grid's cells (resumed and new), in grid order
    new_rows: int
    skipped: int
    errors: list[dict]
    duplicates_on_disk: int
    repaired_bytes: int
    calibration: Calibration | None


class SweepListener:
    """Callbacks of a running sweep (the CLI prints and draws the progress bar from these)."""

    def started(self, total: int, done: int) -> None:
        """The grid has ``total`` cells, ``done`` of them already have rows (resume)."""

    def row(self, row: dict) -> None:
        """A cell finished and its row is on disk."""

    def error(self, error: dict) -> None:
        """A cell (or a length's calibration) failed for good; it has no row and a resume retries it."""

    def note(self, message: str) -> None:
        """Something worth telling the user (calibration result, repaired file)."""


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    os.replace(tmp, path)


def check_run_file(out_dir: Path, fingerprint: dict, resume: bool) -> None:
    """Refuse to mix runs: an existing directory needs --resume and the same fingerprint."""
    run_path = out_dir / RUN_FILE
    results = out_dir / RESULTS_FILE
    if results.exists() and results.stat().st_size and not resume:
        raise ValueError(f"{results} already holds results: pass --resume to continue that run, or choose "
                         f"another --out")
    if run_path.exists() and resume:
        previous = _read_json_object(run_path).get("fingerprint", {})
        if not isinstance(previous, dict):
            raise ValueError(f"{run_path}: 'fingerprint' must be a JSON object, got {previous!r:.80}")
        changed = sorted(k for k in set(previous) | set(fingerprint) if previous.get(k) != fingerprint.get(k))
        if changed:
            raise ValueError(f"--resume: settings differ from the run in {out_dir} ({', '.join(changed)}); "
                             f"rows would not be comparable. Use another --out")


async def run_sweep(config: SweepConfig, endpoint: EndpointConfig, out_dir: "str | Path", *,
                    counter: TokenCounter | None = None, tokenizer_spec: str | None = None, resume: bool = False,
                    listener: SweepListener | None = None,
                    client_factory: Callable[[EndpointConfig, int], OpenAIClient] = OpenAIClient) -> SweepOutcome:
    """Run (or resume) a sweep; rows go to ``out_dir/results.jsonl`` as cells finish.

    ``counter`` fits prompts locally (else lengths are calibrated against the server); ``tokenizer_spec``
    names it in ``run.json``. Cells that already have a row are skipped when ``resume`` is set; a fresh run
    refuses a directory that holds results. Failed cells, and lengths whose calibration failed, go to
    ``errors.jsonl`` and get no row; errors of cells that now have a row (a resume finished them) are removed
    from it at the end of the run.
    """
    listener = listener or SweepListener()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"output directory {out} is a file: choose a directory for --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create output directory {out}: {exc.strerror or exc}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"output directory {out} is not writable")
    config.templates.check_filler_is_distinct()
    fingerprint = config.fingerprint(endpoint, tokenizer_spec or (counter.name if counter is not None else None))
    check_run_file(out, fingerprint, resume)
    builder = PromptBuilder(config, endpoint.endpoint)
    cells = config.cells()
    errors: list[dict] = []
    calibration: Calibration | None = None
    new_rows = 0

    with ResultStore(out / RESULTS_FILE) as store:
        if store.repaired_bytes:
            listener.note(f"cut an interrupted last line ({store.repaired_bytes} bytes) from {store.path}")
        if store.duplicates:
            listener.note(f"{store.path} holds {store.duplicates} duplicate rows; the first row of each cell is used")
        run_info = {"fingerprint": fingerprint, "base_url": endpoint.base_url, "lengths": list(config.lengths),
                    "depths": list(config.depths), "trials": config.trials, "updated": _now()}
        _write_json_atomic(out / RUN_FILE, run_info)
        pending = [c for c in cells if c.key not in store]
        skipped = len(cells) - len(pending)
        listener.started(len(cells), skipped)

        async with client_factory(endpoint, config.concurrency) as client:
            if counter is None and pending:
                cal_path = out / CALIBRATION_FILE
                calibration = Calibration.load(cal_path) if resume and cal_path.exists() else Calibration()
                for length in sorted({c.length for c in pending}):
                    if length in calibration.words:
                        continue
                    probe_cell = next(c for c in pending if c.length == length)
                    try:
                        words = await calibrate_length(probe_cell, builder, client, calibration, config)
                    except (EndpointError, ValueError) as exc:
                        errors.append({"length": length, "stage": "calibration", "error": str(exc), "time": _now()})
                        _append_error(out / ERRORS_FILE, errors[-1])  # its cells get no row: say why on disk
                        listener.error(errors[-1])
                        continue
                    cpt = calibration.chars_per_token.get(length)
                    listener.note(f"calibrated {length} tokens: {words} filler words "
                                  f"({cpt:.2f} chars/token from usage.prompt_tokens)")
                    _write_json_atomic(cal_path, calibration.to_json())

            fit_hints: dict[tuple[int, int], int] = {}

            async def run_cell(cell: Cell) -> None:
                nonlocal new_rows
                try:
                    if counter is not None:
                        hint = fit_hints.get((cell.length, cell.trial))
                        prompt, local_tokens = builder.fit(cell, counter, hint)
                        fit_hints[(cell.length, cell.trial)] = prompt.words
                    else:
                        if calibration is None or cell.length not in calibration.words:
                            return  # calibration failed for this length: already reported
                        prompt, local_tokens = builder.build(cell, calibration.words[cell.length]), None
                    completion = await client.complete(prompt.text)
                except (EndpointError, ValueError) as exc:
                    errors.append({"cell": cell.key, "length": cell.length, "depths": list(cell.depths),
                                   "trial": cell.trial, "error": str(exc), "time": _now()})
                    _append_error(out / ERRORS_FILE, errors[-1])
                    listener.error(errors[-1])
                    return
                row = make_row(cell, prompt, completion, local_tokens, counter, calibration, endpoint)
                store.append(row)  # synchronous, one write: a cancellation cannot split it
                new_rows += 1
                listener.row(row)

            queue = iter(pending)  # shared by the workers: each cell is taken once, no task per cell

            async def worker() -> None:
                for cell in queue:
                    await run_cell(cell)

            tasks = [asyncio.ensure_future(worker()) for _ in range(min(config.concurrency, len(pending)))]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
        prune_errors(out / ERRORS_FILE, store, cells)
        rows = [store.rows[c.key] for c in cells if c.key in store]
        outcome = SweepOutcome(rows, new_rows, skipped, errors, store.duplicates, store.repaired_bytes, calibration)
    return outcome


def prune_errors(path: Path, store: ResultStore, cells: list[Cell]) -> None:
    """Drop from ``errors.jsonl`` the errors a later run resolved: a cell's error once the cell has a row, a
    length's calibration error once every cell of that length in the grid has one. Other lines stay as they are."""
    if not path.exists():
        return
    open_lengths = {c.length for c in cells if c.key not in store}
    grid_lengths = {c.length for c in cells}
    keep, dropped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        try:
            error = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            error = None
        if isinstance(error, dict):
            cell, length = error.get("cell"), error.get("length")
            resolved = (isinstance(cell, str) and cell in store) or (
                cell is None and error.get("stage") == "calibration" and length in grid_lengths
                and length not in open_lengths)
            if resolved:
                dropped += 1
                continue
        keep.append(line if line.endswith("\n") else line + "\n")
    if dropped:
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text("".join(keep), encoding="utf-8")
        os.replace(tmp, path)


def _append_error(path: Path, error: dict) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(error, sort_keys=True) + "\n")


def make_row(cell: Cell, prompt: Prompt, completion, local_tokens: int | None, counter: TokenCounter | None,
             calibration: Calibration | None, endpoint: EndpointConfig) -> dict:
    hay = prompt.haystack
    needles = score_needles(hay.codes, completion.text, completion.reasoning, completion.finish_reason)
    cpt = calibration.chars_per_token.get(cell.length) if calibration else None
    for needle, depth, char in zip(needles, hay.depths, hay.needle_chars):
        needle["depth"] = depth
        needle["char"] = char
        if counter is not None:
            needle["token"] = counter.count_prompt(prompt.text[:char])
            needle["token_exact"] = True
        else:
            needle["token"] = round(char / cpt) if cpt else None
            needle["token_exact"] = False
    return {
        "cell": cell.key, "length": cell.length, "trial": cell.trial, "multi": cell.multi,
        "depth": cell.depths[0] if not cell.multi else None, "depths": list(cell.depths),
        "lines": hay.filler_line_count, "filler_words": prompt.words, "prompt_chars": len(prompt.text),
        "prompt_tokens": completion.prompt_tokens, "prompt_tokens_local": local_tokens,
        "found": cell_found(needles), "found_count": sum(1 for n in needles if n["found"] is True),
        "needles": needles, "finish": completion.finish_reason, "answer": completion.text,
        "reasoning": completion.reasoning[:4000], "completion_tokens": completion.completion_tokens,
        "attempts": completion.attempts, "latency_s": round(completion.latency_s, 3),
        "endpoint": endpoint.endpoint, "model": endpoint.model, "time": _now(),
    }
