"""Reading transformers' DeepSeek-V4 modules: the rope of a ``DeepseekV4RotaryEmbedding``, the
:class:`~dsakit.layers.config.V4AttentionConfig` of a ``DeepseekV4Attention``, and the sharing of its
parameters (the very ``nn.Parameter`` objects under the same names) and norm epsilons with a dsakit block.

Nothing here imports transformers at module level: the modules are read by attribute, and a module that is
not a DeepSeek-V4 attention block is refused with a ValueError naming what it lacks.
See docs/layers.md for :meth:`dsakit.layers.V4Attention.from_transformers`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..transforms import RopeConfig, YarnConfig
from .config import V4AttentionConfig

__all__ = ["rope_from_transformers", "config_from_transformers", "share_parameters", "copy_epsilons",
           "LAYER_TYPE_NAMES", "check_attention_module",
           "layer_config_from_transformers", "adopt_parameters", "indexer_arguments_from_transformers"]

# transformers' layer_types -> dsakit's
LAYER_TYPE_NAMES = {"compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca",
                    "sliding_attention": "window"}
_CONFIG_FIELDS = ("hidden_size", "q_lora_rank", "num_attention_heads", "o_groups", "o_lora_rank", "index_n_heads",
                  "index_topk", "sliding_window", "rms_norm_eps", "head_dim")
_ATTENTION_FIELDS = ("config", "layer_idx", "layer_type", "compressor", "q_a_proj", "kv_proj", "sinks")


def check_attention_module(module: nn.Module) -> None:
    """ValueError unless ``module`` looks like transformers' ``DeepseekV4Attention`` (read by attribute)."""
    missing = [name for name in _ATTENTION_FIELDS if not hasattr(module, name)]
    if not missing:
        missing = [f"config.{name}" for name in _CONFIG_FIELDS if not hasattr(module.config, name)]
    if missing:
        raise ValueError(f"{type(module).__name__} is not a transformers DeepseekV4Attention: it has no "
                         f"{', '.join(missing)}")
    if module.layer_type not in LAYER_TYPE_NAMES:
        raise ValueError(f"unknown DeepSeek-V4 layer type {module.layer_type!r}")


def config_from_transformers(module: nn.Module, *, rope: RopeConfig, index_key_format=None,
                             topk: int | None = None, kv_format="bf16", backend: str = "auto") -> V4AttentionConfig:
    """The V4AttentionConfig of a transformers ``DeepseekV4Attention`` (``rope``: its rope, read with
    :func:`rope_from_transformers` from the module that rotates it); ``topk`` None = the config's
    ``index_topk``. Raises ValueError for anything dsakit's block does not implement."""
    check_attention_module(module)
    config = module.config
    layer_type = LAYER_TYPE_NAMES[module.layer_type]
    rates = dict(getattr(config, "compress_rates", None) or {})
    if layer_type == "csa" and rates.get("compressed_sparse_attention", 4) != 4:
        raise ValueError(f"CSA compress rate must be 4 (overlapping windows), config has "
                         f"{rates['compressed_sparse_attention']}")
    if config.head_dim != 512:
        raise ValueError(f"head_dim must be 512, config has {config.head_dim}")
    unit = getattr(module, "q_b_norm", None)  # the unit RMSNorm of the queries has its own epsilon
    eps = getattr(unit, "eps", None)
    return V4AttentionConfig.from_preset(
        layer_type, config.hidden_size, config.q_lora_rank, num_heads=config.num_attention_heads,
        o_groups=config.o_groups, o_lora_rank=config.o_lora_rank, index_heads=config.index_n_heads,
        index_topk=int(config.index_topk) if topk is None else topk, index_key_format=index_key_format,
        kv_format=kv_format, window=config.sliding_window, rope=rope,
        eps=float(config.rms_norm_eps if eps is None else eps),
        hca_ratio=int(rates.get("heavily_compressed_attention", 128)), backend=backend)


def _set_parameter(root: nn.Module, name: str, param: nn.Parameter) -> None:
    module = root.get_submodule(name.rpartition(".")[0])
    leaf = name.rpartition(".")[2]
    mine = getattr(module, leaf)
    if not isinstance(mine, nn.Parameter):
        raise ValueError(f"the target block has no parameter {name!r}")
    if mine.shape != param.shape:
        raise ValueError(f"parameter {name}: the source has {list(param.shape)}, the target expects "
                         f"{list(mine.shape)}")
    setattr(module, leaf, param)


def share_parameters(mine: nn.Module, original: nn.Module) -> None:
    """Make every parameter of ``mine`` the very Parameter object of ``original`` under the same name
    (checked for every name and shape before the first is set)."""
    theirs = dict(original.named_parameters())
    ours = dict(mine.named_parameters())
    if set(theirs) != set(ours):
        raise ValueError(f"parameter names differ: only in transformers {sorted(set(theirs) - set(ours))}, "
                         f"only in dsakit {sorted(set(ours) - set(theirs))}")
    for name, param in theirs.items():
        if ours[name].shape != param.shape:
            raise ValueError(f"parameter {name}: transformers has {list(param.shape)}, dsakit expects "
                             f"{list(ours[name].shape)}")
    for name, param in theirs.items():
        _set_parameter(mine, name, param)


def copy_epsilons(mine: nn.Module, original: nn.Module) -> None:
    """Each RMSNorm takes its own module's epsilon (they all come from rms_norm_eps in transformers)."""
    for name, module in original.named_modules():
        eps = getattr(module, "variance_epsilon", None)
        if eps is not None:
            mine.get_submodule(name).variance_epsilon = float(eps)


def rope_from_transformers(rotary_emb: torch.nn.Module, layer_type: str = "compress") -> RopeConfig:
    """RopeConfig equal to a transformers ``DeepseekV4RotaryEmbedding``'s ``layer_type`` rope.

    Reads ``config.rope_parameters[layer_type]`` (theta, rope_type 'default' | 'yarn', factor,
    original_max_position_embeddings, beta_fast, beta_slow), rope_dim = 2 x len(inv_freq); verifies the
    frequencies against the module's ``inv_freq`` buffer and that cos/sin are not rescaled.

    The check runs at the buffer's own precision: transformers computes the buffer in fp32, but
    ``model.to(torch.bfloat16)`` casts it too, so a bf16 buffer is compared with the rebuilt frequencies
    rounded to bf16. The returned config always holds the exact (fp64) frequencies of the config.
    """
    config = getattr(rotary_emb, "config", None)
    params = getattr(config, "rope_parameters", {}).get(layer_type) if config is not None else None
    if not isinstance(params, dict):
        raise ValueError(f"rotary embedding has no rope_parameters[{layer_type!r}] dict")
    inv_freq = getattr(rotary_emb, f"{layer_type}_inv_freq")
    scaling = float(getattr(rotary_emb, f"{layer_type}_attention_scaling"))
    if scaling != 1.0:
        raise ValueError(f"transformers multiplies the {layer_type!r} cos/sin by attention_factor {scaling}; "
                         f"DeepSeek-V4 does not (set rope_parameters[{layer_type!r}]['attention_factor'] = 1.0)")
    rope_type = params.get("rope_type", "default")
    yarn = None
    if rope_type == "yarn":
        if params.get("truncate", True) is False:
            raise ValueError("YaRN with truncate=False is not the V4 rule (floor / ceil of the ramp bounds)")
        yarn = YarnConfig(factor=float(params["factor"]),
                          original_max_position=int(params["original_max_position_embeddings"]),
                          beta_fast=float(params.get("beta_fast") or 32.0),
                          beta_slow=float(params.get("beta_slow") or 1.0))
    elif rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} (V4 uses 'yarn' or 'default')")
    rope = RopeConfig(rope_dim=2 * inv_freq.numel(), theta=float(params["rope_theta"]), yarn=yarn)
    buffer = inv_freq.detach().cpu()
    if not buffer.is_floating_point():
        raise ValueError(f"the module's {layer_type}_inv_freq buffer is {buffer.dtype}, not a float tensor")
    # transformers computes inv_freq in fp32, dsakit in fp64; a cast model holds them rounded to its dtype:
    # compare both at the buffer's precision, allowing one rounding step of that dtype (fp32: 1e-5 as before)
    rebuilt = rope.inv_freq().to(buffer.dtype).double()
    rtol = max(1e-5, float(torch.finfo(buffer.dtype).eps))
    held = buffer.double()
    rel = ((rebuilt - held).abs() / held.abs().clamp_min(1e-30)).max() if held.numel() else torch.tensor(0.0)
    if held.shape != rebuilt.shape or not bool(torch.isfinite(held).all()) or float(rel) > rtol:
        yarn_desc = "no YaRN" if yarn is None else (f"YaRN factor {yarn.factor:g} from "
                                                    f"{yarn.original_max_position}")
        raise ValueError(
            f"the module's {layer_type}_inv_freq buffer ({buffer.dtype}, {held.numel()} pairs) is not the rope of "
            f"its config.rope_parameters[{layer_type!r}] (theta {rope.theta:g}, {yarn_desc}, {rope.rope_dim} dims): "
            f"largest relative difference {float(rel):.3g} > {rtol:.3g} (the tolerance of one {buffer.dtype} "
            f"rounding). The buffer was changed after construction or comes from another config")
    return rope


def _model_rotary(attention: nn.Module) -> nn.Module:
    """The rotary embedding a window-only layer uses: one built from the layer's config (same buffers as the
    model's ``rotary_emb``, which the attention module does not hold)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    return DeepseekV4RotaryEmbedding(attention.config)


def layer_config_from_transformers(module: nn.Module, **settings) -> V4AttentionConfig:
    """:func:`config_from_transformers` with the rope read off the module (its compressor's rotary embedding;
    window-only layers: the model's "main" rope, rebuilt from the config)."""
    check_attention_module(module)
    window_only = LAYER_TYPE_NAMES[module.layer_type] == "window"
    owner = module.compressor.rotary_emb if module.compressor is not None else _model_rotary(module)
    rope = rope_from_transformers(owner, "main" if window_only else "compress")
    return config_from_transformers(module, rope=rope, **settings)


def adopt_parameters(mine: nn.Module, original: nn.Module) -> None:
    """``mine`` takes ``original``'s parameters (the same objects) and its norms' epsilons."""
    share_parameters(mine, original)
    copy_epsilons(mine, original)


def indexer_arguments_from_transformers(indexer_module: nn.Module, compressor_module: nn.Module | None = None) -> dict:
    """The :class:`~dsakit.layers.indexer.DSAIndexer` arguments (weights, rope, index_topk, norm_eps) of a
    transformers ``DeepseekV4Indexer`` (or a module whose ``.indexer`` is one); ``compressor_module``: another
    module holding the compressor's four weights, if they are not the indexer's own. See
    :meth:`DSAIndexer.from_transformers`."""
    indexer = getattr(indexer_module, "indexer", indexer_module)
    for name in ("q_b_proj", "scorer", "rotary_emb", "compress_rate", "index_topk"):
        if not hasattr(indexer, name):
            raise ValueError(f"{type(indexer).__name__} is not a DeepseekV4Indexer: it has no {name!r}")
    source = indexer if compressor_module is None else compressor_module
    for name in ("kv_proj", "gate_proj", "position_bias", "kv_norm"):
        if not hasattr(source, name):
            raise ValueError(f"{type(source).__name__} has no compressor weight {name!r}")
    if indexer.compress_rate != 4:
        raise ValueError(f"indexer compress_rate must be 4, got {indexer.compress_rate}")
    rope = rope_from_transformers(indexer.rotary_emb, layer_type=getattr(indexer, "rope_layer_type", "compress"))
    eps = getattr(source.kv_norm, "variance_epsilon", None)
    if eps is None:
        raise ValueError(f"{type(source.kv_norm).__name__} has no variance_epsilon: cannot tell the keys' "
                         f"RMSNorm epsilon")
    return dict(wq_b=indexer.q_b_proj.weight, weights_proj=indexer.scorer.weights_proj.weight,
                wkv=source.kv_proj.weight, wgate=source.gate_proj.weight, ape=source.position_bias,
                norm_weight=source.kv_norm.weight, rope=rope, index_topk=int(indexer.index_topk), norm_eps=float(eps))
