"""Model geometry presets (docs/spec.md §1) as frozen config objects.

>>> from dsakit.presets import get_preset
>>> p = get_preset("deepseek-v4-flash"); p.index_topk, p.compress_ratio, p.rope_layout.name
(512, 4, 'interleaved-trailing')
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ._memory import check_bool, check_choice, check_float
from .formats import KeyFormat
from .transforms import NORMS, ROPE_V4, ROPE_V32, RopeConfig, RopeLayout, YarnConfig


@dataclass(frozen=True)
class KeyTransform:
    """What happens to an index key between the compressor (or wk projection) and the quantizer."""

    norm: str = "rmsnorm"  # "rmsnorm" (V4) | "layernorm" (V3.2, with bias)
    rope_layout: RopeLayout = ROPE_V4
    rope_dim: int = 64
    hadamard: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        check_choice("norm", self.norm, NORMS)
        # a layout given by name is stored as a RopeLayout: callers use .segment() / .pairing on it
        object.__setattr__(self, "rope_layout", RopeLayout.parse(self.rope_layout))
        if not isinstance(self.rope_dim, int) or isinstance(self.rope_dim, bool) or self.rope_dim <= 0 \
                or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be a positive even int, got {self.rope_dim!r}")
        check_bool("hadamard", self.hadamard)
        # a string failed with TypeError; inf made every key zero; NaN every key NaN
        check_float("eps", self.eps, 0)


@dataclass(frozen=True)
class DSAPreset:
    name: str
    index_heads: int  # H
    index_head_dim: int  # D
    index_topk: int  # K
    compress_ratio: int  # 1 = one key per token (V3.2), 4 = CSA entries of 4 tokens (V4)
    compress_overlap: bool
    key_transform: KeyTransform
    rope: RopeConfig
    default_key_format: KeyFormat
    attention_heads: int
    attention_head_dim: int  # shared K = V
    attention_rope_dim: int
    sliding_window: int  # raw tokens attended besides the top-k entries (0 = none)
    attention_sink: bool
    notes: str = field(default="", compare=False)

    @property
    def rope_layout(self) -> RopeLayout:
        return self.key_transform.rope_layout

    def score_flops_per_pair(self) -> int:
        """2 * H * D floating-point operations per (query, visible entry) pair."""
        return 2 * self.index_heads * self.index_head_dim


_V4_ROPE = RopeConfig(rope_dim=64, theta=160000.0,
                      yarn=YarnConfig(factor=16.0, original_max_position=65536, beta_fast=32.0, beta_slow=1.0))

DEEPSEEK_V4_FLASH = DSAPreset(
    name="deepseek-v4-flash", index_heads=64, index_head_dim=128, index_topk=512, compress_ratio=4,
    compress_overlap=True, key_transform=KeyTransform("rmsnorm", ROPE_V4, 64, True, 1e-6), rope=_V4_ROPE,
    default_key_format=KeyFormat.FP4, attention_heads=64, attention_head_dim=512, attention_rope_dim=64,
    sliding_window=128, attention_sink=True,
    notes="43 layers; even layers 2..42 CSA (ratio 4, indexer), odd 3..41 HCA (ratio 128), 0-1 window only")

DEEPSEEK_V4_PRO = DSAPreset(
    name="deepseek-v4-pro", index_heads=64, index_head_dim=128, index_topk=1024, compress_ratio=4,
    compress_overlap=True, key_transform=KeyTransform("rmsnorm", ROPE_V4, 64, True, 1e-6), rope=_V4_ROPE,
    default_key_format=KeyFormat.FP4, attention_heads=128, attention_head_dim=512, attention_rope_dim=64,
    sliding_window=128, attention_sink=True)

DEEPSEEK_V32 = DSAPreset(
    name="deepseek-v3.2", index_heads=64, index_head_dim=128, index_topk=2048, compress_ratio=1,
    compress_overlap=False, key_transform=KeyTransform("layernorm", ROPE_V32, 64, True, 1e-6),
    rope=RopeConfig(rope_dim=64, theta=10000.0,
                    yarn=YarnConfig(factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0)),
    default_key_format=KeyFormat.FP8_UE8M0, attention_heads=128, attention_head_dim=576, attention_rope_dim=64,
    sliding_window=0, attention_sink=False, notes="MLA: kv_lora 512 + rope 64; one index key per token")

PRESETS: dict[str, DSAPreset] = {p.name: p for p in (DEEPSEEK_V4_FLASH, DEEPSEEK_V4_PRO, DEEPSEEK_V32)}


def get_preset(name: "str | DSAPreset") -> DSAPreset:
    """'deepseek-v4-flash' | 'deepseek-v4-pro' | 'deepseek-v3.2' (or a DSAPreset) -> DSAPreset."""
    if isinstance(name, DSAPreset):
        return name
    check_choice("preset", name, sorted(PRESETS))
    return PRESETS[name]
