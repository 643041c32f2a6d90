"""Triton codec of the page-centred key formats (``fp8-centred``, ``fp4-centred``).

The torch codec (the spec) is :class:`dsakit.formats.CentredKeyFormat`: a page holds the plain fp8 / fp4 entry
part (64 residual values, then 64 scales) and then its centre, 128 x bf16 at byte ``CENTRE_OFFSET`` of the
page (8448 for fp8-centred, 4352 for fp4-centred); entry j decodes to centre + residual. The functions here
are what the dispatching codec functions of :mod:`dsakit.formats.triton` call for those codes:

* scores: :func:`load_centre_entries` gives the centres of a block of pages as a [BLOCK, D] bf16 tile, for
  the scores' page-term pass (q . c once per query, head and page; the residual tiles themselves are the plain
  format's loaders with the page's extra 256 bytes);
* store (one launch, docs/formats-centred.md): :func:`centre_u16` makes a page's centre from its entry 0's
  transformed key, :func:`store_centre_bits` writes it, :func:`load_centre_bits` reads the centre of a page
  stored by an earlier call and :func:`centre_started` tells whether that page's entry 0 was ever stored.
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
    def load_centre_entries(values_ptr, pages, valid, PAGE_BYTES: tl.constexpr, CENTRE_OFFSET: tl.constexpr,
                            D: tl.constexpr):
        """bf16 [BLOCK, D]: row n is the centre of page pages[n] (pages / valid [BLOCK]; invalid rows 0).
        values_ptr is the uint8 view of the pool."""
        dims = tl.arange(0, D)
        ptr = values_ptr.to(tl.pointer_type(tl.bfloat16)) + ((pages * PAGE_BYTES + CENTRE_OFFSET) // 2)[:, None]
        return tl.load(ptr + dims[None, :], mask=valid[:, None], other=0.0)

    @triton.jit
    def centre_float(bits):
        """Centre bits (uint16, bf16) -> fp32, exactly."""
        return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def load_centre_bits(pool_ptr, page_base, cols, mask, CENTRE_OFFSET: tl.constexpr):
        """Centre bits (uint16) of each row's page at dims ``cols``: page_base (byte offset of the row's page),
        cols and mask broadcast together ([BLOCK_N, 1] x [1, D] rows or [1, BLOCK_N, 1, 1] x [2, 1, 8, 8]
        halves); masked elements read 0."""
        ptr = pool_ptr.to(tl.pointer_type(tl.uint16)) + (page_base + CENTRE_OFFSET) // 2 + cols
        return tl.load(ptr, mask=mask, other=0)

    @triton.jit
    def store_centre_bits(bits, pool_ptr, page_base, cols, mask, CENTRE_OFFSET: tl.constexpr):
        """Write centre bits (uint16, broadcast like :func:`load_centre_bits`) as their pages' centres."""
        ptr = pool_ptr.to(tl.pointer_type(tl.uint16)) + (page_base + CENTRE_OFFSET) // 2 + cols
        tl.store(ptr, bits, mask=mask)

    @triton.jit
    def centre_started(pool_ptr, page_base, mask, SCALE_OFFSET: tl.constexpr):
        """Whether each row's page has its entry 0 stored: that entry's 4 scale bytes are not all 0 (a stored
        entry's scale never is: fp32 >= 1e-4 / 448, or four ue8m0 bytes of scales >= 2^-15; a zeroed pool's are)."""
        ptr = pool_ptr.to(tl.pointer_type(tl.int32)) + (page_base + SCALE_OFFSET) // 4
        return tl.load(ptr, mask=mask, other=0) != 0
