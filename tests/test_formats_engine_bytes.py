"""fp8 / fp4 index keys byte for byte against an independent implementation of the engines' quantizer rules.

The rules (DeepGEMM's test quantizers, which fill the paged caches its kernels read; SGLang writes the same):

* fp8: per entry, scale = max(amax, 1e-4) / 448 in fp32; ``fp8-ue8m0`` rounds it up to a power of two.
  The element is x * (1 / scale) with the fp32 reciprocal computed once per entry, clamped to +-448 and cast
  to e4m3fn (round to nearest, ties to even; the sign of x is kept, so -0 and a negative value that rounds
  to 0 give 0x80).
* fp4: per 32 elements, scale = 2^ceil(log2(max(amax, 1e-4) / 6)) stored as the ue8m0 byte exponent + 127;
  |x * (1 / scale)| clamped to 6 is coded by the thresholds 0.25 0.75 1.25 1.75 2.5 3.5 5.0 (a value equal
  to a threshold takes the smaller magnitude); the sign bit (bit 3) only on non-zero codes; byte i holds
  elements 2i (low nibble) and 2i + 1 (high nibble).

The implementation below uses numpy fp32 scalars and a table of the 127 non-negative e4m3fn values, none of
dsakit's code. It is checked against ``KeyFormat.quantize`` and against the store op (reference backend, and
the Triton kernel under TRITON_INTERPRET=1 at tiny shapes) on adversarial rows: e4m3 midpoints, fp4
thresholds, powers of two for ue8m0, zeros, -0, tiny, huge, bf16-valued rows, and the pinned example
x[0] = 2.375, x[1] = 0.890625 whose second byte is 0x73 (x / scale would give 0x72).

Through the store op a row must survive norm, rope and rotation unchanged: LayerNorm with weight 0 and the
row as bias gives the bias exactly, rope uses cos = 1, sin = 0, no Hadamard (so one row per call).
"""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch

from dsakit.cache import read_entries
from dsakit.formats import KeyFormat
from dsakit.ops import store as store_ops
from dsakit.presets import KeyTransform

F32 = np.float32
THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# --------------------------------------------------------------------------------------------------
# The engines' rules, independently
# --------------------------------------------------------------------------------------------------


def _e4m3_positive_values() -> np.ndarray:
    """Values of the e4m3fn codes 0..126 (0x7F is NaN), increasing: bias 7, subnormals below 2^-6."""
    out = []
    for code in range(127):
        e, m = code >> 3, code & 7
        out.append(np.ldexp(m / 8, -6) if e == 0 else np.ldexp(1 + m / 8, e - 7))
    return np.array(out, dtype=np.float64)


E4M3 = _e4m3_positive_values()


def e4m3_byte(v: np.float32) -> int:
    """Finite fp32 v with |v| <= 448 -> e4m3fn byte, round to nearest, ties to the even code, sign kept."""
    a = abs(float(v))
    i = int(np.searchsorted(E4M3, a))  # first code whose value is >= a
    if i == 0:
        code = 0
    else:
        lo, hi = E4M3[i - 1], E4M3[i]
        below, above = a - lo, hi - a  # exact in float64
        code = i - 1 if below < above else i if below > above else (i - 1 if (i - 1) % 2 == 0 else i)
    return (0x80 if np.signbit(v) else 0) | code


def pow2_ceil(s: np.float32) -> np.float32:
    """Smallest power of two >= s (s > 0, normal)."""
    m, e = np.frexp(np.float64(s))
    return F32(np.ldexp(1.0, int(e) - 1) if m == 0.5 else np.ldexp(1.0, int(e)))


def engine_fp8(row: np.ndarray, ue8m0: bool = False) -> tuple[list[int], list[int]]:
    """fp32 [128] -> (128 value bytes, 4 scale bytes)."""
    row = row.astype(F32)
    amax = F32(np.max(np.abs(row)))
    scale = F32(max(amax, F32(1e-4))) / F32(448.0)
    if ue8m0:
        scale = pow2_ceil(scale)
    inv = F32(1.0) / scale
    values = [e4m3_byte(F32(min(max(F32(x * inv), F32(-448.0)), F32(448.0)))) for x in row]
    return values, list(struct.pack("<f", float(scale)))


def engine_fp4(row: np.ndarray) -> tuple[list[int], list[int]]:
    """fp32 [128] -> (64 value bytes, 4 ue8m0 scale bytes)."""
    row = row.astype(F32)
    codes, scale_bytes = [], []
    for b in range(4):
        block = row[32 * b: 32 * b + 32]
        amax = F32(max(F32(np.max(np.abs(block))), F32(1e-4)))
        scale = pow2_ceil(F32(amax / F32(6.0)))
        scale_bytes.append(int(np.frexp(np.float64(scale))[1]) - 1 + 127)
        inv = F32(1.0) / scale
        for x in block:
            v = F32(min(max(F32(x * inv), F32(-6.0)), F32(6.0)))
            code = sum(1 for t in THRESHOLDS if abs(float(v)) > t)
            codes.append(code | (8 if code and v < 0 else 0))
    return [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(64)], scale_bytes


ENGINE = {"fp8": lambda r: engine_fp8(r), "fp8-ue8m0": lambda r: engine_fp8(r, ue8m0=True), "fp4": engine_fp4}


# --------------------------------------------------------------------------------------------------
# Adversarial rows
# --------------------------------------------------------------------------------------------------


def _midpoints() -> np.ndarray:
    return (E4M3[:-1] + E4M3[1:]) / 2  # exact in float64; those with <= 24 significant bits are exact in fp32


def adversarial_rows() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    rows: dict[str, np.ndarray] = {}
    pinned = np.zeros(128, dtype=F32)
    pinned[0], pinned[1] = 2.375, 0.890625
    rows["pinned"] = pinned
    mids = _midpoints()
    # e4m3 midpoints with scale exactly 1 (amax 448) and with scales that are not powers of two
    for name, amax in (("mid-scale1", 448.0), ("mid-2.375", 2.375), ("mid-bf16", 0.0859375), ("mid-odd", 3.1415927)):
        scale = F32(F32(amax) / F32(448.0))
        row = np.zeros(128, dtype=F32)
        row[0] = amax
        picks = mids[np.linspace(0, len(mids) - 1, 127).astype(int)]
        row[1:] = (picks * scale).astype(F32) * np.where(np.arange(127) % 2, -1, 1)
        rows[name] = row
    # bf16-valued rows at several magnitudes (what real caches hold), signs mixed
    for i, mag in enumerate((1e-3, 0.5, 1.0, 7.0, 300.0)):
        for j in range(4):
            rows[f"bf16-{i}-{j}"] = torch.from_numpy(rng.standard_normal(128).astype(F32) * F32(mag)) \
                .to(torch.bfloat16).float().numpy()
    # fp4 thresholds: each block's amax 6 * 2^k (scale 2^k exact), then thresholds, and their neighbours
    for k in (-3, 0, 5):
        s = F32(2.0**k)
        block = [6.0]
        for t in THRESHOLDS:
            block += [t, -t, np.nextafter(F32(t), F32(0)), np.nextafter(F32(t), F32(10))]
        block += [0.2, -0.2, -0.0, 0.0]  # negative values that code as 0 carry no sign
        block = (np.array(block[:32], dtype=F32) * s).astype(F32)
        rows[f"fp4-thresholds-{k}"] = np.tile(block, 4)
    # ue8m0: amax exactly 448 * 2^k (scale a power of two) and one ulp above (rounds up); fp4 6 * 2^k likewise
    for k in (-10, 0, 7):
        exact = np.full(128, F32(0.75 * 2.0**k), dtype=F32)
        exact[0] = F32(448.0 * 2.0**k)
        rows[f"pow2-fp8-{k}"] = exact
        above = exact.copy()
        above[0] = np.nextafter(exact[0], F32(np.inf))
        rows[f"pow2-fp8-above-{k}"] = above
        fp4 = np.full(128, F32(1.75 * 2.0**k), dtype=F32)
        fp4[::32] = F32(6.0 * 2.0**k)
        rows[f"pow2-fp4-{k}"] = fp4
        fp4_above = fp4.copy()
        fp4_above[::32] = np.nextafter(fp4[::32], F32(np.inf))
        rows[f"pow2-fp4-above-{k}"] = fp4_above
    rows["zeros"] = np.zeros(128, dtype=F32)
    rows["negative-zeros"] = np.full(128, F32(-0.0), dtype=F32)
    mixed = np.zeros(128, dtype=F32)
    mixed[::2] = -0.0
    mixed[1::4] = 1.5
    rows["mixed-zeros"] = mixed
    rows["tiny"] = (rng.standard_normal(128) * 1e-30).astype(F32)  # below the 1e-4 amax floor
    rows["floor"] = (rng.standard_normal(128) * 3e-5).astype(F32)
    rows["subnormal-scale"] = np.array([1e-4] + [1e-8] * 127, dtype=F32)
    huge = (rng.standard_normal(128) * 1e30).astype(F32)
    huge[5] = F32(3.0e38)
    rows["huge"] = huge
    return rows


ROWS = adversarial_rows()


def _bytes_of(fmt: KeyFormat, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    return fmt.quantize(torch.from_numpy(np.ascontiguousarray(rows)))


# --------------------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------------------


def test_independent_rules_pinned_example():
    values, _ = engine_fp8(ROWS["pinned"])
    assert values[:2] == [0x7E, 0x73]  # 2.375 -> 448 (0x7E); 0.890625 * (448 / 2.375) rounds above 168
    # what dividing would give: 0.890625 / (2.375 / 448) == 168.0 exactly, a tie that goes to the even 160
    scale = F32(F32(2.375) / F32(448.0))
    assert e4m3_byte(F32(F32(0.890625) / scale)) == 0x72
    assert e4m3_byte(F32(168.0)) == 0x72 and e4m3_byte(F32(-0.0)) == 0x80 and e4m3_byte(F32(448.0)) == 0x7E
    codes, scales = engine_fp4(ROWS["fp4-thresholds-0"])
    assert scales == [127] * 4  # amax 6 -> scale 1
    # block: 6, 0.25, -0.25, ...: 6 -> 7, 0.25 -> 0 (tie to smaller), -0.25 -> 0 without sign
    assert codes[0] == 0x07 and codes[1] == 0x00


@pytest.mark.parametrize("name", ["fp8", "fp8-ue8m0", "fp4"])
def test_quantize_matches_engine_rules(name):
    fmt = KeyFormat.parse(name)
    rows = np.stack(list(ROWS.values()))
    values, scales = _bytes_of(fmt, rows)
    for i, (label, row) in enumerate(ROWS.items()):
        want_values, want_scales = ENGINE[name](row)
        assert scales[i].tolist() == want_scales, (name, label)
        diff = [j for j, (a, b) in enumerate(zip(values[i].tolist(), want_values)) if a != b]
        assert not diff, (name, label, diff[:5], [values[i, j].item() for j in diff[:5]], [want_values[j] for j in diff[:5]])
    if name == "fp8":
        assert values[0, 1].item() == 0x73  # the pinned example


def test_quantize_matches_engine_rules_on_many_bf16_rows():
    """bf16-valued keys as caches hold them: 0.06% of bytes differ between x / scale and x * (1 / scale)."""
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(300, 128, generator=g) * torch.logspace(-2, 2, 300).unsqueeze(1)).bfloat16().float()
    for name in ("fp8", "fp4"):
        values, scales = KeyFormat.parse(name).quantize(rows)
        want = [ENGINE[name](r) for r in rows.numpy()]
        assert values.tolist() == [w[0] for w in want], name
        assert scales.tolist() == [w[1] for w in want], name


def _store_row(fmt: KeyFormat, row: np.ndarray, backend: str) -> tuple[list[int], list[int]]:
    """Store one row so that the store's transform returns it unchanged; read back its bytes."""
    bias = torch.from_numpy(np.ascontiguousarray(row))
    # the key only sets the sign of the zero product (weight 0) that the bias is added to: -0 needs -0 + -0
    keys = torch.where(torch.signbit(bias), -1.0, 1.0).reshape(1, 128)
    keys[0, 127] = -keys[0, 0]  # both signs present: LayerNorm's centring keeps every sign
    table = torch.cat([torch.ones(4, 32), torch.zeros(4, 32)], dim=1)  # cos = 1, sin = 0
    transform = KeyTransform(norm="layernorm", hadamard=False)
    pool = torch.zeros(1, fmt.page_bytes, dtype=torch.uint8)
    store_ops.store_index_keys(keys, torch.tensor([2]), torch.tensor([5]), pool, fmt, table, torch.zeros(128),
                               bias, transform, backend=backend)
    values, scales = read_entries(pool, fmt, torch.tensor([5]))
    return values[0].tolist(), scales[0].tolist()


# the identity rope turns a -0 in the rope dims (64..127) into +0 (x - (-0) = x + 0): the store rows keep their
# -0s in dims 0..63 only
STORE_ROWS = list(ROWS)


@pytest.mark.parametrize("name", ["fp8", "fp8-ue8m0", "fp4"])
def test_reference_store_matches_engine_rules(name):
    fmt = KeyFormat.parse(name)
    for label in STORE_ROWS:
        row = ROWS[label].copy()
        row[64:] = np.where(row[64:] == 0, F32(0.0), row[64:])  # +0 in the rope dims (see STORE_ROWS)
        assert _store_row(fmt, row, "reference") == ENGINE[name](row), (name, label)


TRITON_ROWS = ["pinned", "mid-2.375", "mid-odd", "bf16-2-0", "fp4-thresholds-0", "pow2-fp8-above-0",
               "pow2-fp4-above-0", "mixed-zeros", "tiny", "huge"]


@pytest.mark.skipif(not INTERPRET, reason="the Triton store runs on the CPU under TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["fp8", "fp4"])
def test_triton_store_matches_engine_rules(name):
    fmt = KeyFormat.parse(name)
    for label in TRITON_ROWS:
        row = ROWS[label].copy()
        row[64:] = np.where(row[64:] == 0, F32(0.0), row[64:])
        assert _store_row(fmt, row, "triton") == ENGINE[name](row), (name, label)
