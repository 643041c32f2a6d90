"""Transforms (dsakit.transforms) against independent formulations: butterfly WHT, complex-number rope,
YaRN frequencies recomputed from the formulas with plain python floats, torch's own norms."""

from __future__ import annotations

import math

import pytest
import torch

from dsakit.presets import PRESETS, get_preset
from dsakit.transforms import (
    ROPE_V4,
    ROPE_V32,
    RopeConfig,
    RopeLayout,
    YarnConfig,
    apply_norm,
    apply_rope,
    hadamard_matrix,
    hadamard_transform,
    layer_norm,
    rms_norm,
)

# --------------------------------------------------------------------------------------------------
# Hadamard
# --------------------------------------------------------------------------------------------------


def butterfly_wht(x: torch.Tensor) -> torch.Tensor:
    """Fast Walsh-Hadamard transform (natural / Sylvester order) of the last dim, by in-place butterflies."""
    y = x.double().clone()
    n = y.shape[-1]
    h = 1
    while h < n:
        for start in range(0, n, 2 * h):
            a = y[..., start: start + h].clone()
            b = y[..., start + h: start + 2 * h].clone()
            y[..., start: start + h] = a + b
            y[..., start + h: start + 2 * h] = a - b
        h *= 2
    return y / math.sqrt(n)


def test_hadamard_is_orthogonal_symmetric_and_sylvester():
    h = hadamard_matrix(128).double()
    assert torch.allclose(h @ h.T, torch.eye(128, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, h.T)
    assert bool((hadamard_matrix(128).abs() == torch.tensor(128 ** -0.5, dtype=torch.float32)).all())
    # Sylvester recursion H_2n = [[H, H], [H, -H]] (unnormalized)
    small = torch.sign(hadamard_matrix(64))
    big = torch.sign(h)
    assert torch.equal(big, torch.cat([torch.cat([small, small], 1), torch.cat([small, -small], 1)], 0))


def test_hadamard_matches_butterfly():
    x = torch.randn(5, 3, 128)
    assert torch.allclose(hadamard_transform(x).double(), butterfly_wht(x), atol=1e-5)
    # dot products (and norms) are preserved: the property that lets q and k both be rotated
    q, k = torch.randn(128), torch.randn(40, 128)
    assert torch.allclose(hadamard_transform(k) @ hadamard_transform(q), k @ q, atol=1e-4)


def test_hadamard_rejects_bad_sizes():
    with pytest.raises(ValueError, match="96"):
        hadamard_matrix(96)
    with pytest.raises(ValueError, match="64"):
        hadamard_transform(torch.randn(2, 64))


# --------------------------------------------------------------------------------------------------
# Rope
# --------------------------------------------------------------------------------------------------


def complex_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, layout: str,
                 rope_dim: int = 64) -> torch.Tensor:
    """Rope as multiplication by exp(i * pos * f) of complex numbers built from the layout's pairs."""
    x = x.double().clone()
    d = x.shape[-1]
    half = rope_dim // 2
    seg = x[..., d - rope_dim:] if layout.endswith("trailing") else x[..., :rope_dim]
    if layout.startswith("interleaved"):
        z = torch.view_as_complex(seg.reshape(*seg.shape[:-1], half, 2).contiguous())
    else:
        z = torch.complex(seg[..., :half], seg[..., half:])
    angle = positions.double().reshape(-1, *([1] * (x.dim() - 1))) * inv_freq.double()
    z = z * torch.polar(torch.ones_like(angle), angle)
    if layout.startswith("interleaved"):
        rotated = torch.view_as_real(z).reshape(*seg.shape)
    else:
        rotated = torch.cat([z.real, z.imag], dim=-1)
    if layout.endswith("trailing"):
        x[..., d - rope_dim:] = rotated
    else:
        x[..., :rope_dim] = rotated
    return x


@pytest.mark.parametrize("layout", ["interleaved-trailing", "half-split-leading", "interleaved-leading",
                                    "half-split-trailing"])
def test_rope_layouts_match_complex_formulation(layout):
    cfg = RopeConfig(rope_dim=64, theta=10000.0)
    positions = torch.tensor([0, 1, 7, 300, 4096])
    x = torch.randn(5, 3, 128)  # [N, heads, D]: cos/sin broadcast over heads
    cos, sin = cfg.cos_sin(positions)
    got = apply_rope(x, cos, sin, layout)
    want = complex_rope(x, positions, cfg.inv_freq(), layout)
    assert torch.allclose(got.double(), want, atol=1e-4)
    # dims outside the rope segment are untouched
    outside = slice(0, 64) if layout.endswith("trailing") else slice(64, 128)
    assert torch.equal(got[..., outside], x[..., outside])


def test_rope_v4_and_v32_constants_and_relative_property():
    assert ROPE_V4 == RopeLayout.parse("interleaved-trailing") and ROPE_V4.name == "interleaved-trailing"
    assert ROPE_V32 == RopeLayout.parse("half-split-leading")
    a, b = ROPE_V4.pair_dims(128, 64)
    assert a[:2].tolist() == [64, 66] and b[:2].tolist() == [65, 67]
    a, b = ROPE_V32.pair_dims(128, 64)
    assert a[:2].tolist() == [0, 1] and b[:2].tolist() == [32, 33]
    # q(m) . k(n) depends only on m - n
    cfg = get_preset("deepseek-v4-flash").rope
    q, k = torch.randn(1, 128), torch.randn(1, 128)

    def rotated(v, pos):
        cos, sin = cfg.cos_sin(torch.tensor([pos]))
        return apply_rope(v, cos, sin, ROPE_V4)

    assert torch.allclose(rotated(q, 1000) @ rotated(k, 990).T, rotated(q, 20) @ rotated(k, 10).T, atol=1e-3)


def test_rope_rejects_bad_layouts_and_sizes():
    with pytest.raises(ValueError, match="zigzag"):
        RopeLayout("zigzag", "trailing")
    with pytest.raises(ValueError, match="middle"):
        RopeLayout.parse("interleaved-middle")
    cos, sin = RopeConfig().cos_sin(torch.arange(2))
    with pytest.raises(ValueError, match="rope_dim 64"):
        apply_rope(torch.randn(2, 32), cos, sin, ROPE_V4)


def independent_yarn_inv_freq(dim: int, theta: float, factor: float, original: int, beta_fast: float,
                              beta_slow: float) -> list[float]:
    """YaRN "NTK-by-parts" frequencies from the paper's formulas, in plain python floats.

    Pair i has wavelength-based rotation count r_i = original / (2 pi theta^(2i/dim)). Dims that rotate more
    than beta_fast times keep their frequency, fewer than beta_slow are interpolated by 1/factor, a linear
    ramp over the pair index in between. The ramp bounds are the (floored / ceiled) pair indices where
    r_i = beta_fast and r_i = beta_slow, clamped to [0, dim - 1].
    """
    def index_for_rotations(r: float) -> float:
        # solve original / (2 pi theta^(2i/dim)) = r for i
        return dim * math.log(original / (2 * math.pi * r)) / (2 * math.log(theta))

    low = max(math.floor(index_for_rotations(beta_fast)), 0)
    high = min(math.ceil(index_for_rotations(beta_slow)), dim - 1)
    out = []
    for i in range(dim // 2):
        base = theta ** (-2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0) if high != low else float(i >= low)
        out.append(base * (1 - ramp) + base / factor * ramp)
    return out


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_yarn_inv_freq_matches_independent_formula(preset):
    rope = get_preset(preset).rope
    y = rope.yarn
    want = independent_yarn_inv_freq(rope.rope_dim, rope.theta, y.factor, y.original_max_position, y.beta_fast,
                                     y.beta_slow)
    got = rope.inv_freq()
    assert got.dtype == torch.float64 and got.shape == (rope.rope_dim // 2,)
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12)
    # fast pairs keep the base frequency, the slowest pair is interpolated by the full factor
    assert float(got[0]) == 1.0
    assert float(got[-1]) == pytest.approx(rope.theta ** (-(rope.rope_dim - 2) / rope.rope_dim) / y.factor)


def test_v4_yarn_ramp_bounds():
    # V4: theta 160000, dim 64, original 65536: the pair index with 32 rotations is
    # 64 ln(65536 / (2 pi 32)) / (2 ln 160000) = 15.45, with 1 rotation 24.71 -> ramp over [15, 25]
    rope = get_preset("deepseek-v4-flash").rope
    base = RopeConfig(rope_dim=64, theta=160000.0).inv_freq()
    ratio = rope.inv_freq() / base
    assert torch.allclose(ratio[:16], torch.ones(16, dtype=torch.float64))
    assert torch.allclose(ratio[25:], torch.full((7,), 1 / 16, dtype=torch.float64))
    assert bool((ratio[16:25] < 1).all() and (ratio[16:25] > 1 / 16).all())
    # pair 20 sits half way up the ramp: (20 - 15) / (25 - 15) = 0.5 -> 1 - 0.5 + 0.5 / 16
    assert float(ratio[20]) == pytest.approx(0.5 + 0.5 / 16)


def test_cos_sin_table_layout_and_no_mscale():
    rope = RopeConfig(rope_dim=64, theta=160000.0, yarn=YarnConfig(16.0, 65536))
    table = rope.cos_sin_table(50)
    assert table.shape == (50, 64) and table.dtype == torch.float32
    angles = torch.arange(50, dtype=torch.float64).unsqueeze(1) * rope.inv_freq()
    assert torch.allclose(table[:, :32].double(), torch.cos(angles), atol=1e-7)
    assert torch.allclose(table[:, 32:].double(), torch.sin(angles), atol=1e-7)
    # cos^2 + sin^2 = 1: the YaRN mscale (1 + 0.1 ln 16 = 1.277) is not applied
    assert torch.allclose(table[:, :32] ** 2 + table[:, 32:] ** 2, torch.ones(50, 32), atol=1e-6)


# --------------------------------------------------------------------------------------------------
# Norms
# --------------------------------------------------------------------------------------------------


def test_norms_match_torch():
    x, w, b = torch.randn(6, 128) * 3, torch.randn(128), torch.randn(128)
    assert torch.allclose(rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(x, (128,), w, 1e-6), atol=1e-5)
    assert torch.allclose(layer_norm(x, w, b, 1e-6), torch.nn.functional.layer_norm(x, (128,), w, b, 1e-6),
                          atol=1e-5)
    assert torch.equal(apply_norm(x, "rmsnorm", w), rms_norm(x, w))
    assert torch.equal(apply_norm(x, "layernorm", w, b), layer_norm(x, w, b))
    with pytest.raises(ValueError, match="bias"):
        apply_norm(x, "rmsnorm", w, b)
    with pytest.raises(ValueError, match="batchnorm"):
        apply_norm(x, "batchnorm", w)


def test_rope_and_key_transform_configs_validate():
    """Regression: RopeConfig / YarnConfig / KeyTransform accepted anything (an odd rope_dim or theta 1
    failed later with a shape error or a division by zero; a layout given by name stayed a str, breaking
    callers that use .segment() on it)."""
    from dsakit.presets import KeyTransform

    for kwargs, match in [(dict(rope_dim=63), "rope_dim"), (dict(rope_dim=0), "rope_dim"), (dict(theta=1.0), "theta"),
                          (dict(yarn=(16.0, 65536)), "yarn")]:
        with pytest.raises(ValueError, match=match):
            RopeConfig(**kwargs)
    for args, match in [((0.0, 65536), "factor"), ((16.0, 0), "original_max_position"),
                        ((16.0, 65536, 32.0, 0.0), "beta")]:
        with pytest.raises(ValueError, match=match):
            YarnConfig(*args)
    with pytest.raises(ValueError, match="max_position"):
        RopeConfig().cos_sin_table(-1)
    assert KeyTransform(rope_layout="half-split-leading").rope_layout == ROPE_V32
    for kwargs, match in [(dict(norm="batchnorm"), "norm"), (dict(rope_layout="sideways"), "rope layout"),
                          (dict(rope_dim=7), "rope_dim"), (dict(hadamard="yes"), "hadamard"), (dict(eps=-1.0), "eps")]:
        with pytest.raises(ValueError, match=match):
            KeyTransform(**kwargs)


def test_get_preset_rejects_non_names():
    """Regression: an unhashable name (a list) raised TypeError instead of the ValueError listing presets."""
    for bad in (["deepseek-v4-flash"], None, "deepseek-v4"):
        with pytest.raises(ValueError, match="unknown preset"):
            get_preset(bad)
