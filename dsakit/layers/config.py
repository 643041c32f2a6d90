"""What one V4 attention block is: :class:`V4AttentionConfig`, a frozen record checked once when it is made.

:meth:`V4AttentionConfig.from_preset` fills every setting not given from a :class:`dsakit.presets.DSAPreset`
(heads, top-k, window, rope, index-key format); the index-key format, when not given, comes from
``$DSAKIT_INDEX_KEY_FORMAT`` (deployments flip it without code) and then from the preset.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from .._memory import check_choice, check_float, check_instance, check_positive_int
from ..formats import ATTENTION_HEAD_DIM, AttentionKVFormat, KeyFormat
from ..ops._backend import BACKENDS
from ..ops.indexer.config import HierarchyConfig
from ..presets import DSAPreset, get_preset
from ..transforms import ROPE_V4, RopeConfig, RopeLayout

__all__ = ["V4AttentionConfig", "LAYER_TYPES", "INDEX_KEY_FORMAT_ENV", "DEFAULT_QUERY_CHUNK",
           "resolve_index_key_format"]

INDEX_KEY_FORMAT_ENV = "DSAKIT_INDEX_KEY_FORMAT"
# tokens per compressed entry of each layer type (hca: the config's hca_ratio, 128 in V4; window: none)
LAYER_TYPES = {"csa": 4, "hca": 128, "window": 0}
# queries per chunk of a prefill: bounds the [chunk, K] / [chunk, N_hca] index tensors and the attention's
# working set (the top-k op bounds its own score workspace)
DEFAULT_QUERY_CHUNK = 4096


def resolve_index_key_format(index_key_format: "KeyFormat | str | None", preset: DSAPreset) -> KeyFormat:
    """The explicit format if given; else ``$DSAKIT_INDEX_KEY_FORMAT`` if set; else the preset's default."""
    if index_key_format is not None:
        return KeyFormat.parse(index_key_format)
    env = os.environ.get(INDEX_KEY_FORMAT_ENV)
    if env is not None and env.strip():
        try:
            return KeyFormat.parse(env.strip())
        except ValueError as err:
            raise ValueError(f"${INDEX_KEY_FORMAT_ENV}={env!r} is not an index-key format: {err}") from None
    return preset.default_key_format


@dataclass(frozen=True)
class V4AttentionConfig:
    """Settings of one V4 attention block (inference).

    layer_type: "csa" | "hca" | "window". hidden_size, q_lora_rank: model dims. num_heads: attention heads H
    (head dim 512 = 448 no-rope + 64 rope). o_groups, o_lora_rank: grouped output projection (o_a: g groups
    of H * 512 / g -> o_lora_rank). index_heads, index_topk, index_key_format: the lightning indexer's heads,
    top-k and index-key cache format (csa). kv_format: main / compressed KV cache format. window: sliding
    window in raw tokens. rope: RopeConfig of the attention and compressed entries (V4: the plain "main"
    rope on window-only layers, the YaRN "compress" rope on csa / hca). eps: RMSNorm epsilon (each norm
    module may carry its own, see :mod:`dsakit.layers.from_transformers`). hca_ratio: tokens per entry of
    an hca block. backend: "auto" | "reference" | "triton" for the ops. query_chunk: queries per prefill
    chunk. preset: the DSAPreset of the model (its key transform is the index keys'). hierarchy: None (the
    default) for the flat indexer top-k (``index_topk``), or a :class:`~dsakit.ops.indexer.HierarchyConfig`
    (csa only) for hierarchical selection: the layer's index-key cache then keeps page summaries and the
    indexer selects with ``hierarchical_topk`` (docs/hierarchy.md).
    """

    layer_type: str
    hidden_size: int
    q_lora_rank: int
    num_heads: int
    index_heads: int
    index_topk: int
    window: int
    rope: RopeConfig
    index_key_format: KeyFormat
    preset: DSAPreset
    kv_format: AttentionKVFormat = AttentionKVFormat.parse("bf16")
    o_groups: int = 8
    o_lora_rank: int = 1024
    eps: float = 1e-6
    hca_ratio: int = 128
    backend: str = "auto"
    query_chunk: int = DEFAULT_QUERY_CHUNK
    hierarchy: HierarchyConfig | None = None

    def __post_init__(self):
        check_choice("layer_type", self.layer_type, LAYER_TYPES)
        preset = check_instance("preset", self.preset, DSAPreset)
        if preset.compress_ratio != 4 or preset.attention_head_dim != ATTENTION_HEAD_DIM:
            raise ValueError(f"V4Attention needs a DeepSeek-V4 preset, got {preset.name!r}")
        if preset.rope_layout != ROPE_V4:
            raise ValueError(f"V4Attention rotates interleaved trailing pairs; preset rope layout is "
                             f"{RopeLayout.parse(preset.rope_layout).name}")
        for name in ("hidden_size", "q_lora_rank", "num_heads", "o_groups", "o_lora_rank", "index_topk",
                     "index_heads", "window", "query_chunk", "hca_ratio"):
            check_positive_int(name, getattr(self, name))
        if self.num_heads * ATTENTION_HEAD_DIM % self.o_groups:
            raise ValueError(f"num_heads * 512 = {self.num_heads * ATTENTION_HEAD_DIM} must be divisible by "
                             f"o_groups {self.o_groups}")
        if self.hca_ratio == 4:
            raise ValueError("hca_ratio 4 would be the overlapping CSA compressor; HCA blocks do not overlap")
        check_instance("rope", self.rope, RopeConfig)
        if self.rope.rope_dim != preset.attention_rope_dim:
            raise ValueError(f"rope_dim must be {preset.attention_rope_dim}, got {self.rope.rope_dim}")
        eps = check_float("eps", self.eps, minimum=0)
        check_choice("backend", self.backend, BACKENDS)
        if self.hierarchy is not None:
            check_instance("hierarchy", self.hierarchy, HierarchyConfig, label="HierarchyConfig or None")
            if self.layer_type != "csa":
                raise ValueError(f"hierarchy selects the CSA indexer's entries; a {self.layer_type!r} layer has no "
                                 f"indexer (give it hierarchy=None)")
        # the formats as objects (strings accepted), the epsilon as a float
        object.__setattr__(self, "kv_format", AttentionKVFormat.parse(self.kv_format))
        object.__setattr__(self, "index_key_format", KeyFormat.parse(self.index_key_format))
        object.__setattr__(self, "eps", eps)

    @classmethod
    def from_preset(cls, layer_type: str, hidden_size: int, q_lora_rank: int, *,
                    preset: "str | DSAPreset" = "deepseek-v4-flash", num_heads: int | None = None,
                    index_heads: int | None = None, index_topk: int | None = None,
                    index_key_format: "KeyFormat | str | None" = None, window: int | None = None,
                    rope: RopeConfig | None = None, **settings) -> "V4AttentionConfig":
        """The config with every setting left None taken from ``preset``; ``settings``: kv_format, o_groups,
        o_lora_rank, eps, hca_ratio, backend, query_chunk, hierarchy."""
        preset = get_preset(preset)
        unknown = set(settings) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown V4 attention settings {sorted(unknown)}")
        return cls(layer_type=layer_type, hidden_size=hidden_size, q_lora_rank=q_lora_rank,
                   num_heads=preset.attention_heads if num_heads is None else num_heads,
                   index_heads=preset.index_heads if index_heads is None else index_heads,
                   index_topk=preset.index_topk if index_topk is None else index_topk,
                   window=preset.sliding_window if window is None else window,
                   rope=preset.rope if rope is None else rope,
                   index_key_format=resolve_index_key_format(index_key_format, preset), preset=preset, **settings)

    def replace(self, **changes) -> "V4AttentionConfig":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def ratio(self) -> int:
        """Tokens per compressed entry: 4 (csa), hca_ratio (hca), 0 (window)."""
        return self.hca_ratio if self.layer_type == "hca" else LAYER_TYPES[self.layer_type]

    @property
    def head_dim(self) -> int:
        return ATTENTION_HEAD_DIM
