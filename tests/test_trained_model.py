"""The tiny DSA model's training code at toy scale (dsakit.models; models/dsakit-v4-tiny/README.md).

The training script runs its three stages (dense, indexer KL, sparse) for a step each on the CPU, logs every
loss, and writes a checkpoint that loads with ``from_pretrained``. The documents are a pure function of
(seed, step, row) and hold what the losses need (answer, copyable repeated lines).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "models" / "dsakit-v4-tiny"


def test_training_script_runs_every_stage_on_the_cpu(tmp_path):
    from transformers import DeepseekV4ForCausalLM

    from dsakit.models.train import main

    out = tmp_path / "run"
    assert main(["--out", str(out), "--tokenizer", str(MODEL_DIR), "--device", "cpu", "--steps", "1,1,1",
                 "--lengths", "256", "--tokens-per-batch", "256", "--log-every", "1", "--eval-docs", "0",
                 "--workers", "0", "--topk", "4", "--repeat-rate", "0.5"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert [s["stage"] for s in log["stage_starts"]] == ["dense", "indexer", "sparse"]
    assert log["stage_steps"] == {"dense": 1, "indexer": 1, "sparse": 1}
    assert all(r["kl"] > 0 for r in log["steps"] if r["stage"] != "dense")
    assert (out / "loss_curves.png").stat().st_size > 0
    model = DeepseekV4ForCausalLM.from_pretrained(out)
    assert model.config.index_topk == 4


def test_documents_are_reproducible_and_hold_their_answers():
    from dsakit.models.data import DocumentBatches
    from dsakit.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(MODEL_DIR)
    data = DocumentBatches(tokenizer, [512], 2048, seed=3, repeat_rate=0.5)
    a, b = data.batch(7), data.batch(7)
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["copy_mask"], b["copy_mask"])
    assert a["input_ids"].shape == (4, 512)
    for row in range(4):
        ids = a["input_ids"][row][a["valid"][row]].tolist()
        answer = a["input_ids"][row][a["answer_mask"][row]].tolist()
        assert answer and answer[-1] == tokenizer.token_to_id("<eos>") and ids[-len(answer):] == answer
        assert ids[0] == tokenizer.token_to_id("<bos>")
    # repeated filler lines give copyable tokens, never inside the answer
    assert int(a["copy_mask"].sum()) > 0 and not bool((a["copy_mask"] & a["answer_mask"]).any())


def test_copy_warmup_batches_repeat_a_sequence_and_mask_only_the_predictable_copies():
    from dsakit.models.data import DocumentBatches
    from dsakit.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(MODEL_DIR)
    data = DocumentBatches(tokenizer, [256, 512], 2048, seed=1, copy_steps=4, short_length=512)
    early, late = data.batch(0), data.batch(3)
    assert torch.equal(early["input_ids"], data.batch(0)["input_ids"])  # a pure function of the step
    assert early["input_ids"].shape == (8, 256) and bool(early["valid"].all())
    assert torch.equal(early["answer_mask"], early["copy_mask"])
    specials = {tokenizer.token_to_id(t) for t in ("<pad>", "<unk>", "<bos>", "<eos>")}
    for batch in (early, late):
        for row in range(batch["input_ids"].shape[0]):
            ids = batch["input_ids"][row].tolist()
            assert ids[0] == tokenizer.token_to_id("<bos>") and not specials & set(ids[1:])
            masked = batch["copy_mask"][row].nonzero().flatten().tolist()
            assert masked and masked[0] > 3
            # every masked token repeats the token at the same offset of the first copy of the sequence
            period = next(p for p in range(16, 49) if ids[1 + p: 1 + 2 * p] == ids[1: 1 + p]) \
                if batch is early else None
            if period:
                assert all(ids[i] == ids[i - period] for i in masked)
    # the second half of the warm-up puts every other row's copies behind gaps of other random tokens
    gapped = late["input_ids"][1].tolist()
    assert gapped[1:17] != gapped[17:33]
    # after the warm-up the documents take over
    assert not torch.equal(data.batch(4)["answer_mask"], data.batch(4)["copy_mask"])


def test_copy_warmup_gaps_reach_past_the_window_when_asked():
    from dsakit.models.data import DocumentBatches
    from dsakit.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(MODEL_DIR)
    data = DocumentBatches(tokenizer, [512], 2048, seed=2, copy_steps=2, copy_gapped_share=1.0, copy_min_gap=160)
    late = data.batch(1)
    for row in range(late["input_ids"].shape[0]):
        ids = late["input_ids"][row].tolist()
        first_masked = int(late["copy_mask"][row].nonzero()[0])
        repeat_start = first_masked - 2  # the mask skips a repeat's first 2 tokens
        # the repeat copies the sequence (>= 16 tokens) that started after BOS, 160 or more tokens after its end
        assert ids[repeat_start:repeat_start + 16] == ids[1:17]
        assert repeat_start >= 1 + 16 + 160
    for bad in ({"copy_gapped_share": 1.5}, {"copy_min_gap": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DocumentBatches(tokenizer, [512], 2048, seed=2, copy_steps=2, **bad)


def test_set_window_narrows_every_layer_and_the_saved_config(tmp_path):
    from transformers import DeepseekV4ForCausalLM

    from dsakit.models.config import model_config, set_window

    model = DeepseekV4ForCausalLM(model_config(599, 4, hidden_size=64, max_positions=512))
    set_window(model, 64)
    assert model.config.sliding_window == 64
    assert {layer.self_attn.sliding_window for layer in model.model.layers} == {64}
    model.save_pretrained(tmp_path)
    assert DeepseekV4ForCausalLM.from_pretrained(tmp_path).config.sliding_window == 64
    with pytest.raises(ValueError, match="window"):
        set_window(model, 0)


SHIPPED = (MODEL_DIR / "model.safetensors").is_file()


@pytest.mark.skipif(not SHIPPED, reason="no trained weights shipped in models/dsakit-v4-tiny")
def test_shipped_model_finds_passkeys_at_1k_tokens_through_dsakit_blocks(monkeypatch):
    """The shipped checkpoint, patched onto dsakit's blocks with bf16 index keys at its top-k, finds the passkey
    of seeded ~1K-token documents (greedy) in at least 9 of 10 cases."""
    import time

    monkeypatch.syspath_prepend(str(REPO / "models" / "tools"))
    from passkey import found_passkeys

    torch.manual_seed(0)
    started = time.time()
    rows = found_passkeys(str(MODEL_DIR), length=1024, cases=10, seed=0, index_key_format="bf16")
    assert all(700 <= r["tokens"] <= 1024 for r in rows)
    assert sum(r["found"] for r in rows) >= 9, [(r["passkey"], r["output"]) for r in rows]
    assert time.time() - started < 60


def test_stop_at_step_saves_the_checkpoint_of_that_step(tmp_path):
    from dsakit.models.train import main

    out = tmp_path / "run"
    assert main(["--out", str(out), "--tokenizer", str(MODEL_DIR), "--device", "cpu", "--steps", "4,1,1",
                 "--lengths", "128", "--tokens-per-batch", "256", "--copy-steps", "4", "--stop-at-step", "2",
                 "--eval-docs", "0", "--workers", "0", "--topk", "4", "--log-every", "1"]) == 0
    log = json.loads((out / "train_log.json").read_text())
    assert log["stage_steps"] == {"dense": 2} and (out / "model.safetensors").is_file()
    assert (out / "resume.pt").is_file()
