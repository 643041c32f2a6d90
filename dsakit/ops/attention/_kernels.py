"""Triton kernels of sparse attention over paged V4 main-KV pools (launch code: ``triton.py``).

One program owns one query t, a block of BLOCK_H heads and one split of the query's index set::

    q       = q[t, heads]                                   bf16 [BLOCK_H, 512] (loaded once)
    for each tile of BLOCK_N indices of the split (main pool, then extra pool):
        slot  = indices[t, i]; valid = i < topk_length[t] and 0 <= slot < num_slots
        kv    = dequantize(pool bytes of slot) as bf16      [BLOCK_N, 512] (K = V, gathered rows)
        s     = (q @ kv^T) * scale * log2(e)                fp32 [BLOCK_H, BLOCK_N], -inf where invalid
        online softmax: m, l, acc = acc * 2^(m_old - m) + 2^(s - m) @ kv
    final:  out = acc / (l + 2^(sink * log2(e) - m)), lse = (m + log2 l) * ln 2
    split:  partial out = acc / l, partial lse (log2 units) -> _sparse_attention_combine_kernel

Invalid slots (padding, beyond topk_length, outside the pool) are masked loads: no address outside the pool
is read for them. Page layouts (see dsakit.formats): bf16 = 64 x 1024 B rows; fp8-rope-bf16 = 64 x 576 B data
rows (448 e4m3 + 64 bf16 rope) then 64 x 8 scale bytes (7 ue8m0 + pad), page padded to 37440 B.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...formats import ATTENTION_FP8_BLOCK, ENTRIES_PER_PAGE, AttentionKVFormat

# log2(e) and ln(2) appear as literals inside the kernels (scores run in base 2)

# The entry layouts, from the format objects (dsakit.formats), as compile-time constants of the kernels
_FP8_KV = AttentionKVFormat.FP8_ROPE_BF16
KV_DIM = tl.constexpr(_FP8_KV.head_dim)  # 512 dims per token (K = V)
FP8_ROW_BYTES = tl.constexpr(_FP8_KV.value_bytes)  # 576: 448 e4m3 + 64 bf16 rope
FP8_NOPE = tl.constexpr(_FP8_KV.nope_dim)  # 448 fp8 dims, then the rope dims as bf16
FP8_SCALE_BYTES = tl.constexpr(_FP8_KV.scale_bytes)  # 8: 7 ue8m0 scales + 1 pad byte
FP8_BLOCK = tl.constexpr(ATTENTION_FP8_BLOCK)  # 64 fp8 dims per scale
FP8_SCALES = tl.constexpr(_FP8_KV.nope_dim // ATTENTION_FP8_BLOCK)  # 7
BF16_ROW_BYTES = tl.constexpr(AttentionKVFormat.BF16.value_bytes)  # 1024
ENTRIES = tl.constexpr(ENTRIES_PER_PAGE)  # 64 entries per page


@triton.jit
def _round_bf16(x, INTERPRET: tl.constexpr):
    """fp32 -> bf16 with round-to-nearest-even. The interpreter's cast truncates and its bf16 dot is wrong,
    so there the values are rounded by integer arithmetic and kept in fp32 (exact: they are bf16 values)."""
    if INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    """bf16 tensor-core dot with fp32 accumulation; in the interpreter the same products in fp32."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _load_kv_tile(pool_ptr, num_slots, idx_row_ptr, start, end,
                  FP8: tl.constexpr, PAGE_BYTES: tl.constexpr, BLOCK_N: tl.constexpr):
    """-> (kv bf16 [BLOCK_N, 512] (zeros where not valid; those rows are not read), valid [BLOCK_N]) for the
    index positions start + [0, BLOCK_N) (those >= end skipped)."""
    slot, valid = _tile_slots(idx_row_ptr, start, end, num_slots, BLOCK_N)
    return _load_kv_cols(pool_ptr, slot, valid, 0, KV_DIM, FP8, PAGE_BYTES, BLOCK_N), valid


@triton.jit
def _tile_slots(idx_row_ptr, start, end, num_slots, BLOCK_N: tl.constexpr):
    """-> (slot int64 [BLOCK_N] (0 where invalid), valid [BLOCK_N]) of the index positions start + [0, BLOCK_N)."""
    pos = start + tl.arange(0, BLOCK_N)
    in_row = pos < end
    slot = tl.load(idx_row_ptr + pos, mask=in_row, other=-1)
    valid = in_row & (slot >= 0) & (slot < num_slots)
    return tl.where(valid, slot, 0).to(tl.int64), valid


@triton.jit
def _load_kv_cols(pool_ptr, slot, valid, COL0: tl.constexpr, W: tl.constexpr, FP8: tl.constexpr,
                  PAGE_BYTES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dims [COL0, COL0 + W) of the slots' rows, dequantized -> bf16 [BLOCK_N, W] (zeros where not valid)."""
    offs_d = COL0 + tl.arange(0, W)
    page_base = (slot // ENTRIES) * PAGE_BYTES
    entry = slot % ENTRIES
    if FP8:
        base = page_base + entry * FP8_ROW_BYTES  # [BLOCK_N] first data byte of the token
        is_nope = offs_d < FP8_NOPE
        nope = tl.load(pool_ptr + base[:, None] + offs_d[None, :],
                       mask=valid[:, None] & is_nope[None, :], other=0)  # uint8 e4m3 [BLOCK_N, W]
        rope_ptr = (pool_ptr + base + FP8_NOPE).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr[:, None] + (offs_d - FP8_NOPE)[None, :],
                       mask=valid[:, None] & (offs_d >= FP8_NOPE)[None, :], other=0.0)  # bf16, dims 448..511
        NB: tl.constexpr = W // FP8_BLOCK
        offs_s = COL0 // FP8_BLOCK + tl.arange(0, NB)
        sc = tl.load(pool_ptr + (page_base + ENTRIES * FP8_ROW_BYTES + entry * FP8_SCALE_BYTES)[:, None]
                     + offs_s[None, :], mask=valid[:, None] & (offs_s < FP8_SCALES)[None, :],
                     other=127)  # ue8m0 [BLOCK_N, NB]
        scale = tl.exp2(sc.to(tl.float32) - 127.0)
        scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (BLOCK_N, NB, FP8_BLOCK)), (BLOCK_N, W))
        nope_f = nope.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        kv = tl.where(is_nope[None, :], nope_f, rope.to(tl.float32)).to(tl.bfloat16)
    else:
        row_ptr = (pool_ptr + page_base + entry * BF16_ROW_BYTES).to(tl.pointer_type(tl.bfloat16))
        kv = tl.load(row_ptr[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    return kv


@triton.jit
def _attend_range(q, acc, m_i, l_i, pool_ptr, num_slots, idx_row_ptr, start, end, scale_log2,
                  FP8: tl.constexpr, PAGE_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
                  INTERPRET: tl.constexpr, INTERP_TILES: tl.constexpr):
    """Online softmax over index positions [start, end) in tiles of BLOCK_N (scores in log2 units).

    INTERPRET (the interpreter, which cannot take a computed loop bound): a fixed count of tiles from start,
    the positions at or past ``end`` masked out."""
    if INTERPRET:
        for i in range(INTERP_TILES):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, pool_ptr, num_slots, idx_row_ptr, start + i * BLOCK_N,
                                         end, scale_log2, FP8, PAGE_BYTES, BLOCK_N, True)
    else:
        for n0 in range(start, end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, pool_ptr, num_slots, idx_row_ptr, n0, end, scale_log2,
                                         FP8, PAGE_BYTES, BLOCK_N, False)
    return acc, m_i, l_i


@triton.jit
def _attend_tile(q, acc, m_i, l_i, pool_ptr, num_slots, idx_row_ptr, n0, end, scale_log2,
                 FP8: tl.constexpr, PAGE_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr):
    """One online-softmax step over the tile of index positions [n0, n0 + BLOCK_N) (those >= end skipped)."""
    kv, valid = _load_kv_tile(pool_ptr, num_slots, idx_row_ptr, n0, end, FP8, PAGE_BYTES, BLOCK_N)
    s = _dot(q, tl.trans(kv), INTERPRET) * scale_log2  # fp32 [BLOCK_H, BLOCK_N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all-invalid so far: keep exp2 finite
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(_round_bf16(p, INTERPRET), kv, INTERPRET)
    return acc, m_new, l_i


@triton.jit
def _sparse_attention_kernel(
    q_ptr, stride_qt, stride_qh,  # q [T, HQ, 512]
    pool_ptr, num_slots, idx_ptr, stride_it, K, len_ptr,  # main pool uint8, indices int32 [T, K], len [T]
    xpool_ptr, x_num_slots, xidx_ptr, stride_xt, XK, xlen_ptr,  # extra pool / indices [T, XK] / len [T]
    sink_ptr,  # fp32 [HQ]
    out_ptr, lse_ptr,  # final: out [T, HQ, 512] (q dtype), lse fp32 [T, HQ]; split: fp32 [S, T, HQ, 512], [S, T, HQ]
    T, scale_log2, tiles_per_split, xtiles_per_split,
    HQ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    FP8: tl.constexpr, PAGE_BYTES: tl.constexpr, XFP8: tl.constexpr, XPAGE_BYTES: tl.constexpr,
    HAS_LEN: tl.constexpr, HAS_EXTRA: tl.constexpr, HAS_XLEN: tl.constexpr, HAS_SINK: tl.constexpr,
    INTERPRET: tl.constexpr, INTERP_TILES: tl.constexpr, INTERP_XTILES: tl.constexpr,
):
    HB: tl.constexpr = HQ // BLOCK_H
    pid = tl.program_id(0)
    # the head blocks of one query are neighbours: they share the gathered rows in L2
    hb = pid % HB
    rest = pid // HB
    split = rest % NUM_SPLITS
    t = (rest // NUM_SPLITS).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, 512)
    q_rows = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
    q = _round_bf16(tl.load(q_rows + offs_d[None, :]).to(tl.float32), INTERPRET)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)

    length = K
    if HAS_LEN:
        length = tl.minimum(tl.maximum(tl.load(len_ptr + t), 0), K)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, length)
    acc, m_i, l_i = _attend_range(q, acc, m_i, l_i, pool_ptr, num_slots, idx_ptr + t * stride_it, start, end,
                                  scale_log2, FP8, PAGE_BYTES, BLOCK_N, INTERPRET, INTERP_TILES)
    if HAS_EXTRA:
        xlength = XK
        if HAS_XLEN:
            xlength = tl.minimum(tl.maximum(tl.load(xlen_ptr + t), 0), XK)
        xstart = split * xtiles_per_split * BLOCK_N
        xend = tl.minimum(xstart + xtiles_per_split * BLOCK_N, xlength)
        acc, m_i, l_i = _attend_range(q, acc, m_i, l_i, xpool_ptr, x_num_slots, xidx_ptr + t * stride_xt,
                                      xstart, xend, scale_log2, XFP8, XPAGE_BYTES, BLOCK_N, INTERPRET,
                                      INTERP_XTILES)

    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse2 = m_use + tl.log2(l_i)  # -inf for an empty index set
    if NUM_SPLITS == 1:
        denom = l_i
        if HAS_SINK:
            denom += tl.exp2(tl.load(sink_ptr + offs_h).to(tl.float32) * 1.4426950408889634 - m_use)
        denom = tl.where(denom == 0.0, 1.0, denom)
        out = acc / denom[:, None]
        if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
            out = _round_bf16(out, True)
        row = t * HQ + offs_h
        tl.store(out_ptr + row[:, None] * 512 + offs_d[None, :], out.to(out_ptr.dtype.element_ty))
        tl.store(lse_ptr + row, lse2 * 0.6931471805599453)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        row = (split * T + t) * HQ + offs_h
        tl.store(out_ptr + row[:, None] * 512 + offs_d[None, :], out)
        tl.store(lse_ptr + row, lse2)


@triton.jit
def _sparse_attention_combine_kernel(
    part_out_ptr, part_lse_ptr,  # fp32 [S, T, HQ, 512], fp32 [S, T, HQ] (log2 units)
    sink_ptr, out_ptr, lse_ptr,  # fp32 [HQ]; out [T, HQ, 512] (q dtype), lse fp32 [T, HQ]
    T, NUM_SPLITS: tl.constexpr,
    HQ: tl.constexpr, BLOCK_H: tl.constexpr, HAS_SINK: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Merge the splits' (out, lse) of BLOCK_H heads of one query by log-sum-exp, then apply the sink."""
    HB: tl.constexpr = HQ // BLOCK_H
    pid = tl.program_id(0)
    t = (pid // HB).to(tl.int64)
    offs_h = (pid % HB) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, 512)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(part_lse_ptr + (s * T + t) * HQ + offs_h))
    m_use = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_H, 512], tl.float32)
    w_sum = tl.zeros([BLOCK_H], tl.float32)
    for s in range(NUM_SPLITS):
        row = (s * T + t) * HQ + offs_h
        w = tl.exp2(tl.load(part_lse_ptr + row) - m_use)
        acc += w[:, None] * tl.load(part_out_ptr + row[:, None] * 512 + offs_d[None, :])
        w_sum += w
    lse2 = m_use + tl.log2(w_sum)
    denom = w_sum
    if HAS_SINK:
        denom += tl.exp2(tl.load(sink_ptr + offs_h).to(tl.float32) * 1.4426950408889634 - m_use)
    denom = tl.where(denom == 0.0, 1.0, denom)
    row = t * HQ + offs_h
    out = acc / denom[:, None]
    if INTERPRET and out_ptr.dtype.element_ty == tl.bfloat16:
        out = _round_bf16(out, True)
    tl.store(out_ptr + row[:, None] * 512 + offs_d[None, :], out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + row, lse2 * 0.6931471805599453)
