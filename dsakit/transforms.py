"""Per-row transforms applied to index keys and queries before scoring: norms, rope, Hadamard rotation.

All functions are pure PyTorch and compute in fp32; they are the reference for the fused kernels.

Rope layouts (docs/spec.md §2.1, §2.2, §5.1). A layout is a pairing and a placement of the ``rope_dim`` rotated
dims inside the head:

* pairing ``interleaved``: pair i is dims (2i, 2i+1) of the rope segment (DeepSeek-V4);
* pairing ``half-split`` (NeoX): pair i is dims (i, i + rope_dim/2) of the rope segment (DeepSeek-V3.2);
* placement ``trailing``: the rope segment is the last ``rope_dim`` dims (V4); ``leading``: the first (V3.2).

Pair i rotates by angle position * inv_freq[i]:  (a, b) -> (a cos - b sin, a sin + b cos).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._memory import check_choice, check_instance, check_int, check_power_of_two, check_tensor, is_int

HADAMARD_DIM = 128


# --------------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------------

NORMS = ("rmsnorm", "layernorm")


_FP32_MAX = torch.finfo(torch.float32).max


def norm_scale(x: torch.Tensor) -> torch.Tensor:
    """fp32 [N, 1]: the power of two 2^-k (k in 0..126) that brings each row's largest |x| below 4.

    The norms compute on x * 2^-k with eps * 2^-2k: exact scalings, so any row whose sums do not overflow
    gives the very same bits as unscaled math, while a finite row near the fp32 / bf16 maximum (whose sum
    of squares or of values overflows) still normalizes to finite values instead of NaN or zeros. Rows with
    max |x| < 2 are not scaled (k = 0). k comes from the exponent bits of the row's max |x|, so the Triton
    store kernels compute the same factor.
    """
    amax = x.abs().amax(dim=-1, keepdim=True) if x.shape[-1] else x.new_zeros(x.shape[:-1] + (1,))
    biased = (amax.view(torch.int32) >> 23) & 0xFF  # |x| < 2^(biased - 126)
    k = (biased - 127).clamp(0, 126)
    return ((127 - k) << 23).to(torch.int32).view(torch.float32)


def _inverse_norm(mean_sq: torch.Tensor, eps_scaled: torch.Tensor) -> torch.Tensor:
    # clamped: a row that is all zeros (or constant, for LayerNorm) with no eps left gives 0 * huge = 0, not NaN
    return torch.rsqrt(mean_sq + eps_scaled).clamp(max=_FP32_MAX)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [N, D] -> x * rsqrt(mean(x^2) + eps) * weight, fp32 (computed on x scaled by :func:`norm_scale`)."""
    x = x.float()
    inv = norm_scale(x)
    x = x * inv
    return x * _inverse_norm(x.pow(2).mean(dim=-1, keepdim=True), eps * inv * inv) * weight.float()


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """x [N, D] -> (x - mean) * rsqrt(biased var + eps) * weight + bias, fp32 (on x scaled by
    :func:`norm_scale`)."""
    x = x.float()
    inv = norm_scale(x)
    x = x * inv
    centered = x - x.mean(dim=-1, keepdim=True)
    out = centered * _inverse_norm(centered.pow(2).mean(dim=-1, keepdim=True), eps * inv * inv) * weight.float()
    return out if bias is None else out + bias.float()


def apply_norm(x: torch.Tensor, norm: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-6) -> torch.Tensor:
    if norm == "rmsnorm":
        if bias is not None:
            raise ValueError("rmsnorm takes no bias; pass bias=None or use norm='layernorm'")
        return rms_norm(x, weight, eps)
    if norm == "layernorm":
        return layer_norm(x, weight, bias, eps)
    raise ValueError(f"unknown norm {norm!r}; choose one of {NORMS}")


# --------------------------------------------------------------------------------------------------
# Hadamard rotation
# --------------------------------------------------------------------------------------------------


def hadamard_matrix(n: int = HADAMARD_DIM) -> torch.Tensor:
    """Sylvester-ordered Walsh-Hadamard matrix scaled by n^-0.5: H[i, j] = (-1)^popcount(i & j) / sqrt(n)."""
    check_power_of_two("Hadamard size", n, message="Hadamard size must be a power of two")
    i = torch.arange(n)
    bits = i.unsqueeze(1) & i.unsqueeze(0)
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1.0 - 2.0 * parity.float()) / math.sqrt(n)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """x [..., 128] -> x @ H (H symmetric and orthogonal, so exact dot products are unchanged), fp32."""
    if x.shape[-1] != HADAMARD_DIM:
        raise ValueError(f"Hadamard rotation is defined on the last dim of size {HADAMARD_DIM}, got {x.shape[-1]}")
    return x.float() @ hadamard_matrix(HADAMARD_DIM).to(x.device)


# --------------------------------------------------------------------------------------------------
# Rope
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeLayout:
    pairing: str  # "interleaved" | "half-split"
    placement: str  # "trailing" | "leading"

    def __post_init__(self):
        check_choice("pairing", self.pairing, ("interleaved", "half-split"), what="rope pairing")
        check_choice("placement", self.placement, ("trailing", "leading"), what="rope placement")

    @property
    def name(self) -> str:
        return f"{self.pairing}-{self.placement}"

    @staticmethod
    def parse(value: "str | RopeLayout") -> "RopeLayout":
        """'interleaved-trailing' (V4) | 'half-split-leading' (V3.2) | the two other combinations."""
        if isinstance(value, RopeLayout):
            return value
        for pairing in ("interleaved", "half-split"):
            for placement in ("trailing", "leading"):
                if value == f"{pairing}-{placement}":
                    return RopeLayout(pairing, placement)
        raise ValueError(f"unknown rope layout {value!r}; expected '<interleaved|half-split>-<trailing|leading>'")

    def segment(self, head_dim: int, rope_dim: int) -> slice:
        return slice(head_dim - rope_dim, head_dim) if self.placement == "trailing" else slice(0, rope_dim)

    def pair_dims(self, head_dim: int, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Absolute dims (a_i, b_i) [rope_dim/2] of each rotated pair i inside the head."""
        start = self.segment(head_dim, rope_dim).start
        i = torch.arange(rope_dim // 2)
        if self.pairing == "interleaved":
            return start + 2 * i, start + 2 * i + 1
        return start + i, start + i + rope_dim // 2


ROPE_V4 = RopeLayout("interleaved", "trailing")
ROPE_V32 = RopeLayout("half-split", "leading")


@dataclass(frozen=True)
class YarnConfig:
    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"YaRN factor must be > 0, got {self.factor!r}")
        check_int("original_max_position", self.original_max_position, 1,
                  message="YaRN original_max_position must be a positive int")
        if not (self.beta_fast > 0 and self.beta_slow > 0):  # log(original / (beta * 2 pi)) needs beta > 0
            raise ValueError(f"YaRN beta_fast / beta_slow must be > 0, got {self.beta_fast!r} / {self.beta_slow!r}")


@dataclass(frozen=True)
class RopeConfig:
    """Frequencies of a rope: theta, rotated dims, optional YaRN. cos/sin are never scaled by mscale (V4)."""

    rope_dim: int = 64
    theta: float = 10000.0
    yarn: YarnConfig | None = None

    def __post_init__(self):
        if not is_int(self.rope_dim) or self.rope_dim <= 0 or self.rope_dim % 2:
            raise ValueError(f"rope_dim must be a positive even int, got {self.rope_dim!r}")
        if not self.theta > 1:  # theta^(-2i/d) must decrease; YaRN divides by log(theta)
            raise ValueError(f"rope theta must be > 1, got {self.theta!r}")
        if self.yarn is not None:
            check_instance("yarn", self.yarn, YarnConfig, label="YarnConfig or None")

    def inv_freq(self) -> torch.Tensor:
        """fp64 [rope_dim/2] angular frequency of each pair (YaRN blend as in DeepSeek's reference)."""
        dim = self.rope_dim
        freqs = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        if self.yarn is None:
            return freqs
        y = self.yarn

        def correction_dim(rotations: float) -> float:
            return dim * math.log(y.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low = max(math.floor(correction_dim(y.beta_fast)), 0)
        high = min(math.ceil(correction_dim(y.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
        smooth = 1.0 - ramp  # 1 = keep the original frequency (fast dims), 0 = interpolate by factor
        return freqs / y.factor * (1 - smooth) + freqs * smooth

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int [N] -> (cos, sin) fp32 [N, rope_dim/2] on positions' device, angles computed in fp64."""
        check_tensor("positions", positions)
        angles = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq().to(positions.device)
        return torch.cos(angles).float(), torch.sin(angles).float()

    def cos_sin_table(self, max_position: int) -> torch.Tensor:
        """fp32 [max_position, rope_dim]: cos of the rope_dim/2 pairs, then their sin, for positions 0.."""
        check_int("max_position", max_position, 0, message="max_position must be a non-negative int")
        cos, sin = self.cos_sin(torch.arange(max_position))
        return torch.cat([cos, sin], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: RopeLayout | str,
               rope_dim: int | None = None) -> torch.Tensor:
    """Rotate the rope pairs of x [N, ..., Dh] with cos/sin [N, rope_dim/2] (broadcast over middle dims), fp32.

    ``rope_dim`` defaults to 2 * cos.shape[-1].
    """
    layout = RopeLayout.parse(layout)
    rope_dim = 2 * cos.shape[-1] if rope_dim is None else rope_dim
    if cos.shape[-1] != rope_dim // 2 or sin.shape != cos.shape:
        raise ValueError(f"cos/sin must have last dim {rope_dim // 2}, got {list(cos.shape)} / {list(sin.shape)}")
    head_dim = x.shape[-1]
    if rope_dim > head_dim or rope_dim % 2:
        raise ValueError(f"rope_dim {rope_dim} must be even and <= head dim {head_dim}")
    a_idx, b_idx = layout.pair_dims(head_dim, rope_dim)
    out = x.float().clone()
    extra = x.dim() - cos.dim()
    shape = cos.shape[:-1] + (1,) * extra + cos.shape[-1:]
    c, s = cos.float().reshape(shape), sin.float().reshape(shape)
    a, b = out[..., a_idx], out[..., b_idx]
    out[..., a_idx] = a * c - b * s
    out[..., b_idx] = a * s + b * c
    return out
