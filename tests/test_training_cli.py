"""The training command refuses nonsense before the first step and never loses the run (issue 35, class 5).

Every bad argument is one line on stderr and exit 2, with nothing written; a run whose loss or weights turn
NaN / Inf stops with exit 1 instead of saving them; the checkpoint is written before the final evaluation;
``--init-from`` a checkpoint missing a tensor is refused by name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "models" / "dsakit-v4-tiny"
# the smallest real run: one 128-token row per step, the committed tokenizer, no workers, no final evaluation
SMALL = ["--tokenizer", str(MODEL_DIR), "--device", "cpu", "--lengths", "128", "--tokens-per-batch", "128",
         "--workers", "0", "--eval-docs", "0", "--log-every", "1", "--topk", "4"]


def run_main(argv) -> int:
    from dsakit.models.train import main

    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own refusals (a value that is not a number, ...)
        return exc.code


BAD_ARGUMENTS = {
    # ranges that ran forever or crashed at the first step
    "negative steps": ["--steps=-1,1,1"],
    "zero steps": ["--steps", "0,1,1"],
    "two steps": ["--steps", "5,5"],
    "negative budget": ["--budget-seconds=-5"],
    "NaN budget": ["--budget-seconds", "nan"],
    "negative fraction": ["--fractions=-0.1,0.5,0.5"],
    "NaN fraction": ["--fractions", "nan,0.1,0.1"],
    "fractions above 1": ["--fractions", "0.5,0.5,0.5"],
    # checkpoints dsakit serve refuses
    "zero top-k": ["--topk", "0"],
    "negative window": ["--window=-16"],
    "zero window (became 128)": ["--window", "0"],
    # non-finite numbers that trained to NaN weights and exit 0
    "infinite lr": ["--dense-lr", "inf"],
    "NaN lr": ["--dense-lr", "nan"],
    "NaN lm weight": ["--lm-weight", "nan"],
    "infinite answer weight": ["--answer-weight", "inf"],
    "negative answer weight": ["--answer-weight=-1"],
    "no loss at all": ["--lm-weight", "0", "--answer-weight", "0"],
    "NaN clip norm": ["--clip-norm", "nan"],
    "infinite key-norm init": ["--key-norm-init", "inf"],
    "zero key-norm init": ["--key-norm-init", "0"],
    "NaN key-norm lr": ["--key-norm-lr-mult", "nan"],
    # failures only the final evaluation used to find, after the whole schedule
    "negative eval docs": ["--eval-docs=-1"],
    "zero eval length": ["--eval-lengths", "0", "--eval-docs", "1"],
    "no eval length": ["--eval-lengths", "", "--eval-docs", "1"],
    # the rest of the surface
    "zero log interval": ["--log-every", "0"],
    "repeat rate 1": ["--repeat-rate", "1"],
    "unknown kind": ["--kinds", "passkey=1,bogus=2"],
    "kind without weight": ["--kinds", "passkey"],
    "NaN kind weight": ["--kinds", "passkey=nan"],
    "all kinds zero": ["--kinds", "passkey=0"],
    "short length": ["--lengths", "64"],
    "not a length": ["--lengths", "abc"],
    "batch below the length": ["--lengths", "256", "--tokens-per-batch", "128"],
    "batch of a trillion tokens": ["--tokens-per-batch", "1000000000000"],
    "gap of a billion tokens": ["--copy-min-gap", "1000000000"],
    "negative stop": ["--stop-at-step=-1"],
    "negative copy steps": ["--copy-steps=-1"],
    "gapped share above 1": ["--copy-gapped-share", "1.5"],
    "zero copy gap": ["--copy-min-gap", "0"],
    "negative short steps": ["--short-steps=-1"],
    "negative workers": ["--workers=-1"],
    "negative seed": ["--seed=-1"],
    "zero save interval": ["--save-every-seconds", "0"],
    "unknown device": ["--device", "bogus"],
    "resume without resume.pt": ["--resume", str(MODEL_DIR)],
    "missing init-from": ["--init-from", "/nonexistent/checkpoint"],
    "tokenizer without tokenizer.json": ["--tokenizer", str(REPO / "docs")],
}


@pytest.mark.parametrize("bad", list(BAD_ARGUMENTS.values()), ids=list(BAD_ARGUMENTS))
def test_bad_argument_is_one_line_exit_2_and_writes_nothing(bad, tmp_path, capsys):
    out = tmp_path / "run"
    assert run_main(["--out", str(out), *SMALL, *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err and "Traceback" not in err, err
    assert not out.exists()


def test_recipe_refuses_a_setting_beside_it_and_a_bad_recipe(tmp_path, capsys):
    recipe = str(MODEL_DIR / "recipe.json")
    assert run_main(["--recipe", recipe, "--out", str(tmp_path / "a"), "--topk", "4"]) == 2
    assert "--topk" in capsys.readouterr().err
    broken = tmp_path / "broken.json"
    for text, words in (("{", "not JSON"), ('{"phases": []}', "phases"),
                        ('{"phases": [{"name": "a", "settings": {"topk": 0}}]}', "--topk"),
                        ('{"phases": [{"name": "a", "settings": {"out": "x"}}]}', "setting"),
                        ('{"phases": [{"name": "a", "init_from": "b"}]}', "init_from")):
        broken.write_text(text)
        assert run_main(["--recipe", str(broken), "--out", str(tmp_path / "b")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "b").exists()


def test_the_dsakit_command_prints_no_traceback():
    """Through `dsakit train` (the installed entry point): one line, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "dsakit.cli", "train", "--out", "unused", "--window", "0"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "dsakit train: error: --window must be an int in 1..65536, got 0"


def test_init_from_a_checkpoint_missing_a_tensor_is_refused_by_name(tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    from dsakit.models.config import model_config

    ckpt = tmp_path / "ckpt"
    DeepseekV4ForCausalLM(model_config(599, 4, hidden_size=64, max_positions=512)).save_pretrained(ckpt)
    weights = load_file(ckpt / "model.safetensors")
    dropped = sorted(n for n in weights if "indexer" in n)[0]
    del weights[dropped]
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "run"
    assert run_main(["--out", str(out), *SMALL, "--init-from", str(ckpt), "--steps", "1,1,1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("dsakit train: error:") and "missing tensor" in err and "indexer" in err, err
    assert not out.exists()


def test_a_loss_that_turns_non_finite_stops_the_run_without_saving_it(tmp_path, capsys):
    """A finite but absurd learning rate blows the weights up: the run stops (exit 1) at the first NaN / Inf
    loss instead of training on and saving NaN weights with exit 0."""
    out = tmp_path / "run"
    assert run_main(["--out", str(out), *SMALL, "--steps", "4,1,1", "--dense-lr", "1e30", "--clip-norm", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("dsakit train: stopped:"), err
    assert "not finite" in err or "loss is" in err, err
    assert not (out / "model.safetensors").exists()


def test_non_finite_weights_are_never_saved(tmp_path):
    from dsakit.models.config import model_config
    from dsakit.models.loop import NonFiniteTraining, save
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(model_config(599, 4, hidden_size=64, max_positions=512))
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteTraining, match="lm_head.weight"):
        save(model, None, {}, {"steps": [], "stage_starts": []}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "model.safetensors").exists()


def test_the_checkpoint_is_saved_before_the_final_evaluation(tmp_path, monkeypatch, capsys):
    from dsakit.models import loop

    def failing_evaluation(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(loop, "evaluate", failing_evaluation)
    out = tmp_path / "run"
    with pytest.raises(RuntimeError, match="evaluation failed"):
        run_main(["--out", str(out), *SMALL, "--steps", "1,1,1", "--eval-docs", "1", "--eval-lengths", "128"])
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    log = json.loads((out / "train_log.json").read_text())
    assert log["finished"] and log["stage_steps"] == {"dense": 1, "indexer": 1, "sparse": 1}
