"""Tuning of the Triton top-k: :class:`SelectConfig` (radix select), :class:`TopkConfig` (the fused
scores + select of ``index_topk``), with per-GPU defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._tuning import gpu_key
from ..scores.config import ScoresConfig

# Default fp32 score workspace of the chunked prefill path (bytes). 512 MiB keeps the peak extra memory at
# T = 8192, N = 262144, K = 2048 under 1 GiB while chunks stay large enough (>= 512 rows at N <= 256K) to
# fill the GPU.
DEFAULT_WORKSPACE_BYTES = 512 << 20
# Largest tile of the streaming passes: the collect pass packs two per-tile ranks into one int32 cumsum
# (above + 65536 * inside), exact only while 65536 * BLOCK < 2^31.
MAX_SELECT_BLOCK = 16384
#: Largest k of every top-k op, on every backend: the Triton select's final sort holds next_pow2(K) int64
#: keys in the registers of one program, and the reference refuses what the kernels cannot do.
MAX_K = 16384


def _power_of_two(name: str, value, low: int, high: int | None = None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or value & (value - 1) \
            or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a power of two in {bound}, got {value!r}")


@dataclass(frozen=True)
class SelectConfig:
    """Select launch. algorithm: which select runs (see the field). Multi-pass radix select: block (elements
    per tile of the streaming passes), num_warps, bins (buckets of the narrowing histograms), cap (candidate
    buffer entries per row). None = the row-count rule of :meth:`resolve` (many rows -> prefill setting,
    few long rows -> decode setting)."""

    block: int | None = None
    num_warps: int | None = None
    bins: int | None = None
    cap: int = 2048
    # "auto": the streaming select (dsakit.ops.topk._select_stream: one pass over the scores in the common
    # case) for k <= 4096, the multi-pass radix select above; "stream" / "multipass" force one (the knobs
    # above tune the multi-pass kernel only)
    algorithm: str = "auto"
    # measured on the H200 (benchmarks/results/indexer_h200_*.json): (block, warps, bins) for >= 512 rows
    # (prefill) and for fewer, long rows (decode: one program per row)
    many_rows: tuple[int, int, int] = (2048, 8, 128)
    few_rows: tuple[int, int, int] = (8192, 16, 64)

    def __post_init__(self):
        if self.algorithm not in ("auto", "stream", "multipass"):
            raise ValueError(f"algorithm must be 'auto', 'stream' or 'multipass', got {self.algorithm!r}")
        _power_of_two("block", self.block, 16, MAX_SELECT_BLOCK)
        _power_of_two("bins", self.bins, 32, 1024)
        _power_of_two("cap", self.cap, 32)
        if self.num_warps is not None and (isinstance(self.num_warps, bool) or not isinstance(self.num_warps, int)
                                           or self.num_warps < 1):
            raise ValueError(f"num_warps must be a positive int, got {self.num_warps!r}")

    def resolve(self, rows: int) -> tuple[int, int, int]:
        """(block, num_warps, bins) for a launch over ``rows`` rows."""
        block, warps, bins = self.many_rows if rows >= 512 else self.few_rows
        return self.block or block, self.num_warps or warps, self.bins or bins


@dataclass(frozen=True)
class TopkConfig:
    """Tuning of ``index_topk`` on Triton: workspace_bytes bounds the fp32 score workspace of the chunked
    path (rows per chunk = workspace_bytes // (4 * W)); sort orders each row by (score desc, index asc)
    (False: the same set in a deterministic, unspecified order); overlap: on CUDA, when the rows need
    several chunks, select chunk i on a second (high-priority) stream while chunk i + 1 is scored, ping-ponging
    two workspaces of workspace_bytes / 2 each (rows per chunk = (workspace_bytes // 2) // (4 * W)), so the
    score workspace still totals workspace_bytes; the same indices as overlap=False (with sort=False the same
    set per row, its order may follow the smaller chunks); ignored on one chunk and off CUDA; off by default:
    on the H200 the scores kernel keeps every SM busy and a select program does not fit beside it, so the
    two streams ran no faster than one (T 8192 x N 65536: fp8 13.3 vs 13.1 ms, bf16 19.1 vs 18.8 ms);
    scores / select: the kernels' launch configs."""

    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES
    sort: bool = True
    overlap: bool = False
    scores: ScoresConfig = field(default_factory=ScoresConfig)
    select: SelectConfig = field(default_factory=SelectConfig)

    def __post_init__(self):
        wb = self.workspace_bytes
        if isinstance(wb, bool) or not isinstance(wb, int) or wb < 1:
            raise ValueError(f"workspace_bytes must be a positive int, got {wb!r}")
        if not isinstance(self.sort, bool):
            raise ValueError(f"sort must be a bool, got {self.sort!r}")
        if not isinstance(self.overlap, bool):
            raise ValueError(f"overlap must be a bool, got {self.overlap!r}")
        if not isinstance(self.scores, ScoresConfig) or not isinstance(self.select, SelectConfig):
            raise ValueError("scores / select must be a ScoresConfig / SelectConfig")

    @staticmethod
    def for_device(device: "torch.device | str | None" = None) -> "TopkConfig":
        """The measured defaults of the GPU of ``device`` (the H200 table for GPUs not measured yet)."""
        return TOPK_DEFAULTS[gpu_key(device, TOPK_DEFAULTS)]


TOPK_DEFAULTS: dict[str, TopkConfig] = {"H200": TopkConfig(), "default": TopkConfig()}

__all__ = ["TopkConfig", "SelectConfig", "TOPK_DEFAULTS", "DEFAULT_WORKSPACE_BYTES", "MAX_SELECT_BLOCK"]
