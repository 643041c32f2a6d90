"""DSAIndexer.from_transformers on modules whose config is not the V4 default: the keys' RMSNorm epsilon comes
from the module, and a model cast to bf16 (which casts the rope frequency buffers too) still converts."""

from __future__ import annotations

import pytest
import torch

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4",
                               reason="transformers with DeepSeek-V4 is a test-only dependency")
configuration = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")

from dsakit.layers import DSAIndexer, rope_from_transformers  # noqa: E402
from dsakit.presets import get_preset  # noqa: E402

V4_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
           "beta_fast": 32, "beta_slow": 1}
HIDDEN, Q_LORA = 64, 32


def tiny_config(**overrides):
    kwargs = dict(vocab_size=32, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2, head_dim=512,
                  q_lora_rank=Q_LORA, index_n_heads=4, index_head_dim=128, index_topk=8,
                  n_routed_experts=4, moe_intermediate_size=16, rope_parameters=dict(V4_YARN))
    kwargs.update(overrides)
    return configuration.DeepseekV4Config(**kwargs)


def make_indexer(weight_scale: float = 1.0, **config):
    gen = torch.Generator().manual_seed(3)
    indexer = modeling.DeepseekV4Indexer(tiny_config(**config)).eval()
    with torch.no_grad():
        for name, p in indexer.named_parameters():
            if name == "position_bias":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.1)
            else:
                scale = weight_scale if name.startswith(("kv_proj", "gate_proj")) else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 * scale)
    return indexer


def transformers_keys(indexer, hidden):
    """Post-norm, post-rope keys as transformers computes them (captured at the scorer)."""
    captured = {}
    handle = indexer.scorer.register_forward_hook(lambda m, args, out: captured.update(keys=args[1].detach()))
    with torch.no_grad():
        indexer(hidden.unsqueeze(0), torch.randn(1, hidden.shape[0], Q_LORA), torch.arange(hidden.shape[0])[None],
                None, 0)
    handle.remove()
    return captured["keys"][0]


def test_key_norm_epsilon_comes_from_the_module():
    """rms_norm_eps = 1e-5 with small pre-norm keys (rms ~ 3e-3): a hard-coded 1e-6 changes the keys by
    tens of percent; the module's own epsilon reproduces transformers' keys."""
    indexer = make_indexer(weight_scale=0.01, rms_norm_eps=1e-5)
    assert indexer.kv_norm.variance_epsilon == 1e-5
    hidden = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(5))
    ix = DSAIndexer.from_transformers(indexer)
    assert ix.transform().eps == 1e-5
    pre = ix.compressed_keys(hidden)
    assert float(pre.pow(2).mean().sqrt()) < 1e-2  # small enough that the epsilon matters
    theirs = transformers_keys(indexer, hidden)
    ours = ix.keys(hidden, hadamard=False)
    assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    # what the hard-coded 1e-6 gave: far from transformers (so this test fails without the fix)
    wrong = DSAIndexer.from_transformers(indexer)
    wrong.kv_norm.variance_epsilon = get_preset("deepseek-v4-flash").key_transform.eps  # the epsilon's home
    rel = ((wrong.keys(hidden, hadamard=False) - theirs).norm(dim=1) / theirs.norm(dim=1)).max()
    assert float(rel) > 0.05


def test_norm_eps_is_validated():
    base = DSAIndexer.random(HIDDEN, Q_LORA)
    args = dict(wq_b=base.wq_b, weights_proj=base.weights_proj, wkv=base.wkv, wgate=base.wgate, ape=base.ape,
                norm_weight=base.norm_weight)
    for bad in (-1e-6, float("nan"), "1e-6", True):
        with pytest.raises(ValueError, match="norm_eps"):
            DSAIndexer(**args, norm_eps=bad)
    assert DSAIndexer(**args, norm_eps=1e-5).transform().eps == 1e-5


def test_bf16_cast_module_converts_with_the_exact_rope():
    """model.to(torch.bfloat16) casts the inv_freq buffers; the conversion must still work and return the
    config's exact frequencies (not the bf16-rounded ones)."""
    indexer = make_indexer()
    fp32_rope = rope_from_transformers(indexer.rotary_emb)
    indexer = indexer.to(torch.bfloat16)
    assert indexer.rotary_emb.compress_inv_freq.dtype == torch.bfloat16
    ix = DSAIndexer.from_transformers(indexer)
    assert ix.rope == fp32_rope == get_preset("deepseek-v4-flash").rope
    assert torch.equal(ix.wq_b, indexer.q_b_proj.weight.float())


def test_frequency_mismatch_names_the_buffer_and_config():
    indexer = make_indexer()
    with torch.no_grad():
        indexer.rotary_emb.compress_inv_freq.mul_(1.01)
    with pytest.raises(ValueError, match=r"compress_inv_freq buffer \(torch.float32.*rope_parameters\['compress'\]"):
        DSAIndexer.from_transformers(indexer)
    # a bf16 buffer off by more than one bf16 rounding is still caught
    indexer = make_indexer().to(torch.bfloat16)
    with torch.no_grad():
        indexer.rotary_emb.compress_inv_freq.mul_(1.05)
    with pytest.raises(ValueError, match="torch.bfloat16"):
        DSAIndexer.from_transformers(indexer)
