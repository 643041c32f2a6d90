"""Triton codec functions of the index-key formats, dispatched on the compile-time ``CODE`` of
:class:`dsakit.formats.codes.KeyCode` (this module imports triton; the rest of dsakit.formats does not need it).

Kernels read and write keys only through these functions:

* :func:`load_key_tile` - a key tile [BLOCK_N, D] of entries (pages[n], slot[n]) in the dot dtype;
* :func:`scale_key_scores` - per-entry scale of the head-summed scores (fp8: relu(c x) = c relu(x));
* :func:`store_key_rows` / :func:`store_key_halves` - encode and store transformed keys (the two tile
  layouts of the store kernels: [BLOCK_N, 128] rows and [2, BLOCK_N, 8, 8] halves).

Every function takes the page base of each entry, so a format with a per-page side value (a page centre
stored after the scales) can read or write it here without the kernels changing.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bf16 import load_bf16_tile, store_bf16_halves, store_bf16_rows
from .codes import KeyCode
from .fp4 import load_fp4_tile, store_fp4_halves, store_fp4_rows
from .fp8 import load_fp8_scales, load_fp8_tile, store_fp8_halves, store_fp8_rows

BF16 = tl.constexpr(int(KeyCode.BF16))
FP8 = tl.constexpr(int(KeyCode.FP8))
FP4 = tl.constexpr(int(KeyCode.FP4))


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
    else:
        k = load_fp4_tile(values_ptr, scales_ptr, pages, slot, valid, D)
    return k


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
    elif CODE == FP8:
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
    elif CODE == FP8:
        store_fp8_halves(x, pool_ptr, value_base, scale_base, cols, live, UE8M0, NATIVE)
    else:
        store_fp4_halves(x, pool_ptr, value_base, scale_base, half, live, FP4_RNE, BLOCK_N)
