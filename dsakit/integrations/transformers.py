"""Run a Hugging Face transformers DeepSeek-V4 model on dsakit's attention blocks.

>>> model = DeepseekV4ForCausalLM.from_pretrained(...)          # doctest: +SKIP
>>> patch_deepseek_v4(model, index_key_format="bf16")           # doctest: +SKIP
>>> model.generate(input_ids, max_new_tokens=32)                 # doctest: +SKIP

:func:`patch_deepseek_v4` replaces every ``layer.self_attn`` (transformers' ``DeepseekV4Attention``) with a
:class:`PatchedDeepseekV4Attention`, a :class:`dsakit.layers.V4Attention` whose parameters *are* the original
module's (the same ``nn.Parameter`` objects under the same names: nothing is copied, the state dict keys do not
change). The patched block keeps its sequences in dsakit's paged caches (main KV, compressed entries, index
keys), attached to the transformers cache object that ``generate`` passes around, and leaves only zero-width
placeholders in transformers' own cache layers so their token counts (``get_seq_length``, the masks) stay
right. Conventions that differ from transformers' eager code are listed in docs/layers.md.

Not supported (ValueError or documented): beam search / cache reordering, assisted generation (transformers
already refuses it for V4), left-padded batches (positions are each sequence's own token count).
"""

from __future__ import annotations

import torch
from torch import nn

from ..formats import AttentionKVFormat, KeyFormat
from ..layers.attention import V4Attention, V4LayerCache
from ..layers.indexer import rope_from_transformers

__all__ = ["patch_deepseek_v4", "unpatch_deepseek_v4", "PatchedDeepseekV4Attention", "LAYER_TYPE_NAMES"]

LAYER_TYPE_NAMES = {"compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca",
                    "sliding_attention": "window"}
_STATE_ATTR = "_dsakit_layer_state"


class _SequenceState:
    """dsakit caches of one patched layer for the batch rows of one transformers cache."""

    def __init__(self, layer: V4Attention, batch: int, max_tokens: int, device: torch.device):
        self.cache = V4LayerCache(layer, max_tokens=max_tokens, max_sequences=batch, device=device)
        self.seqs = [self.cache.add_sequence() for _ in range(batch)]


class PatchedDeepseekV4Attention(V4Attention):
    """Drop-in for transformers' ``DeepseekV4Attention`` (same forward signature and parameter names)."""

    def __init__(self, original: nn.Module, *, index_key_format, topk, kv_format, backend, max_tokens):
        config = original.config
        layer_type = LAYER_TYPE_NAMES.get(original.layer_type)
        if layer_type is None:
            raise ValueError(f"unknown DeepSeek-V4 layer type {original.layer_type!r}")
        rates = dict(getattr(config, "compress_rates", None) or {})
        if layer_type == "csa" and rates.get("compressed_sparse_attention", 4) != 4:
            raise ValueError(f"CSA compress rate must be 4 (overlapping windows), config has "
                             f"{rates['compressed_sparse_attention']}")
        rope_owner = original.compressor.rotary_emb if original.compressor is not None else None
        if rope_owner is None:  # window-only layers: transformers passes the model's "main" rope in
            rope_owner = _model_rotary(original)
        rope = rope_from_transformers(rope_owner, "main" if layer_type == "window" else "compress")
        if config.head_dim != 512:
            raise ValueError(f"head_dim must be 512, config has {config.head_dim}")
        with torch.device("meta"):  # placeholders only: every parameter is replaced by the original's below
            super().__init__(
                layer_type, config.hidden_size, config.q_lora_rank, num_heads=config.num_attention_heads,
                o_groups=config.o_groups, o_lora_rank=config.o_lora_rank, index_heads=config.index_n_heads,
                index_topk=int(config.index_topk) if topk is None else topk, index_key_format=index_key_format,
                kv_format=kv_format, window=config.sliding_window, rope=rope, eps=float(config.rms_norm_eps),
                hca_ratio=int(rates.get("heavily_compressed_attention", 128)), backend=backend)
        self.config = config
        self.layer_idx = original.layer_idx
        self.max_tokens = max_tokens
        _share_parameters(self, original)
        _check_epsilons(self, original)

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, position_ids=None,
                attention_mask=None, cache=None, **kwargs):
        """hidden_states [B, S, hidden] -> (output [B, S, hidden], None). ``position_embeddings``,
        ``position_ids`` and ``attention_mask`` are not used: positions are each sequence's token count in
        dsakit's cache, and the window / compressed-entry visibility rules replace the mask."""
        if kwargs.get("past_key_values") is not None and cache is None:
            cache = kwargs["past_key_values"]
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be [B, S, hidden], got "
                             f"{list(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else hidden_states!r}")
        batch, seq_len, _ = hidden_states.shape
        state = self._state(cache, batch, seq_len, hidden_states)
        out = V4Attention.forward(self, hidden_states, state.cache, state.seqs)
        return out.to(hidden_states.dtype), None

    def _state(self, cache, batch: int, seq_len: int, hidden_states: torch.Tensor) -> _SequenceState:
        if cache is None:  # a forward without cache: a fresh sequence per call
            return _SequenceState(self, batch, max(seq_len, 1), hidden_states.device)
        layer = cache.layers[self.layer_idx]
        state = getattr(layer, _STATE_ATTR, None)
        seen = layer.get_seq_length()
        if state is None:
            if seen:
                raise ValueError(f"layer {self.layer_idx}: the transformers cache already holds {seen} tokens that "
                                 f"dsakit never saw (patch the model before the cache is filled)")
            state = _SequenceState(self, batch, max(self.max_tokens, seq_len), hidden_states.device)
            setattr(layer, _STATE_ATTR, state)
        if len(state.seqs) != batch:
            raise ValueError(f"layer {self.layer_idx}: the cache holds {len(state.seqs)} sequences, the input has "
                             f"{batch} (cache reordering / beam search is not supported)")
        held = state.cache.length(state.seqs[0])
        if held != seen:
            raise ValueError(f"layer {self.layer_idx}: dsakit holds {held} tokens, the transformers cache {seen} "
                             f"(cropped or reordered caches are not supported)")
        # zero-width placeholder: transformers' cache layer counts the tokens (masks, get_seq_length)
        placeholder = hidden_states.new_zeros(batch, 1, seq_len, 0)
        cache.update(placeholder, placeholder, self.layer_idx)
        return state


def _model_rotary(attention: nn.Module) -> nn.Module:
    """The rotary embedding a window-only layer uses: one built from the layer's config (same buffers as the
    model's ``rotary_emb``, which the attention module does not hold)."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    return DeepseekV4RotaryEmbedding(attention.config)


def _set_parameter(root: nn.Module, name: str, param: nn.Parameter) -> None:
    *path, leaf = name.split(".")
    module = root
    for part in path:
        module = getattr(module, part)
    mine = getattr(module, leaf)
    if not isinstance(mine, nn.Parameter):
        raise ValueError(f"dsakit's block has no parameter {name!r}")
    if mine.shape != param.shape:
        raise ValueError(f"parameter {name}: transformers has {list(param.shape)}, dsakit expects {list(mine.shape)}")
    setattr(module, leaf, param)


def _share_parameters(mine: nn.Module, original: nn.Module) -> None:
    """Make every parameter of ``mine`` the very Parameter object of ``original`` under the same name."""
    theirs = dict(original.named_parameters())
    ours = dict(mine.named_parameters())
    if set(theirs) != set(ours):
        raise ValueError(f"parameter names differ: only in transformers {sorted(set(theirs) - set(ours))}, "
                         f"only in dsakit {sorted(set(ours) - set(theirs))}")
    for name, param in theirs.items():
        _set_parameter(mine, name, param)


def _check_epsilons(mine: V4Attention, original: nn.Module) -> None:
    """Each RMSNorm takes its own module's epsilon (they all come from rms_norm_eps in transformers)."""
    for name, module in original.named_modules():
        eps = getattr(module, "variance_epsilon", None)
        if eps is not None:
            target = mine.get_submodule(name)
            target.variance_epsilon = float(eps)
    unit = getattr(original, "q_b_norm", None)
    if unit is not None and getattr(unit, "eps", None) is not None:
        mine.eps = float(unit.eps)


def _decoder_layers(model: nn.Module):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None or not len(layers) or not hasattr(layers[0], "self_attn"):
        raise ValueError(f"{type(model).__name__} is not a transformers DeepseekV4 model (no .layers[i].self_attn)")
    return layers


def patch_deepseek_v4(model: nn.Module, index_key_format: "KeyFormat | str | None" = "bf16",
                      topk: int | None = None, *, kv_format: "AttentionKVFormat | str" = "bf16",
                      backend: str = "auto", max_tokens: int = 4096) -> nn.Module:
    """Swap every attention block of a loaded transformers DeepseekV4 model for dsakit's, in place.

    index_key_format: index-key cache format of the CSA layers ("bf16", "fp8", "fp4", ...; None = the
        ``DSAKIT_INDEX_KEY_FORMAT`` environment variable or the preset's default).
    topk: compressed entries per query (default: the config's ``index_topk``).
    kv_format: main / compressed KV cache format ("bf16" | "fp8-rope-bf16").
    max_tokens: initial cache capacity per sequence (caches grow when exceeded).
    Returns the model. Parameters are shared, not copied. Idempotent for already patched layers.
    """
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if topk is not None and (not isinstance(topk, int) or isinstance(topk, bool) or topk < 1):
        raise ValueError(f"topk must be a positive int or None, got {topk!r}")
    layers = _decoder_layers(model)
    for layer in layers:
        if isinstance(layer.self_attn, PatchedDeepseekV4Attention):
            continue
        layer.self_attn = PatchedDeepseekV4Attention(layer.self_attn, index_key_format=index_key_format, topk=topk,
                                                     kv_format=kv_format, backend=backend, max_tokens=max_tokens)
    return model


def unpatch_deepseek_v4(model: nn.Module) -> nn.Module:
    """Put transformers' attention blocks back (same shared parameters), in place; returns the model."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention

    for layer in _decoder_layers(model):
        patched = layer.self_attn
        if not isinstance(patched, PatchedDeepseekV4Attention):
            continue
        original = DeepseekV4Attention(patched.config, patched.layer_idx).to(patched.q_a_proj.weight.device)
        for name, param in patched.named_parameters():
            _set_parameter(original, name, param)
        layer.self_attn = original
    return model
