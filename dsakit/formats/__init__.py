"""Cache entry formats: index keys (bf16, fp8, fp4) and V4 main-attention KV (fp8+bf16 rope, bf16).

Every format stores entries in pages of ``ENTRIES_PER_PAGE = 64``. Inside a page the value bytes of all 64
entries come first, then the scale bytes of all 64 entries (then padding, for the attention-KV page)::

    page p:  [ values of entry 0 | values of entry 1 | ... | values of entry 63 ]
             [ scales of entry 0 | ... | scales of entry 63 ] [ pad ]
    entry e of page p: values at p * page_bytes + e * value_bytes
                       scales at p * page_bytes + 64 * value_bytes + e * scale_bytes
    global slot s: page s // 64, entry s % 64

Index-key formats (one entry = one 128-dim key; docs/spec.md §4):

    ===========  =====================================  ===========  ==========  ==========
    format       values                                 scales       bytes/entry page bytes
    ===========  =====================================  ===========  ==========  ==========
    bf16         128 x bf16 little endian (256 B)       none           256        16384
    fp8          128 x e4m3fn (128 B)                   1 x fp32 LE    132         8448
    fp8-ue8m0    same, scale rounded up to 2^n          1 x fp32 LE    132         8448
    fp4          64 B e2m1, byte i = elems (2i, 2i+1),  4 x ue8m0      68          4352
                 low nibble = even element; ties of
                 the thresholds go to the smaller code
    fp4-rne      same, round half to even code          4 x ue8m0      68          4352
    fp8-centred  fp8 codes of k - c, then the page's    1 x fp32 LE    136         8704
                 centre c: 128 x bf16 (256 B per page)
    fp4-centred  fp4 codes of k - c, then the centre    4 x ue8m0      72          4608
    ===========  =====================================  ===========  ==========  ==========

The page-centred formats (:class:`CentredKeyFormat`) append one bf16 centre per page after the scales and
code every entry as its residual from it; the centre is entry 0's key (rule and byte layout in the class
docstring, docs/formats-centred.md).

The fp8 layout is byte-identical to what DeepGEMM's paged fp8 logits kernel and SGLang read
([pages, 64, 1, 132] viewed as bytes).

Quantization rules (the reference defines them; kernels must match byte for byte):

* fp8 scale = max(amax, 1e-4) / 448 with amax the largest finite |x| of the entry (fp32, correctly rounded
  division). ``ue8m0`` rounds that scale up to a power of two (biased exponent + 1 unless the mantissa is 0).
  value = clamp(x * (1 / scale), -448, 448) cast to e4m3fn with round-to-nearest-even, the fp32 reciprocal
  computed once per entry (the engines' arithmetic; x / scale differs at e4m3 rounding ties).
* fp4 scale per 32 elements = 2^ceil(log2(max(amax, 1e-4) / 6)), stored as the ue8m0 byte (exponent + 127).
  Magnitude |x| / scale is coded to {0, .5, 1, 1.5, 2, 3, 4, 6} by thresholds .25 .75 1.25 1.75 2.5 3.5 5;
  ``threshold`` sends a value equal to a threshold to the smaller magnitude (DeepGEMM, SGLang), ``rne`` to
  the even code (DeepSeek's QAT reference). Sign bit (bit 3) = x < 0 on non-zero codes only (a negative
  value that rounds to 0 is stored as 0x0, as the engines store it).
* Non-finite input (quantized formats): NaN elements encode as 0, +-Inf saturate to the largest code
  (+-448 * scale, +-6 * scale) and do not enter amax. An all-zero or all-non-finite entry gets the scale
  of the 1e-4 floor. So finite input never produces a NaN byte, and non-finite input never does either.
  bf16 is a plain round-to-nearest-even cast: NaN and Inf are kept as they are.

Attention-KV formats (one entry = one token's 512-dim shared K = V of V4 main attention; docs/spec.md §4.4):

* ``fp8-rope-bf16`` (584 B/token): 448 e4m3fn no-rope values with 7 ue8m0 scales (one per 64 values,
  same rounding as ``fp8-ue8m0``), then the 64 rope dims as bf16 (128 B): 576 data bytes; scale part is the
  7 scale bytes + 1 zero pad byte. Page = 64 x 576 + 64 x 8 = 37376 bytes padded to a multiple of 576:
  37440 bytes.
* ``bf16`` (1024 B/token): 512 x bf16.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from .._memory import INDEX_DTYPES, check_tensor
from .bf16 import dequantize_bf16, quantize_bf16
from .codes import KEY_CODECS, KeyCode, KeyCodec
from .common import SCALE_FLOOR, finite_amax, sanitize, ue8m0_exponent_ceil, ue8m0_to_float
from .fp4 import (FP4_BLOCK, FP4_MAGNITUDES, FP4_MAX, FP4_THRESHOLDS, decode_e2m1, dequantize_fp4, encode_e2m1,
                  quantize_fp4)
from .fp8 import FP8_MAX, decode_e4m3, dequantize_fp8, encode_e4m3, fp8_scale, quantize_fp8

ENTRIES_PER_PAGE = 64
INDEX_HEAD_DIM = 128
ATTENTION_HEAD_DIM = 512
ATTENTION_ROPE_DIM = 64
ATTENTION_FP8_BLOCK = 64


# --------------------------------------------------------------------------------------------------
# Formats
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryFormat(ABC):
    """Byte layout of one cache entry and of a page of 64 entries (see module docstring)."""

    name: str
    head_dim: int
    value_bytes: int
    scale_bytes: int
    page_bytes: int
    kind: str = "bf16"  # "bf16" (plain, no scales) or the quantized kind of the subclass
    entries_per_page: ClassVar[int] = ENTRIES_PER_PAGE

    @property
    def bytes_per_entry(self) -> int:
        return self.value_bytes + self.scale_bytes

    @property
    def scale_offset_in_page(self) -> int:
        return self.entries_per_page * self.value_bytes

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 [N, head_dim] -> (values uint8 [N, value_bytes], scales uint8 [N, scale_bytes])."""
        x = self.check_entries(x)
        if self.kind == "bf16":  # plain round-to-nearest-even cast, little endian, no scales
            return quantize_bf16(x)
        return self._quantize_scaled(x)

    def dequantize(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """(values uint8 [N, value_bytes], scales uint8 [N, scale_bytes]) -> fp32 [N, head_dim]."""
        self.check_encoded(values, scales)
        values, scales = values.cpu(), scales.cpu()
        if self.kind == "bf16":
            return dequantize_bf16(values, self.head_dim)
        return self._dequantize_scaled(values, scales)

    @abstractmethod
    def _quantize_scaled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked fp32 CPU x [N, head_dim] of a quantized kind -> (values, scales) as in quantize."""

    @abstractmethod
    def _dequantize_scaled(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Checked CPU (values, scales) of a quantized kind -> fp32 [N, head_dim]."""

    # -- shared ---------------------------------------------------------------------------------------
    def check_entries(self, x: torch.Tensor, what: str = "x") -> torch.Tensor:
        check_tensor(what, x)
        check_tensor(what, x, shape=(None, self.head_dim), floating=True,
                     message=f"{what} must have shape [N, {self.head_dim}] for format {self.name}")
        return x.detach().to("cpu", torch.float32)

    def check_encoded(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        """values uint8 [N, value_bytes] and scales uint8 [N, scale_bytes], else ValueError (a wrong width
        would otherwise decode silently into the wrong number of elements)."""
        for what, t, width in (("values", values, self.value_bytes), ("scales", scales, self.scale_bytes)):
            check_tensor(what, t, shape=(None, width), dtypes=torch.uint8,
                         message=f"{what} must be uint8 [N, {width}] for format {self.name}")
        if values.shape[0] != scales.shape[0]:
            raise ValueError(f"values and scales must have the same N, got {values.shape[0]} and {scales.shape[0]}")

    def quantize_pages(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [P * 64, head_dim] -> uint8 [P, page_bytes] in the page layout (padding bytes 0)."""
        x, pages = self._whole_pages(x)
        values, scales = self.quantize(x)
        return self._pack_pages(values, scales, pages)

    def _whole_pages(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """check_entries(x) for quantize_pages, which also needs whole pages: (x fp32 [P * 64, head_dim], P)."""
        x = self.check_entries(x)
        n = x.shape[0]
        if n % self.entries_per_page:
            raise ValueError(f"quantize_pages needs a multiple of {self.entries_per_page} entries, got {n}")
        return x, n // self.entries_per_page

    def _pack_pages(self, values: torch.Tensor, scales: torch.Tensor, pages: int) -> torch.Tensor:
        """uint8 [P, page_bytes] (zeros) with the values and then the scales of P * 64 entries written."""
        out = torch.zeros(pages, self.page_bytes, dtype=torch.uint8)
        out[:, : self.scale_offset_in_page] = values.reshape(pages, -1)
        end = self.scale_offset_in_page + self.entries_per_page * self.scale_bytes
        out[:, self.scale_offset_in_page: end] = scales.reshape(pages, -1)
        return out

    def split_pages(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 [P, page_bytes] -> (values [P * 64, value_bytes], scales [P * 64, scale_bytes])."""
        check_tensor("pages", pages, shape=(None, self.page_bytes), dtypes=torch.uint8,
                     message=f"pages must be uint8 [P, {self.page_bytes}] for format {self.name}")
        end = self.scale_offset_in_page + self.entries_per_page * self.scale_bytes
        values = pages[:, : self.scale_offset_in_page].reshape(-1, self.value_bytes)
        # explicit row count: formats without scales (bf16) have 0 scale bytes and reshape(-1, 0) is ambiguous
        scales = pages[:, self.scale_offset_in_page: end].reshape(pages.shape[0] * self.entries_per_page,
                                                                   self.scale_bytes)
        return values, scales

    def dequantize_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """uint8 [P, page_bytes] -> fp32 [P * 64, head_dim]."""
        values, scales = self.split_pages(pages.cpu())
        return self.dequantize(values, scales)

    def byte_offsets(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat byte offsets (int64 [N]) of the first value byte and first scale byte of each global slot [N].

        Slots must be >= 0: a padding slot (-1) has no bytes, and floor division would map it to the last
        entry of page -1, a negative offset that indexes from the end of a flat pool."""
        check_tensor("slots", slots, dtypes=INDEX_DTYPES, message="slots must be an int32/int64 tensor")
        slots = slots.long()
        if slots.numel() and bool((slots < 0).any()):
            raise ValueError(f"slots must be >= 0 (padding has no bytes), got {int(slots.min())}")
        page = slots // self.entries_per_page
        entry = slots % self.entries_per_page
        base = page * self.page_bytes
        return base + entry * self.value_bytes, base + self.scale_offset_in_page + entry * self.scale_bytes


def _lookup(table: dict, name, what: str):
    found = table.get(str(name).lower())
    if found is None:
        raise ValueError(f"unknown {what} {name!r}; choose one of {sorted(table)}")
    return found


@dataclass(frozen=True)
class KeyFormat(EntryFormat):
    """Index-key format for 128-dim keys. Use the constants ``KeyFormat.BF16`` ... or ``KeyFormat.parse``."""

    # kind: "bf16" | "fp8" | "fp4"
    scale_fmt: str = "fp32"  # fp8 only: "fp32" | "ue8m0"
    rounding: str = "threshold"  # fp4 only: "threshold" | "rne"

    BF16: ClassVar["KeyFormat"]
    FP8: ClassVar["KeyFormat"]
    FP8_UE8M0: ClassVar["KeyFormat"]
    FP4: ClassVar["KeyFormat"]
    FP4_RNE: ClassVar["KeyFormat"]
    FP8_CENTRED: ClassVar["KeyFormat"]
    FP4_CENTRED: ClassVar["KeyFormat"]

    @staticmethod
    def parse(name: "str | KeyFormat") -> "KeyFormat":
        """'bf16' | 'fp8' | 'fp8-ue8m0' | 'fp4' | 'fp4-rne' | 'fp8-centred' | 'fp4-centred' (or a KeyFormat)."""
        return name if isinstance(name, KeyFormat) else _lookup(KEY_FORMATS, name, "key format")

    def _quantize_scaled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the element codecs live in the per-format modules (dsakit/formats/fp8.py, fp4.py)
        if self.kind == "fp8":
            return quantize_fp8(x, self.scale_fmt)
        return quantize_fp4(x, self.rounding)

    def _dequantize_scaled(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp8":
            return dequantize_fp8(values, scales)
        return dequantize_fp4(values, scales)


def _key_format(name: str, kind: str, value_bytes: int, scale_bytes: int, **kw) -> KeyFormat:
    return KeyFormat(name=name, head_dim=INDEX_HEAD_DIM, value_bytes=value_bytes, scale_bytes=scale_bytes,
                     page_bytes=ENTRIES_PER_PAGE * (value_bytes + scale_bytes), kind=kind, **kw)


KeyFormat.BF16 = _key_format("bf16", "bf16", 256, 0)
KeyFormat.FP8 = _key_format("fp8", "fp8", 128, 4, scale_fmt="fp32")
KeyFormat.FP8_UE8M0 = _key_format("fp8-ue8m0", "fp8", 128, 4, scale_fmt="ue8m0")
KeyFormat.FP4 = _key_format("fp4", "fp4", 64, 4, rounding="threshold")
KeyFormat.FP4_RNE = _key_format("fp4-rne", "fp4", 64, 4, rounding="rne")
KEY_FORMATS: dict[str, KeyFormat] = {f.name: f for f in (KeyFormat.BF16, KeyFormat.FP8, KeyFormat.FP8_UE8M0,
                                                          KeyFormat.FP4, KeyFormat.FP4_RNE)}


@dataclass(frozen=True)
class AttentionKVFormat(EntryFormat):
    """V4 main-attention KV entry (shared K = V, head_dim 512). ``AttentionKVFormat.FP8_ROPE_BF16`` / ``BF16``."""

    # kind: "bf16" | "fp8-rope-bf16"
    rope_dim: int = ATTENTION_ROPE_DIM

    FP8_ROPE_BF16: ClassVar["AttentionKVFormat"]
    BF16: ClassVar["AttentionKVFormat"]

    @staticmethod
    def parse(name: "str | AttentionKVFormat") -> "AttentionKVFormat":
        if isinstance(name, AttentionKVFormat):
            return name
        return _lookup(ATTENTION_KV_FORMATS, name, "attention KV format")

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    def _quantize_scaled(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        nope = x[:, : self.nope_dim].reshape(n, -1, ATTENTION_FP8_BLOCK)  # [N, 7, 64]
        scale = fp8_scale(finite_amax(nope), "ue8m0")  # [N, 7], powers of two
        nope_codes = encode_e4m3(nope, scale).reshape(n, self.nope_dim)
        rope = x[:, self.nope_dim:].to(torch.bfloat16).view(torch.uint8).reshape(n, 2 * self.rope_dim)
        exponent = ue8m0_exponent_ceil(scale).to(torch.uint8)  # exact: scale is already 2^k
        scales = torch.cat([exponent, torch.zeros(n, 1, dtype=torch.uint8)], dim=1)
        return torch.cat([nope_codes, rope], dim=1).contiguous(), scales.contiguous()

    def _dequantize_scaled(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        n = values.shape[0]
        blocks = self.nope_dim // ATTENTION_FP8_BLOCK
        nope = decode_e4m3(values[:, : self.nope_dim]).reshape(n, blocks, ATTENTION_FP8_BLOCK)
        nope = nope * ue8m0_to_float(scales[:, :blocks]).unsqueeze(-1)
        rope = values[:, self.nope_dim:].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope.reshape(n, self.nope_dim), rope], dim=1)


def _padded_page(value_bytes: int, scale_bytes: int) -> int:
    raw = ENTRIES_PER_PAGE * (value_bytes + scale_bytes)
    return math.ceil(raw / value_bytes) * value_bytes


AttentionKVFormat.FP8_ROPE_BF16 = AttentionKVFormat(
    name="fp8-rope-bf16", head_dim=ATTENTION_HEAD_DIM, value_bytes=576, scale_bytes=8,
    page_bytes=_padded_page(576, 8), kind="fp8-rope-bf16")
AttentionKVFormat.BF16 = AttentionKVFormat(
    name="bf16", head_dim=ATTENTION_HEAD_DIM, value_bytes=1024, scale_bytes=0,
    page_bytes=ENTRIES_PER_PAGE * 1024, kind="bf16")
ATTENTION_KV_FORMATS: dict[str, AttentionKVFormat] = {
    f.name: f for f in (AttentionKVFormat.FP8_ROPE_BF16, AttentionKVFormat.BF16)}


# --------------------------------------------------------------------------------------------------
# Page-centred index keys (fp8-centred, fp4-centred)
# --------------------------------------------------------------------------------------------------

CENTRE_BYTES = 2 * INDEX_HEAD_DIM  # one bf16 [128] centre per page


def centre_of(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The page centre made from a page's first entry: fp32 x [N, 128] -> (bytes uint8 [N, 256], fp32 [N, 128]).

    bf16 round-to-nearest-even of x, except that an element whose bf16 value is not finite (NaN, +-Inf, or a
    finite fp32 beyond the bf16 range) becomes 0: a centre is always finite, so one bad element can never
    poison the other 63 entries of its page (the entry's own NaN / Inf still go through its residual).
    """
    c = x.float().to(torch.bfloat16)
    c = torch.where(torch.isfinite(c), c, torch.zeros_like(c))
    n = c.shape[0]
    return c.view(torch.uint8).reshape(n, CENTRE_BYTES).contiguous(), c.float()


def decode_centres(raw: torch.Tensor) -> torch.Tensor:
    """Centre bytes uint8 [N, 256] (128 x bf16 little endian) -> fp32 [N, 128]."""
    check_tensor("centre bytes", raw, shape=(None, CENTRE_BYTES), dtypes=torch.uint8,
                 message=f"centre bytes must be uint8 [N, {CENTRE_BYTES}]")
    return raw.cpu().contiguous().view(torch.bfloat16).float().reshape(raw.shape[0], INDEX_HEAD_DIM)


@dataclass(frozen=True)
class CentredKeyFormat(KeyFormat):
    """A key format that stores each page's centre c (bf16) once and every entry as its residual x - c.

    The residual is quantized exactly like the plain format of the same ``kind`` (``fp8``: e4m3fn values and
    one fp32 scale of the residual's own amax; ``fp4``: e2m1 values and ue8m0 scales per 32 elements), and
    an entry decodes to c + dequantized residual. Page layout (bytes; V = value_bytes, S = scale_bytes)::

        [0, 64 V)               values of entries 0..63 (the residual's codes, entry e at e * V)
        [64 V, 64 (V + S))      scales of entries 0..63 (entry e at 64 V + e * S)
        [64 (V + S), +256)      the page centre: 128 x bf16 little endian (dim d at 64 (V + S) + 2 d)

    fp8-centred: V = 128, S = 4, page 8704 B = 136 B per entry; fp4-centred: V = 64, S = 4, page 4608 B =
    72 B per entry. The entry part is the plain format's page, so values and scales sit where they do there.

    Centre rule: the centre of a page is the bf16 value (:func:`centre_of`) of the transformed key stored at
    entry 0 of that page, written when entry 0 is stored, and never otherwise. Storing entry 0 (re)starts the
    page: every other entry of the page is encoded against the centre in force when it is stored, so a
    page's entry 0 must be stored no later than its other entries (always true for a sequence that appends
    in order, one at a time or in bulk). A bulk store of entries 0..n gives the same bytes as n + 1
    one-at-a-time appends, because each entry depends only on its own key and on entry 0's key.

    Started pages: a page whose entry 0 was stored has a non-zero scale at entry 0 (a stored entry's scale is
    never 0: fp32 >= 1e-4 / 448, or ue8m0 bytes of scales >= 2^-15), a zeroed page has 0 there. The stores
    refuse an entry e > 0 of a page that is not started and whose entry 0 is not in the same call
    (:func:`dsakit.pool.check_centre_order`), so a page is never coded against a centre nobody wrote.
    """

    centre_bytes: int = CENTRE_BYTES

    @property
    def bytes_per_entry(self) -> int:
        return self.value_bytes + self.scale_bytes + self.centre_bytes // self.entries_per_page

    @property
    def centre_offset_in_page(self) -> int:
        return self.entries_per_page * (self.value_bytes + self.scale_bytes)

    @property
    def residual_format(self) -> KeyFormat:
        """The plain format whose codec the residuals use (fp8 or fp4)."""
        return KEY_FORMATS[self.kind]

    # -- entry codec (centres given) ------------------------------------------------------------------
    def check_centres(self, centres, n: int) -> torch.Tensor:
        check_tensor("centres", centres, shape=(n, self.head_dim), floating=True,
                     message=f"format {self.name} needs centres: a floating [N, {self.head_dim}] tensor with "
                             f"N = {n} (the centre of each entry's page)")
        return centres.detach().to("cpu", torch.float32)

    def quantize(self, x: torch.Tensor, centres: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 x [N, 128] and the centre of each entry's page centres [N, 128] -> (values uint8 [N, value_bytes],
        scales uint8 [N, scale_bytes]) of the residual x - centres, coded like the plain format."""
        x = self.check_entries(x)
        centres = self.check_centres(centres, x.shape[0])
        return self.residual_format._quantize_scaled(x - centres)

    def dequantize(self, values: torch.Tensor, scales: torch.Tensor,
                   centres: torch.Tensor | None = None) -> torch.Tensor:
        """(values, scales) of N entries and their pages' centres [N, 128] -> fp32 [N, 128] = centre + residual."""
        self.check_encoded(values, scales)
        centres = self.check_centres(centres, values.shape[0])
        return centres + self.dequantize_residual(values, scales)

    def dequantize_residual(self, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The residuals alone, fp32 [N, 128] (what the scores multiply before adding q . c)."""
        self.check_encoded(values, scales)
        return self.residual_format._dequantize_scaled(values.cpu(), scales.cpu())

    # -- pages ----------------------------------------------------------------------------------------
    def quantize_pages(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 [P * 64, 128] -> uint8 [P, page_bytes]: whole pages under the centre rule (entry 0's bf16)."""
        x, pages = self._whole_pages(x)
        raw, centre = centre_of(x[:: self.entries_per_page])
        values, scales = self.quantize(x, centre.repeat_interleave(self.entries_per_page, dim=0))
        out = self._pack_pages(values, scales, pages)  # the scales end where the centres start
        out[:, self.centre_offset_in_page:] = raw
        return out

    def page_centres(self, pages: torch.Tensor) -> torch.Tensor:
        """uint8 [P, page_bytes] -> fp32 [P, 128]: each page's centre."""
        self.split_pages(pages)  # validates the shape
        return decode_centres(pages[:, self.centre_offset_in_page:])

    def dequantize_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """uint8 [P, page_bytes] -> fp32 [P * 64, 128]."""
        pages = pages.cpu()
        values, scales = self.split_pages(pages)
        centres = self.page_centres(pages).repeat_interleave(self.entries_per_page, dim=0)
        return self.dequantize(values, scales, centres)

    # -- byte offsets (the pool floor, dsakit.pool, reads and writes centres with them) ---------------
    def centre_offsets(self, pages: torch.Tensor) -> torch.Tensor:
        """Flat byte offset (int64 [N]) of the centre of each page id [N]."""
        return pages.long() * self.page_bytes + self.centre_offset_in_page


def _centred_format(name: str, kind: str, value_bytes: int, **kw) -> CentredKeyFormat:
    return CentredKeyFormat(name=name, head_dim=INDEX_HEAD_DIM, value_bytes=value_bytes, scale_bytes=4,
                            page_bytes=ENTRIES_PER_PAGE * (value_bytes + 4) + CENTRE_BYTES, kind=kind, **kw)


KeyFormat.FP8_CENTRED = _centred_format("fp8-centred", "fp8", 128, scale_fmt="fp32")
KeyFormat.FP4_CENTRED = _centred_format("fp4-centred", "fp4", 64, rounding="threshold")
CENTRED_KEY_FORMATS: dict[str, CentredKeyFormat] = {f.name: f for f in (KeyFormat.FP8_CENTRED, KeyFormat.FP4_CENTRED)}
KEY_FORMATS.update(CENTRED_KEY_FORMATS)


def is_centred(fmt) -> bool:
    """True for the page-centred key formats (their pages end in a bf16 centre)."""
    return isinstance(fmt, CentredKeyFormat)


def key_codec(fmt: "KeyFormat | str") -> KeyCodec:
    """The kernel codec of an index-key format (:mod:`dsakit.formats.codes`)."""
    fmt = KeyFormat.parse(fmt)
    return KEY_CODECS[fmt.name if is_centred(fmt) else fmt.kind]
