"""Train the tiny DSA model: transformers' ``DeepseekV4ForCausalLM`` on :mod:`dsakit.models.data` documents
with the DSA recipe (DeepSeek-V3.2's), in three stages:

1. ``dense``: every parameter on the language-model loss, with the top-k above the number of compressed
   entries (the CSA layers attend to every entry: a dense model to start from; the indexer gets no gradient);
2. ``indexer``: everything frozen except the lightning indexers, trained with the KL divergence from the main
   attention's distribution over the compressed entries (summed over heads, renormalised) to the indexer's
   softmax over its scores;
3. ``sparse``: top-k = the model's ``index_topk``; the main model on the LM loss, the indexers on the KL
   restricted to the selected entries, with their inputs detached (the KL trains the indexer only).

Loss of stages 1 and 3: ``lm_weight`` x mean token cross-entropy over the document + ``answer_weight`` x mean
cross-entropy over the answer tokens (a code is ~8 of ~1000 tokens; the answer term keeps retrieval from
drowning in filler). Documents repeat some filler lines (``--repeat-rate``, see :mod:`dsakit.models.data`) so
that copying pays off everywhere, and the first ``--short-steps`` steps use short documents only.

The pieces: :mod:`~dsakit.models.config` (the architecture), :mod:`~dsakit.models.data` (documents),
:mod:`~dsakit.models.losses`, :mod:`~dsakit.models.loop` (stages, saving, evaluation),
:mod:`~dsakit.models.settings` (the checked settings and recipe files). This module is the command line.

Usage::

    dsakit train --recipe models/dsakit-v4-tiny/recipe.json --out DIR     # a shipped checkpoint, reproduced
    dsakit train --out DIR [--budget-seconds 420 | --steps 1500,200,600] [--device cuda] [...]

(``python -m dsakit.models.train`` takes the same arguments.) Writes into DIR: config.json,
generation_config.json, model.safetensors, tokenizer files, train_log.json (every logged step, the stage
boundaries, the final evaluation), loss_curves.png and resume.pt (optimizer moments in bf16, the stage and
step; ``--resume DIR`` continues from it). Seeded: data is a pure function of (seed, step), the initial weights
of the seed. Every argument is checked before anything is built or written (exit 2 and one line naming the
bad value); a NaN or Inf loss or weight stops the run (exit 1) without saving over the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import typer

from .settings import RUN_ONLY, TrainSettings, check_settings, differing_settings, load_recipe, plan, refuse

#: flags a recipe run may set: where and how fast it runs, how often it logs, where it stops (a short check)
RECIPE_OVERRIDES = ("device", "workers", "log_every", "stop_at_step")

REPO_ROOT = Path(__file__).resolve().parents[2]


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (``prog: error: ...``, exit 2) instead of usage + error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _csv(kind):
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s, got {text!r}") from None
    parse.__name__ = f"{kind.__name__} list"
    return parse


def _kinds(text: str) -> dict:
    items = {}
    for item in text.split(","):
        name, sep, weight = item.partition("=")
        try:
            items[name.strip()] = float(weight)
        except ValueError:
            sep = ""
        if not sep:
            raise argparse.ArgumentTypeError(f"expected KIND=WEIGHT,..., e.g. passkey=3,codes=1, got {item!r}")
    return items


def build_parser() -> argparse.ArgumentParser:
    d = TrainSettings()
    ap = OneLineParser(prog="dsakit train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default=None,
                    help="a recipe file (e.g. models/dsakit-v4-tiny/recipe.json): every setting of every phase; "
                         "beside it only --out, --device, --workers, --log-every and --stop-at-step (every phase "
                         "stops after that many steps: a quick check of the recipe)")
    ap.add_argument("--out", required=True, help="output directory (checkpoint, log, curves)")
    ap.add_argument("--resume", default=None, help="directory of a checkpoint with resume.pt to continue")
    ap.add_argument("--init-from", default=None, help="checkpoint directory whose weights start the run (strict)")
    ap.add_argument("--tokenizer", default=None, help="directory with a tokenizer.json to reuse (default: build)")
    ap.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--topk", type=int, default=d.topk, help="index_topk of the model (stage 3)")
    ap.add_argument("--lengths", type=_csv(int), default=d.lengths, help="document lengths in tokens (one per step)")
    ap.add_argument("--tokens-per-batch", type=int, default=d.tokens_per_batch)
    ap.add_argument("--steps", type=_csv(int), default=None,
                    help="steps per stage: dense,indexer,sparse (overrides the budget)")
    ap.add_argument("--budget-seconds", type=float, default=d.budget_seconds, help="total training time without --steps")
    ap.add_argument("--fractions", type=_csv(float), default=d.fractions,
                    help="time share of the stages with a budget (3 numbers > 0, sum <= 1)")
    ap.add_argument("--lm-weight", type=float, default=d.lm_weight)
    ap.add_argument("--answer-weight", type=float, default=d.answer_weight)
    ap.add_argument("--key-norm-init", type=float, default=d.key_norm_init,
                    help="initial weight of the attention key norms (see config.soften_attention_; 1 = transformers')")
    ap.add_argument("--key-norm-lr-mult", type=float, default=d.key_norm_lr_mult,
                    help="learning-rate factor of the key norms")
    ap.add_argument("--repeat-rate", type=float, default=d.repeat_rate, help="share of filler lines copied from earlier")
    ap.add_argument("--kinds", type=_kinds, default=None,
                    help="document kind weights, e.g. passkey=1,codes=1 (default: data.py's)")
    ap.add_argument("--short-steps", type=int, default=d.short_steps, help="first steps on lengths <= --short-length only")
    ap.add_argument("--short-length", type=int, default=d.short_length)
    ap.add_argument("--window", type=int, default=None,
                    help="sliding window of the model (new models: default 128; --init-from: the checkpoint's)")
    ap.add_argument("--copy-gapped-share", type=float, default=d.copy_gapped_share,
                    help="share of the copy-toy rows with gapped repeats in the warm-up's second half")
    ap.add_argument("--copy-min-gap", type=int, default=d.copy_min_gap, help="shortest gap before a gapped repeat (tokens)")
    ap.add_argument("--stop-at-step", type=int, default=None,
                    help="save and stop after this global step (the schedule still spans --steps)")
    ap.add_argument("--dense-lr", type=float, default=None, help="peak learning rate of the dense stage")
    ap.add_argument("--clip-norm", type=float, default=d.clip_norm, help="gradient-norm clip (0: none)")
    ap.add_argument("--copy-steps", type=int, default=d.copy_steps,
                    help="first steps on the copy toy (a random sequence repeated; data.DocumentBatches.copy_row)")
    ap.add_argument("--log-every", type=int, default=None, help=f"log every this many steps (default {d.log_every})")
    ap.add_argument("--save-every-seconds", type=float, default=d.save_every_seconds)
    ap.add_argument("--eval-lengths", type=_csv(int), default=d.eval_lengths)
    ap.add_argument("--eval-docs", type=int, default=d.eval_docs, help="eval batches per length (0: no final eval)")
    ap.add_argument("--workers", type=int, default=None, help=f"data-loader processes (default {d.workers})")
    return ap


def settings_from_args(argv) -> tuple[list[tuple[str, TrainSettings]], str | None]:
    """-> ([(phase name, checked settings)], the recipe path or None). Exits 2 (one line) on a bad flag."""
    ap = build_parser()
    args = ap.parse_args(argv)
    values = {k: v for k, v in vars(args).items() if k != "recipe"}
    if args.recipe is None:
        for name in ("workers", "log_every", "stop_at_step"):  # unset: the settings' defaults
            if values[name] is None:
                values.pop(name)
        return [("run", check_settings(TrainSettings(**values)))], None
    given = sorted(k for k, v in values.items() if k not in ("out", *RECIPE_OVERRIDES) and v != ap.get_default(k))
    if given:
        ap.error(f"--recipe fixes every setting; beside it only --out, --device, --workers, --log-every and "
                 f"--stop-at-step may be given, got --{given[0].replace('_', '-')}")
    phases, _ = load_recipe(args.recipe)
    overrides = {k: values[k] for k in RECIPE_OVERRIDES if values[k] != ap.get_default(k)}
    planned = plan(phases, args.out, REPO_ROOT, **overrides)
    return [(phase.name, check_settings(s, init_from_pending=phase.init_from is not None))
            for phase, s in planned], args.recipe


def run_phases(phases: list[tuple[str, TrainSettings]], recipe: str | None = None) -> list[dict]:
    """Train each phase in order (checked settings). With a recipe, a phase whose directory already holds a run
    of the same settings is skipped when finished and resumed when not (a cut-off recipe run goes on where it
    stopped); a run of other settings there is refused (ValueError), never overwritten."""
    from .loop import train

    logs = []
    for name, s in phases:
        earlier = _earlier_run(Path(s.out)) if recipe is not None else None
        if earlier is not None:
            changed = differing_settings(s, earlier["args"], ignore=RUN_ONLY + ("device", "workers", "log_every"))
            if changed:
                key = sorted(changed)[0]
                refuse(f"{s.out} holds a run of phase {name} with other settings ({key} "
                                 f"{changed[key][1]!r}, the recipe says {changed[key][0]!r}); choose a fresh --out")
            if earlier.get("finished"):
                print(f"phase {name}: finished in {s.out}, skipped", flush=True)
                logs.append(earlier)
                continue
            s = check_settings(TrainSettings(**{**vars(s), "resume": s.out, "init_from": None, "window": None}))
        if recipe is not None:
            print(f"phase {name} of {recipe} -> {s.out}", flush=True)
        logs.append(train(s))
    return logs


def _earlier_run(out: Path) -> dict | None:
    """The train_log.json of a resumable run in ``out`` (None when there is none)."""
    log_file = out / "train_log.json"
    if not ((out / "resume.pt").is_file() and log_file.is_file()):
        return None
    try:
        log = json.loads(log_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return log if isinstance(log, dict) and isinstance(log.get("args"), dict) else None


def main(argv=None) -> int:
    from .loop import NonFiniteTraining

    try:
        phases, recipe = settings_from_args(argv)
        run_phases(phases, recipe)
    except ValueError as exc:  # bad input: found before the first step
        print(f"dsakit train: error: {exc}", file=sys.stderr)
        return 2
    except NonFiniteTraining as exc:
        print(f"dsakit train: stopped: {exc}", file=sys.stderr)
        return 1
    return 0


#: ``dsakit train`` hands every argument (``--help`` included) to this module's parser
TRAIN_COMMAND_CONTEXT = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def train_command(ctx: typer.Context) -> None:
    """Train the tiny DSA model (dense, indexer KL, sparse); `dsakit train --help` lists the flags."""
    raise typer.Exit(main(list(ctx.args)))


if __name__ == "__main__":
    sys.exit(main())
