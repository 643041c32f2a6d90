"""Gluon kernel of the prefill scores for Hopper (sm_90), bf16 index keys, asynchronous wgmma (launch: ``gluon.py``).

Same contract, arguments and grid as the Triton tile kernel (``_kernels._index_scores_tile_kernel``): program =
(query tile of a tile plan, key tile of BLOCK_N entries) on a 1-D grid with the key tile fastest; it writes::

    out[rows[s], j] = sum_h w[rows[s], h] * q_scale[rows[s], h] * relu(q[rows[s], h, :] . k[j, :])   j visible
                    = -inf                                                                          otherwise

for the plan's sorted positions s of the tile and j in [n_start, n_start + BLOCK_N). The difference is the head
loop. Triton 3.6 waits for each head's dot (synchronous wgmma) before its relu-and-weight epilogue; here each
head's dot is an asynchronous wgmma issued before the previous head's epilogue runs::

    k_smem   = keys of the tile, bf16 [BLOCK_N, 128]        (cp.async gather through the block table, once)
    q_smem   = STAGES buffers bf16 [64, 128]                  (cp.async gather of q[rows, h, :], STAGES - 2 heads
                                                               ahead, one commit group per head)
    S(0) = q_smem[0] @ k_smem^T                               async wgmma
    for h in 0 .. H-2:
        wait until q(h+1) is in shared memory (every thread's copies; fence for the async proxy)
        gather q(h + STAGES - 1) into the buffer S(h-1) read (retired in both warpgroups before the barrier)
        S(h+1) = q_smem[(h+1) % STAGES] @ k_smem^T            async wgmma
        wait S(h) (S(h+1) stays in flight)                    warpgroup_mma_wait(1)
        acc += relu(S(h)) * w[:, h]                           under S(h+1)
    wait S(H-1); acc += relu(S(H-1)) * w[:, H-1]

The loop body takes two heads, S(h) alternating between two register tiles, so that the tile in flight at the
back edge is always the same one (a loop-carried in-flight tile copied between registers makes ptxas serialize
the wgmma: C7514). In the sm_90 code the compiler places head h's relu-and-weight work after the wait of head
h + 1, so the epilogues of two heads run under S(h + 2) (the tensor cores hold two queued dots); pinning each
epilogue before the next issue (a volatile move of acc) made ptxas serialize the wgmma, so it is left there.

Query tiles are always 64 rows (the M of one wgmma); a plan's shorter tiles leave the extra rows masked
(zero-filled, never stored). With 4 warps one warpgroup owns the [64, BLOCK_N] tile; with 8 the two warpgroups
split its columns. fp32 registers per thread: 3 x 64 x BLOCK_N / (32 x warps) (acc, S(h), S(h+1)).

bf16 keys only: page p holds entry e's 128 bf16 values at element p * 8192 + e * 128 (``dsakit.formats``,
16 KB pages), read through the pool's bf16 view. q is bf16 (the launcher rounds fp32 / fp16 q once and widens
fp8 q exactly, as the Triton kernel does in registers) and contiguous: q[t, h] is read at element (t * H + h) *
128 and stride_qt / stride_qh are not read. Rows are gathered 16 B per thread and copy: the launcher
guarantees 16 B aligned bases (``gluon.gluon_q``, ``check_pool``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                               warpgroup_mma_wait)

from ...formats import ENTRIES_PER_PAGE, INDEX_HEAD_DIM

D = gl.constexpr(INDEX_HEAD_DIM)  # 128
ENTRIES = gl.constexpr(ENTRIES_PER_PAGE)  # 64 entries per page
PAGE_ELEMS = gl.constexpr(ENTRIES_PER_PAGE * INDEX_HEAD_DIM)  # bf16 elements per page
GLUON_BLOCK_T = gl.constexpr(64)  # query rows per program: the M of one wgmma (4 warps x 16 rows)


@gluon.constexpr_function
def _scores_layout(block_n, num_warps):
    """Register layout of a head's logits [64, block_n]: one warpgroup (4 warps) or two side by side in N."""
    groups = num_warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups],
                                     instr_shape=[16, block_n // groups, 16])


@gluon.constexpr_function
def _gather_layout(num_warps):
    """Rows of 128 bf16 (256 B) gathered 16 B (8 elements) per thread: a warp on two rows."""
    return gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])


@gluon.jit
def _tile_queries(counts_ptr, pos_ptr, rows_ptr, tile_seq_ptr, tile_start_ptr, tile_len_ptr, tile, ratio,
                  num_seqs, HAS_POS: gl.constexpr, layout: gl.constexpr):
    """The query side of the program in the 1D layout ``layout`` (as the Triton kernel's ``_tile_rows``): its
    sequence, rows / row_ok [64] (original rows), entries visible to each row [64] and to any of them."""
    seq = gl.minimum(gl.load(tile_seq_ptr + tile), num_seqs - 1)  # clamps only matter for an unchecked batch
    first = gl.load(tile_start_ptr + tile)
    length = gl.load(tile_len_ptr + tile)
    count = gl.load(counts_ptr + seq)
    offs_t = gl.arange(0, GLUON_BLOCK_T, layout)
    row_ok = offs_t < length
    rows = gl.load(rows_ptr + first + offs_t, mask=row_ok, other=0).to(gl.int64)
    if HAS_POS:
        # int64: pos + 1 must not wrap for pos = INT32_MAX; (pos + 1) <= 0 gives <= 0 -> 0
        pos = gl.load(pos_ptr + rows, mask=row_ok, other=0).to(gl.int64)
        visible = gl.minimum(gl.maximum((pos + 1) // ratio, 0), count).to(count.dtype)
    else:
        visible = gl.zeros([GLUON_BLOCK_T], count.dtype, layout) + count
    visible = gl.where(row_ok, visible, 0)
    return seq, rows, row_ok, visible, gl.max(visible, axis=0)


@gluon.jit
def _issue_q_copies(q_buf, q_ptr, tile_rows_ptr, length, head, H: gl.constexpr, gather: gl.constexpr):
    """cp.async q[rows, head, :] into q_buf bf16 [64, 128] for the tile's rows (``length`` of them from
    tile_rows_ptr; zeros for the others and for head >= H, whose group only keeps the group count uniform) and
    commit them as one group. The rows are loaded again for every head (an L1 hit) rather than kept: held
    across the head loop they would take registers the three [64, BLOCK_N] fp32 tiles need."""
    offs_t = gl.arange(0, GLUON_BLOCK_T, gl.SliceLayout(1, gather))
    row_ok = offs_t < length
    rows = gl.load(tile_rows_ptr + offs_t, mask=row_ok, other=0)
    cols = gl.arange(0, D, gl.SliceLayout(0, gather))
    live = row_ok & (head < H)
    offs = (rows * H + gl.minimum(head, H - 1)).to(gl.int64) * D  # q contiguous: row-major [T, H, D]
    async_copy.async_copy_global_to_shared(q_buf, q_ptr + offs[:, None] + cols[None, :], mask=live[:, None])
    async_copy.commit_group()


@gluon.jit
def _head_weights(w_ptr, q_scale_ptr, rows, row_ok, head, stride_wt, stride_wh, stride_st, stride_sh,
                  HAS_Q_SCALE: gl.constexpr):
    """fp32 w[rows, head] (x q_scale[rows, head]) [64], 0 for masked rows."""
    w = gl.load(w_ptr + rows * stride_wt + head * stride_wh, mask=row_ok, other=0.0).to(gl.float32)
    if HAS_Q_SCALE:
        w *= gl.load(q_scale_ptr + rows * stride_st + head * stride_sh, mask=row_ok, other=0.0)
    return w


@gluon.jit
def _relu_weighted(acc, s, w):
    """acc + relu(s) * w[:, None]; NaN propagates like torch.relu (s < 0 is false for NaN), so a NaN key or
    query stays visible downstream."""
    return acc + gl.where(s < 0.0, 0.0, s) * w[:, None]


@gluon.jit
def _overlapped_head(h, acc, s_cur, s_next, w_cur, q_smem, k_t, q_ptr, tile_rows_ptr, length, w_ptr, q_scale_ptr,
                     rows, row_ok, stride_wt, stride_wh, stride_st, stride_sh, H: gl.constexpr,
                     STAGES: gl.constexpr, HAS_Q_SCALE: gl.constexpr, gather: gl.constexpr):
    """Head h of the loop: S(h) is in flight in s_cur (weights w_cur); issue S(h + 1) into s_next's registers
    (whose last value, S(h - 1), is consumed) as soon as q(h + 1) is in shared memory, gather q(h + STAGES - 1),
    then retire S(h) and add its relu x w under S(h + 1) -> (acc, S(h) retired, S(h + 1) in flight, w of head h + 1)."""
    async_copy.wait_group(STAGES - 3)  # q(h + 1) (this thread's copies) ...
    fence_async_shared()  # (cp.async writes through the generic proxy; wgmma reads through the async one)
    gl.thread_barrier()  # ... every thread's; and every thread has retired S(h - 1): its q buffer is free
    _issue_q_copies(q_smem.index((h + STAGES - 1) % STAGES), q_ptr, tile_rows_ptr, length, h + STAGES - 1, H,
                    gather)
    s_next = warpgroup_mma(q_smem.index((h + 1) % STAGES), k_t, s_next, use_acc=False, is_async=True)
    w_next = _head_weights(w_ptr, q_scale_ptr, rows, row_ok, h + 1, stride_wt, stride_wh, stride_st, stride_sh,
                           HAS_Q_SCALE)  # loaded under the wgmma
    s_cur = warpgroup_mma_wait(1, deps=(s_cur, ))  # S(h) retired (issued first); S(h + 1) runs on
    return _relu_weighted(acc, s_cur, w_cur), s_cur, s_next, w_next


@gluon.jit
def _store_scores(acc, out_ptr, rows, row_ok, visible, n_start, width, stride_out, BLOCK_N: gl.constexpr,
                  cols_layout: gl.constexpr):
    """out[rows, n_start ..+BLOCK_N] = acc [64, BLOCK_N], -inf where entry n is not visible to the row (the
    addresses made here, after the head loop: live across it they would hold 2 registers per score)."""
    offs_n = n_start + gl.arange(0, BLOCK_N, cols_layout)
    result = gl.where(offs_n[None, :] < visible[:, None], acc, float("-inf"))
    gl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], result,
             mask=row_ok[:, None] & (offs_n[None, :] < width))


@gluon.jit
def index_scores_gluon_tile_kernel(
    q_ptr, w_ptr, q_scale_ptr, values_ptr, scales_ptr, block_table_ptr, counts_ptr, pos_ptr, rows_ptr,
    tile_seq_ptr, tile_start_ptr, tile_len_ptr, out_ptr,
    width, ratio, num_pages, num_seqs, max_pages,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh, stride_bt, stride_out,
    pt_ptr, stride_ps, stride_pp, stride_ph,
    HAS_POS: gl.constexpr, HAS_Q_SCALE: gl.constexpr, H: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Arguments as ``_index_scores_tile_kernel`` (scales_ptr and the page-term buffer are never read: bf16
    keys have neither; nor are the q strides: q is contiguous); values_ptr is the pool's bf16 view, q bf16."""
    gl.static_assert(STAGES >= 3, "q(h + STAGES - 1) goes into the buffer of S(h - 1): 3 buffers at least")
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = _scores_layout(BLOCK_N, NUM_WARPS)
    gather: gl.constexpr = _gather_layout(NUM_WARPS)
    rows_g: gl.constexpr = gl.SliceLayout(1, gather)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    pid = gl.program_id(0)
    n_tiles = gl.cdiv(width, BLOCK_N)
    tile = pid // n_tiles
    n_start = (pid % n_tiles) * BLOCK_N
    seq, rows, row_ok, visible, tile_visible = _tile_queries(
        counts_ptr, pos_ptr, rows_ptr, tile_seq_ptr, tile_start_ptr, tile_len_ptr, tile, ratio, num_seqs, HAS_POS,
        rows_s)

    if n_start < tile_visible:
        # the key tile: entry n of page block_table[seq, n // 64] (clamped: memory safety for unchecked batches)
        entries = n_start + gl.arange(0, BLOCK_N, rows_g)
        entry_ok = entries < tile_visible
        column = gl.minimum(entries // ENTRIES, max_pages - 1)
        pages = gl.load(block_table_ptr + seq.to(gl.int64) * stride_bt + column, mask=entry_ok, other=0)
        pages = gl.minimum(gl.maximum(pages, 0), num_pages - 1).to(gl.int64)
        k_offs = pages * PAGE_ELEMS + (entries % ENTRIES) * D
        cols_g = gl.arange(0, D, gl.SliceLayout(0, gather))
        k_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GLUON_BLOCK_T, D], gl.bfloat16)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, D], k_layout)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, GLUON_BLOCK_T, D], q_layout)
        async_copy.async_copy_global_to_shared(k_smem, values_ptr + k_offs[:, None] + cols_g[None, :],
                                               mask=entry_ok[:, None])  # committed with q(0)
        tile_rows_ptr = rows_ptr + gl.load(tile_start_ptr + tile)
        length = gl.load(tile_len_ptr + tile)
        for j in gl.static_range(STAGES - 1):
            _issue_q_copies(q_smem.index(j), q_ptr, tile_rows_ptr, length, j, H, gather)
        k_t = k_smem.permute((1, 0))  # [D, BLOCK_N], the B operand
        s_zero = gl.zeros([GLUON_BLOCK_T, BLOCK_N], gl.float32, s_layout)

        async_copy.wait_group(STAGES - 2)  # the keys and q(0) (this thread's copies) ...
        fence_async_shared()  # (cp.async writes through the generic proxy; wgmma reads through the async one)
        gl.thread_barrier()  # ... and every thread's
        s_a = warpgroup_mma(q_smem.index(0), k_t, s_zero, use_acc=False, is_async=True)  # S(0)
        s_b = s_zero
        w_cur = _head_weights(w_ptr, q_scale_ptr, rows, row_ok, 0, stride_wt, stride_wh, stride_st, stride_sh,
                              HAS_Q_SCALE)
        acc = gl.zeros([GLUON_BLOCK_T, BLOCK_N], gl.float32, s_layout)
        # two heads per iteration, S(h) alternating between two register tiles: the tile in flight at the back
        # edge is always s_a, so no in-flight accumulator is copied between registers (a copy would make ptxas
        # serialize the wgmma, C7514)
        for p in range((H - 1) // 2):
            acc, s_a, s_b, w_cur = _overlapped_head(
                2 * p, acc, s_a, s_b, w_cur, q_smem, k_t, q_ptr, tile_rows_ptr, length, w_ptr, q_scale_ptr, rows,
                row_ok, stride_wt, stride_wh, stride_st, stride_sh, H, STAGES, HAS_Q_SCALE, gather)
            acc, s_b, s_a, w_cur = _overlapped_head(
                2 * p + 1, acc, s_b, s_a, w_cur, q_smem, k_t, q_ptr, tile_rows_ptr, length, w_ptr, q_scale_ptr, rows,
                row_ok, stride_wt, stride_wh, stride_st, stride_sh, H, STAGES, HAS_Q_SCALE, gather)
        if H % 2 == 0:  # S(H - 2) in flight in s_a: one more overlapped head, then S(H - 1) in s_b
            acc, s_a, s_b, w_cur = _overlapped_head(
                H - 2, acc, s_a, s_b, w_cur, q_smem, k_t, q_ptr, tile_rows_ptr, length, w_ptr, q_scale_ptr, rows,
                row_ok, stride_wt, stride_wh, stride_st, stride_sh, H, STAGES, HAS_Q_SCALE, gather)
            s_last = warpgroup_mma_wait(0, deps=(s_b, ))
        else:  # S(H - 1) in flight in s_a
            s_last = warpgroup_mma_wait(0, deps=(s_a, ))
        acc = _relu_weighted(acc, s_last, w_cur)
        async_copy.wait_group(0)  # the (masked) gathers issued past the last head
        _store_scores(acc, out_ptr, rows, row_ok, visible, n_start, width, stride_out, BLOCK_N, cols_s)
    else:
        _store_scores(gl.zeros([GLUON_BLOCK_T, BLOCK_N], gl.float32, s_layout), out_ptr, rows, row_ok,
                      gl.zeros_like(visible), n_start, width, stride_out, BLOCK_N, cols_s)
