"""Recall lab on captured tensors: file round trip, planted needle, and the transformers DeepseekV4 hook."""

import pytest
import torch

from dsakit.ops.indexer import index_scores_dense
from dsakit.ops.indexer import select_topk
from dsakit.recall.captured import CapturedTensors, capture_deepseek_v4_indexer, load_captured, run_captured, save_captured


def _planted(t=3, h=8, n=300, needle=123, seed=0):
    """Random keys with one entry that every query points at: the needle is rank 0 under exact scoring."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, 128, generator=gen)
    u = k[needle] / k[needle].norm()
    q = 0.3 * torch.randn(t, h, 128, generator=gen) + 4.0 * u
    w = torch.rand(t, h, generator=gen) + 0.1
    return CapturedTensors(q=q, k=k, weights=w, needle_entries=torch.tensor([needle]), ratio=1, rotated=True)


def test_roundtrip_and_validation(tmp_path):
    cap = _planted()
    cap.query_positions = torch.tensor([297, 298, 299])
    path = save_captured(tmp_path / "cap.safetensors", cap)
    back = load_captured(path)
    assert torch.equal(back.q, cap.q) and torch.equal(back.k, cap.k) and torch.equal(back.weights, cap.weights)
    assert back.needle_entries.tolist() == [123] and back.query_positions.tolist() == [297, 298, 299]
    assert back.ratio == 1 and back.rotated
    with pytest.raises(ValueError, match="weights must be"):
        CapturedTensors(q=cap.q, k=cap.k, weights=cap.weights[:1])
    with pytest.raises(ValueError, match="needle_entries"):
        CapturedTensors(q=cap.q, k=cap.k, weights=cap.weights, needle_entries=torch.tensor([300]))
    with pytest.raises(ValueError, match="does not exist"):
        load_captured(tmp_path / "missing.safetensors")
    for formats, topks, match in (("bf16", [16], "sequences"), (["bf16"], [0], "topks"), (["bf16"], [True], "topks"),
                                  (["bf16", "fp6"], [16], "fp6")):
        with pytest.raises(ValueError, match=match):  # "bf16" used to be read as the formats 'b', 'f', ...
            run_captured(cap, formats, topks)


def test_planted_needle_is_found_and_metrics_are_sane():
    records = run_captured(_planted(), ["bf16", "fp8", "fp4"], [16, 64])
    assert len(records) == 6
    for r in records:
        assert r["exact_rank"] == 0 and r["exact_found"]
        assert r["found"] == (r["needle_rank"] < r["index_topk"])
        assert 0.0 <= r["set_recall"] <= 1.0
    bf16 = [r for r in records if r["format"] == "bf16"]
    assert all(r["needle_rank"] == 0 and r["set_recall"] > 0.9 for r in bf16)


def test_unrotated_capture_is_rotated_before_quantizing():
    cap = _planted()
    plain = run_captured(cap, ["bf16"], [16])[0]
    cap.rotated = False  # the lab applies the Hadamard rotation to q and k: exact ranks are unchanged
    rotated = run_captured(cap, ["bf16"], [16])[0]
    assert rotated["exact_rank"] == plain["exact_rank"] == 0


def test_capture_from_transformers_deepseek_v4_indexer():
    """The hook records q, keys and folded weights that reproduce the indexer's own top-k."""
    config_mod = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")
    model_mod = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    torch.manual_seed(0)
    config = config_mod.DeepseekV4Config(hidden_size=64, q_lora_rank=32, index_n_heads=4, index_head_dim=128,
                                         index_topk=8, num_hidden_layers=4, vocab_size=100, num_attention_heads=4,
                                         head_dim=64)
    indexer = model_mod.DeepseekV4Indexer(config).eval()
    torch.nn.init.normal_(indexer.position_bias)
    seq = 64
    hidden = torch.randn(1, seq, 64)
    q_residual = torch.randn(1, seq, 32)
    positions = torch.arange(seq).unsqueeze(0)
    with torch.no_grad(), capture_deepseek_v4_indexer(indexer) as cap:
        chosen = indexer(hidden, q_residual, positions, None, 0)
    got = cap.last
    assert got.q.shape == (seq, 4, 128) and got.k.shape == (seq // 4, 128) and got.weights.shape == (seq, 4)
    assert got.ratio == 4 and not got.rotated and got.query_positions.tolist() == list(range(seq))
    scores = index_scores_dense(got.q, got.weights, got.k, got.query_positions, got.ratio)
    ours = select_topk(scores, 8)
    theirs = chosen[0]
    same = 0
    for row in range(seq):
        a = ours[row][ours[row] >= 0]
        b = theirs[row][theirs[row] >= 0]
        assert a.numel() == b.numel(), row
        if a.numel() == 0:
            continue
        # compared as sets up to near-ties: every index they chose scores within rounding of our k-th score
        kth = float(scores[row, a].min())
        assert float(scores[row, b].min()) >= kth - 1e-4 * abs(kth) - 1e-6, row
        same += set(a.tolist()) == set(b.tolist())
    assert same >= seq - 8
    records = run_captured(got, ["fp8"], [4])
    assert records[0]["needle_rank"] is None and records[0]["leaked"] == 0
