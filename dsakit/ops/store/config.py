"""Launch configuration of the Triton store kernels: :class:`StoreConfig` and its per-GPU defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checks import check_power_of_two
from .._tuning import gpu_key


@dataclass(frozen=True)
class StoreConfig:
    """Rows per program and warps of the store kernels.

    index_*: the fast index-key kernel (two lanes per row, 16 rows per warp); attention_*: the fast
    attention-KV kernel (eight lanes per row, 4 rows per warp); generic_*: the any-rope-geometry kernels.
    """

    index_block_n: int = 32
    index_warps: int = 2
    attention_block_n: int = 8
    attention_warps: int = 2
    generic_index_block_n: int = 16
    generic_attention_block_n: int = 4
    generic_warps: int = 4

    def __post_init__(self):
        for name, value in self.__dict__.items():
            check_power_of_two(name, value)

    @staticmethod
    def for_device(device: "torch.device | str | None" = None) -> "StoreConfig":
        """The measured defaults of the GPU of ``device`` (the H200 table for GPUs not measured yet)."""
        return STORE_DEFAULTS[gpu_key(device, STORE_DEFAULTS)]


# Measured on the H200 (benchmarks/results/store_h200_v2_inregister.json): index keys 32 rows x 2 warps was
# fastest (64 x 4 within 1%); attention KV 8 rows x 2 warps. The generic kernels use 16 rows x 4 warps for
# index keys (larger row blocks trip a Triton 3.6 layout pass, RemoveLayoutConversions, on their 1-D row
# vectors) and 4 rows x 4 warps for attention KV (benchmarks/results/store_h200_v1_butterfly.json).
STORE_DEFAULTS: dict[str, StoreConfig] = {"H200": StoreConfig(), "default": StoreConfig()}

__all__ = ["StoreConfig", "STORE_DEFAULTS"]
