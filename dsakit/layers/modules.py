"""Small building blocks of the V4 layers: RMSNorm, the weight-dtype linear, the device rope table and
rotation (V4: interleaved pairs on the trailing rope dims), and one compressor's projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._memory import indexed_device  # a CUDA device without CUDA: ValueError
from ..ops.compress.device import CompressorState, compress_step
from ..transforms import RopeConfig

__all__ = ["RMSNorm", "V4Compressor", "linear", "RopeTable", "rope_v4", "indexed_device"]


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x @ W.T in the weight's dtype (as the model computes it)."""
    return F.linear(x.to(layer.weight.dtype), layer.weight)


class RMSNorm(nn.Module):
    """x -> x * rsqrt(mean(x^2) + eps) * weight, in fp32 (the weight is kept as given)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight.float()


class V4Compressor(nn.Module):
    """Projections of one compressor: kv_proj, gate_proj [c*d, hidden], position_bias [ratio, c*d], kv_norm [d]
    (c = 2 for the overlapping ratio-4 windows, 1 otherwise; names as in transformers)."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float = 1e-6):
        super().__init__()
        c = 2 if ratio == 4 else 1
        self.ratio, self.dim = ratio, dim
        self.kv_proj = nn.Linear(hidden, c * dim, bias=False)
        self.gate_proj = nn.Linear(hidden, c * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, c * dim))
        self.kv_norm = RMSNorm(dim, eps)

    def step(self, x: torch.Tensor, state: CompressorState) -> tuple[torch.Tensor, int]:
        """x [S, hidden] (next tokens of the sequence) -> (pre-norm entries fp32 [n, d], first entry index)."""
        return compress_step(linear(x, self.kv_proj), linear(x, self.gate_proj), self.position_bias,
                             self.ratio, state)

    def new_state(self, device) -> CompressorState:
        return CompressorState(self.ratio, self.kv_proj.weight.shape[0], device=device)


class RopeTable:
    """fp32 [max_position, rope_dim] cos|sin table of one RopeConfig on one device, grown by doubling."""

    def __init__(self, rope: RopeConfig):
        self.rope = rope
        self.table: torch.Tensor | None = None

    def get(self, max_position: int, device: torch.device) -> torch.Tensor:
        device = indexed_device(device)
        if self.table is None or self.table.shape[0] < max_position or self.table.device != device:
            size = max(max_position, 1024 if self.table is None else 2 * self.table.shape[0])
            self.table = self.rope.cos_sin_table(size).to(device)
        return self.table


def rope_v4(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing rope dims of x [S, ..., Dh] (interleaved pairs) at positions [S]; fp32 out.

    ``inverse`` rotates by -angle (undoes the rotation V carries into the output, K = V)."""
    rope_dim = table.shape[1]
    half = rope_dim // 2
    cs = table[positions]  # [S, rope_dim]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cs[:, :half].reshape(shape), cs[:, half:].reshape(shape)
    if inverse:
        sin = -sin
    x = x.float()
    rope = x[..., -rope_dim:].unflatten(-1, (half, 2))
    a, b = rope[..., 0], rope[..., 1]
    rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)
