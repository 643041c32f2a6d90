"""Triton codec functions of the index-key formats, dispatched on the compile-time ``CODE`` of
:class:`dsakit.formats.codes.KeyCode` (this module imports triton; the rest of dsakit.formats does not need it).

Kernels read and write keys only through these functions:

* :func:`load_key_tile` - a key tile [BLOCK_N, D] of entries (pages[n], slot[n]) in the dot dtype;
* :func:`load_key_block` / :func:`load_key_block_scales` / :func:`key_block_scale` - a key tile [BLOCK_N, 32]
  of one 32-element block in e4m3 with its per-entry block scale kept out of the tile (fp4: the decode
  kernel's per-block dots, see ``ScoresConfig.decode_fp4``);
* :func:`scale_key_scores` - per-entry scale of the head-summed scores (fp8: relu(c x) = c relu(x));
* :func:`store_key_rows` / :func:`store_key_halves` - encode and store transformed keys (the two tile
  layouts of the store kernels: [BLOCK_N, 128] rows and [2, BLOCK_N, 8, 8] halves).

Formats with a per-page term (``KeyCodec.page_term``: the page-centred formats) also use
:func:`load_key_page_rows` (the side values of a block of pages as a [BLOCK, D] tile, for the scores'
page-term pass that computes q . c once per query, head and page),
:func:`load_logit_scales` / :func:`scale_key_logits` (a per-entry scale applied to each head's logits before
the relu, since relu(s a + b) != s relu(a + b / s)), and in the store kernel :func:`key_page_value` (a page's
side value from its entry 0's key), :func:`load_key_page_value` / :func:`key_page_started` (the side value a
page got from an earlier call, and whether it has one) and :func:`store_key_page_rows` /
:func:`store_key_page_halves` (an entry against its page's side value; entry 0 also writes it).

Page summaries (:class:`dsakit.pool.PageSummaries`) read stored entries back with :func:`load_key_decoded`: the
decoded fp32 value of an entry, bit for bit what :func:`dsakit.pool.dequantize_entries` gives.

Every function takes the page base of each entry, so a format with a per-page side value (a page centre
stored after the scales) can read or write it here without the kernels changing.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .bf16 import load_bf16_tile, store_bf16_halves, store_bf16_rows
from .centred import (CENTRE_EXTRA, centre_float, centre_started, centre_u16, load_centre_bits, load_centre_entries,
                      store_centre_bits)
from .codes import KeyCode
from .fp4 import (e2m1_float, fp4_block_scale, fp4_bytes_e4m3, load_fp4_block_e4m3, load_fp4_block_scales,
                  load_fp4_tile, store_fp4_halves, store_fp4_rows, ue8m0_float)
from .fp8 import e4m3_float, load_fp8_scales, load_fp8_tile, store_fp8_halves, store_fp8_rows

BF16 = tl.constexpr(int(KeyCode.BF16))
FP8 = tl.constexpr(int(KeyCode.FP8))
FP4 = tl.constexpr(int(KeyCode.FP4))
FP8_CENTRED = tl.constexpr(int(KeyCode.FP8_CENTRED))
FP4_CENTRED = tl.constexpr(int(KeyCode.FP4_CENTRED))
EXTRA = tl.constexpr(CENTRE_EXTRA)
# where a centred page's centre starts (D = 128): after 64 x (128 + 4) fp8 bytes / 64 x (64 + 4) fp4 bytes
FP8_CENTRE_OFFSET = tl.constexpr(64 * (128 + 4))
FP4_CENTRE_OFFSET = tl.constexpr(64 * (64 + 4))
# the e4m3 tiles of load_key_block hold fp4 values times 2^-6: a kernel multiplies its scores by this once
KEY_BLOCK_FACTOR = tl.constexpr(64.0)


@triton.jit
def load_key_tile(values_ptr, scales_ptr, pages, slot, valid, CODE: tl.constexpr, FP8_DOT: tl.constexpr,
                  D: tl.constexpr):
    """Key tile [BLOCK_N, D] in the dot dtype for entries (pages[n], slot[n]); invalid entries read as 0.

    pages int64 [BLOCK_N] page ids, slot [BLOCK_N] entry in page, valid [BLOCK_N] bool; values_ptr / scales_ptr
    are the typed pool views of ``KeyCodec.pool_views``. bf16 / fp4: bf16 tile (exact); fp8: e4m3 (FP8_DOT)
    or bf16, unscaled (see :func:`scale_key_scores`).
    """
    if CODE == BF16:
        k = load_bf16_tile(values_ptr, pages, slot, valid, D)
    elif CODE == FP8:
        k = load_fp8_tile(values_ptr, pages, slot, valid, FP8_DOT, D)
    elif CODE == FP8_CENTRED:  # the residuals, unscaled (see scale_key_logits)
        k = load_fp8_tile(values_ptr, pages, slot, valid, FP8_DOT, D, EXTRA)
    elif CODE == FP4_CENTRED:  # the residuals
        k = load_fp4_tile(values_ptr, scales_ptr, pages, slot, valid, D, EXTRA)
    else:
        k = load_fp4_tile(values_ptr, scales_ptr, pages, slot, valid, D)
    return k


@triton.jit
def load_key_block(values_ptr, pages, slot, valid, BLOCK: tl.constexpr, CODE: tl.constexpr, D: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """Elements 32 BLOCK .. 32 BLOCK + 31 of entries (pages[n], slot[n]) as an e4m3 tile [BLOCK_N, 32] whose
    true values are tile x :func:`key_block_scale` x :data:`KEY_BLOCK_FACTOR` (fp4 and fp4-centred residuals:
    the e2m1 codes placed in e4m3 bits, exact); invalid entries read as 0. INTERPRET: plain Triton ops instead
    of the GPU's inline assembly."""
    tl.static_assert(CODE == FP4 or CODE == FP4_CENTRED, "per-block key tiles exist for the fp4 codes only")
    if CODE == FP4_CENTRED:
        k = load_fp4_block_e4m3(values_ptr, pages, slot, valid, BLOCK, D, INTERPRET, EXTRA)
    else:
        k = load_fp4_block_e4m3(values_ptr, pages, slot, valid, BLOCK, D, INTERPRET)
    return k


@triton.jit
def key_block_nibble_order(raw, CODE: tl.constexpr, INTERPRET: tl.constexpr):
    """The tile of :func:`load_key_block` from a block's packed bytes already on chip, uint8 [BLOCK_N, 16]
    (e.g. a bulk tensor copy of a page's block columns) -> e4m3 [BLOCK_N, 32] with its columns in nibble order:
    the block's 16 even elements, then its 16 odd ones (multiply by q's block in the same order)."""
    tl.static_assert(CODE == FP4 or CODE == FP4_CENTRED, "per-block key tiles exist for the fp4 codes only")
    return fp4_bytes_e4m3(raw, INTERPRET, True)


@triton.jit
def load_key_block_scales(scales_ptr, pages, slot, valid, CODE: tl.constexpr, D: tl.constexpr):
    """Per-entry block scales of :func:`load_key_block`, packed (fp4: the four ue8m0 bytes as an int32 [BLOCK_N])."""
    tl.static_assert(CODE == FP4 or CODE == FP4_CENTRED, "per-block key tiles exist for the fp4 codes only")
    if CODE == FP4_CENTRED:
        words = load_fp4_block_scales(scales_ptr, pages, slot, valid, D, EXTRA)
    else:
        words = load_fp4_block_scales(scales_ptr, pages, slot, valid, D)
    return words


@triton.jit
def key_block_scale(words, BLOCK: tl.constexpr, CODE: tl.constexpr):
    """fp32 [BLOCK_N] scale of block BLOCK from :func:`load_key_block_scales` (fp4: 2^(s - 127))."""
    tl.static_assert(CODE == FP4 or CODE == FP4_CENTRED, "per-block key tiles exist for the fp4 codes only")
    return fp4_block_scale(words, BLOCK)


@triton.jit
def load_key_page_rows(values_ptr, pages, valid, CODE: tl.constexpr, D: tl.constexpr):
    """Per-page side value of pages[n], bf16 [BLOCK, D] (row n: that of page pages[n]; rows not ``valid`` are 0).
    For the page-centred formats, the centres: the scores' page-term pass multiplies a block of them by q."""
    if CODE == FP8_CENTRED:
        c = load_centre_entries(values_ptr, pages, valid, FP8_CENTRE_OFFSET + EXTRA, FP8_CENTRE_OFFSET, D)
    else:
        c = load_centre_entries(values_ptr, pages, valid, FP4_CENTRE_OFFSET + EXTRA, FP4_CENTRE_OFFSET, D)
    return c


@triton.jit
def load_logit_scales(scales_ptr, pages, slot, valid, CODE: tl.constexpr, D: tl.constexpr):
    """Per-entry scales [BLOCK_N] that must multiply each head's logits before the relu (fp8-centred: the
    residual's scale, because of the centre term added next); a dummy for every other code."""
    if CODE == FP8_CENTRED:
        s = load_fp8_scales(scales_ptr, pages, slot, valid, D, EXTRA)
    else:
        s = tl.zeros([1], dtype=tl.float32)
    return s


@triton.jit
def scale_key_logits(logits, scales, CODE: tl.constexpr, ENTRY_AXIS: tl.constexpr):
    """One head's logits times the per-entry scales of :func:`load_logit_scales` (fp8-centred); unchanged
    otherwise. ENTRY_AXIS: the axis (0 or 1) that runs over the tile's entries."""
    if CODE == FP8_CENTRED:
        if ENTRY_AXIS == 0:
            logits = logits * scales[:, None]
        else:
            logits = logits * scales[None, :]
    return logits


@triton.jit
def scale_key_scores(scores, scales_ptr, pages, slot, valid, CODE: tl.constexpr, D: tl.constexpr,
                     ENTRY_AXIS: tl.constexpr):
    """Scores [.., ..] whose axis ENTRY_AXIS (0 or 1) runs over the tile's entries, times each entry's scale
    where the format keeps it out of the tile (fp8); unchanged otherwise."""
    if CODE == FP8:
        scale = load_fp8_scales(scales_ptr, pages, slot, valid, D)
        if ENTRY_AXIS == 0:
            scores = scores * scale[:, None]
        else:
            scores = scores * scale[None, :]
    return scores


@triton.jit
def store_key_rows(x, pool_ptr, page_base, value_base, scale_base, cols, live, CODE: tl.constexpr,
                   UE8M0: tl.constexpr, FP4_RNE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Encode and store rows x fp32 [BLOCK_N, 128]; page_base / value_base / scale_base [BLOCK_N] byte offsets
    of each row's page, values and scales; live [BLOCK_N] masks every store."""
    if CODE == BF16:
        store_bf16_rows(x, pool_ptr, value_base, cols, live)
    elif (CODE == FP8) or (CODE == FP8_CENTRED):  # centred: x is the residual (store_key_page_rows)
        store_fp8_rows(x, pool_ptr, value_base, scale_base, cols, live, UE8M0)
    else:
        store_fp4_rows(x, pool_ptr, value_base, scale_base, live, FP4_RNE, BLOCK_N)


@triton.jit
def store_key_halves(x, pool_ptr, page_base, value_base, scale_base, cols, half, live, CODE: tl.constexpr,
                     UE8M0: tl.constexpr, FP4_RNE: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Encode and store x fp32 [2, BLOCK_N, 8, 8] (half, row, piece, e) with cols its dims and half [2, 1, 1, 1];
    page_base / value_base / scale_base / live [1, BLOCK_N, 1, 1]. NATIVE: the GPU's own rounding casts."""
    if CODE == BF16:
        store_bf16_halves(x, pool_ptr, value_base, cols, live, NATIVE)
    elif (CODE == FP8) or (CODE == FP8_CENTRED):  # centred: x is the residual (store_key_page_halves)
        store_fp8_halves(x, pool_ptr, value_base, scale_base, cols, live, UE8M0, NATIVE)
    else:
        store_fp4_halves(x, pool_ptr, value_base, scale_base, half, live, FP4_RNE, BLOCK_N)


@triton.jit
def key_page_value(x, CODE: tl.constexpr, NATIVE: tl.constexpr):
    """The per-page side value (uint16 bits, the shape of x) that a page takes from its entry 0's transformed
    key x fp32 (page-centred: the centre, bf16 of x with non-finite elements 0)."""
    tl.static_assert((CODE == FP8_CENTRED) or (CODE == FP4_CENTRED), "only page-term codes have a side value")
    return centre_u16(x, NATIVE)


@triton.jit
def load_key_page_value(pool_ptr, page_base, cols, mask, CODE: tl.constexpr):
    """The side value (uint16 bits) of each row's page as stored in the pool: page_base, cols and mask broadcast
    together ([BLOCK_N, 1] x [1, 128] or [1, BLOCK_N, 1, 1] x [2, 1, 8, 8]); masked elements 0."""
    if CODE == FP8_CENTRED:
        bits = load_centre_bits(pool_ptr, page_base, cols, mask, FP8_CENTRE_OFFSET)
    else:
        bits = load_centre_bits(pool_ptr, page_base, cols, mask, FP4_CENTRE_OFFSET)
    return bits


@triton.jit
def key_page_started(pool_ptr, page_base, mask, CODE: tl.constexpr, D: tl.constexpr):
    """Whether each row's page (page_base byte offsets) has its entry 0 stored, i.e. holds a side value
    (entry 0's scale bytes are not all 0). Masked rows: False."""
    if CODE == FP8_CENTRED:
        started = centre_started(pool_ptr, page_base, mask, 64 * D)
    else:
        started = centre_started(pool_ptr, page_base, mask, 64 * (D // 2))
    return started


@triton.jit
def store_key_page_value(bits, pool_ptr, page_base, cols, mask, CODE: tl.constexpr):
    """Write side values (uint16 bits, broadcast like :func:`load_key_page_value`) as their pages' own."""
    if CODE == FP8_CENTRED:
        store_centre_bits(bits, pool_ptr, page_base, cols, mask, FP8_CENTRE_OFFSET)
    else:
        store_centre_bits(bits, pool_ptr, page_base, cols, mask, FP4_CENTRE_OFFSET)


@triton.jit
def store_key_page_rows(x, page_value, first, pool_ptr, page_base, value_base, scale_base, cols, live,
                        CODE: tl.constexpr, UE8M0: tl.constexpr, FP4_RNE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store rows x fp32 [BLOCK_N, 128] of a page-term format against their pages' side values page_value
    (uint16 bits [BLOCK_N, 128], from :func:`key_page_value` or :func:`load_key_page_value`); rows at entry 0
    of their page (``first`` [BLOCK_N]) also write the side value. Page-centred: the entry is the residual
    x - c coded like the plain format, c the page's centre."""
    store_key_page_value(page_value, pool_ptr, page_base[:, None], cols[None, :], (live & first)[:, None], CODE)
    store_key_rows(x - centre_float(page_value), pool_ptr, page_base, value_base, scale_base, cols, live, CODE,
                   UE8M0, FP4_RNE, BLOCK_N)


@triton.jit
def store_key_page_halves(x, page_value, first, pool_ptr, page_base, value_base, scale_base, cols, half, live,
                          CODE: tl.constexpr, UE8M0: tl.constexpr, FP4_RNE: tl.constexpr, NATIVE: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """:func:`store_key_page_rows` for the [2, BLOCK_N, 8, 8] layout of the fast store kernel (page_value the
    shape of x; first / live / page_base [1, BLOCK_N, 1, 1])."""
    store_key_page_value(page_value, pool_ptr, page_base, cols, live & first, CODE)
    store_key_halves(x - centre_float(page_value), pool_ptr, page_base, value_base, scale_base, cols, half, live,
                     CODE, UE8M0, FP4_RNE, NATIVE, BLOCK_N)


# The interpreter runs jit functions as numpy (no inline assembly); read once, when this module is imported.
_INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def mul_unfused(a, b):
    """fp32 a * b rounded once and never contracted with a following add into an FMA (``mul.rn`` is exempt
    from contraction): the page summaries' sums must round each decoded value first, as the spec does."""
    if _INTERPRETING:
        return a * b
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def load_key_decoded(pool_ptr, page_base, entry, cols, mask, CODE: tl.constexpr, D: tl.constexpr):
    """Decoded fp32 values of stored entries, bit for bit :func:`dsakit.pool.dequantize_entries`: entry
    ``entry`` of the page at byte offset ``page_base``, dims ``cols``; page_base, entry, cols and mask broadcast
    together (any layout: rows [BLOCK_N, 1] x [1, D], halves [1, BLOCK_N, 1, 1] x [2, 1, 8, 8]); masked
    elements read 0. bf16: the value; fp8: e4m3 x fp32 scale (one rounded product); fp4: e2m1 x 2^(s - 127)
    (exact); page-centred: centre + residual (one rounded add)."""
    if CODE == BF16:
        bits = tl.load(pool_ptr.to(tl.pointer_type(tl.uint16)) + (page_base + entry * (2 * D)) // 2 + cols,
                       mask=mask, other=0)
        x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    elif (CODE == FP8) or (CODE == FP8_CENTRED):
        code = tl.load(pool_ptr + page_base + entry * D + cols, mask=mask, other=0)
        scale = tl.load(pool_ptr.to(tl.pointer_type(tl.float32)) + (page_base + 64 * D + entry * 4) // 4 + cols * 0,
                        mask=mask, other=0.0)
        x = mul_unfused(e4m3_float(code), scale)
    else:
        byte = tl.load(pool_ptr + page_base + entry * (D // 2) + cols // 2, mask=mask, other=0).to(tl.int32)
        nibble = tl.where((cols & 1) == 1, byte >> 4, byte & 0xF)
        exponent = tl.load(pool_ptr + page_base + 64 * (D // 2) + entry * 4 + cols // 32, mask=mask,
                           other=127).to(tl.int32)
        x = e2m1_float(nibble) * ue8m0_float(exponent)
    if (CODE == FP8_CENTRED) or (CODE == FP4_CENTRED):
        x = centre_float(load_key_page_value(pool_ptr, page_base, cols, mask, CODE)) + x
    return x
