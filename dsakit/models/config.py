"""The tiny DeepSeek-V4's architecture and the few places the training changes a built model: its config
(:func:`model_config`), the soft start of the attention (:func:`soften_attention_`), the sliding window and the
indexer's top-k (:func:`set_window`, :func:`set_topk`), and the modules the losses hook into."""

from __future__ import annotations

import torch

from .._memory import check_int

LAYER_TYPES = ["heavily_compressed_attention", "sliding_attention", "compressed_sparse_attention",
               "compressed_sparse_attention"]
V4_YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
           "beta_fast": 32, "beta_slow": 1}
MAX_POSITIONS = 65536
DENSE_TOPK = 1 << 20  # above any number of compressed entries: the CSA layers are dense
MAX_TOPK = MAX_POSITIONS // 4  # the CSA layers' compressed entries at the longest context (ratio 4)
MODEL_MAX_LENGTH = 16384  # what the tokenizer config advertises
DEFAULT_WINDOW = 128  # V4's sliding window
#: the attention's key norms (raw KV and compressed entries; K = V in V4), trained at their own learning rate
KEY_NORMS = ("self_attn.kv_norm.weight", "self_attn.compressor.kv_norm.weight")


def model_config(vocab_size: int, topk: int, *, hidden_size: int = 128, max_positions: int = MAX_POSITIONS,
                 sliding_window: int = DEFAULT_WINDOW):
    """The tiny DeepseekV4Config: 4 layers (hca, window, csa, csa), hidden 128, 2 heads of 512, q_lora 64,
    indexer 4 heads x 128, 2 routed experts (top-1) + a shared one of width 128, 2 hyper-connection streams."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES), mlp_layer_types=["moe"] * len(LAYER_TYPES), num_attention_heads=2,
        head_dim=512, q_lora_rank=64, o_groups=2, o_lora_rank=64, index_n_heads=4, index_head_dim=128,
        index_topk=topk, n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1, moe_intermediate_size=128,
        hc_mult=2, hc_sinkhorn_iters=8, sliding_window=sliding_window, max_position_embeddings=max_positions,
        rope_parameters=dict(V4_YARN), bos_token_id=2, eos_token_id=3, pad_token_id=0, tie_word_embeddings=False,
        num_nextn_predict_layers=0)


def soften_attention_(model, gain: float) -> None:
    """Start the attention's key norms (raw KV and compressed entries; K = V in V4) at ``gain`` and scale the
    output projection ``o_a_proj`` by 1 / gain, so values reach the residual at the usual size.

    Why: V4 normalises every query head to a fixed norm (an RMSNorm without weight), so a logit is
    sqrt(512) x cos(q, k) x the key norm's weight, and with transformers' init (weight 1) the attention starts
    sharp and random. The tiny model then never learnt to copy: on a toy task (a random 24-token sequence
    repeated, loss on the repeat, batch 16) it did not move in 900 steps, where a Llama of the same size
    copies after ~200 steps. With the key norms at 0.15 (soft attention at init, like an unnormalised query
    of small norm) and trained 10x faster than the rest (``key_norm_lr_mult``: the temperature can rise as
    soon as matching pays), it copies after ~220 steps. Only the initial values and learning rates change:
    the architecture is transformers' DeepseekV4."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.kv_norm.weight.fill_(gain)
            if attn.compressor is not None:
                attn.compressor.kv_norm.weight.fill_(gain)
            attn.o_a_proj.weight.mul_(1.0 / gain)


def set_window(model, window: int) -> None:
    """Give every attention layer (and the config, which builds the mask and is saved) a sliding window of
    ``window`` tokens; the weights do not depend on it."""
    check_int("window", window, 1)
    model.config.sliding_window = window
    for layer in model.model.layers:
        layer.self_attn.sliding_window = window


def indexer_modules(model) -> list:
    """The lightning indexers of the CSA layers, in layer order."""
    return [layer.self_attn.compressor.indexer for layer in model.model.layers
            if getattr(layer.self_attn, "compressor", None) is not None
            and hasattr(layer.self_attn.compressor, "indexer")]


def csa_attentions(model) -> list:
    """The attention modules of the compressed-sparse (indexer) layers, in layer order."""
    return [layer.self_attn for layer in model.model.layers
            if layer.self_attn.layer_type == "compressed_sparse_attention"]


def set_topk(model, topk: int) -> None:
    """Let every indexer select ``topk`` compressed entries (``DENSE_TOPK``: all of them)."""
    for indexer in indexer_modules(model):
        indexer.index_topk = topk
