"""Tiny random DeepSeek-V4 models shared by the tests that compare dsakit with Hugging Face transformers
(CPU only, nothing downloaded). Import after ``pytest.importorskip`` of transformers' deepseek_v4 modules."""

from __future__ import annotations

import torch

# The V4 rope scaling (yarn), as in the released config.
V4_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
           "beta_fast": 32, "beta_slow": 1}


def tiny_v4_config(**overrides):
    """A DeepseekV4Config small enough for the CPU: hidden 64, q_lora_rank 32, 2 attention heads of 512,
    2 layers, an indexer of 4 heads x 128 with top-k 8, 4 experts; ``overrides`` replace any of these."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    kwargs = dict(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=512,
                  q_lora_rank=32, index_n_heads=4, index_head_dim=128, index_topk=8,
                  n_routed_experts=4, moe_intermediate_size=16, rope_parameters=dict(V4_YARN))
    kwargs.update(overrides)
    return DeepseekV4Config(**kwargs)


def randomize_v4_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Weights like a trained model's, drawn from ``gen``: matrices N(0, 1/fan_in), position bias N(0, 0.5^2),
    norm weights 1 + N(0, 0.1^2), attention sinks N(0, 1), other vectors N(0, 0.1^2). (transformers
    allocates some of these, position_bias among them, with torch.empty: they must be initialized.)"""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
