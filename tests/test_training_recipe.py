"""The shipped checkpoint's recipe (models/dsakit-v4-tiny/recipe.json) is what made it, and reruns to the same
losses (issue 36, item 5).

* the recipe's settings are the ``args`` its two training logs recorded (train_log_copy_toy.json for the copy
  toy, train_log.json for the documents), but for the documented ``stop_at_step`` of the copy toy;
* the recipe's first steps rerun to the logged losses: step 1 against train_log_copy_toy.json (the shipped
  run's log, same torch 2.13.0), steps 1-2 against recipe_check.json (recorded with the recipe, since the
  shipped log only has every 50th step);
* the documented one-line command, cut to one step per phase with ``--stop-at-step``, runs both phases.
  Tolerance: relative 1e-5 (the same torch build gave bit-identical values; the margin covers other
  thread counts' reduction order).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "models" / "dsakit-v4-tiny"
RECIPE = MODEL_DIR / "recipe.json"
LOGS = {"copy_toy": MODEL_DIR / "train_log_copy_toy.json", "documents": MODEL_DIR / "train_log.json"}
REL = 1e-5


@pytest.fixture
def one_thread():
    """One CPU thread: on a shared 2-core machine two threads spin against each other (a step takes ~5x the
    CPU time); the losses do not depend on it (within REL)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_recipe_settings_are_the_logged_ones():
    from dsakit.models.settings import differing_settings, load_recipe, plan

    phases, _ = load_recipe(RECIPE)
    assert [p.name for p in phases] == ["copy_toy", "documents"] and phases[1].init_from == "copy_toy"
    for phase, settings in plan(phases, "unused", REPO):
        logged = json.loads(LOGS[phase.name].read_text())["args"]
        # the recipe names the tokenizer relative to the repository, the log as the run was called
        differ = differing_settings(settings, logged, ignore=("out", "resume", "init_from", "tokenizer"))
        expected = {"stop_at_step": (1200, 0)} if phase.name == "copy_toy" else {}
        assert differ == expected, (phase.name, differ)
        assert Path(settings.tokenizer) == MODEL_DIR and logged["tokenizer"] == "models/dsakit-v4-tiny"
    # phase 2 starts from phase 1, as the shipped run did (--init-from TOY)
    assert json.loads(LOGS["documents"].read_text())["args"]["init_from"] is not None


def test_recipe_reruns_its_first_steps_to_the_logged_losses(tmp_path, one_thread):
    """The copy toy phase of the recipe, its first two steps: the same losses as logged and recorded."""
    import dataclasses

    from dsakit.models.loop import train
    from dsakit.models.settings import check_settings, load_recipe, plan

    phases, _ = load_recipe(RECIPE)
    _, settings = plan(phases, tmp_path / "tiny", REPO)[0]
    log = train(check_settings(dataclasses.replace(settings, stop_at_step=2, log_every=1, workers=0)))
    rerun = log["steps"]
    shipped_first = json.loads(LOGS["copy_toy"].read_text())["steps"][0]
    recorded = json.loads((MODEL_DIR / "recipe_check.json").read_text())["steps"]
    assert [r["step"] for r in rerun] == [1, 2]
    for key in ("lm", "answer"):
        assert rerun[0][key] == pytest.approx(shipped_first[key], rel=REL)
        for got, want in zip(rerun, recorded[:2]):
            assert got[key] == pytest.approx(want[key], rel=REL), (got, want)
    assert [(r["length"], r["lr"]) for r in rerun] == [(r["length"], r["lr"]) for r in recorded[:2]]


def test_documented_recipe_command_runs_both_phases(tmp_path, capsys, one_thread):
    """`dsakit train --recipe models/dsakit-v4-tiny/recipe.json --out DIR` (the model card's command), cut to
    one step per phase: phase 2 starts from phase 1 and writes a checkpoint dsakit serve can load on its own."""
    from transformers import DeepseekV4ForCausalLM

    from dsakit.models.train import main

    out = tmp_path / "tiny"
    assert main(["--recipe", str(RECIPE), "--out", str(out), "--stop-at-step", "1", "--workers", "0"]) == 0
    first = json.loads((out / "copy_toy" / "train_log.json").read_text())["steps"][0]
    assert first["lm"] == pytest.approx(json.loads(LOGS["copy_toy"].read_text())["steps"][0]["lm"], rel=REL)
    documents = json.loads((out / "train_log.json").read_text())
    assert documents["args"]["init_from"] == str(out / "copy_toy") and documents["stage_steps"] == {"dense": 1}
    model = DeepseekV4ForCausalLM.from_pretrained(out)
    assert model.config.index_topk == 16 and model.config.sliding_window == 16
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file()
    # rerun: both phases are found finished and skipped; other settings in the same --out are refused
    assert main(["--recipe", str(RECIPE), "--out", str(out), "--stop-at-step", "1", "--workers", "0"]) == 0
    assert capsys.readouterr().out.count("skipped") == 2
    assert main(["--recipe", str(RECIPE), "--out", str(out), "--stop-at-step", "3", "--workers", "0"]) == 2
    assert "other settings" in capsys.readouterr().err
