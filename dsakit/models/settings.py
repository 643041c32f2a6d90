"""Every setting of a training run in one checked record (:class:`TrainSettings`), and recipes: a JSON file of
one or more phases, each a set of settings, that reproduces a shipped checkpoint with one command
(``dsakit train --recipe models/dsakit-v4-tiny/recipe.json --out DIR``).

:func:`check_settings` checks every value (type, range, finiteness) and the combinations before anything is
built or written, so a run never starts on a value that would run forever, save a checkpoint ``dsakit serve``
refuses, or fail after the whole schedule.

Recipe file::

    {"description": "...",
     "phases": [{"name": "copy_toy", "settings": {"seed": 0, "window": 16, ...}},
                {"name": "documents", "init_from": "copy_toy", "settings": {"seed": 1, ...}}]}

``settings`` take the names of :class:`TrainSettings` (the flags of ``python -m dsakit.models.train`` with
``_`` for ``-``); ``init_from`` names an earlier phase, whose checkpoint starts this one. A relative
``tokenizer`` path is taken from the repository root (the folder that holds ``models/``), so a recipe runs
from any working directory.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from .._memory import check_choice, check_float, check_int, check_int_list, parse_device
from .config import MAX_POSITIONS, MAX_TOPK
from .data import KIND_WEIGHTS

MIN_LENGTH = 128  # shortest document the data generator writes (intro, needle, question, answer)
# a sanity bound, not a memory model: 16x the largest batch any run used (131K tokens ran out of memory on an
# H200 with transformers' eager attention); a typo of a few zeros is refused instead of killed by the OS
MAX_TOKENS_PER_BATCH = 1 << 21


@dataclass
class TrainSettings:
    """One training run (three stages: dense, indexer, sparse); see dsakit/models/train.py for the recipe."""

    out: str = ""
    resume: str | None = None          # a checkpoint directory with resume.pt to continue
    init_from: str | None = None       # a checkpoint whose weights start the run (loaded strictly)
    tokenizer: str | None = None       # a directory with tokenizer.json (default: build one)
    device: str | None = None          # default: cuda when available, else cpu
    seed: int = 0
    topk: int = 32                     # the model's index_topk (stage 3)
    lengths: list = field(default_factory=lambda: [256, 512, 1024, 1536, 2048])
    tokens_per_batch: int = 32768
    steps: list | None = None          # steps per stage (dense, indexer, sparse); None: budget_seconds
    budget_seconds: float = 420.0
    fractions: list = field(default_factory=lambda: [0.62, 0.1, 0.28])
    lm_weight: float = 0.5
    answer_weight: float = 2.0
    key_norm_init: float = 0.15
    key_norm_lr_mult: float = 10.0
    repeat_rate: float = 0.3
    kinds: dict | None = None          # document kind weights (default: data.KIND_WEIGHTS)
    short_steps: int = 0
    short_length: int = 512
    window: int | None = None          # new models: 128; --init-from: the checkpoint's
    copy_gapped_share: float = 0.5
    copy_min_gap: int = 32
    stop_at_step: int = 0              # 0: run the whole schedule
    dense_lr: float | None = None      # None: STAGE_SETTINGS' dense peak
    clip_norm: float = 1.0             # 0: no clipping
    copy_steps: int = 0
    log_every: int = 10
    save_every_seconds: float = 90.0
    eval_lengths: list = field(default_factory=lambda: [1024, 2048, 4096])
    eval_docs: int = 8                 # 0: no final evaluation
    workers: int = field(default_factory=lambda: min(8, os.cpu_count() or 1))


SETTING_NAMES = tuple(f.name for f in dataclasses.fields(TrainSettings))
#: settings a recipe may not fix: where the run writes and what it continues belong to the command
RUN_ONLY = ("out", "resume", "init_from")


def refuse(message: str) -> NoReturn:
    """The one ValueError of the settings checks whose wording no shared checker has (paths, combinations)."""
    raise ValueError(message)


def _check_fraction(name: str, value, *, below_one: bool = False) -> float:
    """A finite number in [0, 1] ([0, 1) when ``below_one``)."""
    value = check_float(name, value, 0.0)
    if value > 1.0 or (below_one and value == 1.0):
        refuse(f"{name} must be in [0, {'1)' if below_one else '1]'}, got {value!r}")
    return value


def _check_dir(flag: str, value, must_hold: str | None = None) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not Path(value).is_dir():
        refuse(f"{flag} must be an existing directory, got {value!r}")
    if must_hold and not (Path(value) / must_hold).is_file():
        refuse(f"{flag} {value!r} has no {must_hold}")


def check_settings(s: TrainSettings, *, init_from_pending: bool = False) -> TrainSettings:
    """``s`` with every value checked (ValueError naming the first bad one); the device resolved. Nothing is
    built or written here: paths are only looked at (``init_from_pending``: ``init_from`` is an earlier recipe
    phase's output, written before this phase starts)."""
    if not isinstance(s.out, str) or not s.out:
        refuse(f"--out must name a directory, got {s.out!r}")
    if Path(s.out).exists() and not Path(s.out).is_dir():
        refuse(f"--out {s.out!r} exists and is not a directory")
    _check_dir("--resume", s.resume, "resume.pt")
    if not init_from_pending:
        _check_dir("--init-from", s.init_from, "config.json")
    _check_dir("--tokenizer", s.tokenizer, "tokenizer.json")
    if s.resume is not None and s.init_from is not None:
        refuse("--resume and --init-from exclude each other (resume continues a run, init-from starts one)")
    if s.resume is not None and s.window is not None:
        refuse("--window cannot change a resumed run (the checkpoint keeps its window)")
    s.device = str(parse_device(s.device if s.device is not None else _default_device(), "--device"))
    check_int("--seed", s.seed, 0, 2**63 - 1)
    check_int("--topk", s.topk, 1, MAX_TOPK)
    check_int_list("--lengths", s.lengths, MIN_LENGTH)
    if not s.lengths or max(s.lengths) > MAX_POSITIONS:
        refuse(f"--lengths must be one or more ints in {MIN_LENGTH}..{MAX_POSITIONS}, got {s.lengths!r}")
    check_int("--tokens-per-batch", s.tokens_per_batch, max(s.lengths), MAX_TOKENS_PER_BATCH,
              message=f"--tokens-per-batch must be an int in {max(s.lengths)} (the longest length)..{MAX_TOKENS_PER_BATCH}")
    if s.steps is not None:
        check_int_list("--steps", s.steps, 1, length=3,
                       message="--steps must be 3 ints >= 1 (dense, indexer, sparse)")
    check_float("--budget-seconds", s.budget_seconds, positive=True)
    if not isinstance(s.fractions, (list, tuple)) or len(s.fractions) != 3:
        refuse(f"--fractions must be 3 numbers (dense, indexer, sparse), got {s.fractions!r}")
    for value in s.fractions:
        check_float("--fractions", value, positive=True, message="--fractions must be finite numbers > 0")
    if sum(s.fractions) > 1.0 + 1e-9:
        refuse(f"--fractions must sum to at most 1 (shares of --budget-seconds), got {s.fractions!r}")
    check_float("--lm-weight", s.lm_weight, 0.0)
    check_float("--answer-weight", s.answer_weight, 0.0)
    if s.lm_weight + s.answer_weight == 0:
        refuse("--lm-weight and --answer-weight are both 0: the dense and sparse stages would train on nothing")
    check_float("--key-norm-init", s.key_norm_init, positive=True)
    check_float("--key-norm-lr-mult", s.key_norm_lr_mult, positive=True)
    _check_fraction("--repeat-rate", s.repeat_rate, below_one=True)
    if s.kinds is not None:
        if not isinstance(s.kinds, dict) or not s.kinds:
            refuse(f"--kinds must map document kinds to weights, e.g. passkey=1,codes=1, got {s.kinds!r}")
        for kind, weight in s.kinds.items():
            check_choice("--kinds", kind, tuple(KIND_WEIGHTS), what="document kind")
            check_float(f"--kinds {kind}", weight, 0.0)
        if sum(s.kinds.values()) <= 0:
            refuse(f"--kinds must give at least one kind a weight > 0, got {s.kinds!r}")
    check_int("--short-steps", s.short_steps, 0)
    check_int("--short-length", s.short_length, 1, MAX_POSITIONS)
    check_int("--window", s.window, 1, MAX_POSITIONS, allow_none=True)
    _check_fraction("--copy-gapped-share", s.copy_gapped_share)
    check_int("--copy-min-gap", s.copy_min_gap, 1, MAX_POSITIONS)
    check_int("--copy-steps", s.copy_steps, 0)
    check_int("--stop-at-step", s.stop_at_step, 0)
    check_float("--dense-lr", s.dense_lr, positive=True, allow_none=True)
    check_float("--clip-norm", s.clip_norm, 0.0)
    check_int("--log-every", s.log_every, 1)
    check_float("--save-every-seconds", s.save_every_seconds, positive=True)
    check_int("--eval-docs", s.eval_docs, 0)
    check_int_list("--eval-lengths", s.eval_lengths, MIN_LENGTH)
    if s.eval_docs and not s.eval_lengths:
        refuse("--eval-lengths must name at least one length when --eval-docs > 0")
    if max(s.eval_lengths, default=0) > MAX_POSITIONS:
        refuse(f"--eval-lengths must be ints in {MIN_LENGTH}..{MAX_POSITIONS}, got {s.eval_lengths!r}")
    check_int("--workers", s.workers, 0, 256)
    return s


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class Phase:
    """One run of a recipe: its name (the folder it writes under the recipe's --out), the phase whose checkpoint
    starts it (None: a new model), and its settings (``out`` and ``init_from`` filled in by :func:`plan`)."""

    name: str
    init_from: str | None
    settings: dict


def load_recipe(path: "str | Path") -> tuple[list[Phase], dict]:
    """The phases of a recipe file and its whole JSON (ValueError naming what is wrong)."""
    path = Path(path)
    if not path.is_file():
        refuse(f"--recipe {str(path)!r} is not a file")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        refuse(f"--recipe {str(path)!r} is not JSON: {exc}")
    phases = raw.get("phases") if isinstance(raw, dict) else None
    if not isinstance(phases, list) or not phases:
        refuse(f"--recipe {str(path)!r} has no non-empty 'phases' list")
    seen: list[str] = []
    out = []
    for i, phase in enumerate(phases):
        where = f"{path} phase {i}"
        if not isinstance(phase, dict) or not isinstance(phase.get("name"), str) or not phase["name"].isidentifier():
            refuse(f"{where} needs a 'name' (an identifier), got {phase!r}")
        unknown = sorted(set(phase) - {"name", "init_from", "settings", "note"})
        if unknown:
            check_choice(where, unknown[0], ("name", "init_from", "settings", "note"), what=f"{where} key")
        if phase.get("init_from") is not None:
            check_choice(f"{where} init_from", phase["init_from"], tuple(seen), what=f"{where} init_from (an earlier phase)")
        settings = phase.get("settings", {})
        if not isinstance(settings, dict):
            refuse(f"{where}: 'settings' must be a JSON object, got {settings!r}")
        for key in settings:
            check_choice(f"{where} setting", key, tuple(n for n in SETTING_NAMES if n not in RUN_ONLY),
                         what=f"{where} setting")
        seen.append(phase["name"])
        out.append(Phase(phase["name"], phase.get("init_from"), dict(settings)))
    return out, raw


def plan(phases: list[Phase], out: "str | Path", root: "str | Path", **overrides) -> list[tuple[Phase, TrainSettings]]:
    """Each phase with its checked settings: the last phase writes ``out``, earlier ones ``out/<name>``; a
    relative tokenizer path is taken from ``root``; ``overrides`` (device, workers, ...) apply to every phase."""
    out = Path(out)
    dirs = {p.name: (out if i == len(phases) - 1 else out / p.name) for i, p in enumerate(phases)}
    planned = []
    for phase in phases:
        values = {**phase.settings, **{k: v for k, v in overrides.items() if v is not None}}
        tokenizer = values.get("tokenizer")
        if isinstance(tokenizer, str) and not Path(tokenizer).is_absolute():
            values["tokenizer"] = str(Path(root) / tokenizer)
        settings = TrainSettings(out=str(dirs[phase.name]), **values)
        if phase.init_from is not None:
            settings.init_from = str(dirs[phase.init_from])
        planned.append((phase, settings))
    return planned


def as_log(s: TrainSettings) -> dict:
    """The settings as the training log records them (``args``)."""
    return dataclasses.asdict(s)


def differing_settings(s: TrainSettings, logged: dict, ignore=RUN_ONLY) -> dict:
    """{name: (this run's value, the logged one)} for every setting that differs from a train_log's ``args``
    (settings absent from an older log compare to their default)."""
    default = TrainSettings()
    mine = as_log(s)
    return {name: (mine[name], logged.get(name, getattr(default, name))) for name in SETTING_NAMES
            if name not in ignore and mine[name] != logged.get(name, getattr(default, name))}
