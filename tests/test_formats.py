"""Index-key and attention-KV formats (dsakit.formats): round trips, byte layouts, hand-computed bytes.

The hand-computed examples write the arithmetic out in comments; the expected bytes are literals, so a
change in any quantization rule (scale, rounding, nibble order, byte order) fails here first.
"""

from __future__ import annotations

import struct

import pytest
import torch

from dsakit.formats import (
    ATTENTION_KV_FORMATS,
    KEY_FORMATS,
    AttentionKVFormat,
    KeyFormat,
    fp8_scale,
    ue8m0_exponent_ceil,
)

# formats whose entries encode on their own (the page-centred ones: tests/test_formats_centred.py)
ALL_KEY_FORMATS = sorted(name for name in KEY_FORMATS if not name.endswith("-centred"))


def f32_bytes(value: float) -> list[int]:
    """Little-endian bytes of an fp32 number (independent of torch)."""
    return list(struct.pack("<f", value))


# --------------------------------------------------------------------------------------------------
# Constants and parsing
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,value_bytes,scale_bytes,page_bytes", [
    ("bf16", 256, 0, 16384), ("fp8", 128, 4, 8448), ("fp8-ue8m0", 128, 4, 8448),
    ("fp4", 64, 4, 4352), ("fp4-rne", 64, 4, 4352)])
def test_key_format_sizes(name, value_bytes, scale_bytes, page_bytes):
    fmt = KeyFormat.parse(name)
    assert (fmt.value_bytes, fmt.scale_bytes, fmt.page_bytes) == (value_bytes, scale_bytes, page_bytes)
    assert fmt.bytes_per_entry == value_bytes + scale_bytes
    assert KeyFormat.parse(fmt) is fmt
    assert KeyFormat.parse(name.upper()) is fmt


def test_parse_rejects_unknown_names():
    with pytest.raises(ValueError, match="fp6"):
        KeyFormat.parse("fp6")
    with pytest.raises(ValueError, match="fp9"):
        AttentionKVFormat.parse("fp9")


def test_attention_kv_sizes():
    fmt = AttentionKVFormat.FP8_ROPE_BF16
    assert fmt.value_bytes == 576 and fmt.scale_bytes == 8 and fmt.bytes_per_entry == 584
    # 64 x 576 + 64 x 8 = 37376, padded up to a multiple of 576: 65 x 576 = 37440
    assert fmt.page_bytes == 37440 and fmt.page_bytes % 576 == 0
    assert AttentionKVFormat.BF16.page_bytes == 64 * 1024
    assert set(ATTENTION_KV_FORMATS) == {"fp8-rope-bf16", "bf16"}


# --------------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------------

# Relative L2 error per entry of a Gaussian key (measured: bf16 0.17%, fp8 2.6%, fp4 11.5% mean).
ROUND_TRIP_BOUNDS = {"bf16": (0.0, 0.004), "fp8": (0.01, 0.04), "fp8-ue8m0": (0.01, 0.045),
                     "fp4": (0.05, 0.2), "fp4-rne": (0.05, 0.2)}


@pytest.mark.parametrize("name", ALL_KEY_FORMATS)
def test_round_trip_error_bounds(name):
    fmt = KeyFormat.parse(name)
    x = torch.randn(200, 128) * torch.logspace(-3, 3, 200).unsqueeze(1)  # scales over 6 decades
    values, scales = fmt.quantize(x)
    assert values.dtype == torch.uint8 and values.shape == (200, fmt.value_bytes)
    assert scales.dtype == torch.uint8 and scales.shape == (200, fmt.scale_bytes)
    y = fmt.dequantize(values, scales)
    rel = (y - x).norm(dim=1) / x.norm(dim=1)
    low, high = ROUND_TRIP_BOUNDS[name]
    assert float(rel.max()) < high, f"{name}: worst relative error {float(rel.max()):.4f}"
    assert float(rel.mean()) >= low  # a quantized format that loses nothing would mean it was skipped
    # every element within half a code step of its scale: |err| <= amax * (format's relative step)
    per_elem = {"bf16": 2 ** -8, "fp8": 2 ** -4, "fp8-ue8m0": 2 ** -3, "fp4": 1 / 3, "fp4-rne": 1 / 3}[name]
    amax = x.abs().amax(dim=1, keepdim=True)
    assert bool(((y - x).abs() <= amax * per_elem + 1e-30).all())


@pytest.mark.parametrize("name", ["bf16", "fp8", "fp8-ue8m0"])
def test_quantize_is_idempotent_on_dequantized_values(name):
    """Dequantized values are representable: quantizing them again gives the same bytes.

    Not true of fp4, by design: a block with amax 6.1 gets scale 2 (6.1 / 6 > 1), 6.1 / 2 = 3.05 decodes
    to 6.0, and the second pass then picks scale 1.
    """
    fmt = KeyFormat.parse(name)
    x = torch.randn(32, 128)
    values, scales = fmt.quantize(x)
    again_v, again_s = fmt.quantize(fmt.dequantize(values, scales))
    assert torch.equal(again_v, values) and torch.equal(again_s, scales)


# --------------------------------------------------------------------------------------------------
# Page layout and slot offsets
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_KEY_FORMATS)
def test_page_layout_values_then_scales(name):
    fmt = KeyFormat.parse(name)
    x = torch.randn(128, 128)  # two pages
    values, scales = fmt.quantize(x)
    pages = fmt.quantize_pages(x)
    assert pages.shape == (2, fmt.page_bytes)
    for slot in (0, 1, 63, 64, 100, 127):
        p, e = divmod(slot, 64)
        v0 = e * fmt.value_bytes
        assert torch.equal(pages[p, v0: v0 + fmt.value_bytes], values[slot])
        s0 = 64 * fmt.value_bytes + e * fmt.scale_bytes
        assert torch.equal(pages[p, s0: s0 + fmt.scale_bytes], scales[slot])
    assert torch.equal(fmt.dequantize_pages(pages), fmt.dequantize(values, scales))


@pytest.mark.parametrize("name,slot,value_offset,scale_offset", [
    # fp8: page 8448 B = 64 x 128 value bytes (8192) + 64 x 4 scale bytes
    ("fp8", 0, 0, 8192), ("fp8", 65, 8448 + 128, 8448 + 8192 + 4),
    ("fp8", 130, 2 * 8448 + 2 * 128, 2 * 8448 + 8192 + 8),
    # fp4: page 4352 B = 64 x 64 (4096) + 64 x 4
    ("fp4", 63, 63 * 64, 4096 + 63 * 4), ("fp4", 64, 4352, 4352 + 4096),
    # bf16: no scales, scale offset = end of the value area
    ("bf16", 3, 3 * 256, 16384), ("bf16", 67, 16384 + 3 * 256, 2 * 16384)])
def test_byte_offsets_literal(name, slot, value_offset, scale_offset):
    v, s = KeyFormat.parse(name).byte_offsets(torch.tensor([slot]))
    assert (int(v[0]), int(s[0])) == (value_offset, scale_offset)


def test_quantize_pages_rejects_partial_page():
    with pytest.raises(ValueError, match="65"):
        KeyFormat.FP8.quantize_pages(torch.randn(65, 128))


@pytest.mark.parametrize("bad,match", [
    (torch.randn(4, 64), r"\[4, 64\]"), (torch.randn(128), r"\[128\]"),
    (torch.ones(2, 128, dtype=torch.int32), "int32")])
def test_quantize_rejects_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        KeyFormat.FP8.quantize(bad)


# --------------------------------------------------------------------------------------------------
# Hand-computed fp8 example
# --------------------------------------------------------------------------------------------------


def test_fp8_hand_computed_bytes():
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3], x[0, 4] = 3.5, -1.0, 0.1, 7.0, 0.09765625
    # amax = 7.0 -> scale = 7 / 448 = 0.015625 = 2^-6 (exact), so x / scale = 64 x
    #   3.5  -> 224   = 1.75 x 2^7 : sign 0, exponent 7 + bias 7 = 14 = 1110b, mantissa .75 = 110b -> 0x76
    #  -1.0  -> -64   = 1.0  x 2^6 : sign 1, exponent 13 = 1101b, mantissa 000b               -> 0xE8
    #   0.1  -> 6.4   in [4, 8) the step is 0.5: nearest 6.5 = 1.625 x 2^2, exp 9 = 1001b, m 101b -> 0x4D
    #   7.0  -> 448   = 1.75 x 2^8 : exponent 15 = 1111b, mantissa 110b (largest finite)        -> 0x7E
    #   0.09765625 -> 6.25 exactly: tie between 6.0 (m 100b) and 6.5 (m 101b), even mantissa wins -> 0x4C
    #   0.0  -> 0x00
    # scale fp32 2^-6: biased exponent 121 = 0x79 -> bits 0x3C800000, little endian 00 00 80 3C
    values, scales = KeyFormat.FP8.quantize(x)
    assert values[0, :6].tolist() == [0x76, 0xE8, 0x4D, 0x7E, 0x4C, 0x00]
    assert bool((values[0, 5:] == 0).all())
    assert scales[0].tolist() == [0x00, 0x00, 0x80, 0x3C]
    assert scales[0].tolist() == f32_bytes(2.0 ** -6)
    y = KeyFormat.FP8.dequantize(values, scales)
    assert y[0, :5].tolist() == [3.5, -1.0, 6.5 / 64, 7.0, 6.0 / 64]


def test_fp8_non_power_of_two_scale_is_unrounded_fp32():
    x = torch.zeros(1, 128)
    x[0, 7] = -3.0  # amax 3 -> scale = fl32(3 / 448), stored un-rounded; -3 / scale = -448 -> 0xFE
    values, scales = KeyFormat.FP8.quantize(x)
    expected_scale = struct.unpack("<f", struct.pack("<f", 3.0 / 448.0))[0]
    assert scales[0].tolist() == f32_bytes(expected_scale)
    assert int(values[0, 7]) == 0xFE


# --------------------------------------------------------------------------------------------------
# fp8 ue8m0 scale rounding
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("amax,expected_scale", [
    (448.0, 1.0),                 # 448 / 448 = 2^0 exactly: stays
    (112.0, 0.25),                # 2^-2 exactly: stays
    (448.0 * 2 ** 20, 2.0 ** 20),  # large exact power stays
    (100.0, 0.25),                # 0.2232 -> next power of two up is 0.25
    (449.0, 2.0),                 # 1.0022 -> 2
    (672.0, 2.0),                 # 1.5 -> 2
    (0.0, 2.0 ** -22),            # floor: 1e-4 / 448 = 2.23e-7 -> 2^-22 = 2.38e-7
])
def test_ue8m0_scale_rounding(amax, expected_scale):
    assert float(fp8_scale(torch.tensor([amax]), "ue8m0")[0]) == expected_scale
    x = torch.zeros(1, 128)
    x[0, 0] = amax
    _, scales = KeyFormat.FP8_UE8M0.quantize(x)
    assert scales[0].tolist() == f32_bytes(expected_scale)


def test_ue8m0_exponent_ceil_next_to_powers_of_two():
    powers = torch.tensor([2.0 ** k for k in range(-20, 21)])
    above = torch.nextafter(powers, torch.tensor(float("inf")))
    below = torch.nextafter(powers, torch.tensor(0.0))
    k = torch.arange(-20, 21, dtype=torch.int32)
    assert torch.equal(ue8m0_exponent_ceil(powers), k + 127)       # exact powers stay
    assert torch.equal(ue8m0_exponent_ceil(above), k + 128)        # one ulp above -> next power
    assert torch.equal(ue8m0_exponent_ceil(below), k + 127)        # one ulp below -> this power


# --------------------------------------------------------------------------------------------------
# Hand-computed fp4 example and the rounding modes
# --------------------------------------------------------------------------------------------------


def fp4_example() -> torch.Tensor:
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 5.0, -0.3, 1.3, 2.9   # block 0
    x[0, 32], x[0, 33] = 0.75, -0.1                               # block 1
    # block 2 (elements 64..95) stays all zero
    x[0, 96], x[0, 97] = -6000.0, 1792.0                          # block 3
    return x


@pytest.mark.parametrize("name", ["fp4", "fp4-rne"])
def test_fp4_hand_computed_bytes(name):
    # Block 0: amax 5 -> 5/6 = 0.833 -> scale 2^ceil(log2 .833) = 2^0 -> ue8m0 byte 127 = 0x7F
    #   5.0  -> 5.0: exactly on threshold 5.0 (between 4 = code 6 and 6 = code 7): both modes pick code 6
    #              (threshold: smaller; rne: code 6 is even)
    #  -0.3  -> 0.3 > 0.25 -> 0.5 = code 1, sign bit -> 0x9
    #   1.3  -> 1.25 < 1.3 <= 1.75 -> 1.5 = code 3;  2.9 -> 2.5 < 2.9 <= 3.5 -> 3.0 = code 5
    #   byte 0 = elem0 | elem1 << 4 = 0x6 | 0x90 = 0x96;  byte 1 = 0x3 | 0x50 = 0x53
    # Block 1: amax 0.75 -> 0.75/6 = 0.125 = 2^-3 exactly -> byte 124 = 0x7C
    #   0.75 -> 6.0 = code 7;  -0.1 -> -0.8: 0.75 < 0.8 <= 1.25 -> 1.0 = code 2, sign -> 0xA
    #   byte 16 = 0x7 | 0xA0 = 0xA7
    # Block 2: all zero -> floor 1e-4 / 6 = 1.67e-5 -> 2^-15 (2^-16 = 1.53e-5 is too small) -> 112 = 0x70
    # Block 3: amax 6000 -> 1000 -> 2^10 -> byte 137 = 0x89
    #  -6000 -> -5.86 > 5 -> 6 = code 7, sign -> 0xF
    #   1792 -> 1.75 exactly: threshold mode -> 1.5 = code 3; rne -> 2.0 = code 4 (even)
    #   byte 48 = 0xF | 0x30 = 0x3F (threshold) or 0xF | 0x40 = 0x4F (rne)
    values, scales = KeyFormat.parse(name).quantize(fp4_example())
    expected = [0] * 64
    expected[0], expected[1], expected[16] = 0x96, 0x53, 0xA7
    expected[48] = 0x3F if name == "fp4" else 0x4F
    assert values[0].tolist() == expected
    assert scales[0].tolist() == [0x7F, 0x7C, 0x70, 0x89]
    y = KeyFormat.parse(name).dequantize(values, scales)
    assert y[0, :4].tolist() == [4.0, -0.5, 1.5, 3.0]
    assert y[0, 32:34].tolist() == [0.75, -0.125]
    assert y[0, 96:98].tolist() == [-6144.0, 1536.0 if name == "fp4" else 2048.0]


# (threshold, code in threshold mode, code in rne mode); code = index into 0, .5, 1, 1.5, 2, 3, 4, 6
FP4_TIES = [(0.25, 0, 0), (0.75, 1, 2), (1.25, 2, 2), (1.75, 3, 4), (2.5, 4, 4), (3.5, 5, 6), (5.0, 6, 6)]


@pytest.mark.parametrize("threshold,code_threshold,code_rne", FP4_TIES)
def test_fp4_ties_at_every_threshold(threshold, code_threshold, code_rne):
    x = torch.zeros(1, 128)
    x[0, 0] = 6.0  # amax 6 -> scale exactly 1, so element values are their own scaled magnitudes
    above = float(torch.nextafter(torch.tensor(threshold), torch.tensor(10.0)))
    below = float(torch.nextafter(torch.tensor(threshold), torch.tensor(0.0)))
    x[0, 2], x[0, 3], x[0, 4], x[0, 5] = threshold, -threshold, above, below
    for name, code in (("fp4", code_threshold), ("fp4-rne", code_rne)):
        values, scales = KeyFormat.parse(name).quantize(x)
        assert int(scales[0, 0]) == 127
        b1, b2 = int(values[0, 1]), int(values[0, 2])  # byte 1 = elems 2, 3; byte 2 = elems 4, 5
        assert b1 & 0xF == code, f"{name} tie at {threshold}"
        # the sign only on non-zero codes: -0.25 rounds to magnitude 0 and stores 0x0, as the engines do
        assert b1 >> 4 == (code | 0x8 if code else 0), f"{name} negative tie at {threshold}"
        # just above a threshold always rounds up, just below always down, in both modes
        index = FP4_TIES.index((threshold, code_threshold, code_rne))
        assert b2 & 0xF == index + 1 and b2 >> 4 == index


# --------------------------------------------------------------------------------------------------
# Non-finite and all-zero entries
# --------------------------------------------------------------------------------------------------


def special_rows() -> torch.Tensor:
    x = torch.randn(4, 128)
    x[0, 5] = float("nan")
    x[1, 6], x[1, 7] = float("inf"), float("-inf")
    x[2] = 0.0
    x[3] = float("nan")
    return x


def test_fp8_non_finite_and_zero_rows():
    x = special_rows()
    values, scales = KeyFormat.FP8.quantize(x)
    assert not bool(((values & 0x7F) == 0x7F).any()), "an e4m3fn NaN byte was produced"
    scale = scales.view(torch.float32).flatten()
    assert int(values[0, 5]) == 0x00  # NaN element -> 0
    finite0 = x[0].clone()
    finite0[5] = 0
    assert float(scale[0]) == float(fp8_scale(finite0.abs().amax().unsqueeze(0), "fp32")[0])  # NaN not in amax
    assert int(values[1, 6]) == 0x7E and int(values[1, 7]) == 0xFE  # +-Inf saturate to +-448
    floor = struct.unpack("<f", struct.pack("<f", 1e-4 / 448))[0]
    assert float(scale[2]) == pytest.approx(floor, rel=1e-6) and bool((values[2] == 0).all())
    assert float(scale[3]) == float(scale[2]) and bool((values[3] == 0).all())  # all-NaN row = zero row
    assert bool(torch.isfinite(KeyFormat.FP8.dequantize(values, scales)).all())


@pytest.mark.parametrize("name", ["fp4", "fp4-rne"])
def test_fp4_non_finite_and_zero_rows(name):
    x = special_rows()
    values, scales = KeyFormat.parse(name).quantize(x)
    codes = torch.stack([values & 0xF, values >> 4], dim=-1).reshape(4, 128)
    assert int(codes[0, 5]) == 0
    assert int(codes[1, 6]) == 0x7 and int(codes[1, 7]) == 0xF
    assert scales[2].tolist() == [0x70] * 4 and bool((values[2] == 0).all())
    assert scales[3].tolist() == [0x70] * 4 and bool((values[3] == 0).all())
    assert bool(torch.isfinite(KeyFormat.parse(name).dequantize(values, scales)).all())


def test_bf16_keeps_non_finite_values():
    x = special_rows()
    y = KeyFormat.BF16.dequantize(*KeyFormat.BF16.quantize(x))
    assert torch.equal(torch.isnan(y), torch.isnan(x))
    assert float(y[1, 6]) == float("inf") and float(y[1, 7]) == float("-inf")
    assert torch.equal(y[0, :5], x[0, :5].bfloat16().float())


# --------------------------------------------------------------------------------------------------
# Attention KV 584-byte layout
# --------------------------------------------------------------------------------------------------


def test_attention_kv_fp8_rope_bf16_layout():
    fmt = AttentionKVFormat.FP8_ROPE_BF16
    x = torch.randn(64, 512)
    x[0, :64] = 0.0
    x[0, 0] = 448.0       # block 0 amax 448 -> scale 1 = 2^0 -> exponent byte 127; 448 -> code 0x7E
    x[0, 64:128] = 0.0
    x[0, 64] = -100.0     # block 1 amax 100 -> 0.223 -> ue8m0 rounds up to 0.25 = 2^-2 -> byte 125
    x[0, 65] = 1.0        # 1 / 0.25 = 4 = 1.0 x 2^2 -> exponent 9 = 1001b, m 000 -> 0x48
    values, scales = fmt.quantize(x)
    assert values.shape == (64, 576) and scales.shape == (64, 8)
    assert int(values[0, 0]) == 0x7E and int(scales[0, 0]) == 127
    # -100 / 0.25 = -400: in [256, 512) step 32: 384 (m 100b) or 416 (m 101b); 400 is a tie -> even 384
    # 384 = 1.5 x 2^8 -> exponent 15 = 1111b, mantissa 100b, sign 1 -> 1 1111 100 = 0xFC
    assert int(values[0, 64]) == 0xFC and int(values[0, 65]) == 0x48 and int(scales[0, 1]) == 125
    # rope part: the trailing 64 dims as plain bf16 bytes, exact
    assert torch.equal(values[:, 448:], x[:, 448:].bfloat16().view(torch.uint8).reshape(64, 128))
    assert bool((scales[:, 7] == 0).all()), "pad byte must be 0"
    pages = fmt.quantize_pages(x)
    assert pages.shape == (1, 37440)
    assert torch.equal(pages[0, :64 * 576].reshape(64, 576), values)
    assert torch.equal(pages[0, 64 * 576: 64 * 584].reshape(64, 8), scales)
    assert bool((pages[0, 64 * 584:] == 0).all())  # 64 bytes of page padding
    y = fmt.dequantize_pages(pages)
    assert torch.equal(y[:, 448:], x[:, 448:].bfloat16().float())
    rel = (y[:, :448] - x[:, :448]).norm(dim=1) / x[:, :448].norm(dim=1)
    assert float(rel[1:].max()) < 0.05


def test_attention_kv_bf16_round_trip():
    fmt = AttentionKVFormat.BF16
    x = torch.randn(3, 512)
    values, scales = fmt.quantize(x)
    assert values.shape == (3, 1024) and scales.shape == (3, 0)
    assert torch.equal(fmt.dequantize(values, scales), x.bfloat16().float())


@pytest.mark.parametrize("fmt", [KeyFormat.BF16, AttentionKVFormat.BF16], ids=["key-bf16", "kv-bf16"])
def test_scaleless_formats_split_pages(fmt):
    """Regression: split_pages / dequantize_pages failed for formats with 0 scale bytes (reshape(-1, 0))."""
    x = torch.randn(128, fmt.head_dim)
    values, scales = fmt.split_pages(fmt.quantize_pages(x))
    assert values.shape == (128, fmt.value_bytes) and scales.shape == (128, 0)
    assert torch.equal(fmt.dequantize_pages(fmt.quantize_pages(x)), x.bfloat16().float())


@pytest.mark.parametrize("values_shape,scales_shape,match", [
    ((2, 127), (2, 4), r"values must be uint8 \[N, 128\]"), ((2, 128), (2, 3), r"scales must be uint8 \[N, 4\]"),
    ((2, 128), (3, 4), "same N")])
def test_dequantize_rejects_wrong_encoded_shapes(values_shape, scales_shape, match):
    """Regression: a values tensor of the wrong width decoded silently into [N, 127] elements."""
    with pytest.raises(ValueError, match=match):
        KeyFormat.FP8.dequantize(torch.zeros(values_shape, dtype=torch.uint8),
                                 torch.zeros(scales_shape, dtype=torch.uint8))
    with pytest.raises(ValueError, match="float32"):
        AttentionKVFormat.FP8_ROPE_BF16.dequantize(torch.zeros(1, 576), torch.zeros(1, 8, dtype=torch.uint8))


def test_fp8_multiplies_by_the_fp32_reciprocal_of_the_scale():
    """x[0, 0] = 2.375 (the amax), x[0, 1] = 0.890625: x / scale is exactly 168, an e4m3 tie that rounds to
    0x72 (160); the engines multiply by the fp32 reciprocal 1 / scale, which lands just above 168 -> 0x73."""
    x = torch.zeros(1, 128)
    x[0, 0], x[0, 1] = 2.375, 0.890625
    values, scales = KeyFormat.FP8.quantize(x)
    scale = torch.tensor([2.375], dtype=torch.float32) / 448
    assert scales.view(torch.float32).item() == scale.item()
    assert values[0, 0].item() == 0x7E  # 448
    assert values[0, 1].item() == 0x73
    assert ((x[0, 1:2] / scale).to(torch.float8_e4m3fn).view(torch.uint8).item()) == 0x72  # what x / scale gives
    assert ((x[0, 1:2] * (1 / scale)).to(torch.float8_e4m3fn).view(torch.uint8).item()) == 0x73


def test_fp4_negative_values_rounding_to_zero_store_plus_zero():
    """A negative value whose magnitude rounds to 0 is stored as code 0x0 (no sign), 0x8 never appears."""
    x = torch.zeros(1, 128)
    x[0, 0] = 6.0                   # block scale 1
    x[0, 1], x[0, 2] = -0.25, -0.1  # round to magnitude 0 (0.25 is the tie, sent to 0 by the threshold rule)
    x[0, 3] = -0.26                 # rounds to -0.5: the sign stays
    for fmt in (KeyFormat.FP4, KeyFormat.FP4_RNE):
        values, _ = fmt.quantize(x)
        codes = torch.stack([values[0] & 0xF, values[0] >> 4], dim=-1).reshape(-1)
        assert codes[1].item() == 0 and codes[2].item() == 0, fmt.name
        assert codes[3].item() == 0x9, fmt.name
        assert not bool((codes == 0x8).any()), fmt.name
