"""Triton codec of the page-centred key formats (``fp8-centred``, ``fp4-centred``).

The torch codec (the spec) is :class:`dsakit.formats.CentredKeyFormat`: a page holds the plain fp8 / fp4 entry
part (64 residual values, then 64 scales) and then its centre, 128 x bf16 at byte ``CENTRE_OFFSET`` of the
page (8448 for fp8-centred, 4352 for fp4-centred); entry j decodes to centre + residual. The functions here
are what the dispatching codec functions of :mod:`dsakit.formats.triton` call for those codes:

* scores: :func:`load_centre_tile` gives the centres of a key tile's pages as a [16, D] bf16 tile (prefill
  kernel) and :func:`load_centre_entries` each entry's page centre as a [BLOCK_N, D] bf16 tile (decode
  kernel), for the kernels' per-page term q . c (the residual tile itself is the plain format's loader with
  the page's extra 256 bytes);
* store: :func:`store_centre_rows` / :func:`store_centre_halves` write a page's centre from its entry 0 (the
  first of the store kernel's two launches); :func:`load_centre_rows` / :func:`load_centre_halves` read it
  back for the residual x - c (the second launch).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch side works without triton
    triton = None

CENTRE_EXTRA = 256  # bytes a centred page holds after its scales: 128 x bf16

if triton is not None:
    from .bf16 import bf16_u16

    @triton.jit
    def centre_u16(x, NATIVE: tl.constexpr):
        """Centre bits (uint16) of transformed keys x fp32: bf16 RNE, 0 where that is not finite (Inf / NaN)."""
        bits = bf16_u16(x, NATIVE)
        return tl.where((bits & 0x7F80) == 0x7F80, 0, bits).to(tl.uint16)

    @triton.jit
    def load_centre_tile(values_ptr, pages, valid, PAGE_BYTES: tl.constexpr, CENTRE_OFFSET: tl.constexpr,
                         BLOCK_N: tl.constexpr, D: tl.constexpr):
        """bf16 [16, D]: row p < BLOCK_N / 64 is the centre of the page of the tile's entries 64p .. 64p + 63
        (pages / valid [BLOCK_N] per entry, the tile starting on a page boundary); other rows 0. values_ptr is
        the uint8 view of the pool. 16 rows: the smallest tile a dot takes."""
        p = tl.arange(0, 16)
        first = tl.arange(0, BLOCK_N)[None, :] == (p * 64)[:, None]  # [16, BLOCK_N]: entry 64p of the tile
        page = tl.sum(tl.where(first, pages[None, :], 0), axis=1)  # [16]
        ok = tl.sum(tl.where(first & valid[None, :], 1, 0), axis=1) > 0
        dims = tl.arange(0, D)
        ptr = values_ptr.to(tl.pointer_type(tl.bfloat16)) + (page * PAGE_BYTES + CENTRE_OFFSET)[:, None] // 2
        return tl.load(ptr + dims[None, :], mask=ok[:, None], other=0.0)

    @triton.jit
    def load_centre_entries(values_ptr, pages, valid, PAGE_BYTES: tl.constexpr, CENTRE_OFFSET: tl.constexpr,
                            D: tl.constexpr):
        """bf16 [BLOCK_N, D]: row n is the centre of entry n's page (pages / valid [BLOCK_N]; invalid rows 0).
        values_ptr is the uint8 view of the pool. The A operand of the page term's dot, accumulated into the
        residual dot's accumulator: no second [BLOCK_N, N] fp32 tile, no per-page broadcast in registers."""
        dims = tl.arange(0, D)
        ptr = values_ptr.to(tl.pointer_type(tl.bfloat16)) + ((pages * PAGE_BYTES + CENTRE_OFFSET) // 2)[:, None]
        return tl.load(ptr + dims[None, :], mask=valid[:, None], other=0.0)

    @triton.jit
    def load_centre_rows(pool_ptr, page_base, cols, live, CENTRE_OFFSET: tl.constexpr):
        """fp32 centre of each row's page at dims ``cols``: page_base [BLOCK_N] byte offsets, x [BLOCK_N, D]."""
        ptr = pool_ptr.to(tl.pointer_type(tl.uint16)) + ((page_base + CENTRE_OFFSET) // 2)[:, None] + cols[None, :]
        bits = tl.load(ptr, mask=live[:, None], other=0)
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def load_centre_halves(pool_ptr, page_base, cols, live, CENTRE_OFFSET: tl.constexpr):
        """fp32 centre of each row's page at dims ``cols`` [2, 1, 8, 8]; page_base / live [1, BLOCK_N, 1, 1]."""
        ptr = pool_ptr.to(tl.pointer_type(tl.uint16)) + (page_base + CENTRE_OFFSET) // 2 + cols
        bits = tl.load(ptr, mask=live, other=0)
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def store_centre_rows(x, pool_ptr, page_base, cols, live, CENTRE_OFFSET: tl.constexpr):
        """Write rows x fp32 [BLOCK_N, D] (entry 0 of their pages) as their pages' centres."""
        ptr = pool_ptr.to(tl.pointer_type(tl.uint16)) + ((page_base + CENTRE_OFFSET) // 2)[:, None] + cols[None, :]
        tl.store(ptr, centre_u16(x, False), mask=live[:, None])

    @triton.jit
    def store_centre_halves(x, pool_ptr, page_base, cols, live, CENTRE_OFFSET: tl.constexpr, NATIVE: tl.constexpr):
        """Write x fp32 [2, BLOCK_N, 8, 8] (entry 0 of their pages) as their pages' centres."""
        ptr = pool_ptr.to(tl.pointer_type(tl.uint16)) + (page_base + CENTRE_OFFSET) // 2 + cols
        tl.store(ptr, centre_u16(x, NATIVE), mask=live)
