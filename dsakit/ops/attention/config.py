"""Launch configuration of the sparse-attention Triton kernels: :class:`AttentionConfig` and its per-GPU
defaults. The launcher (``triton.py``) reads every launch setting from here and derives none of its own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..._memory import check_choice, check_int, check_power_of_two
from .._tuning import gpu_key

# head counts the kernel takes: programs own HEAD_BLOCK heads of one query, and one program's [64, 512] fp32
# accumulator is what the warps below are sized for
TRITON_HEADS = (64, 128)
HEAD_BLOCK = 64
# which kernel runs the attention: "auto" = the Gluon kernel where it applies (an sm_90 GPU, Gluon importable,
# bf16 pools; see dsakit.ops.attention.triton.choose_attention_kernel), the portable Triton kernel elsewhere
ATTENTION_KERNELS = ("auto", "triton", "gluon")


def _stages_table(bf16_64: int, bf16_128: int, fp8_64: int, fp8_128: int) -> dict[tuple[str, int], int]:
    return {("bf16", 64): bf16_64, ("bf16", 128): bf16_128, ("fp8-rope-bf16", 64): fp8_64,
            ("fp8-rope-bf16", 128): fp8_128}


@dataclass(frozen=True)
class AttentionConfig:
    """Tuning of :func:`dsakit.ops.attention.triton.sparse_attention_triton`.

    block_n: gathered KV rows per tile. num_warps: warps of the main kernel (one program holds a [64, 512]
    fp32 accumulator, so 8 is the only count without heavy spills). stages: pipeline stages
    per (main-pool format kind, Hq); num_stages, when set, overrides the table for every case.
    num_splits: splits of each query's index set (None = :meth:`splits_for`: enough (query, head block,
    split) programs to fill the SMs about once; decode only, prefill fills them with queries).
    combine_block_h / combine_warps: heads per program and warps of the split-merging kernel.
    kernel: "auto" (the Gluon sm_90 kernel where it applies, else the portable kernel), "triton" (always the
    portable kernel) or "gluon" (ValueError naming the reason where it does not apply). The fields above
    are the portable kernel's; the Gluon kernel reads gluon_block_n (gathered rows per tile and the N of the
    QK wgmma; 64 or 32), gluon_stages (shared-memory buffers of gathered tiles, >= 2), gluon_overlap
    (FA3 order: the softmax of a tile under the previous tile's PV product; needs gluon_stages >= 3; off in
    the class default, on in the H200 table below, which measured it fastest), num_splits and combine_*.
    The Gluon kernel reads bf16 pools only (fp8-rope-bf16 pools run the portable kernel).
    """

    block_n: int = 64
    num_warps: int = 8
    stages: dict = field(default_factory=lambda: _stages_table(1, 2, 1, 1))
    num_stages: int | None = None
    num_splits: int | None = None
    combine_block_h: int = 16
    combine_warps: int = 4
    kernel: str = "auto"
    gluon_block_n: int = 64
    gluon_stages: int = 2
    gluon_overlap: bool = False

    def __post_init__(self):
        for name in ("block_n", "num_warps", "combine_block_h", "combine_warps"):
            value = getattr(self, name)
            check_power_of_two(name, value)
        for name in ("num_stages", "num_splits"):
            value = getattr(self, name)
            check_int(name, value, 1, message=f"{name} must be a positive int or None", allow_none=True)
        check_choice("kernel", self.kernel, ATTENTION_KERNELS)
        # q (64 KB) + gluon_stages tiles of gluon_block_n x 1 KB must fit the 227 KB of an sm_90 SM
        check_choice("gluon_block_n", check_int("gluon_block_n", self.gluon_block_n), (32, 64))
        check_int("gluon_stages", self.gluon_stages, 2, (227 - 64 - 4) // self.gluon_block_n)
        if not isinstance(self.gluon_overlap, bool):
            raise ValueError(f"gluon_overlap must be a bool, got {self.gluon_overlap!r}")
        if self.gluon_overlap and self.gluon_stages < 3:
            raise ValueError(f"gluon_overlap needs gluon_stages >= 3 (so gluon_block_n 32), got {self.gluon_stages}")
        if HEAD_BLOCK % self.combine_block_h:
            raise ValueError(f"combine_block_h must divide {HEAD_BLOCK}, got {self.combine_block_h}")
        if not isinstance(self.stages, dict) or set(self.stages) != set(_stages_table(1, 1, 1, 1)) or any(
                isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in self.stages.values()):
            raise ValueError(f"stages must map every (format kind, Hq) of {sorted(_stages_table(1, 1, 1, 1))} "
                             f"to a positive int, got {self.stages!r}")

    @staticmethod
    def for_device(device: "torch.device | str | None" = None) -> "AttentionConfig":
        """The measured defaults of the GPU of ``device`` (the H200 table for GPUs not measured yet)."""
        return ATTENTION_DEFAULTS[gpu_key(device, ATTENTION_DEFAULTS)]

    def replace(self, **changes) -> "AttentionConfig":
        """A copy with ``changes`` (checked again)."""
        return dataclasses.replace(self, **changes)

    def stages_for(self, kind: str, heads: int) -> int:
        """Pipeline stages of the main kernel for a main pool of format ``kind`` and ``heads`` query heads."""
        return self.num_stages if self.num_stages is not None else self.stages[(kind, heads)]

    def splits_for(self, num_queries: int, num_heads: int, tiles: int, sm_count: int | None) -> int:
        """Splits per query: ``num_splits`` if set; else, on a GPU of ``sm_count`` SMs (None: not a GPU, one
        split), as many as leave about one (query, head block, split) program per SM, at most one per tile."""
        if self.num_splits is not None:
            return self.num_splits
        if sm_count is None:
            return 1
        programs = num_queries * (num_heads // HEAD_BLOCK)
        if programs >= sm_count or tiles <= 1:
            return 1
        return max(1, min(tiles, sm_count // programs))


# Measured on the H200 (benchmarks/bench_attention.py stage sweep): with 128 heads the two head blocks of a
# query run side by side and the cp.async pipeline (2 stages) pays off for bf16 KV; with 64 heads, and for the
# fp8 dequantization in registers, gathering straight through registers (1 stage, no shared-memory double
# buffer) is faster. The Gluon kernel (bf16 pools on sm_90, kernel "auto"): 32-row tiles, 4 buffers and the
# overlapped order were the fastest of its three settings at every measured shape, two runs at one tree
# (benchmarks/results/attention_gluon_h200_3422ba2_run{1,2}.json): prefill T 4096 K 2048 4.14 / 8.10 ms at
# H 64 / 128 (portable 5.94 / 8.61), decode B 64-128 next_n 1-2 1.16-1.65x the portable kernel. Other GPUs
# take the H200's table until measured.
H200_ATTENTION = AttentionConfig(gluon_block_n=32, gluon_stages=4, gluon_overlap=True)
ATTENTION_DEFAULTS: dict[str, AttentionConfig] = {"H200": H200_ATTENTION, "default": H200_ATTENTION}

__all__ = ["AttentionConfig", "ATTENTION_DEFAULTS", "ATTENTION_KERNELS", "TRITON_HEADS", "HEAD_BLOCK"]
