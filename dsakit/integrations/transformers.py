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

A refused or failed call changes nothing: patching checks every layer before it replaces the first one, and a
forward of the patched model that raises puts every layer's caches (dsakit's and transformers' placeholders)
back as they were before it.

Not supported (ValueError or documented): beam search / cache reordering, assisted generation (transformers
already refuses it for V4), left-padded batches (positions are each sequence's own token count).
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

from .._memory import check_instance, check_positive_int, check_tensor
from ..formats import AttentionKVFormat, KeyFormat
from ..layers.attention import V4Attention
from ..layers.config import resolve_index_key_format
from ..presets import get_preset
from ..layers.from_transformers import (LAYER_TYPE_NAMES, adopt_parameters, check_attention_module,
                                        layer_config_from_transformers)
from ..layers.kv_cache import V4LayerCache
from ..ops.indexer.config import HierarchyConfig

__all__ = ["patch_deepseek_v4", "unpatch_deepseek_v4", "layer_settings", "PatchedDeepseekV4Attention",
           "LAYER_TYPE_NAMES"]

_STATE_ATTR = "_dsakit_layer_state"
_FORWARD_ATTR = "forward"
_DEFAULT_PRESET = "deepseek-v4-flash"  # the preset config_from_transformers builds on  # the decoder's instance attribute that makes its forward a transaction


class _SequenceState:
    """dsakit caches of one patched layer for the batch rows of one transformers cache."""

    def __init__(self, layer: V4Attention, batch: int, max_tokens: int, device: torch.device):
        self.cache = V4LayerCache(layer, max_tokens=max_tokens, max_sequences=batch, device=device)
        self.seqs = [self.cache.add_sequence() for _ in range(batch)]


class PatchedDeepseekV4Attention(V4Attention):
    """Drop-in for transformers' ``DeepseekV4Attention`` (same forward signature and parameter names).

    ``self.config`` is the transformers config; dsakit's settings are ``self.layer_config``. The replaced
    module is kept (not as a submodule: its parameters are this block's) so :func:`unpatch_deepseek_v4` puts
    back the very object, buffers included."""

    def __init__(self, original: nn.Module, *, index_key_format, topk, kv_format, backend, max_tokens,
                 hierarchy=None):
        config = layer_config_from_transformers(original, index_key_format=index_key_format, topk=topk,
                                                kv_format=kv_format, backend=backend)
        if hierarchy is not None and config.layer_type == "csa":  # the only layers with an indexer
            config = config.replace(hierarchy=hierarchy)
        with torch.device("meta"):  # placeholders only: every parameter is replaced by the original's below
            super().__init__(config)
        adopt_parameters(self, original)
        self.config = original.config
        self.layer_idx = original.layer_idx
        self.max_tokens = max_tokens
        object.__setattr__(self, "_original", original)  # plain attribute: not a submodule

    @property
    def original(self) -> nn.Module:
        """The transformers module this block replaced (sharing its parameters)."""
        return self._original

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, position_ids=None,
                attention_mask=None, cache=None, **kwargs):
        """hidden_states [B, S, hidden] -> (output [B, S, hidden], None). ``position_embeddings``,
        ``position_ids`` and ``attention_mask`` are not used: positions are each sequence's token count in
        dsakit's cache, and the window / compressed-entry visibility rules replace the mask."""
        if kwargs.get("past_key_values") is not None and cache is None:
            cache = kwargs["past_key_values"]
        check_tensor("hidden_states", hidden_states, dims=3, message="hidden_states must be [B, S, hidden]")
        batch, seq_len, _ = hidden_states.shape
        with _layer_transaction(cache, self.layer_idx):
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
        if state.cache.layer is not self:
            raise ValueError(f"layer {self.layer_idx}: the cache was filled by an earlier patch of this model "
                             f"(patched again since): start a new cache")
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


# --------------------------------------------------------------------------------------------------
# Transactions: a failed forward leaves every cache as it was
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _cache_transaction(cache, layer_indices=None):
    """On an exception, put the transformers cache ``cache`` (its layer list, the attributes of the layers at
    ``layer_indices``, default all: ``update`` replaces their tensors, never changes them) and the dsakit
    caches attached to those layers (their own transactions) back as they were."""
    layers = getattr(cache, "layers", None)
    if cache is None or layers is None or getattr(cache, "_dsakit_transaction", False):
        yield  # no cache, or an outer transaction covers it
        return
    indices = range(len(layers)) if layer_indices is None else [i for i in layer_indices if i < len(layers)]
    saved_layers = list(layers)
    saved_attrs = {i: {k: (dict(v) if isinstance(v, dict) else v) for k, v in vars(layers[i]).items()}
                   for i in indices}
    cache._dsakit_transaction = True
    try:
        with contextlib.ExitStack() as stack:
            for attrs in saved_attrs.values():
                state = attrs.get(_STATE_ATTR)
                if state is not None:
                    stack.enter_context(state.cache.transaction(state.seqs))
            yield
    except BaseException:
        cache.layers[:] = saved_layers
        for i, attrs in saved_attrs.items():
            vars(saved_layers[i]).clear()
            vars(saved_layers[i]).update(attrs)
        raise
    finally:
        del cache._dsakit_transaction


def _layer_transaction(cache, layer_idx: int):
    return _cache_transaction(cache, [layer_idx])


def _decoder_forward(self, *args, **kwargs):
    """The decoder's forward as one transaction on the cache it is given (instance attribute set by
    :func:`patch_deepseek_v4`): a failure in any layer leaves every layer's cache as it was."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None and len(args) > 3:
        cache = args[3]  # forward(input_ids, attention_mask, position_ids, cache, ...)
    with _cache_transaction(cache):
        return type(self).forward(self, *args, **kwargs)


# --------------------------------------------------------------------------------------------------
# Patching
# --------------------------------------------------------------------------------------------------


def _decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """(the module holding ``.layers``, the layers), every layer's ``self_attn`` a DeepSeek-V4 attention block
    (or an already patched one); ValueError otherwise, before anything is changed."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers) or not hasattr(layers[0], "self_attn"):
        raise ValueError(f"{type(model).__name__} is not a transformers DeepseekV4 model (no .layers[i].self_attn)")
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if isinstance(attn, PatchedDeepseekV4Attention):
            continue
        try:
            check_attention_module(attn)
        except ValueError as err:
            raise ValueError(f"{type(model).__name__} is not a transformers DeepseekV4 model: layer {i}: {err}") \
                from None
    return inner, layers


def _patch_settings(index_key_format, topk, kv_format, backend, max_tokens, hierarchy) -> dict:
    """The patch's arguments, checked and in canonical form (compared to decide whether to re-patch)."""
    check_positive_int("max_tokens", max_tokens)
    if hierarchy is not None:
        check_instance("hierarchy", hierarchy, HierarchyConfig, label="HierarchyConfig or None")
    if topk is not None:
        check_positive_int("topk", topk)
    if index_key_format is not None:
        index_key_format = KeyFormat.parse(index_key_format)
    return dict(index_key_format=index_key_format, topk=topk, kv_format=AttentionKVFormat.parse(kv_format),
                backend=backend, max_tokens=max_tokens, hierarchy=hierarchy)


def patch_deepseek_v4(model: nn.Module, index_key_format: "KeyFormat | str | None" = "bf16",
                      topk: int | None = None, *, kv_format: "AttentionKVFormat | str" = "bf16",
                      backend: str = "auto", max_tokens: int = 4096,
                      hierarchy: HierarchyConfig | None = None) -> nn.Module:
    """Swap every attention block of a loaded transformers DeepseekV4 model for dsakit's, in place.

    index_key_format: index-key cache format of the CSA layers ("bf16", "fp8", "fp4", ...; None = the
        ``DSAKIT_INDEX_KEY_FORMAT`` environment variable or the preset's default).
    topk: compressed entries per query (default: the config's ``index_topk``).
    kv_format: main / compressed KV cache format ("bf16" | "fp8-rope-bf16").
    max_tokens: initial cache capacity per sequence (caches grow when exceeded).
    hierarchy: None (the default: the flat indexer top-k) or a
        :class:`~dsakit.ops.indexer.HierarchyConfig`: the CSA layers select with hierarchical top-k, their
        index-key caches keeping page summaries (docs/hierarchy.md).
    Returns the model. Parameters are shared, not copied.

    Every layer is checked and its block built before the first one is replaced: a model that is not a
    DeepSeek-V4 one, or a layer dsakit cannot run, raises ValueError and leaves the model as it was. Patching
    a patched model again with the same arguments changes nothing; with other arguments it re-patches every
    layer with them (caches filled under the earlier patch are refused by the new blocks: start a new
    ``generate``).
    """
    settings = _patch_settings(index_key_format, topk, kv_format, backend, max_tokens, hierarchy)
    inner, layers = _decoder(model)
    # the format a block gets (None: $DSAKIT_INDEX_KEY_FORMAT or the preset's), compared to decide a re-patch
    resolved = resolve_index_key_format(settings["index_key_format"], get_preset(_DEFAULT_PRESET))
    built = {}
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        if isinstance(attn, PatchedDeepseekV4Attention):
            if attn.patch_settings == (settings, resolved):
                continue
            attn = attn.original
        block = PatchedDeepseekV4Attention(attn, **settings)
        block.patch_settings = (settings, resolved)
        built[i] = block
    for i, block in built.items():  # every layer checked: now replace
        layers[i].self_attn = block
    vars(inner)[_FORWARD_ATTR] = types.MethodType(_decoder_forward, inner)
    return model


@contextlib.contextmanager
def layer_settings(model: nn.Module, *, index_key_format: "KeyFormat | None" = None, topk: int | None = None,
                   query_chunk: int | None = None):
    """Run a patched model with other per-call settings, without re-patching: inside the ``with``, every patched
    block reads a copy of its :class:`~dsakit.layers.config.V4AttentionConfig` with the given fields replaced
    (None = keep the patch's); on the way out the patch's configs are back. Nothing else changes (parameters,
    buffers, modules), so it costs one checked config per block and setting (cached on the block; measured in
    docs/serve.md). Caches made inside the ``with`` take its formats: use them only inside it (a server makes a
    cache per request).

    index_key_format: a :class:`~dsakit.formats.KeyFormat` (parsed by the caller, once, at its edge).
    topk: compressed entries per query (csa). query_chunk: queries per prefill chunk (bounds the working set).
    Every setting is checked (on every block) before the first block changes."""
    if index_key_format is not None:
        index_key_format = KeyFormat.parse(index_key_format)  # an object passes through unchanged
    if topk is not None:
        check_positive_int("topk", topk)
    if query_chunk is not None:
        check_positive_int("query_chunk", query_chunk)
    _, layers = _decoder(model)
    blocks = [check_instance(f"layer {i}'s self_attn", layer.self_attn, PatchedDeepseekV4Attention,
                             "layer_settings runs a model patched by patch_deepseek_v4")
              for i, layer in enumerate(layers)]
    key = (index_key_format, topk, query_chunk)
    changes = {name: value for name, value in (("index_key_format", index_key_format), ("index_topk", topk),
                                               ("query_chunk", query_chunk)) if value is not None}
    saved = [b.layer_config for b in blocks]
    configs = []
    for block, base in zip(blocks, saved):
        variants = vars(block).setdefault("_setting_variants", {})  # key -> (the patch's config, variant)
        made = variants.get(key)
        if made is None or made[0] is not base:
            made = variants[key] = (base, base.replace(**changes) if changes else base)
        configs.append(made[1])
    try:
        for block, config in zip(blocks, configs):
            block.layer_config = config
        yield model
    finally:
        for block, config in zip(blocks, saved):
            block.layer_config = config


def unpatch_deepseek_v4(model: nn.Module) -> nn.Module:
    """Put transformers' attention blocks back, in place; returns the model.

    Each layer gets back the very module it had before patching: its parameters (shared all along), its
    buffers (the rotary ``inv_freq`` of a bf16-cast model stay bf16, bit for bit) and attributes. A model
    moved to another device after patching has those buffers moved to its parameters' device."""
    inner, layers = _decoder(model)
    for layer in layers:
        patched = layer.self_attn
        if isinstance(patched, PatchedDeepseekV4Attention):
            original = patched.original
            device = patched.q_a_proj.weight.device
            if any(b.device != device for b in original.buffers()):
                original.to(device)
            layer.self_attn = original
    vars(inner).pop(_FORWARD_ATTR, None)
    return model
