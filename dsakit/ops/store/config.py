"""Launch configuration of the Triton store kernels: :class:`StoreConfig` and its per-GPU defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._memory import check_choice, check_int, check_power_of_two
from .._tuning import gpu_key


KERNELS = ("auto", "generic")


# The page-summary launch that follows a store whose pages may get several rows (each program walks the entries
# of the pages its rows end, so few rows a program): fixed launch constants, not tuning. They are not a config
# field until a per-GPU table sets them from a measurement (docs/layout.md).
SUMMARY_ROWS_PER_PROGRAM = 4
SUMMARY_WARPS = 1


@dataclass(frozen=True)
class StoreConfig:
    """Every launch setting of the store kernels; the launchers (``triton.py``) read them and derive nothing.

    index_*: the fast index-key kernel (two lanes per row, 16 rows per warp); page_term_*: the same kernel for
    the page-centred formats (rows per program and warps; it holds a second transformed tile in bulk stores);
    attention_*: the fast attention-KV kernel (eight lanes per row, 4 rows per warp); generic_*: the
    any-rope-geometry kernels. index_kernel / attention_kernel: ``"auto"`` runs the fast kernel where it
    applies (rope_dim 64; attention: rope on the trailing dims of the fp8-rope-bf16 entry), ``"generic"``
    always the generic one (tests and benchmarks compare the two).
    page_term_two_launches_from: a page-centred store of at least this many rows takes two launches (the
    pages' centres, then the entries) instead of one (entry 0's row transformed again by the programs that
    need its centre); 0 = always one launch.
    """

    index_block_n: int = 32
    index_warps: int = 2
    page_term_block_n: int = 32
    page_term_warps: int = 2
    attention_block_n: int = 8
    attention_warps: int = 2
    generic_index_block_n: int = 16
    generic_attention_block_n: int = 4
    generic_warps: int = 4
    index_kernel: str = "auto"
    attention_kernel: str = "auto"
    page_term_two_launches_from: int = 0

    def __post_init__(self):
        for name, value in self.__dict__.items():
            if name in ("index_kernel", "attention_kernel"):
                check_choice(name, value, KERNELS)
            elif name == "page_term_two_launches_from":
                check_int(name, value, 0, message=f"{name} must be an int >= 0 (0 = never)")
            else:
                check_power_of_two(name, value)

    @staticmethod
    def for_device(device: "torch.device | str | None" = None) -> "StoreConfig":
        """The measured defaults of the GPU of ``device`` (the H200 table for GPUs not measured yet)."""
        return STORE_DEFAULTS[gpu_key(device, STORE_DEFAULTS)]

    def fast_index_kernel(self, rope_dim: int) -> bool:
        """The quarter-tile index kernel covers rope_dim 64 (every preset); other widths take the generic one."""
        return self.index_kernel == "auto" and rope_dim == 64

    def fast_attention_kernel(self, rope_dim: int, placement: str, kind: str) -> bool:
        """The fast attention kernel covers 64 rope dims at the tail (V4) of the fp8-rope-bf16 entry, the only
        entry it writes; plain bf16 entries and every other rope geometry take the generic kernel (which for
        bf16 entries also measured faster on the H200: 1M rows 0.88 ms against 1.39, benchmarks/NOTES.md)."""
        return self.attention_kernel == "auto" and rope_dim == 64 and placement == "trailing" \
            and kind == "fp8-rope-bf16"

    def page_term_launches(self, rows: int) -> int:
        """Launches of a page-centred store of ``rows`` rows: 1, or 2 from page_term_two_launches_from on."""
        return 2 if 0 < self.page_term_two_launches_from <= rows else 1

    def index_launch(self, rope_dim: int, page_term: bool) -> tuple[bool, int, int]:
        """(fast kernel?, rows per program, warps) of an index-key store."""
        if not self.fast_index_kernel(rope_dim):
            return False, self.generic_index_block_n, self.generic_warps
        if page_term:
            return True, self.page_term_block_n, self.page_term_warps
        return True, self.index_block_n, self.index_warps


# Measured on the H200 (benchmarks/results/store_h200_v2_inregister.json): index keys 32 rows x 2 warps was
# fastest (64 x 4 within 1%); attention KV 8 rows x 2 warps. The generic kernels use 16 rows x 4 warps for
# index keys (larger row blocks trip a Triton 3.6 layout pass, RemoveLayoutConversions, on their 1-D row
# vectors) and 4 rows x 4 warps for attention KV (benchmarks/results/store_h200_v1_butterfly.json).
STORE_DEFAULTS: dict[str, StoreConfig] = {"H200": StoreConfig(), "default": StoreConfig()}

__all__ = ["StoreConfig", "STORE_DEFAULTS"]
