"""Gluon kernel of sparse attention for Hopper (sm_90): bf16 KV pools, asynchronous wgmma (launch: ``gluon.py``).

Same contract and work decomposition as the portable Triton kernel (``_kernels.py``): one program (8 warps = two
warpgroups) owns one query t, a block of 64 heads and one split of the query's index set, main pool then
extra pool, with the same split partials (so the portable combine kernel merges them)::

    q_smem  = q[t, heads] as bf16                              [64, 512] (NVMMA-swizzled shared memory)
    prologue: gather tiles 0 .. STAGES-2 (cp.async, one commit group per tile)
    for tile i:
        wait for tile i's group; S = q_smem @ kv_smem[i]^T      async wgmma, fp32 [64, BLOCK_N]
        wait S (which also retires PV of tile i-1, wgmma groups retire in order)
        gather tile i + STAGES - 1 into the buffer PV(i-1) read (now free)
        online softmax (base 2) on S; acc *= alpha
        acc += P(bf16, registers) @ kv_smem[i]                  async wgmma, left in flight over the next gather
    final / split epilogue as in the portable kernel.

The two warpgroups split the 64 x 512 accumulator by output columns (warps_per_cta [4, 2]: 128 fp32 registers
of accumulator per thread); for S they split the BLOCK_N score columns, and the row max / sum cross them
through shared memory (the compiler's reduction). KV rows are scattered (one per index), so they are gathered
with per-row cp.async (16 B per thread and copy, zero-filled where invalid), not a 2D TMA tile.

Page layout (bf16, ``dsakit.formats``): entry e of page p is the 512 bf16 values at p * PAGE_BYTES + e * 1024.
The kernel reads the pools as bf16 views; the extra pool is addressed relative to the main pool by
``extra_offset`` ((extra base - main base) in 16 B units: both are 16 B aligned, and the unit lets the
compiler prove every row 16 B aligned for 16 B cp.async), so one pointer serves both index sets.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, warpgroup_mma,
                                                               warpgroup_mma_init, warpgroup_mma_wait)

from ...formats import ENTRIES_PER_PAGE, AttentionKVFormat

HEAD_DIM = gl.constexpr(AttentionKVFormat.BF16.head_dim)  # 512
ROW_ELEMS = gl.constexpr(AttentionKVFormat.BF16.value_bytes // 2)  # bf16 values per entry (1024 B)
ENTRIES = gl.constexpr(ENTRIES_PER_PAGE)  # 64 entries per page
GLUON_HEAD_BLOCK = gl.constexpr(64)  # heads per program: the M of every wgmma (4 warps x 16 rows)
GLUON_NUM_WARPS = gl.constexpr(8)  # two warpgroups


@gluon.jit
def _tile_slots(idx_ptr, xidx_ptr, tile, n_main, start, end, xstart, xend, num_slots, x_num_slots,
                BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """-> (element offset int64 [BLOCK_N] of each selected row from the main pool's base (0 where invalid),
    valid [BLOCK_N]) for combined tile ``tile``: tiles [0, n_main) of the main index range [start, end), the
    rest of the extra range [xstart, xend). ``layout``: a 1D layout (the gather's rows or the scores' columns)."""
    ar = gl.arange(0, BLOCK_N, layout)
    is_main = tile < n_main
    pos = start + tile * BLOCK_N + ar
    xpos = xstart + (tile - n_main) * BLOCK_N + ar
    in_main = (pos < end) & is_main
    in_extra = (xpos < xend) & (tile >= n_main)
    slot = gl.load(idx_ptr + pos, mask=in_main, other=-1)
    xslot = gl.load(xidx_ptr + xpos, mask=in_extra, other=-1)
    slot = gl.where(in_main, slot, xslot)
    limit = gl.where(is_main, num_slots, x_num_slots)
    valid = (slot >= 0) & (slot < limit)
    return slot, valid


@gluon.jit
def _row_offsets(slot, valid, is_main, extra_offset, PAGE_ELEMS: gl.constexpr, XPAGE_ELEMS: gl.constexpr):
    """Element offsets (from the main pool's base) of the rows of ``slot`` (0 for invalid rows)."""
    s = gl.where(valid, slot, 0).to(gl.int64)
    page_elems = gl.where(is_main, PAGE_ELEMS, XPAGE_ELEMS).to(gl.int64)
    # extra_offset counts 16 B units (rows stay provably 16 B aligned); int64 before the scaling: the JIT passes
    # a small offset as int32, and pools a few GB apart would overflow it
    base = gl.where(is_main, 0, extra_offset).to(gl.int64) * 8
    return base + (s // ENTRIES) * page_elems + (s % ENTRIES) * ROW_ELEMS


@gluon.jit
def _gather_rows(idx_ptr, xidx_ptr, tile, n_main, start, end, xstart, xend, num_slots, x_num_slots, extra_offset,
                 PAGE_ELEMS: gl.constexpr, XPAGE_ELEMS: gl.constexpr, BLOCK_N: gl.constexpr,
                 gather_layout: gl.constexpr):
    """-> (row element offsets int64 [BLOCK_N], valid [BLOCK_N]) of combined tile ``tile`` in the row layout of
    ``gather_layout`` (the index loads; issued ahead of the copies so that their latency is hidden)."""
    rows_layout: gl.constexpr = gl.SliceLayout(1, gather_layout)
    slot, valid = _tile_slots(idx_ptr, xidx_ptr, tile, n_main, start, end, xstart, xend, num_slots, x_num_slots,
                              BLOCK_N, rows_layout)
    return _row_offsets(slot, valid, tile < n_main, extra_offset, PAGE_ELEMS, XPAGE_ELEMS), valid


@gluon.jit
def _issue_copies(kv_buf, pool_ptr, row, valid, gather_layout: gl.constexpr):
    """cp.async rows ``row`` of the pool into ``kv_buf`` [BLOCK_N, 512] (zeros where not ``valid``: src-size
    0) and commit them as one group (all zeros for a tile past the end, so group counts stay uniform)."""
    cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, gather_layout))
    async_copy.async_copy_global_to_shared(kv_buf, pool_ptr + row[:, None] + cols[None, :], mask=valid[:, None])
    async_copy.commit_group()


@gluon.jit
def _split_range(len_ptr, t, split, tiles_per_split, K, HAS_LEN: gl.constexpr, BLOCK_N: gl.constexpr):
    """-> (start, end, tiles) of split ``split``'s index positions of query t: [start, end) within
    [0, min(topk_length[t], K)), ``tiles`` of BLOCK_N covering it (0 if empty)."""
    length = K
    if HAS_LEN:
        length = gl.minimum(gl.maximum(gl.load(len_ptr + t), 0), K)
    start = split * tiles_per_split * BLOCK_N
    end = gl.minimum(start + tiles_per_split * BLOCK_N, length)
    return start, end, gl.maximum(gl.cdiv(end - start, BLOCK_N), 0)


@gluon.jit
def _softmax_step(s, valid, m_i, l_i, scale_log2):
    """Online softmax (base 2) of raw scores s [64, BLOCK_N] (-inf where not ``valid``) against the running
    row max m_i and sum l_i -> (p, alpha = 2^(m_i - m_new), m_new, l_new)."""
    s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # all-invalid so far: keep exp2 finite
    p = gl.exp2(s - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _tile_start(i, idx_row, xidx_row, n_main, start, end, xstart, xend, num_slots, x_num_slots, extra_offset,
                PAGE_ELEMS: gl.constexpr, XPAGE_ELEMS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                gather_layout: gl.constexpr, cols_s: gl.constexpr):
    """Top of tile i: wait until its rows are in shared memory and visible to wgmma; then the index loads of
    the gather of tile i + STAGES - 1 and of tile i's score mask (issued before QK(i): their latency runs
    under it) -> (row offsets, row valid, score-column valid)."""
    async_copy.wait_group(STAGES - 2)  # tile i's rows have landed (this thread's copies) ...
    fence_async_shared()  # (cp.async writes through the generic proxy; wgmma reads through the async one)
    gl.thread_barrier()  # ... and every thread's
    row, row_valid = _gather_rows(idx_row, xidx_row, i + STAGES - 1, n_main, start, end, xstart, xend, num_slots,
                                  x_num_slots, extra_offset, PAGE_ELEMS, XPAGE_ELEMS, BLOCK_N, gather_layout)
    _, valid = _tile_slots(idx_row, xidx_row, i, n_main, start, end, xstart, xend, num_slots, x_num_slots,
                           BLOCK_N, cols_s)
    return row, row_valid, valid


@gluon.jit
def _write_outputs(acc, m_i, l_i, t, hb, split, sink_ptr, out_ptr, lse_ptr, T, HQ: gl.constexpr,
                   NUM_SPLITS: gl.constexpr, HAS_SINK: gl.constexpr, o_layout: gl.constexpr):
    """Epilogue (as the portable kernel's): one split -> out = acc / (l + sink term), lse (natural log); several
    -> the split's partial out = acc / l and lse (log2 units) for the combine kernel."""
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    m_o = gl.convert_layout(m_i, rows_o)
    l_o = gl.convert_layout(l_i, rows_o)
    m_use = gl.where(m_o == float("-inf"), 0.0, m_o)
    lse2 = m_use + gl.log2(l_o)  # -inf for an empty index set
    offs_h = hb * GLUON_HEAD_BLOCK + gl.arange(0, GLUON_HEAD_BLOCK, rows_o)
    offs_d = gl.arange(0, HEAD_DIM, cols_o)
    if NUM_SPLITS == 1:
        denom = l_o
        if HAS_SINK:
            denom += gl.exp2(gl.load(sink_ptr + offs_h).to(gl.float32) * 1.4426950408889634 - m_use)
        denom = gl.where(denom == 0.0, 1.0, denom)
        out = acc / denom[:, None]
        row = t * HQ + offs_h
        gl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out.to(out_ptr.dtype.element_ty))
        gl.store(lse_ptr + row, lse2 * 0.6931471805599453)
    else:
        out = acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None]
        row = (split * T + t) * HQ + offs_h
        gl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out)
        gl.store(lse_ptr + row, lse2)


@gluon.constexpr_function
def _wgmma_layout(n):
    """Register layout of a wgmma result [64, n]: two warpgroups side by side in N (n / 2 columns each)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, n // 2, 16])


@gluon.jit
def _program_start(q_ptr, stride_qt, stride_qh, idx_ptr, stride_it, K, len_ptr, xidx_ptr, stride_xt, XK,
                   xlen_ptr, tiles_per_split, xtiles_per_split, HQ: gl.constexpr, NUM_SPLITS: gl.constexpr,
                   BLOCK_N: gl.constexpr, HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_XLEN: gl.constexpr,
                   q_layout: gl.constexpr):
    """The program's (query t, head block hb, split), q[t, heads] as bf16 in shared memory (NVMMA, read by
    every QK wgmma), and its index ranges: main [start, end) in n_main tiles, extra [xstart, xend) in n_extra,
    walked as one sequence of tiles from the index rows idx_row / xidx_row."""
    HB: gl.constexpr = HQ // GLUON_HEAD_BLOCK
    pid = gl.program_id(0)
    hb = pid % HB  # the head blocks of one query are neighbours: they share the gathered rows in L2
    rest = pid // HB
    split = rest % NUM_SPLITS
    t = (rest // NUM_SPLITS).to(gl.int64)

    offs_hq = hb * GLUON_HEAD_BLOCK + gl.arange(0, GLUON_HEAD_BLOCK, gl.SliceLayout(1, q_layout))
    offs_dq = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, q_layout))
    q = gl.load(q_ptr + t * stride_qt + offs_hq[:, None] * stride_qh + offs_dq[None, :])
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GLUON_HEAD_BLOCK, HEAD_DIM], gl.bfloat16)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [GLUON_HEAD_BLOCK, HEAD_DIM], q_smem_layout, q.to(gl.bfloat16))

    start, end, n_main = _split_range(len_ptr, t, split, tiles_per_split, K, HAS_LEN, BLOCK_N)
    xstart = 0
    xend = 0
    n_extra = 0
    if HAS_EXTRA:
        xstart, xend, n_extra = _split_range(xlen_ptr, t, split, xtiles_per_split, XK, HAS_XLEN, BLOCK_N)
    return (t, hb, split, q_smem, start, end, n_main, xstart, xend, n_extra, idx_ptr + t * stride_it,
            xidx_ptr + t * stride_xt)


@gluon.jit
def sparse_attention_gluon_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, HQ, 512] (bf16 / fp16 / fp32; rounded to bf16)
    pool_ptr, num_slots, idx_ptr, stride_it, K, len_ptr,  # main pool as bf16, indices int32 [T, K], len [T]
    extra_offset, x_num_slots, xidx_ptr, stride_xt, XK, xlen_ptr,  # extra pool at pool_ptr + 8 * extra_offset
    sink_ptr,  # fp32 [HQ]
    out_ptr, lse_ptr,  # final: out [T, HQ, 512] (q dtype), lse fp32 [T, HQ]; split: fp32 [S, T, HQ, 512], [S, T, HQ]
    T, scale_log2, tiles_per_split, xtiles_per_split,
    HQ: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, NUM_SPLITS: gl.constexpr,
    PAGE_ELEMS: gl.constexpr, XPAGE_ELEMS: gl.constexpr,
    HAS_LEN: gl.constexpr, HAS_EXTRA: gl.constexpr, HAS_XLEN: gl.constexpr, HAS_SINK: gl.constexpr,
    OVERLAP: gl.constexpr,
):
    BLOCK_H: gl.constexpr = GLUON_HEAD_BLOCK
    gl.static_assert(gl.num_warps() == GLUON_NUM_WARPS, "the kernel is laid out for two warpgroups")
    gl.static_assert(STAGES >= 2, "the gather of tile i+1 goes into the buffer PV(i-1) read: 2 stages at least")

    # layouts: scores [64, BLOCK_N] and accumulator [64, 512] on wgmma (two warpgroups side by side in N);
    # P as the register A operand of PV; gathers with 16 B (8 x bf16) per thread, a warp on a row's 512 B
    s_layout: gl.constexpr = _wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = _wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    gather_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [GLUON_NUM_WARPS, 1], [1, 0])
    smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    # q in shared memory; this split's index ranges: main [start, end), extra [xstart, xend), one tile sequence
    t, hb, split, q_smem, start, end, n_main, xstart, xend, n_extra, idx_row, xidx_row = _program_start(
        q_ptr, stride_qt, stride_qh, idx_ptr, stride_it, K, len_ptr, xidx_ptr, stride_xt, XK, xlen_ptr,
        tiles_per_split, xtiles_per_split, HQ, NUM_SPLITS, BLOCK_N, HAS_LEN, HAS_EXTRA, HAS_XLEN, gather_layout)
    kv_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
    n_tiles = n_main + n_extra

    for j in gl.static_range(STAGES - 1):
        row, row_valid = _gather_rows(idx_row, xidx_row, j, n_main, start, end, xstart, xend, num_slots,
                                      x_num_slots, extra_offset, PAGE_ELEMS, XPAGE_ELEMS, BLOCK_N, gather_layout)
        _issue_copies(kv_smem.index(j), pool_ptr, row, row_valid, gather_layout)
    fence_async_shared()  # q_smem's generic-proxy store before the first wgmma reads it

    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, rows_s)
    s_zero = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
    if OVERLAP:
        # FA3 order: QK(i) and PV(i-1) in flight together, the softmax of tile i under PV(i-1); the gather of
        # tile i + STAGES - 1 goes into PV(i-1)'s buffer once it retires, so it needs 3 stages to run ahead.
        # PV(-1) multiplies zeros by the zeroed last buffer (no prologue gather goes there).
        gl.static_assert(STAGES >= 3, "OVERLAP gathers into the buffer of PV(i-1) late: 3 stages at least")
        kv_smem.index(STAGES - 1).store(gl.zeros([BLOCK_N, HEAD_DIM], gl.bfloat16, gather_layout))
        fence_async_shared()
        p_prev = gl.zeros([BLOCK_H, BLOCK_N], gl.bfloat16, p_layout)
        acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, o_layout)
        for i in range(n_tiles):
            row, row_valid, valid = _tile_start(i, idx_row, xidx_row, n_main, start, end, xstart, xend, num_slots,
                                                x_num_slots, extra_offset, PAGE_ELEMS, XPAGE_ELEMS, BLOCK_N, STAGES,
                                                gather_layout, cols_s)
            prev_buf = kv_smem.index((i + STAGES - 1) % STAGES)
            s_tok = warpgroup_mma(q_smem, kv_smem.index(i % STAGES).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            acc_tok = warpgroup_mma(p_prev, prev_buf, acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok, ))  # QK(i) retired (issued first); PV(i-1) may run on
            p, alpha, m_i, l_i = _softmax_step(s, valid, m_i, l_i, scale_log2)
            # (P of tile i-1 is a register operand of PV(i-1): kept alive through the wait, like acc)
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc_tok, p_prev))
            gl.thread_barrier()  # PV(i-1) retired in both warpgroups: its buffer takes the next gather
            _issue_copies(prev_buf, pool_ptr, row, row_valid, gather_layout)
            acc = acc * gl.convert_layout(alpha, rows_o, assert_trivial=True)[:, None]
            p_prev = gl.convert_layout(p.to(gl.bfloat16), p_layout)
        acc_tok = warpgroup_mma(p_prev, kv_smem.index((n_tiles + STAGES - 1) % STAGES), acc, is_async=True)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc_tok, p_prev))
    else:
        # loop-carried as an in-flight wgmma accumulator (the PV of the previous tile), with that PV's register
        # operand P, kept alive until the wait that retires it
        acc = warpgroup_mma_init(gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, o_layout))
        p_op = gl.zeros([BLOCK_H, BLOCK_N], gl.bfloat16, p_layout)
        for i in range(n_tiles):
            row, row_valid, valid = _tile_start(i, idx_row, xidx_row, n_main, start, end, xstart, xend, num_slots,
                                                x_num_slots, extra_offset, PAGE_ELEMS, XPAGE_ELEMS, BLOCK_N, STAGES,
                                                gather_layout, cols_s)
            kv = kv_smem.index(i % STAGES)
            s_tok = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s, acc, p_op = warpgroup_mma_wait(0, deps=(s_tok, acc, p_op))  # S(i); PV(i-1) retired in this WG
            gl.thread_barrier()  # ... and in the other one, before the copies below overwrite what PV(i-1) read
            _issue_copies(kv_smem.index((i + STAGES - 1) % STAGES), pool_ptr, row, row_valid, gather_layout)
            p, alpha, m_i, l_i = _softmax_step(s, valid, m_i, l_i, scale_log2)
            acc = acc * gl.convert_layout(alpha, rows_o, assert_trivial=True)[:, None]  # same rows: free
            p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            acc = warpgroup_mma(p_op, kv, acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    async_copy.wait_group(0)  # the gathers issued past the last tile (empty groups, masked rows)

    _write_outputs(acc, m_i, l_i, t, hb, split, sink_ptr, out_ptr, lse_ptr, T, HQ, NUM_SPLITS, HAS_SINK, o_layout)
