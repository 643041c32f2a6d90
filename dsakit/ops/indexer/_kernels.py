"""Triton kernels of the lightning-indexer scores (launch code: :mod:`dsakit.ops.indexer.scores`).

Keys are read and decoded in registers by the format codecs of :mod:`dsakit.formats.triton` (``CODE`` = the
format's :class:`dsakit.formats.codes.KeyCode`); the numerical semantics are described in
:mod:`dsakit.ops.indexer.scores`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...formats.triton import FP8 as FP8_CODE
from ...formats.triton import FP8_CENTRED as FP8_CENTRED_CODE
from ...formats.triton import (KEY_BLOCK_FACTOR, key_block_nibble_order, key_block_scale, load_key_block,
                               load_key_block_scales, load_key_page_rows, load_key_tile, load_logit_scales,
                               scale_key_logits, scale_key_scores)


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    """a [M, K] x b [K, N] -> fp32 [M, N] on the tensor cores.

    The Triton 3.6 interpreter multiplies bf16 operands as their raw uint16 bits, so under
    TRITON_INTERPRET=1 bf16 operands go through fp32 (bf16 values are exact in fp32; the products are the
    same, only the accumulation order may differ). fp8 operands are handled correctly by the interpreter.
    """
    if INTERPRET and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _dot_acc(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a [M, K] x b [K, N] (fp32 [M, N]), accumulated by the tensor cores in acc's registers (see _dot)."""
    if INTERPRET and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _load_pages(block_table_ptr, seq, stride_bt, offs_n, entry_ok, num_pages, max_pages):
    """int64 [BLOCK_N] page of each entry, clamped to the block-table row and to the pool (memory safety)."""
    column = tl.minimum(offs_n // 64, max_pages - 1)
    pages = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + column, mask=entry_ok, other=0)
    return tl.minimum(tl.maximum(pages, 0), num_pages - 1).to(tl.int64)


@triton.jit
def _load_terms(ptrs, col, num_cols, ok, stride_pp):
    """One page column's terms from the page-term buffer: ptrs [X] (a row or query-head column each) + col *
    stride_pp, 0 where not ``ok`` or col >= num_cols."""
    return tl.load(ptrs + col.to(tl.int64) * stride_pp, mask=ok & (col < num_cols), other=0.0)


@triton.jit
def _page_bias(term0, term1, ENTRY_AXIS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page term of each logit of a key tile spanning one page (BLOCK_N <= 64: term0) or two (term1 for its
    entries 64..127): [X] -> [X, BLOCK_N] (ENTRY_AXIS 1) or [BLOCK_N, X] (ENTRY_AXIS 0)."""
    if ENTRY_AXIS == 1:
        out = tl.broadcast_to(term0[:, None], (term0.shape[0], BLOCK_N))
        if BLOCK_N > 64:
            out = tl.where((tl.arange(0, BLOCK_N) >= 64)[None, :], term1[:, None], out)
    else:
        out = tl.broadcast_to(term0[None, :], (BLOCK_N, term0.shape[0]))
        if BLOCK_N > 64:
            out = tl.where((tl.arange(0, BLOCK_N) >= 64)[:, None], term1[None, :], out)
    return out


@triton.jit
def _tile_rows(counts_ptr, pos_ptr, rows_ptr, tile_seq_ptr, tile_start_ptr, tile_len_ptr, tile, ratio, num_seqs,
               HAS_POS: tl.constexpr, BLOCK_T: tl.constexpr):
    """The query side of a tile-plan program: its sequence, first sorted position, rows / row_ok [BLOCK_T]
    (original rows), the entries visible to each row [BLOCK_T] and to any of them (scalar)."""
    seq = tl.minimum(tl.load(tile_seq_ptr + tile), num_seqs - 1)  # clamps only matter for an unchecked batch
    first = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    count = tl.load(counts_ptr + seq)
    offs_t = tl.arange(0, BLOCK_T)
    row_ok = offs_t < length
    rows = tl.load(rows_ptr + first + offs_t, mask=row_ok, other=0).to(tl.int64)  # [BLOCK_T] original rows
    if HAS_POS:
        # int64: pos + 1 must not wrap for pos = INT32_MAX (an "everything visible" sentinel)
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        # (pos + 1) <= 0 gives <= 0 -> 0; the min with count brings the value back into count's range
        visible = tl.minimum(tl.maximum((pos + 1) // ratio, 0), count).to(count.dtype)
    else:
        visible = tl.zeros([BLOCK_T], dtype=tl.int32) + count
    visible = tl.where(row_ok, visible, 0)
    return seq, first, rows, row_ok, visible, tl.max(visible, axis=0)


@triton.jit
def _page_block_centres(values_ptr, block_table_ptr, seq, stride_bt, col0, visible, num_pages, max_pages,
                        CODE: tl.constexpr, PAGE_BLOCK: tl.constexpr, D: tl.constexpr):
    """Block-table columns col0 .. col0 + PAGE_BLOCK - 1 of sequence seq [PAGE_BLOCK], which of them hold an
    entry below ``visible``, and their pages' centres, bf16 [PAGE_BLOCK, D] (0 for the others)."""
    cols = col0 + tl.arange(0, PAGE_BLOCK)
    col_ok = cols * 64 < visible
    pages = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + tl.minimum(cols, max_pages - 1),
                    mask=col_ok, other=0)
    pages = tl.minimum(tl.maximum(pages, 0), num_pages - 1).to(tl.int64)  # memory safety, as _load_pages
    return cols, col_ok, load_key_page_rows(values_ptr, pages, col_ok, CODE, D)


@triton.jit
def _page_term_tile_kernel(
    q_ptr, w_ptr, q_scale_ptr, values_ptr, scales_ptr, block_table_ptr, counts_ptr, pos_ptr, rows_ptr,
    tile_seq_ptr, tile_start_ptr, tile_len_ptr, out_ptr,
    width, ratio, num_pages, num_seqs, max_pages,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh, stride_bt, stride_out,
    pt_ptr, stride_ps, stride_pp, stride_ph,
    HAS_POS: tl.constexpr, CODE: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr,
    PAGE_BLOCK: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Page-term pass of a tile plan (page-centred formats): pt[s, p, h] = q[rows[s], h] . c[page column p]
    for the rows s of tile program_id(0) and the page columns p of block program_id(1) (PAGE_BLOCK of them,
    only those holding an entry visible to the tile). Per head one [BLOCK_T, D] x [D, PAGE_BLOCK] bf16 dot:
    the products are exact (bf16 q, or fp8 q upcast; bf16 centres), the sums fp32. 1/64 of the scores'
    multiply-adds, on full tensor-core tiles instead of a dot padded from a key tile's two pages to 16."""
    seq, first, rows, row_ok, visible, tile_visible = _tile_rows(
        counts_ptr, pos_ptr, rows_ptr, tile_seq_ptr, tile_start_ptr, tile_len_ptr, tl.program_id(0), ratio,
        num_seqs, HAS_POS, BLOCK_T)
    col0 = tl.program_id(1) * PAGE_BLOCK
    if col0 * 64 < tile_visible:
        cols, col_ok, centres = _page_block_centres(values_ptr, block_table_ptr, seq, stride_bt, col0, tile_visible,
                                                    num_pages, max_pages, CODE, PAGE_BLOCK, D)
        c_t = tl.trans(centres)  # [D, PAGE_BLOCK] bf16
        dims = tl.arange(0, D)
        q_ptrs = q_ptr + rows[:, None] * stride_qt + dims[None, :]
        pos = (first + tl.arange(0, BLOCK_T)).to(tl.int64)
        pt_ptrs = pt_ptr + pos[:, None] * stride_ps + cols[None, :].to(tl.int64) * stride_pp
        for h in range(H):
            q_h = tl.load(q_ptrs + h * stride_qh, mask=row_ok[:, None], other=0.0).to(tl.bfloat16)
            tl.store(pt_ptrs + h * stride_ph, _dot(q_h, c_t, INTERPRET), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _page_term_group_kernel(
    q_ptr, w_ptr, q_scale_ptr, values_ptr, scales_ptr, block_table_ptr, counts_ptr, pos_ptr, rows_ptr,
    tile_seq_ptr, tile_start_ptr, tile_len_ptr, out_ptr,
    width, ratio, num_pages, num_seqs, max_pages,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh, stride_bt, stride_out,
    pt_ptr, stride_ps, stride_pp, stride_ph,
    HAS_POS: tl.constexpr, CODE: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr,
    PAGE_BLOCK: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Page-term pass of a group plan: pt[s, p, h] for the GROUP * H query-head columns of group
    program_id(0) and the page columns of block program_id(1): one [PAGE_BLOCK, D] x [D, GROUP * H] bf16 dot
    of the pages' centres with q^T (exact products, fp32 sums)."""
    seq, g_rows, g_ok, visible, group_visible, c_rows, c_head, c_ok, c_pos, q_t, w = _group_queries(
        q_ptr, w_ptr, q_scale_ptr, counts_ptr, pos_ptr, rows_ptr, tile_seq_ptr, tile_start_ptr, tile_len_ptr,
        ratio, num_seqs, stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh,
        HAS_POS, False, H, GROUP, D)
    col0 = tl.program_id(1) * PAGE_BLOCK
    if col0 * 64 < group_visible:
        cols, col_ok, centres = _page_block_centres(values_ptr, block_table_ptr, seq, stride_bt, col0,
                                                    group_visible, num_pages, max_pages, CODE, PAGE_BLOCK, D)
        terms = _dot(centres, q_t.to(tl.bfloat16), INTERPRET)  # [PAGE_BLOCK, GROUP * H]
        tl.store(pt_ptr + c_pos[None, :] * stride_ps + cols[:, None].to(tl.int64) * stride_pp
                 + c_head[None, :] * stride_ph, terms, mask=col_ok[:, None] & c_ok[None, :])


@triton.jit
def _index_scores_tile_kernel(
    q_ptr, w_ptr, q_scale_ptr, values_ptr, scales_ptr, block_table_ptr, counts_ptr, pos_ptr, rows_ptr,
    tile_seq_ptr, tile_start_ptr, tile_len_ptr, out_ptr,
    width, ratio, num_pages, num_seqs, max_pages,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh, stride_bt, stride_out,
    pt_ptr, stride_ps, stride_pp, stride_ph,
    HAS_POS: tl.constexpr, HAS_Q_SCALE: tl.constexpr, CODE: tl.constexpr,
    FP8_DOT: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    INTERPRET: tl.constexpr, PAGE_TERM: tl.constexpr = False,
):
    # 1-D grid over (query tile, entry tile) with the entry tile fastest: programs running at the same time
    # share one query tile, so its q [BLOCK_T, H, D] stays in L2 while the (smaller) key tiles stream
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(width, BLOCK_N)
    tile = pid // n_tiles
    n_start = (pid % n_tiles) * BLOCK_N
    seq, first, rows, row_ok, visible, tile_visible = _tile_rows(
        counts_ptr, pos_ptr, rows_ptr, tile_seq_ptr, tile_start_ptr, tile_len_ptr, tile, ratio, num_seqs,
        HAS_POS, BLOCK_T)

    offs_n = n_start + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    store_mask = row_ok[:, None] & (offs_n[None, :] < width)

    if n_start < tile_visible:
        entry_ok = offs_n < tile_visible
        pages = _load_pages(block_table_ptr, seq, stride_bt, offs_n, entry_ok, num_pages, max_pages)
        slot = offs_n % 64
        k = load_key_tile(values_ptr, scales_ptr, pages, slot, entry_ok, CODE, FP8_DOT, D)  # [BLOCK_N, D]
        k_t = tl.trans(k)  # [D, BLOCK_N], K-major for the tensor cores
        if PAGE_TERM:
            # page-centred formats: logit = s * (q . r) + q . c, where q . c comes from the page-term pass (one
            # value per row, head and page) and s is the residual's per-entry scale (fp8-centred; 1 otherwise),
            # applied per head because the page term is added before the relu. The terms of head h + 2 are
            # loaded while head h is scored: they come from memory the pass wrote long before (DRAM latency),
            # which a load in the same iteration would expose once per head (H200, b548897: 2.4x plain fp8)
            logit_scale = load_logit_scales(scales_ptr, pages, slot, entry_ok, CODE, D)
            pt_rows = pt_ptr + (first + tl.arange(0, BLOCK_T)).to(tl.int64) * stride_ps
            page_col = n_start // 64
            num_cols = tl.cdiv(width, 64)
            now0 = _load_terms(pt_rows, page_col, num_cols, row_ok, stride_pp)
            now1 = _load_terms(pt_rows, page_col + 1, num_cols, row_ok & (BLOCK_N > 64), stride_pp)
            next0 = _load_terms(pt_rows + stride_ph, page_col, num_cols, row_ok & (H > 1), stride_pp)
            next1 = _load_terms(pt_rows + stride_ph, page_col + 1, num_cols, row_ok & (H > 1) & (BLOCK_N > 64),
                                stride_pp)
        else:
            now0 = tl.zeros([BLOCK_T], dtype=tl.float32)  # unused
            now1, next0, next1 = now0, now0, now0

        dims = tl.arange(0, D)
        q_ptrs = q_ptr + rows[:, None] * stride_qt + dims[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for h in range(H):
            q_h = tl.load(q_ptrs + h * stride_qh, mask=row_ok[:, None], other=0.0)  # [BLOCK_T, D]
            if FP8_DOT:
                q_h = q_h.to(tl.float8e4nv)
            else:
                q_h = q_h.to(tl.bfloat16)  # bf16 or exact fp8 upcast
            w_h = tl.load(w_ptr + rows * stride_wt + h * stride_wh, mask=row_ok, other=0.0).to(tl.float32)
            if HAS_Q_SCALE:
                w_h *= tl.load(q_scale_ptr + rows * stride_st + h * stride_sh, mask=row_ok, other=0.0)
            logits = _dot(q_h, k_t, INTERPRET)  # [BLOCK_T, BLOCK_N] fp32
            if PAGE_TERM:
                logits = scale_key_logits(logits, logit_scale, CODE, 1) + _page_bias(now0, now1, 1, BLOCK_N)
                ahead = row_ok & (h + 2 < H)
                now0, now1 = next0, next1
                next0 = _load_terms(pt_rows + (h + 2) * stride_ph, page_col, num_cols, ahead, stride_pp)
                next1 = _load_terms(pt_rows + (h + 2) * stride_ph, page_col + 1, num_cols, ahead & (BLOCK_N > 64),
                                    stride_pp)
            # NaN propagates like torch.relu so that a NaN key or query is visible downstream
            acc += tl.maximum(logits, 0.0, propagate_nan=tl.PropagateNan.ALL) * w_h[:, None]
        acc = scale_key_scores(acc, scales_ptr, pages, slot, entry_ok, CODE, D, 1)
        result = tl.where(offs_n[None, :] < visible[:, None], acc, float("-inf"))
        tl.store(out_ptrs, result, mask=store_mask)
    else:
        tl.store(out_ptrs, tl.full([BLOCK_T, BLOCK_N], float("-inf"), tl.float32), mask=store_mask)


@triton.jit
def _group_queries(q_ptr, w_ptr, q_scale_ptr, counts_ptr, pos_ptr, rows_ptr, tile_seq_ptr, tile_start_ptr,
                   tile_len_ptr, ratio, num_seqs, stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh,
                   HAS_POS: tl.constexpr, HAS_Q_SCALE: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr,
                   D: tl.constexpr):
    """The query side of a group-kernel program (program_id(0) = query group): the group's sequence, rows
    g_rows / g_ok [GROUP], entries visible to each query [GROUP] and to any of them (scalar); per dot column
    c = g * H + h: its row, head, validity and sorted position [GROUP * H], q^T [D, GROUP * H] as stored, and
    the fp32 head weights w (x q_scale) [GROUP * H]."""
    group = tl.program_id(0)
    seq = tl.minimum(tl.load(tile_seq_ptr + group), num_seqs - 1)  # clamps only matter for an unchecked batch
    first = tl.load(tile_start_ptr + group)
    length = tl.load(tile_len_ptr + group)
    count = tl.load(counts_ptr + seq)

    offs_g = tl.arange(0, GROUP)
    g_ok = offs_g < length
    g_rows = tl.load(rows_ptr + first + offs_g, mask=g_ok, other=0).to(tl.int64)  # [GROUP]
    if HAS_POS:
        pos = tl.load(pos_ptr + g_rows, mask=g_ok, other=0).to(tl.int64)  # int64: see the tile kernel
        visible = tl.minimum(tl.maximum((pos + 1) // ratio, 0), count).to(count.dtype)
    else:
        visible = tl.zeros([GROUP], dtype=tl.int32) + count
    visible = tl.where(g_ok, visible, 0)
    group_visible = tl.max(visible, axis=0)

    offs_c = tl.arange(0, GROUP * H)
    c_query = offs_c // H
    c_head = offs_c % H
    c_ok = c_query < length
    c_pos = (first + c_query).to(tl.int64)  # sorted position (the page-term buffer's row)
    c_rows = tl.load(rows_ptr + c_pos, mask=c_ok, other=0).to(tl.int64)
    dims = tl.arange(0, D)
    q_t = tl.load(q_ptr + c_rows[None, :] * stride_qt + c_head[None, :] * stride_qh + dims[:, None],
                  mask=c_ok[None, :], other=0.0)  # [D, GROUP * H]
    w = tl.load(w_ptr + c_rows * stride_wt + c_head * stride_wh, mask=c_ok, other=0.0).to(tl.float32)
    if HAS_Q_SCALE:
        w *= tl.load(q_scale_ptr + c_rows * stride_st + c_head * stride_sh, mask=c_ok, other=0.0)
    return seq, g_rows, g_ok, visible, group_visible, c_rows, c_head, c_ok, c_pos, q_t, w


@triton.jit
def _index_scores_group_kernel(
    q_ptr, w_ptr, q_scale_ptr, values_ptr, scales_ptr, block_table_ptr, counts_ptr, pos_ptr, rows_ptr,
    tile_seq_ptr, tile_start_ptr, tile_len_ptr, out_ptr,
    width, ratio, num_pages, num_seqs, max_pages,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh, stride_bt, stride_out,
    pt_ptr, stride_ps, stride_pp, stride_ph,
    HAS_POS: tl.constexpr, HAS_Q_SCALE: tl.constexpr, CODE: tl.constexpr,
    FP8_DOT: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr, PAGE_TERM: tl.constexpr = False,
    FP4_BLOCKS: tl.constexpr = False,
):
    # grid: (query groups, cdiv(width, BLOCK_N * TILES_PER_PROGRAM))
    # dot per key tile: keys [BLOCK_N, D] (M) x q^T [D, GROUP * H] (N, column c = g * H + h); the head sum is
    # then a reduction along the dot's N axis, which stays inside a thread quad.
    # FP4_BLOCKS (fp4 keys): one [BLOCK_N, 32] x [32, GROUP * H] dot per 32-element scale block on keys placed
    # in e4m3 bits (no dequantization arithmetic), each scaled per entry by its block scale; fp8 tensor cores
    # when q is fp8 e4m3 (exact products, as for fp8 keys), bf16 otherwise (exact).
    # PAGE_TERM (page-centred keys): the residual tile as the plain format's, q . c of each page read from the
    # page-term pass's buffer (pt_ptr) and added to the logits before the relu.
    seq, g_rows, g_ok, visible, group_visible, c_rows, c_head, c_ok, c_pos, q_t, w = _group_queries(
        q_ptr, w_ptr, q_scale_ptr, counts_ptr, pos_ptr, rows_ptr, tile_seq_ptr, tile_start_ptr, tile_len_ptr,
        ratio, num_seqs, stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh,
        HAS_POS, HAS_Q_SCALE, H, GROUP, D)
    if FP8_DOT:
        q_t = q_t.to(tl.float8e4nv)
    else:
        q_t = q_t.to(tl.bfloat16)  # bf16 or exact fp8 upcast
    pt_group = pt_ptr + tl.load(tile_start_ptr + tl.program_id(0)).to(tl.int64) * stride_ps  # PAGE_TERM only
    if FP4_BLOCKS:  # q's four 32-dim blocks [32, GROUP * H], in q's dtype if fp8 e4m3, else bf16
        q_blocks = (_load_q_block(q_ptr, c_rows, c_head, c_ok, stride_qt, stride_qh, 0),
                    _load_q_block(q_ptr, c_rows, c_head, c_ok, stride_qt, stride_qh, 1),
                    _load_q_block(q_ptr, c_rows, c_head, c_ok, stride_qt, stride_qh, 2),
                    _load_q_block(q_ptr, c_rows, c_head, c_ok, stride_qt, stride_qh, 3))
    else:
        q_blocks = (q_t, q_t, q_t, q_t)  # unused

    chunk_start = tl.program_id(1) * (TILES_PER_PROGRAM * BLOCK_N)
    # page terms (PAGE_TERM) of a tile are loaded one tile ahead: they come from memory the pass wrote long
    # before, whose latency a load in the same iteration would expose once per tile
    num_cols = tl.cdiv(width, 64)
    now0, now1 = _tile_terms(pt_group, chunk_start, num_cols, c_ok, stride_pp, PAGE_TERM, BLOCK_N)
    if INTERPRET:
        # the interpreter cannot take a computed loop bound: score every tile (invisible ones come out -inf)
        for i in range(TILES_PER_PROGRAM):
            next0, next1 = _tile_terms(pt_group, chunk_start + (i + 1) * BLOCK_N, num_cols,
                                       c_ok & (i + 1 < TILES_PER_PROGRAM), stride_pp, PAGE_TERM, BLOCK_N)
            _score_group_tile(chunk_start + i * BLOCK_N, q_t, q_blocks, w, seq, g_rows, g_ok, visible,
                              group_visible, values_ptr, scales_ptr, block_table_ptr, out_ptr, now0, now1, width,
                              stride_bt, stride_out, num_pages, max_pages, CODE, FP8_DOT, GROUP, H, BLOCK_N, D,
                              INTERPRET, PAGE_TERM, FP4_BLOCKS)
            now0, now1 = next0, next1
    else:
        # tiles holding visible entries: a counted loop without a branch inside, so the key loads pipeline
        busy_tiles = tl.minimum(tl.maximum(tl.cdiv(group_visible - chunk_start, BLOCK_N), 0), TILES_PER_PROGRAM)
        for i in range(0, busy_tiles):
            next0, next1 = _tile_terms(pt_group, chunk_start + (i + 1) * BLOCK_N, num_cols,
                                       c_ok & (i + 1 < busy_tiles), stride_pp, PAGE_TERM, BLOCK_N)
            _score_group_tile(chunk_start + i * BLOCK_N, q_t, q_blocks, w, seq, g_rows, g_ok, visible,
                              group_visible, values_ptr, scales_ptr, block_table_ptr, out_ptr, now0, now1, width,
                              stride_bt, stride_out, num_pages, max_pages, CODE, FP8_DOT, GROUP, H, BLOCK_N, D,
                              INTERPRET, PAGE_TERM, FP4_BLOCKS)
            now0, now1 = next0, next1
        _fill_idle_tiles(busy_tiles, TILES_PER_PROGRAM, chunk_start, g_rows, g_ok, out_ptr, stride_out, width,
                         BLOCK_N, GROUP)


@triton.jit
def _load_q_block(q_ptr, c_rows, c_head, c_ok, stride_qt, stride_qh, BLOCK: tl.constexpr,
                  SPLIT: tl.constexpr = False):
    """q^T rows 32 BLOCK .. 32 BLOCK + 31 [32, GROUP * H]: fp8 e4m3 q as it is, any other q as bf16. SPLIT: the
    block's even dimensions first, then its odd ones (the order of a key block split by nibbles)."""
    j = tl.arange(0, 32)
    if SPLIT:
        dims = BLOCK * 32 + tl.where(j < 16, 2 * j, 2 * (j - 16) + 1)
    else:
        dims = BLOCK * 32 + j
    q_b = tl.load(q_ptr + c_rows[None, :] * stride_qt + c_head[None, :] * stride_qh + dims[:, None],
                  mask=c_ok[None, :], other=0.0)
    if q_b.dtype != tl.float8e4nv:
        q_b = q_b.to(tl.bfloat16)
    return q_b


@triton.jit
def _block_dot(values_ptr, pages, slot, entry_ok, q_b, BLOCK: tl.constexpr, CODE: tl.constexpr, D: tl.constexpr,
               INTERPRET: tl.constexpr):
    """Unscaled logits of one 32-element key block: e4m3 keys [BLOCK_N, 32] x q_b [32, GROUP * H] -> fp32."""
    k_b = load_key_block(values_ptr, pages, slot, entry_ok, BLOCK, CODE, D, INTERPRET)
    if q_b.dtype != tl.float8e4nv:
        k_b = k_b.to(tl.bfloat16)  # exact: e4m3 values are bf16 values
    return _dot(k_b, q_b, INTERPRET)


@triton.jit
def _head_sum(logits, w, GROUP: tl.constexpr, H: tl.constexpr):
    """sum_h w[c] relu(logits[:, c]) per query: logits [BLOCK, GROUP * H] (column c = g * H + h) -> [BLOCK, GROUP].
    NaN propagates like torch.relu, so a NaN key or query stays visible downstream."""
    weighted = tl.maximum(logits, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
    if GROUP == 1:
        return tl.sum(weighted, axis=1)[:, None]
    return tl.sum(tl.reshape(weighted, (logits.shape[0], GROUP, H)), axis=2)


@triton.jit
def _store_group_scores(scores, offs_n, visible, g_rows, g_ok, out_ptr, stride_out, width):
    """out[g_rows[g], offs_n[n]] = scores [BLOCK, GROUP], -inf where entry n is not visible to query g."""
    result = tl.where(offs_n[:, None] < visible[None, :], scores, float("-inf"))
    tl.store(out_ptr + g_rows[None, :] * stride_out + offs_n[:, None], result,
             mask=g_ok[None, :] & (offs_n[:, None] < width))


@triton.jit
def _fill_idle_tiles(first, last, chunk_start, g_rows, g_ok, out_ptr, stride_out, width, BLOCK: tl.constexpr,
                     GROUP: tl.constexpr):
    """-inf for the program's tiles first .. last - 1 (of BLOCK entries from chunk_start): no visible entry."""
    for i in range(first, last):
        offs_n = chunk_start + i * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + g_rows[None, :] * stride_out + offs_n[:, None],
                 tl.full([BLOCK, GROUP], float("-inf"), tl.float32),
                 mask=g_ok[None, :] & (offs_n[:, None] < width))


@triton.jit
def _score_group_tile(n_start, q_t, q_blocks, w, seq, g_rows, g_ok, visible, group_visible,
                      values_ptr, scales_ptr, block_table_ptr, out_ptr, term0, term1, width, stride_bt, stride_out,
                      num_pages, max_pages, CODE: tl.constexpr, FP8_DOT: tl.constexpr,
                      GROUP: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                      INTERPRET: tl.constexpr, PAGE_TERM: tl.constexpr, FP4_BLOCKS: tl.constexpr):
    """Scores of one key tile (entries n_start ..+BLOCK_N) for a query group: store [BLOCK_N, GROUP] columns.
    term0 / term1 [GROUP * H]: the page terms of the tile's first / second page (PAGE_TERM)."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    entry_ok = offs_n < group_visible
    pages = _load_pages(block_table_ptr, seq, stride_bt, offs_n, entry_ok, num_pages, max_pages)
    slot = offs_n % 64
    if FP4_BLOCKS:
        # sum over the four blocks of scale_b x (keys_b . q_b): the scale is a power of two, so each product
        # is exact and only the fp32 accumulation order differs from one dot over the dequantized keys
        words = load_key_block_scales(scales_ptr, pages, slot, entry_ok, CODE, D)
        logits = _block_dot(values_ptr, pages, slot, entry_ok, q_blocks[0], 0, CODE, D, INTERPRET) \
            * key_block_scale(words, 0, CODE)[:, None]
        logits += _block_dot(values_ptr, pages, slot, entry_ok, q_blocks[1], 1, CODE, D, INTERPRET) \
            * key_block_scale(words, 1, CODE)[:, None]
        logits += _block_dot(values_ptr, pages, slot, entry_ok, q_blocks[2], 2, CODE, D, INTERPRET) \
            * key_block_scale(words, 2, CODE)[:, None]
        logits += _block_dot(values_ptr, pages, slot, entry_ok, q_blocks[3], 3, CODE, D, INTERPRET) \
            * key_block_scale(words, 3, CODE)[:, None]
    else:
        k = load_key_tile(values_ptr, scales_ptr, pages, slot, entry_ok, CODE, FP8_DOT, D)  # [BLOCK_N, D]
        logits = _dot(k, q_t, INTERPRET)  # [BLOCK_N, GROUP * H]
    if PAGE_TERM:
        logits = _add_page_terms(logits, scales_ptr, pages, slot, entry_ok, term0, term1, CODE, D, BLOCK_N,
                                 FP4_BLOCKS)
    scores = scale_key_scores(_head_sum(logits, w, GROUP, H), scales_ptr, pages, slot, entry_ok, CODE, D, 0)
    if FP4_BLOCKS:  # the block tiles hold the keys times 2^-6: relu(2^6 x) w = 2^6 relu(x) w, exactly
        scores = scores * KEY_BLOCK_FACTOR
    _store_group_scores(scores, offs_n, visible, g_rows, g_ok, out_ptr, stride_out, width)


@triton.jit
def _add_page_terms(logits, scales_ptr, pages, slot, entry_ok, term0, term1, CODE: tl.constexpr, D: tl.constexpr,
                    BLOCK_N: tl.constexpr, FP4_BLOCKS: tl.constexpr):
    """Residual logits [BLOCK_N, GROUP * H] of a page-centred key tile -> the full logits: times the residual's
    per-entry scale (fp8-centred), plus q . c of each entry's page (term0 / term1 [GROUP * H]: the tile's first
    and second page). FP4_BLOCKS: the logits are the true ones times 2^-6 (the block tiles), so the term is
    added times 2^-6 (exact)."""
    logits = scale_key_logits(logits, load_logit_scales(scales_ptr, pages, slot, entry_ok, CODE, D), CODE, 0)
    terms = _page_bias(term0, term1, 0, BLOCK_N)
    if FP4_BLOCKS:
        terms = terms * (1.0 / KEY_BLOCK_FACTOR)
    return logits + terms


@triton.jit
def _tile_terms(pt_group, n_start, num_cols, c_ok, stride_pp, PAGE_TERM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page terms [GROUP * H] of the pages of the group-kernel key tile starting at entry n_start (its first
    page; its second, or zeros, for BLOCK_N > 64). The group plans' buffer is [pages, rows, H], so a page's terms
    for the group's query-head columns are contiguous from pt_group (the group's first row). Zeros without
    PAGE_TERM (nothing loaded)."""
    offs = tl.arange(0, c_ok.shape[0])
    if PAGE_TERM:
        col = n_start // 64
        term0 = _load_terms(pt_group + offs, col, num_cols, c_ok, stride_pp)
        term1 = _load_terms(pt_group + offs, col + 1, num_cols, c_ok & (BLOCK_N > 64), stride_pp)
    else:
        term0 = tl.zeros([c_ok.shape[0]], dtype=tl.float32)
        term1 = term0
    return term0, term1


@triton.jit
def _index_scores_group_tma_kernel(
    q_ptr, w_ptr, q_scale_ptr, key_desc, scales_ptr, block_table_ptr, counts_ptr, pos_ptr, rows_ptr,
    tile_seq_ptr, tile_start_ptr, tile_len_ptr, out_ptr,
    width, ratio, num_pages, num_seqs, max_pages,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh, stride_bt, stride_out,
    pt_ptr, stride_ps, stride_pp, stride_ph,
    HAS_POS: tl.constexpr, HAS_Q_SCALE: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr,
    PAGES_PER_PROGRAM: tl.constexpr, PAGE_ROWS: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr,
    CODE: tl.constexpr = FP8_CODE, PAGE_TERM: tl.constexpr = False, LOOKAHEAD: tl.constexpr = 1,
):
    """The group kernel with one whole page per key tile, loaded by the tensor memory accelerator, for fp8
    keys with e4m3 queries and fp4 keys (any query dtype). A page's key bytes are one contiguous box, so a
    paged batch needs no gather: bulk copies issued stages ahead by the pipeliner, no address registers per
    entry.

    fp8: key_desc views the pool as rows of D e4m3 bytes (PAGE_ROWS rows per page, the page's 64 key rows
    first), block [64, D], one copy per page. fp4: key_desc views the pool as rows of D / 2 bytes (the page's
    64 packed value rows first), block [64, 16]: one copy per 32-element scale block, each placed in e4m3 bits
    on chip and multiplied by q's block on the tensor cores (the "blocks" decode of the group kernel), the
    block's elements in nibble order (see _tma_block_dot).

    Page-centred keys (PAGE_TERM; CODE fp8-centred or fp4-centred): the residual rows sit where the plain
    format's keys do (PAGE_ROWS counts the page's centre bytes too), read and multiplied as above; each page's
    q . c comes from the page-term pass's buffer (one [GROUP * H] row per page, broadcast to its 64 entries)
    and is added before the relu."""
    seq, g_rows, g_ok, visible, group_visible, c_rows, c_head, c_ok, c_pos, q_t, w = _group_queries(
        q_ptr, w_ptr, q_scale_ptr, counts_ptr, pos_ptr, rows_ptr, tile_seq_ptr, tile_start_ptr, tile_len_ptr,
        ratio, num_seqs, stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh,
        HAS_POS, HAS_Q_SCALE, H, GROUP, D)
    pt_group = pt_ptr + tl.load(tile_start_ptr + tl.program_id(0)).to(tl.int64) * stride_ps  # PAGE_TERM only
    if CODE == FP8_CODE or CODE == FP8_CENTRED_CODE:
        q_t = q_t.to(tl.float8e4nv)  # e4m3 already (the launcher's condition)
        q_blocks = (q_t, q_t, q_t, q_t)  # unused
    else:  # q's four 32-dim blocks [32, GROUP * H], in q's dtype if fp8 e4m3, else bf16
        q_blocks = (_load_q_block(q_ptr, c_rows, c_head, c_ok, stride_qt, stride_qh, 0, True),
                    _load_q_block(q_ptr, c_rows, c_head, c_ok, stride_qt, stride_qh, 1, True),
                    _load_q_block(q_ptr, c_rows, c_head, c_ok, stride_qt, stride_qh, 2, True),
                    _load_q_block(q_ptr, c_rows, c_head, c_ok, stride_qt, stride_qh, 3, True))

    chunk_start = tl.program_id(1) * (PAGES_PER_PROGRAM * 64)
    # page terms (PAGE_TERM) loaded LOOKAHEAD pages ahead of their use (0: in the page's own iteration). H200
    # (64 x 64K, b548897 / d405359): fp8-centred 0.514 ms with 0 (96-register cap) against 0.568 with 2 (112,
    # one program per SM fewer); fp4-centred 0.581 with 1 (168) against 0.617 / 0.680 with 0 (144 / 128)
    num_cols = tl.cdiv(width, 64)
    now, _ = _tile_terms(pt_group, chunk_start, num_cols, c_ok, stride_pp, PAGE_TERM and LOOKAHEAD > 0, 64)
    if LOOKAHEAD == 2:
        nxt, _ = _tile_terms(pt_group, chunk_start + 64, num_cols, c_ok, stride_pp, PAGE_TERM, 64)
    if INTERPRET:
        # the interpreter cannot take a computed loop bound (see the group kernel)
        for i in range(PAGES_PER_PROGRAM):
            later, _ = _tile_terms(pt_group, chunk_start + (i + LOOKAHEAD) * 64, num_cols,
                                   c_ok & (i + LOOKAHEAD < PAGES_PER_PROGRAM), stride_pp, PAGE_TERM, 64)
            if LOOKAHEAD == 0:
                now = later
            _score_tma_page(chunk_start + i * 64, key_desc, q_t, q_blocks, w, seq, g_rows, g_ok, visible,
                            group_visible, scales_ptr, block_table_ptr, out_ptr, now, width, stride_bt, stride_out,
                            num_pages, max_pages, GROUP, H, PAGE_ROWS, D, CODE, INTERPRET, PAGE_TERM)
            if LOOKAHEAD == 2:
                now = nxt
                nxt = later
            elif LOOKAHEAD == 1:
                now = later
    else:
        busy = tl.minimum(tl.maximum(tl.cdiv(group_visible - chunk_start, 64), 0), PAGES_PER_PROGRAM)
        for i in range(0, busy):
            later, _ = _tile_terms(pt_group, chunk_start + (i + LOOKAHEAD) * 64, num_cols,
                                   c_ok & (i + LOOKAHEAD < busy), stride_pp, PAGE_TERM, 64)
            if LOOKAHEAD == 0:
                now = later
            _score_tma_page(chunk_start + i * 64, key_desc, q_t, q_blocks, w, seq, g_rows, g_ok, visible,
                            group_visible, scales_ptr, block_table_ptr, out_ptr, now, width, stride_bt, stride_out,
                            num_pages, max_pages, GROUP, H, PAGE_ROWS, D, CODE, INTERPRET, PAGE_TERM)
            if LOOKAHEAD == 2:
                now = nxt
                nxt = later
            elif LOOKAHEAD == 1:
                now = later
        _fill_idle_tiles(busy, PAGES_PER_PROGRAM, chunk_start, g_rows, g_ok, out_ptr, stride_out, width, 64, GROUP)


@triton.jit
def _score_tma_page(n_start, key_desc, q_t, q_blocks, w, seq, g_rows, g_ok, visible, group_visible,
                    scales_ptr, block_table_ptr, out_ptr, term, width, stride_bt, stride_out,
                    num_pages, max_pages, GROUP: tl.constexpr, H: tl.constexpr, PAGE_ROWS: tl.constexpr,
                    D: tl.constexpr, CODE: tl.constexpr, INTERPRET: tl.constexpr, PAGE_TERM: tl.constexpr):
    """Scores of the page holding entries n_start .. n_start + 63 (n_start a multiple of 64, < group_visible)."""
    column = tl.minimum(n_start // 64, max_pages - 1)
    page = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + column)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1)  # memory safety, as _load_pages
    offs_n = n_start + tl.arange(0, 64)
    pages = tl.zeros([64], dtype=tl.int64) + page
    entry_ok = offs_n < group_visible
    if CODE == FP8_CODE or CODE == FP8_CENTRED_CODE:
        k = key_desc.load([page * PAGE_ROWS, 0])  # [64, D] e4m3, unscaled
        logits = tl.dot(k, q_t)  # [64, GROUP * H]
        if PAGE_TERM:
            logits = _add_page_terms(logits, scales_ptr, pages, offs_n % 64, entry_ok, term, term, CODE, D, 64, False)
        scores = _head_sum(logits, w, GROUP, H)  # [64, GROUP]
        scores = scale_key_scores(scores, scales_ptr, pages, offs_n % 64, entry_ok, CODE, D, 0)
    else:
        # as _score_group_tile's FP4_BLOCKS: sum over the blocks of scale_b x (keys_b . q_b), the keys times 2^-6
        words = load_key_block_scales(scales_ptr, pages, offs_n % 64, entry_ok, CODE, D)
        row = page * PAGE_ROWS
        logits = _tma_block_dot(key_desc, row, q_blocks[0], 0, CODE, INTERPRET) \
            * key_block_scale(words, 0, CODE)[:, None]
        logits += _tma_block_dot(key_desc, row, q_blocks[1], 1, CODE, INTERPRET) \
            * key_block_scale(words, 1, CODE)[:, None]
        logits += _tma_block_dot(key_desc, row, q_blocks[2], 2, CODE, INTERPRET) \
            * key_block_scale(words, 2, CODE)[:, None]
        logits += _tma_block_dot(key_desc, row, q_blocks[3], 3, CODE, INTERPRET) \
            * key_block_scale(words, 3, CODE)[:, None]
        if PAGE_TERM:
            logits = _add_page_terms(logits, scales_ptr, pages, offs_n % 64, entry_ok, term, term, CODE, D, 64, True)
        scores = _head_sum(logits, w, GROUP, H) * KEY_BLOCK_FACTOR
    _store_group_scores(scores, offs_n, visible, g_rows, g_ok, out_ptr, stride_out, width)


@triton.jit
def _tma_block_dot(key_desc, row, q_b, BLOCK: tl.constexpr, CODE: tl.constexpr, INTERPRET: tl.constexpr):
    """Unscaled logits of one 32-element key block of a page (packed bytes at columns 16 BLOCK ..+16 of rows
    row .. row + 63 of key_desc) x q_b [32, GROUP * H] -> fp32 [64, GROUP * H] (see _block_dot).

    The block's dot runs over its elements in nibble order, the 16 even elements then the 16 odd ones, and
    q_b comes in that order (_load_q_block SPLIT): a thread's four consecutive operand bytes are then the low
    (or high) nibbles of four consecutive stored bytes, one 32-bit shared-memory word placed in e4m3 bits by a
    few logic operations, where the element order needs byte permutes on each side (sm_90 SASS at 4a0a4ae:
    ~25 fewer instructions per block and thread)."""
    k_b = key_block_nibble_order(key_desc.load([row, BLOCK * 16]), CODE, INTERPRET)
    if q_b.dtype != tl.float8e4nv:
        k_b = k_b.to(tl.bfloat16)  # exact: e4m3 values are bf16 values
    return _dot(k_b, q_b, INTERPRET)
