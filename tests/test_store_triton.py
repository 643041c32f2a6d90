"""Fused Triton store kernels (dsakit.ops.store.triton) against the fp32 CPU reference, byte for byte.

Runs on the CPU under TRITON_INTERPRET=1 (./dev.sh test sets it) or on a CUDA device; skipped otherwise.

Tolerance table (the only places where bytes may legitimately differ, and why):

* Inputs whose pipeline is exact in fp32 (the crafted cases below: rows of +-1, eps 0, rope at position
  0, no Hadamard) must give identical pools: this pins round-to-nearest-even, the fp4 tie modes, signs,
  subnormal e4m3 codes, saturation and the NaN / Inf rules.
* Random inputs: the kernel sums the 128 (or 512) squares of the norm and the Hadamard butterfly in a
  different order than torch's CPU reduction and matmul (whose order itself depends on the CPU's vector
  width), so its fp32 value before quantization can differ from the reference's in the last bits. A
  stored code may then differ only where the reference's fp32 value lies within that rounding of a code
  boundary: every kernel code must be the encoding of some value within TOL_REL * (row max) of the
  reference's fp32 value (checked with the reference codec), which for the coarse fp8 / fp4 codes means
  one code at most, and only next to a boundary. (For bf16 with Hadamard, an output that nearly cancels to
  zero has a tiny bf16 ulp, so the same fp32 slack can be several of its codes: the bound stays absolute.)
* fp8 with an fp32 scale stores max(amax, 1e-4) / 448 un-rounded, so the scale itself carries the amax
  difference: at most SCALE_ULPS fp32 ulps apart, and the kernel's scale is at least as close to the fp64
  value as the reference's (test_fp8_scale_at_least_as_accurate_as_reference).
* Power-of-two scales (ue8m0 bytes) must be equal unless the reference's scale before rounding is within
  TOL_REL of a power of two.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsakit.cache import read_entries
from dsakit.formats import AttentionKVFormat, KeyFormat, encode_e2m1, encode_e4m3
from dsakit.ops.store import prepare_attention_kv, prepare_index_keys, store_attention_kv, store_index_keys
from dsakit.ops.store import StoreConfig
from dsakit.ops.store import reference as store_reference
from dsakit.presets import KeyTransform
from dsakit.transforms import ROPE_V4, ROPE_V32, RopeConfig, RopeLayout, hadamard_matrix

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                                reason="Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
DEVICE = "cpu" if INTERPRET else "cuda"

if INTERPRET or torch.cuda.is_available():
    from dsakit.ops.store.triton import launch_store_attention_kv, launch_store_index_keys

TOL_REL = 2.0**-15  # fp32 slack relative to the row's largest |value| (see module docstring)
SCALE_ULPS = 16  # fp32 ulps between the kernel's and the reference's un-rounded fp8 scale
KEY_FORMATS = ["bf16", "fp8", "fp8-ue8m0", "fp4", "fp4-rne"]
ALL_LAYOUTS = ["interleaved-trailing", "half-split-leading", "interleaved-leading", "half-split-trailing"]
TABLE = RopeConfig(64, 160000.0).cos_sin_table(512)


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------


def spread_slots(n: int, num_pages: int, padding_every: int, generator: torch.Generator) -> torch.Tensor:
    """n distinct slots scattered over non-consecutive pages, every ``padding_every``-th one -1 (padding)."""
    slots = torch.randperm(num_pages * 64, generator=generator)[:n]
    if padding_every:
        slots[::padding_every] = -1
    return slots


def run_both(store, rows, positions, slots, pool_pages, page_bytes, *args, **kwargs):
    """Run the reference and the Triton backend on the same poisoned pool; return (ref, out, poison)."""
    poison = torch.randint(0, 256, (pool_pages, page_bytes), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(pool_pages))
    ref = poison.clone()
    store(rows, positions, slots, ref, *args, backend="reference", **kwargs)
    out = poison.clone().to(DEVICE)
    dev = lambda t: t.to(DEVICE) if isinstance(t, torch.Tensor) else t  # noqa: E731
    store(dev(rows), dev(positions), dev(slots), out, *[dev(a) for a in args], backend="triton",
          **{k: dev(v) for k, v in kwargs.items()})
    return ref, out.cpu(), poison


def written_mask(fmt, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """bool [P, page_bytes]: the value and scale bytes of the entries at slots >= 0."""
    mask = torch.zeros_like(pool, dtype=torch.bool)
    live = slots[slots >= 0].long()
    value_start, scale_start = fmt.byte_offsets(live)
    flat = mask.view(-1)
    flat[(value_start.unsqueeze(1) + torch.arange(fmt.value_bytes)).reshape(-1)] = True
    if fmt.scale_bytes:
        flat[(scale_start.unsqueeze(1) + torch.arange(fmt.scale_bytes)).reshape(-1)] = True
    return mask


def sign_magnitude_order(codes: torch.Tensor, sign_bit: int) -> torch.Tensor:
    """Sign-magnitude codes -> int64 whose order is the order of the decoded values (+0 and -0 tie)."""
    codes = codes.long()
    magnitude = codes & (sign_bit - 1)
    return torch.where((codes & sign_bit) != 0, -magnitude, magnitude)


def bf16_codes(x: torch.Tensor) -> torch.Tensor:
    return sign_magnitude_order(x.to(torch.bfloat16).view(torch.int16).long() & 0xFFFF, 0x8000)


def assert_codes_within(kind: str, out_codes: torch.Tensor, x_ref: torch.Tensor, scale: torch.Tensor,
                        rounding: str = "threshold", what: str = "") -> None:
    """Every kernel code (ordered ints [R, n]) must encode a value within TOL_REL * row max of x_ref [R, n].

    ``scale`` [R, n] is the kernel's own (decoded) scale of each element; non-finite references must match
    their encoding exactly (NaN -> 0, +-Inf -> largest code; bf16 keeps NaN, compared by isnan).
    """
    finite = torch.isfinite(x_ref)
    row_max = torch.where(finite, x_ref.abs(), torch.zeros_like(x_ref)).amax(dim=1, keepdim=True)
    slack = TOL_REL * row_max.expand_as(x_ref)
    clean = torch.where(finite, x_ref, torch.zeros_like(x_ref))

    def encode(v):
        if kind == "bf16":
            return bf16_codes(v)
        if kind == "e4m3":
            return sign_magnitude_order(encode_e4m3(v, torch.ones(v.shape[:-1])), 0x80)
        return sign_magnitude_order(encode_e2m1(torch.clamp(v, -6.0, 6.0), rounding), 0x8)

    unit = scale if kind != "bf16" else torch.ones_like(x_ref)
    low, high = encode((clean - slack) / unit), encode((clean + slack) / unit)
    ok = (out_codes >= low) & (out_codes <= high)
    if kind == "bf16":
        exact = encode(x_ref) == out_codes
    else:
        exact = encode(x_ref / unit) == out_codes  # non-finite: sanitize + saturate rules
    ok = torch.where(finite, ok, exact)
    bad = (~ok).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} codes outside the fp32 slack, first at {bad[0].tolist()}: "
                              f"kernel {int(out_codes[tuple(bad[0])])}, allowed {int(low[tuple(bad[0])])}.."
                              f"{int(high[tuple(bad[0])])}, reference value {float(x_ref[tuple(bad[0])])}")


def assert_bf16_within(out_bytes: torch.Tensor, ref_bytes: torch.Tensor, x_ref: torch.Tensor, what: str) -> None:
    """bf16 entries (uint8 [R, 2n]): NaN exactly where the reference has NaN (payload free), else the slack."""
    out_half = out_bytes.contiguous().view(torch.bfloat16)
    out_nan = torch.isnan(out_half)
    assert torch.equal(torch.isnan(ref_bytes.contiguous().view(torch.bfloat16)), out_nan), f"{what}: NaN positions"
    out_codes = sign_magnitude_order(out_bytes.contiguous().view(torch.int16).long() & 0xFFFF, 0x8000)
    assert_codes_within("bf16", torch.where(out_nan, bf16_codes(x_ref), out_codes), x_ref, None, what=what)


def assert_pow2_exponents_close(out_exp: torch.Tensor, ref_exp: torch.Tensor, pre_rounding: torch.Tensor,
                                what: str) -> None:
    """ue8m0 bytes equal, or one apart where the reference's unrounded scale is within TOL_REL of 2^k."""
    differ = out_exp.long() != ref_exp.long()
    if not bool(differ.any()):
        return
    nearest = torch.exp2(torch.round(torch.log2(pre_rounding.double())))
    near_pow2 = ((pre_rounding.double() / nearest - 1).abs() <= TOL_REL)
    assert bool(((out_exp.long() - ref_exp.long()).abs() <= 1)[differ].all()), f"{what}: exponent off by > 1"
    assert bool(near_pow2[differ].all()), f"{what}: exponent differs away from a power of two"


def assert_index_store_ok(fmt: KeyFormat, ref_pool, out_pool, poison, slots, x_ref) -> None:
    """Full check of an index-key store: untouched bytes, scales, codes (see the tolerance table)."""
    written = written_mask(fmt, ref_pool, slots)
    assert torch.equal(out_pool[~written], poison[~written]), "kernel wrote bytes outside the stored entries"
    assert torch.equal(ref_pool[~written], poison[~written])
    live = slots >= 0
    if not bool(live.any()):
        return
    x_ref = x_ref[live]
    rv, rs = read_entries(ref_pool, fmt, slots[live])
    ov, os_ = read_entries(out_pool, fmt, slots[live])
    n = x_ref.shape[0]
    if fmt.kind == "bf16":
        assert_bf16_within(ov, rv, x_ref, fmt.name)
        return
    if fmt.kind == "fp8":
        out_scale = os_.contiguous().view(torch.float32).reshape(n, 1)
        ref_scale = rs.contiguous().view(torch.float32).reshape(n, 1)
        if fmt.scale_fmt == "fp32":
            ulps = (os_.contiguous().view(torch.int32).long() - rs.contiguous().view(torch.int32).long()).abs()
            assert int(ulps.max()) <= SCALE_ULPS, f"fp8 scale {int(ulps.max())} ulps from the reference"
        else:
            finite = torch.where(torch.isfinite(x_ref), x_ref.abs(), torch.zeros_like(x_ref))
            pre = torch.clamp(finite.amax(dim=1), min=1e-4) / 448
            to_exp = lambda s: (s.view(torch.int32) >> 23) & 0xFF  # noqa: E731 (exact powers of two)
            assert_pow2_exponents_close(to_exp(out_scale.flatten()), to_exp(ref_scale.flatten()), pre, fmt.name)
        out_codes = sign_magnitude_order(ov, 0x80)
        assert_codes_within("e4m3", out_codes, x_ref, out_scale.expand(n, 128), what=fmt.name)
        return
    # fp4: 4 blocks of 32 with one ue8m0 byte each
    finite = torch.where(torch.isfinite(x_ref), x_ref.abs(), torch.zeros_like(x_ref))
    pre = torch.clamp(finite.reshape(n, 4, 32).amax(dim=2), min=1e-4) / 6
    assert_pow2_exponents_close(os_, rs, pre, fmt.name)
    scale = torch.exp2(os_.float() - 127).repeat_interleave(32, dim=1)
    nibbles = torch.stack([ov & 0xF, ov >> 4], dim=-1).reshape(n, 128)
    assert_codes_within("e2m1", sign_magnitude_order(nibbles, 0x8), x_ref, scale, fmt.rounding, what=fmt.name)


def assert_attention_store_ok(fmt: AttentionKVFormat, ref_pool, out_pool, poison, slots, x_ref) -> None:
    written = written_mask(fmt, ref_pool, slots)
    assert torch.equal(out_pool[~written], poison[~written]), "kernel wrote bytes outside the stored entries"
    live = slots >= 0
    if not bool(live.any()):
        return
    x_ref = x_ref[live]
    n = x_ref.shape[0]
    rv, rs = read_entries(ref_pool, fmt, slots[live])
    ov, os_ = read_entries(out_pool, fmt, slots[live])
    if fmt.kind == "bf16":
        assert_bf16_within(ov, rv, x_ref, fmt.name)
        return
    assert torch.equal(os_[:, 7], torch.zeros(n, dtype=torch.uint8)), "pad byte of the scale part must be 0"
    nope = x_ref[:, :448]
    finite = torch.where(torch.isfinite(nope), nope.abs(), torch.zeros_like(nope))
    pre = torch.clamp(finite.reshape(n, 7, 64).amax(dim=2), min=1e-4) / 448
    assert_pow2_exponents_close(os_[:, :7], rs[:, :7], pre, fmt.name)
    scale = torch.exp2(os_[:, :7].float() - 127).repeat_interleave(64, dim=1)
    assert_codes_within("e4m3", sign_magnitude_order(ov[:, :448], 0x80), nope, scale, what=f"{fmt.name} fp8 part")
    assert_bf16_within(ov[:, 448:], rv[:, 448:], x_ref[:, 448:], f"{fmt.name} bf16 rope part")


def index_case(n: int, dtype: torch.dtype, norm: str, seed: int, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(n, 128, generator=g) * scale + torch.randn(1, 128, generator=g)).to(dtype)
    positions = torch.randint(0, TABLE.shape[0], (n,), generator=g)
    weight = torch.rand(128, generator=g) + 0.5
    bias = torch.randn(128, generator=g) * 0.1 if norm == "layernorm" else None
    return keys, positions, weight, bias, g


def check_index(fmt_name: str, layout: str, norm: str, hadamard: bool, dtype: torch.dtype, n: int = 37,
                seed: int = 0, keys: torch.Tensor | None = None, table: torch.Tensor = TABLE) -> None:
    fmt = KeyFormat.parse(fmt_name)
    gen_keys, positions, weight, bias, g = index_case(n, dtype, norm, seed)
    keys = gen_keys if keys is None else keys
    positions = positions % table.shape[0]
    transform = KeyTransform(norm, RopeLayout.parse(layout), table.shape[1], hadamard, 1e-6)
    pages = max(6, -(-n // 64) + 2)  # room for n scattered slots (6 pages hold only 384)
    slots = spread_slots(n, pages, 5, g)
    ref, out, poison = run_both(store_index_keys, keys, positions, slots, pages, fmt.page_bytes, fmt, table, weight,
                                bias, transform)
    x_ref = prepare_index_keys(keys, positions, table, weight, bias, transform)
    assert_index_store_ok(fmt, ref, out, poison, slots, x_ref)


# --------------------------------------------------------------------------------------------------
# index keys: every format x layout x norm x Hadamard (x input dtype)
# --------------------------------------------------------------------------------------------------

MAIN_CASES = [(fmt, layout, norm, hadamard)
              for fmt in KEY_FORMATS for layout in ("interleaved-trailing", "half-split-leading")
              for norm in ("rmsnorm", "layernorm") for hadamard in (False, True)]


@pytest.mark.parametrize("fmt,layout,norm,hadamard", MAIN_CASES,
                         ids=[f"{f}-{lay}-{nm}-{'had' if h else 'nohad'}" for f, lay, nm, h in MAIN_CASES])
def test_index_keys_match_reference(fmt, layout, norm, hadamard):
    # alternate the input dtype so both reach every format / layout / norm combination
    dtype = torch.bfloat16 if (MAIN_CASES.index((fmt, layout, norm, hadamard)) // 2) % 2 == 0 else torch.float32
    check_index(fmt, layout, norm, hadamard, dtype, seed=MAIN_CASES.index((fmt, layout, norm, hadamard)))


@pytest.mark.parametrize("fmt", KEY_FORMATS)
@pytest.mark.parametrize("layout", ["interleaved-leading", "half-split-trailing"])
def test_index_keys_other_layouts(fmt, layout):
    check_index(fmt, layout, "rmsnorm", True, torch.bfloat16, seed=7)


@pytest.mark.parametrize("fmt", KEY_FORMATS)
def test_index_keys_generic_kernel_other_rope_width(fmt):
    """rope_dim != 64 runs the generic kernel (any width): same contract."""
    table = RopeConfig(32, 10000.0).cos_sin_table(300)
    check_index(fmt, "interleaved-trailing", "rmsnorm", True, torch.bfloat16, table=table, seed=3)
    check_index(fmt, "half-split-leading", "layernorm", False, torch.float32, table=table, seed=4)


def test_index_keys_fp16_input_and_single_row():
    check_index("fp8", "interleaved-trailing", "rmsnorm", True, torch.float16, n=1, seed=11)
    check_index("fp4", "half-split-leading", "layernorm", True, torch.float16, n=3, seed=12)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(KEY_FORMATS), layout=st.sampled_from(ALL_LAYOUTS),
       norm=st.sampled_from(["rmsnorm", "layernorm"]), hadamard=st.booleans(), n=st.integers(1, 80),
       seed=st.integers(0, 2**16), log_scale=st.floats(-6, 6))
def test_index_keys_property(fmt, layout, norm, hadamard, n, seed, log_scale):
    """Random shapes, padding patterns and input magnitudes (1e-6 .. 1e6 before the norm)."""
    keys = index_case(n, torch.float32, norm, seed, scale=10.0**log_scale)[0]
    check_index(fmt, layout, norm, hadamard, torch.float32, n=n, seed=seed, keys=keys)


@pytest.fixture
def gpu_nan_rule(monkeypatch):
    """Under the interpreter, give ``tl.minimum`` / ``tl.maximum`` the compiled kernel's NaN rule.

    Their default (``propagate_nan=NONE``) compiles to the GPU's ``min.f32`` / ``max.f32``, which return the
    other operand when one is NaN; the interpreter runs numpy's minimum / maximum, which propagate it. So the
    CPU runs the non-finite cases as the H200 does (this is how the GPU store once turned NaN rows into
    huge finite values while the interpreter matched the reference). On a GPU it changes nothing.
    """
    if INTERPRET:
        from triton.runtime.interpreter import InterpreterBuilder

        monkeypatch.setattr(InterpreterBuilder, "create_minnumf", lambda self, a, b: self.binary_op(a, b, np.fmin))
        monkeypatch.setattr(InterpreterBuilder, "create_maxnumf", lambda self, a, b: self.binary_op(a, b, np.fmax))


def test_index_keys_non_finite_and_extreme_rows(gpu_nan_rule):
    """NaN / +-Inf rows, zero rows, overflowing squares, tiny rows, and Inf from the norm weight."""
    g = torch.Generator().manual_seed(5)
    keys = torch.randn(12, 128, generator=g)
    keys[0, 3] = float("nan")
    keys[1, 70] = float("inf")
    keys[2, 5] = -float("inf")
    keys[3] = 0.0
    keys[4] = 1e30  # squares would overflow unscaled: the norm runs on the row scaled by a power of two
    keys[5] = 1e-30
    keys[6, :64] = -0.0
    weight = torch.rand(128, generator=g) + 0.5
    weight[100] = 3e38  # x * r * w overflows to +-Inf for that dim only
    for fmt in KEY_FORMATS:
        for hadamard in (False, True):
            f = KeyFormat.parse(fmt)
            positions = torch.randint(0, TABLE.shape[0], (12,), generator=g)
            transform = KeyTransform("rmsnorm", ROPE_V4, 64, hadamard, 1e-6)
            slots = spread_slots(12, 4, 0, g)
            ref, out, poison = run_both(store_index_keys, keys, positions, slots, 4, f.page_bytes, f, TABLE,
                                        weight, None, transform)
            x_ref = prepare_index_keys(keys, positions, TABLE, weight, None, transform)
            assert_index_store_ok(f, ref, out, poison, slots, x_ref)


# --------------------------------------------------------------------------------------------------
# exact cases: fp32-exact pipelines must give identical pools (rounding modes, ties, signs, subnormals)
# --------------------------------------------------------------------------------------------------


def balanced_signs(n: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """Rows of d/2 (+1) and d/2 (-1) in random order: mean 0 and mean square 1, exactly."""
    base = torch.cat([torch.ones(d // 2), -torch.ones(d // 2)])
    return torch.stack([base[torch.randperm(d, generator=generator)] for _ in range(n)])


# values that sit exactly on rounding boundaries of e4m3 (scale 1), e2m1 (scale 1) and bf16
E4M3_TIES = [448.0, 1.0625, 1.1875, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-11, 0.0, 2.0**-7 + 2.0**-11, 240.0 + 8.0,
             1e-6, 0.3, 13.5, 440.0]
E2M1_TIES = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.1, 5.5, 2.2]
BF16_TIES = [1 + 2.0**-8, 1 + 3 * 2.0**-8, 3.0 + 2.0**-7, 2.0**-130, 1e-3, 7.0]


def tie_weight(values: list[float], d: int, block: int, generator: torch.Generator) -> torch.Tensor:
    """A weight whose blocks each hold the block's max value (so the power-of-two scale is 1) and ties."""
    w = torch.tensor(values)[torch.randint(0, len(values), (d,), generator=generator)]
    w[::block] = values[0]
    return w


@pytest.mark.parametrize("fmt", KEY_FORMATS)
@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_index_keys_exact_pipeline_identical_bytes(fmt, norm):
    f = KeyFormat.parse(fmt)
    g = torch.Generator().manual_seed(hash((fmt, norm)) % 1000)
    n = 24
    keys = balanced_signs(n, 128, g)
    values = {"bf16": BF16_TIES, "fp8": E4M3_TIES, "fp4": E2M1_TIES}[f.kind]
    weight = tie_weight(values, 128, 128 if f.kind != "fp4" else 32, g)
    bias = torch.zeros(128) if norm == "layernorm" else None
    for layout in (ROPE_V4, ROPE_V32):
        transform = KeyTransform(norm, layout, 64, False, 0.0)  # eps 0: rsqrt(1) = 1 exactly
        slots = spread_slots(n, 3, 7, g)
        ref, out, _ = run_both(store_index_keys, keys, torch.zeros(n, dtype=torch.long), slots, 3, f.page_bytes, f,
                               TABLE, weight, bias, transform)
        assert torch.equal(ref, out), f"{fmt} {norm} {layout.name}: {int((ref != out).sum())} bytes differ"


@pytest.mark.parametrize("fmt", ["fp8-rope-bf16", "bf16"])
def test_attention_kv_exact_pipeline_identical_bytes(fmt):
    f = AttentionKVFormat.parse(fmt)
    g = torch.Generator().manual_seed(3)
    n = 10
    kv = balanced_signs(n, 512, g)
    weight = tie_weight(E4M3_TIES if f.kind != "bf16" else BF16_TIES, 512, 64, g)
    for layout in ("interleaved-trailing", "half-split-trailing", "interleaved-leading"):
        slots = spread_slots(n, 2, 4, g)
        ref, out, _ = run_both(store_attention_kv, kv, torch.zeros(n, dtype=torch.long), slots, 2, f.page_bytes, f,
                               TABLE, weight, layout, 0.0)
        assert torch.equal(ref, out), f"{fmt} {layout}: {int((ref != out).sum())} bytes differ"


def test_fp8_scale_at_least_as_accurate_as_reference():
    """The fp32 fp8 scale: the kernel's is no further from the fp64 value than the reference's own (+1 ulp)."""
    n = 64
    keys, positions, weight, _, g = index_case(n, torch.bfloat16, "rmsnorm", 21)
    slots = spread_slots(n, 2, 0, g)
    transform = KeyTransform("rmsnorm", ROPE_V4, 64, True, 1e-6)
    ref, out, _ = run_both(store_index_keys, keys, positions, slots, 2, KeyFormat.FP8.page_bytes, KeyFormat.FP8,
                           TABLE, weight, None, transform)
    x = keys.double()
    x = x * torch.rsqrt((x * x).mean(dim=1, keepdim=True) + 1e-6) * weight.double()
    rows = TABLE.double()[positions]
    cos, sin = rows[:, :32], rows[:, 32:]
    a, b = x[:, 64::2].clone(), x[:, 65::2].clone()
    x[:, 64::2], x[:, 65::2] = a * cos - b * sin, a * sin + b * cos
    x = x @ (hadamard_matrix(128).double().sign() / 128**0.5)
    exact = torch.clamp(x.abs().amax(dim=1), min=1e-4) / 448
    ulp = exact * 2.0**-23

    def error(pool):
        scale = read_entries(pool, KeyFormat.FP8, slots)[1].contiguous().view(torch.float32).flatten().double()
        return float(((scale - exact) / ulp).abs().max())

    assert error(out) <= error(ref) + 1.0


# --------------------------------------------------------------------------------------------------
# attention KV
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8-rope-bf16", "bf16"])
@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_attention_kv_match_reference(fmt, layout):
    f = AttentionKVFormat.parse(fmt)
    g = torch.Generator().manual_seed(ALL_LAYOUTS.index(layout))
    n = 21
    dtype = torch.bfloat16 if layout.endswith("trailing") else torch.float32
    kv = (torch.randn(n, 512, generator=g) * 2 + torch.randn(1, 512, generator=g)).to(dtype)
    positions = torch.randint(0, TABLE.shape[0], (n,), generator=g)
    weight = torch.rand(512, generator=g) + 0.5
    slots = spread_slots(n, 3, 4, g)
    ref, out, poison = run_both(store_attention_kv, kv, positions, slots, 3, f.page_bytes, f, TABLE, weight, layout)
    x_ref = prepare_attention_kv(kv, positions, TABLE, weight, RopeLayout.parse(layout))
    assert_attention_store_ok(f, ref, out, poison, slots, x_ref)


def test_attention_kv_non_finite_rows(gpu_nan_rule):
    g = torch.Generator().manual_seed(8)
    kv = torch.randn(6, 512, generator=g)
    kv[0, 10] = float("nan")
    kv[1, 500] = float("inf")
    kv[2] = 0.0
    weight = torch.rand(512, generator=g) + 0.5
    weight[3] = 3e38
    for fmt in ("fp8-rope-bf16", "bf16"):
        f = AttentionKVFormat.parse(fmt)
        positions = torch.randint(0, TABLE.shape[0], (6,), generator=g)
        slots = spread_slots(6, 1, 0, g)
        ref, out, poison = run_both(store_attention_kv, kv, positions, slots, 1, f.page_bytes, f, TABLE, weight)
        assert_attention_store_ok(f, ref, out, poison, slots, prepare_attention_kv(kv, positions, TABLE, weight))


# --------------------------------------------------------------------------------------------------
# kernel safety without validation, strided input, determinism, empty input
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("generic", [False, True], ids=["fast", "generic"])
def test_kernel_drops_out_of_range_rows_without_validation(generic):
    """The launcher (no validation, as under capture) never writes for bad slots / positions (both kernels)."""
    fmt = KeyFormat.FP8
    keys, positions, weight, _, g = index_case(8, torch.bfloat16, "rmsnorm", 9)
    positions[1] = TABLE.shape[0]  # outside the table
    positions[2] = -5
    slots = torch.tensor([3, 70, 71, 128, 10**9, -1, 5, 127])  # pool of 2 pages = slots 0..127
    pool = torch.randint(0, 256, (2, fmt.page_bytes), dtype=torch.uint8, generator=g)
    before = pool.clone()
    launch_store_index_keys(keys.to(DEVICE), positions.to(DEVICE), slots.to(DEVICE), pool_dev := pool.to(DEVICE),
                            TABLE.to(DEVICE), weight.to(DEVICE), None, fmt, "rmsnorm", "interleaved", "trailing",
                            True, 1e-6, config=StoreConfig(index_kernel="generic" if generic else "auto"))
    good = torch.tensor([0, 6, 7])
    ref = before.clone()
    store_reference.store_index_keys(keys[good], positions[good], slots[good], ref, fmt, TABLE, weight)
    assert_index_store_ok(fmt, ref, pool_dev.cpu(), before, slots[good],
                          prepare_index_keys(keys[good], positions[good], TABLE, weight))
    written = written_mask(fmt, before, slots[good])
    assert torch.equal(pool_dev.cpu()[~written], before[~written])


@pytest.mark.parametrize("generic", [False, True], ids=["fast", "generic"])
def test_attention_kernel_drops_out_of_range_rows_without_validation(generic):
    fmt = AttentionKVFormat.FP8_ROPE_BF16
    g = torch.Generator().manual_seed(4)
    kv = torch.randn(5, 512, generator=g)
    positions = torch.tensor([0, TABLE.shape[0], 2, 3, 4])
    slots = torch.tensor([1, 2, 64, -1, 63])  # one page = slots 0..63
    pool = torch.randint(0, 256, (1, fmt.page_bytes), dtype=torch.uint8, generator=g)
    before = pool.clone()
    out = pool.to(DEVICE)
    launch_store_attention_kv(kv.to(DEVICE), positions.to(DEVICE), slots.to(DEVICE), out, TABLE.to(DEVICE),
                              (torch.rand(512, generator=g) + 0.5).to(DEVICE), fmt, "interleaved", "trailing", 1e-6,
                              config=StoreConfig(attention_kernel="generic" if generic else "auto"))
    written = written_mask(fmt, before, torch.tensor([1, 63]))
    assert torch.equal(out.cpu()[~written], before[~written])
    assert not torch.equal(out.cpu()[written], before[written])


def test_strided_keys_deterministic_and_empty():
    fmt = KeyFormat.FP4
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(9, 200, generator=g)
    keys = wide[:, 40:168]  # row stride 200, last dim dense
    positions = torch.randint(0, TABLE.shape[0], (9,), generator=g)
    weight = torch.rand(128, generator=g) + 0.5
    slots = spread_slots(9, 2, 0, g)
    ref, out, poison = run_both(store_index_keys, keys, positions, slots, 2, fmt.page_bytes, fmt, TABLE, weight)
    assert_index_store_ok(fmt, ref, out, poison, slots, prepare_index_keys(keys, positions, TABLE, weight))
    _, again, _ = run_both(store_index_keys, keys, positions, slots, 2, fmt.page_bytes, fmt, TABLE, weight)
    assert torch.equal(out, again), "two runs of the kernel gave different bytes"
    pool = poison.clone().to(DEVICE)
    store_index_keys(keys[:0].to(DEVICE), positions[:0].to(DEVICE), slots[:0].to(DEVICE), pool, fmt,
                     TABLE.to(DEVICE), weight.to(DEVICE), backend="triton")
    assert torch.equal(pool.cpu(), poison)


# --------------------------------------------------------------------------------------------------
# validation, dispatch, custom op, torch.compile
# --------------------------------------------------------------------------------------------------


def _valid_index_args(n: int = 4):
    fmt = KeyFormat.FP8
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(n, 128, generator=g)
    return dict(keys=keys, positions=torch.arange(n), slots=torch.arange(n), pool=torch.zeros(2, fmt.page_bytes,
                dtype=torch.uint8), fmt=fmt, rope_cos_sin=TABLE, norm_weight=torch.ones(128))


@pytest.mark.parametrize("change,match", [
    (dict(keys=torch.randn(4, 64)), "keys"),
    (dict(keys=torch.randn(4, 128).to(torch.int32)), "keys"),
    (dict(positions=torch.arange(3)), "positions"),
    (dict(positions=torch.arange(4).float()), "positions"),
    (dict(slots=torch.tensor([0, 1, 1, 2])), "duplicate"),
    (dict(slots=torch.tensor([0, 1, 2, 128])), "out of range"),
    (dict(positions=torch.tensor([0, 1, 2, 512])), "rope table"),
    (dict(pool=torch.zeros(2, 8448 * 2, dtype=torch.uint8)[:, ::2]), "pool"),
    (dict(pool=torch.zeros(2, 100, dtype=torch.uint8)), "pool"),
    (dict(rope_cos_sin=TABLE[:, :32]), "rope_cos_sin"),
    (dict(rope_cos_sin=TABLE.double()), "rope_cos_sin"),
    (dict(norm_weight=torch.ones(64)), "norm_weight"),
    (dict(norm_bias=torch.zeros(128)), "bias"),
    (dict(fmt="fp6"), "unknown key format"),
])
def test_store_index_keys_rejects_bad_input_and_leaves_pool(change, match):
    args = _valid_index_args()
    args.update(change)
    # on the device the Triton backend runs on (the CPU under the interpreter; a GPU machine refuses CPU
    # tensors for their device before any argument check), strides kept (the strided-pool case)
    args = {k: _on_device(v) for k, v in args.items()}
    pool = args["pool"]
    before = pool.clone()
    with pytest.raises(ValueError, match=match):
        store_index_keys(**args, backend="triton")
    assert torch.equal(pool, before)


def _on_device(value):
    """A CPU tensor of a test case moved to DEVICE with its strides (other values unchanged)."""
    if not isinstance(value, torch.Tensor) or value.device.type == DEVICE:
        return value
    out = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=DEVICE)
    return out.copy_(value)


def test_store_attention_kv_rejects_bad_input():
    fmt = AttentionKVFormat.FP8_ROPE_BF16
    pool = torch.zeros(1, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    kv = torch.randn(3, 512, device=DEVICE)
    table, rows, ones = TABLE.to(DEVICE), torch.arange(3, device=DEVICE), torch.ones(512, device=DEVICE)
    with pytest.raises(ValueError, match="kv"):
        store_attention_kv(torch.randn(3, 448, device=DEVICE), rows, rows, pool, fmt, table, ones, backend="triton")
    with pytest.raises(ValueError, match="out of range"):
        store_attention_kv(kv, rows, torch.tensor([0, 1, 64], device=DEVICE), pool, fmt, table, ones,
                           backend="triton")
    with pytest.raises(ValueError, match="norm_weight"):
        store_attention_kv(kv, rows, rows, pool, fmt, table, ones[:128], backend="triton")
    with pytest.raises(ValueError, match="backend"):
        store_attention_kv(kv, rows, rows, pool, fmt, table, ones, backend="cuda")
    # regression: a negative eps was accepted and turned rows with a small mean square into NaN
    for backend in ("triton", "reference"):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0, got -1"):
            store_attention_kv(kv, rows, rows, pool, fmt, table, ones, eps=-1e-6, backend=backend)
    assert not bool(pool.any())


def test_auto_backend_on_cpu_is_the_reference():
    args = _valid_index_args()
    expected = args["pool"].clone()
    store_reference.store_index_keys(args["keys"], args["positions"], args["slots"], expected, args["fmt"],
                                     TABLE, args["norm_weight"])
    store_index_keys(**args)  # auto: CPU tensors -> reference
    assert torch.equal(args["pool"], expected)


def test_custom_ops_registered_and_opcheck():
    args = _valid_index_args(3)
    layout = ROPE_V4.name
    op_args = (args["keys"].to(DEVICE), args["positions"].to(DEVICE), args["slots"].to(DEVICE),
               args["pool"].to(DEVICE), TABLE.to(DEVICE), args["norm_weight"].to(DEVICE), None, "fp8", "rmsnorm",
               layout, True, 1e-6)
    torch.library.opcheck(torch.ops.dsakit.store_index_keys.default, op_args,
                          test_utils=("test_schema", "test_faketensor"))
    fmt = AttentionKVFormat.BF16
    kv_args = (torch.randn(2, 512).to(DEVICE), torch.arange(2).to(DEVICE), torch.arange(2).to(DEVICE),
               torch.zeros(1, fmt.page_bytes, dtype=torch.uint8).to(DEVICE), TABLE.to(DEVICE),
               torch.ones(512).to(DEVICE), "bf16", layout, 1e-6)
    torch.library.opcheck(torch.ops.dsakit.store_attention_kv.default, kv_args,
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_matches_eager():
    args = _valid_index_args(5)
    dev = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    eager_pool = dev["pool"].clone()
    store_index_keys(**{**dev, "pool": eager_pool}, backend="triton")

    def step(keys, positions, slots, pool):
        store_index_keys(keys, positions, slots, pool, KeyFormat.FP8, dev["rope_cos_sin"], dev["norm_weight"],
                         backend="triton")
        return pool

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    pool = dev["pool"].clone()
    compiled(dev["keys"], dev["positions"], dev["slots"], pool)
    assert torch.equal(pool.cpu(), eager_pool.cpu())
    assert bool(pool.any())
    # a pool off a 16-byte boundary is refused inside the traced call too (by the custom op, on the real pool)
    raw = torch.zeros(pool.numel() + 16, dtype=torch.uint8, device=DEVICE)
    shifted = raw[8:8 + pool.numel()].view(pool.shape)
    with pytest.raises(ValueError, match="16-byte boundary"):
        compiled(dev["keys"], dev["positions"], dev["slots"], shifted)
    assert not bool(raw.any())


# --------------------------------------------------------------------------------------------------
# GPU only: a full-size byte check of the native-cast path
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA device (native casts)")
@pytest.mark.parametrize("fmt", KEY_FORMATS)
def test_gpu_full_size_index_keys(fmt):
    check_index(fmt, "interleaved-trailing", "rmsnorm", True, torch.bfloat16, n=8192, seed=99)
    check_index(fmt, "half-split-leading", "layernorm", True, torch.bfloat16, n=8192, seed=98)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA device (graph capture)")
def test_gpu_cuda_graph_capture_of_public_function():
    """Under capture the host-side value checks are skipped; replaying the graph stores the same bytes."""
    fmt = KeyFormat.FP4
    keys, positions, weight, _, g = index_case(300, torch.bfloat16, "rmsnorm", 31)
    slots = spread_slots(300, 8, 9, g)
    dev = [t.cuda() for t in (keys, positions, slots, TABLE, weight)]
    eager = torch.zeros(8, fmt.page_bytes, dtype=torch.uint8, device="cuda")
    store_index_keys(dev[0], dev[1], dev[2], eager, fmt, dev[3], dev[4])
    pool = torch.zeros_like(eager)
    store_index_keys(dev[0], dev[1], dev[2], pool, fmt, dev[3], dev[4])  # warm-up (compiles) outside capture
    pool.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_index_keys(dev[0], dev[1], dev[2], pool, fmt, dev[3], dev[4])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool, eager)


def test_store_config_holds_every_launch_setting():
    """StoreConfig validates its fields and answers the launchers' choices (they derive nothing themselves)."""
    config = StoreConfig()
    assert config.index_launch(64, False) == (True, config.index_block_n, config.index_warps)
    assert config.index_launch(64, True) == (True, config.page_term_block_n, config.page_term_warps)
    assert config.index_launch(32, True) == (False, config.generic_index_block_n, config.generic_warps)
    assert StoreConfig(index_kernel="generic").index_launch(64, False)[0] is False
    assert config.fast_attention_kernel(64, "trailing", "fp8-rope-bf16")
    assert not config.fast_attention_kernel(64, "trailing", "bf16")
    assert not StoreConfig(attention_kernel="generic").fast_attention_kernel(64, "trailing", "fp8-rope-bf16")
    assert config.page_term_launches(10**6) == 1
    assert StoreConfig(page_term_two_launches_from=100).page_term_launches(99) == 1
    assert StoreConfig(page_term_two_launches_from=100).page_term_launches(100) == 2
    for bad in (dict(index_block_n=24), dict(page_term_warps=0), dict(index_kernel="fast"),
                dict(page_term_two_launches_from=-1), dict(attention_warps=True)):
        with pytest.raises(ValueError):
            StoreConfig(**bad)
    with pytest.raises(TypeError):  # a lost variant (never measured): no such field
        StoreConfig(page_term_early_loads=True)
