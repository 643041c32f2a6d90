"""The model card's commands run as written (issue 35, deliverable 6): models/dsakit-v4-tiny/README.md.

Each ```bash block of the card runs from a fresh working directory that sees the repository's ``models/``
(outputs land there, not in the clone), with ``dsakit`` / ``python`` on the PATH as after
``source .venv/bin/activate``, made small by the replacements in ``SMALL`` (each must occur in the card, so the
card and this test cannot drift apart). The training command is the one tests/test_training_recipe.py runs.
The probe honours ``--depth``, and the niah script's defaults are the card's table.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
pytest.importorskip("tokenizers")

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "models" / "dsakit-v4-tiny"
CARD = MODEL_DIR / "README.md"
TRAIN = "dsakit train --recipe models/dsakit-v4-tiny/recipe.json --out tiny-rerun"
# command in the card -> the same command at a small size
SMALL = {
    "passkey": {"--length 1024 --cases 10": "--length 256 --cases 1"},
    "niah": {'OUT=niah-bf16 FORMATS="bf16" TOPKS="16" models/tools/niah.sh':
             'OUT=niah-bf16 FORMATS="bf16" TOPKS="16" LENGTHS=512 DEPTHS=0.5 TRIALS=1 models/tools/niah.sh',
             "OUT=niah-all models/tools/niah.sh":
             'OUT=niah-all FORMATS="fp4" TOPKS="8" LENGTHS=512 DEPTHS=0.5 TRIALS=1 models/tools/niah.sh'},
    "probe": {"--lengths 2048,4096": "--lengths 256"},
}


def card_blocks() -> dict[str, str]:
    blocks = re.findall(r"```bash\n(.*?)```", CARD.read_text(), flags=re.S)
    named = {}
    for block in blocks:
        name = ("train" if "dsakit train" in block else "passkey" if "passkey.py" in block
                else "niah" if "niah.sh" in block else "probe" if "probe.py" in block else None)
        assert name is not None and name not in named, f"an unexpected command block in the card:\n{block}"
        named[name] = block
    assert sorted(named) == ["niah", "passkey", "probe", "train"]
    return named


def small(name: str) -> str:
    block = card_blocks()[name]
    for big, little in SMALL.get(name, {}).items():
        assert big in block, f"the card's {name} command changed: {big!r} not in\n{block}"
        block = block.replace(big, little)
    return block


def run_block(block: str, workdir: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    """``block`` in bash (errexit) in ``workdir``, which sees the repository's models/; dsakit, python and
    python3 are this interpreter with this checkout importable."""
    bin_dir = workdir / "bin"
    bin_dir.mkdir()
    for name, target in (("python", ""), ("python3", ""), ("dsakit", " -m dsakit.cli")):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec "{sys.executable}"{target} "$@"\n')
        (bin_dir / name).chmod(0o755)
    (workdir / "models").symlink_to(REPO / "models")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_the_training_command_is_the_one_the_recipe_test_runs():
    assert card_blocks()["train"].strip() == TRAIN
    recipe_test = (REPO / "tests" / "test_training_recipe.py").read_text()
    assert '["--recipe", str(RECIPE), "--out", str(out)' in recipe_test


def test_passkey_command_runs(tmp_path):
    proc = run_block(small("passkey"), tmp_path)
    assert re.search(r"found [01] / 1 at ~256 tokens", proc.stdout), proc.stdout


def test_probe_and_recall_commands_run(tmp_path):
    run_block(small("probe"), tmp_path)
    probe = json.loads((tmp_path / "probe" / "probe.json").read_text())
    assert probe["depth"] == 0.5 and [r["layer"] for r in probe["runs"]] == [2, 3]
    for layer in (2, 3):  # one recall run per capture file, each with its own --out
        rows = [json.loads(line) for line in (tmp_path / f"recall_L256_layer{layer}" / "runs.jsonl").open()]
        assert {r["format"] for r in rows if r["kind"] == "run"} == {"bf16", "fp8", "fp4", "fp8-centred",
                                                                       "fp4-centred"}


@pytest.mark.slow
def test_niah_commands_run(tmp_path):
    run_block(small("niah"), tmp_path, timeout=600)
    for run in ("niah-bf16/bf16_k16", "niah-all/fp4_k8"):
        rows = [json.loads(line) for line in (tmp_path / run / "results.jsonl").open()]
        assert [r["length"] for r in rows] == [512] and rows[0]["depth"] == 0.5
    assert "| fp4 | 8 |" in (tmp_path / "niah-all" / "table.md").read_text()


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_probe_puts_the_needle_at_the_depth_it_is_given(depth, monkeypatch):
    """The needle's first token sits at ``depth`` of the filler (it used to land at a random depth: 0.73 and
    0.95 for a requested 0.5)."""
    monkeypatch.syspath_prepend(str(REPO / "models" / "tools"))
    from probe import passkey_ids

    from dsakit.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(MODEL_DIR)
    for length in (1024, 2048):
        ids, answer_start, (code_start, _) = passkey_ids(tokenizer, length, depth, seed=0)
        assert len(ids) <= length
        # intro (~30 tokens) before the filler and the question (~25) after it shift the position a little
        assert abs(code_start / answer_start - depth) < 0.06, (length, code_start, answer_start)


def test_niah_script_defaults_are_the_cards_table():
    script = (REPO / "models" / "tools" / "niah.sh").read_text()
    defaults = dict(re.findall(r'^(\w+)=\$\{\1:-"?([^"}]*)"?\}', script, flags=re.M))
    card = CARD.read_text()
    table = re.search(r"\| index keys \| top-k \| (.*?) \| all \|\n\|[-|]+\|\n((?:\|.*\|\n)+)", card)
    columns = [c.replace(" tok", "") for c in table.group(1).split(" | ")]
    rows = [line.split(" | ")[:2] for line in table.group(2).splitlines()]
    assert sorted({r[0].strip("| ") for r in rows}) == sorted(defaults["FORMATS"].split())
    assert sorted({int(r[1]) for r in rows}) == sorted(int(k) for k in defaults["TOPKS"].split())
    assert [int(c) for c in columns] == [int(x.rstrip("K")) * 1024 for x in defaults["LENGTHS"].split(",")]
    depths = defaults["DEPTHS"].split(",")
    assert f"depths {', '.join(depths)}, {defaults['TRIALS']} trials" in card
    per_cell = len(depths) * int(defaults["TRIALS"])
    assert f"(15/15)" in table.group(2) and per_cell == 15
    # the committed grid is the one the defaults run
    committed = json.loads((MODEL_DIR / "eval" / "niah" / "table.json").read_text())
    assert len(committed) == len(rows)
