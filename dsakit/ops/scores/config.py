"""Launch configuration of the Triton scores kernels: :class:`ScoresConfig` and its per-GPU defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checks import check_int, check_power_of_two
from .._tuning import gpu_key

KERNELS = ("auto", "tile", "group")
DECODE_FP4 = ("blocks", "dequant")
DECODE_LOADS = ("gather", "tma")


@dataclass(frozen=True)
class ScoresConfig:
    """Tuning of :func:`dsakit.ops.scores.triton.index_scores_triton` (all compile-time launch choices).

    kernel: "auto" (group kernel when each sequence has <= 4 queries and H is a power of two >= 16), "tile"
    (prefill) or "group" (decode). prefill_*: BLOCK_T x BLOCK_N tile, warps (None = 4, or 8 for tiles larger
    than 64 x 128, and for page-centred formats from 64 x 128 on) and pipeline stages of the tile kernel (None =
    the format's ``KeyCodec.prefill_stages``: 2 for bf16 keys, 3 otherwise).
    decode_*: BLOCK_N (None = the key format's preferred tile, see ``KeyCodec.decode_block_n``; 64 for
    page-centred formats from 128 query heads per program on), key tiles per program (None = min(the format's
    ``KeyCodec.decode_tiles``, enough to cover W in four programs' worth)), warps and stages (None = the
    format's ``KeyCodec.decode_stages``; 8 tiles and 3 stages above 64 query-head columns per program) of the
    group kernel; decode_maxnreg / prefill_maxnreg: a register cap per thread for the group / tile kernel
    (None = the launch default: the compiler's choice, except 128 for fp4 keys read by page copies at <= 64
    query-head columns per program; a lower cap lets more programs share an SM, at the risk of spills).
    decode_fp4: how the group kernel reads fp4 keys: "blocks" (one dot per 32-element scale block on the e2m1
    codes placed in e4m3 bits, each block's scale applied to its dot's result per entry; fp8 tensor cores when
    q is fp8 e4m3, bf16 otherwise) or "dequant" (the keys dequantized to a bf16 tile in registers, one bf16
    dot). Both are exact; the prefill kernel always dequantizes.
    decode_loads: how the group kernel reads fp8 keys with e4m3 queries: "tma" (default: one bulk
    tensor-memory-accelerator copy per 64-entry page on sm_90+; key tiles are then one page, decode_block_n is
    ignored and decode_tiles_per_program counts pages) or "gather" (per-entry addresses through the block table,
    asynchronous copies). Other formats, query dtypes and GPUs before sm_90 always gather.
    """

    kernel: str = "auto"
    prefill_block_t: int = 64
    prefill_block_n: int = 128
    prefill_warps: int | None = None
    prefill_stages: int | None = None
    decode_block_n: int | None = None
    decode_tiles_per_program: int | None = None
    decode_warps: int = 4
    decode_stages: int | None = None
    decode_fp4: str = "blocks"
    decode_maxnreg: int | None = None
    decode_loads: str = "tma"
    prefill_maxnreg: int | None = None

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be 'auto', 'tile' or 'group', got {self.kernel!r}")
        if self.decode_fp4 not in DECODE_FP4:
            raise ValueError(f"decode_fp4 must be 'blocks' or 'dequant', got {self.decode_fp4!r}")
        if self.decode_loads not in DECODE_LOADS:
            raise ValueError(f"decode_loads must be 'gather' or 'tma', got {self.decode_loads!r}")
        bt = self.prefill_block_t
        check_power_of_two("block_t (prefill_block_t)", bt, 16)
        for name in ("prefill_block_n", "decode_block_n"):
            value = getattr(self, name)
            check_power_of_two(name, value, 16, allow_none=True)
        for name in ("prefill_warps", "decode_warps", "decode_tiles_per_program", "prefill_stages", "decode_stages"):
            value = getattr(self, name)
            check_int(name, value, 1, message=f"{name} must be a positive int", allow_none=True)

        for name in ("decode_maxnreg", "prefill_maxnreg"):
            reg = getattr(self, name)
            if reg is not None and (isinstance(reg, bool) or not isinstance(reg, int) or not 24 <= reg <= 255
                                    or reg % 8):
                raise ValueError(f"{name} must be None or a multiple of 8 in 24..255, got {reg!r}")

    @staticmethod
    def for_device(device: "torch.device | str | None" = None) -> "ScoresConfig":
        """The measured defaults of the GPU of ``device`` (the H200 table for GPUs not measured yet)."""
        return SCORES_DEFAULTS[gpu_key(device, SCORES_DEFAULTS)]


# Measured on the H200 (benchmarks/results/scores_h200_c7d9b66.json, T = 8192 x N = 64K and B = 64 x N = 64K /
# 128K): prefill (BLOCK_T, BLOCK_N, warps, stages) = (64, 128, 4, 3) was fastest for every format (bf16 keys
# later measured 0.4-2.3 % faster on 2 stages, the codec's prefill_stages); decode
# (BLOCK_N, tiles per program, warps, stages) = (64, 8, 4, 3) for bf16 / fp8 and (128, 8, 4, 3) for fp4 (the
# per-format BLOCK_N lives with the format's codec).
SCORES_DEFAULTS: dict[str, ScoresConfig] = {"H200": ScoresConfig(), "default": ScoresConfig()}

__all__ = ["ScoresConfig", "SCORES_DEFAULTS"]
