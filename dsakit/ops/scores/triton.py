"""Triton kernels for the lightning-indexer scores, reading keys straight from the paged cache.

Same math and masking as :func:`dsakit.ops.scores.reference.index_scores` (the spec)::

    S[t, j] = sum_h w[t, h] * q_scale[t, h] * relu(q[t, h, :] . k[j, :])       fp32 accumulation
    entry j visible to query t  iff  j < entry_counts[seq(t)] and j < (pos[t] + 1) // ratio
    invisible entries score -inf

Keys are dequantized in registers from the page layout of :mod:`dsakit.formats` (page = 64 entries, values
of all entries then scales of all entries):

    bf16  values bf16 [64, 128]                                   -> bf16 operand as stored
    fp8   values e4m3fn [64, 128], scales fp32 [64]               -> e4m3 operand; the per-entry scale c > 0
          multiplies the head-summed score per column (relu(c x) = c relu(x))
    fp4   values uint8 [64, 64] (low nibble = even element),      -> bf16 operand: e2m1 magnitude x 2^(s - 127),
          scales ue8m0 [64, 4] (one per 32 elements)                 exact in bf16 (<= 2 significant bits)

Tensor-core operands (documented numerical semantics, tested against the reference run on the same
rounded inputs with a tight bound):

    q dtype        key format   dot operands                   rounding versus the fp32 reference
    fp8 e4m3       fp8          e4m3 x e4m3 (fp8 tensor cores)  products exact; Hopper's fp8 wgmma accumulates
                                                                with fewer than fp32 mantissa bits (measured
                                                                relative L2 6e-5 on the H200); exact under the
                                                                interpreter
    fp8 e4m3       bf16 / fp4   bf16 x bf16 (q upcast, exact)   none
    bf16           any          bf16 x bf16 (keys exact)        none
    fp32 / fp16    any          bf16 x bf16                     q rounded once to bf16 (nearest even)

Otherwise accumulation is fp32 in a different order from the reference (per head, per 128-dim dot), so
scores differ from the reference by fp32 rounding only.

Two kernels, chosen by the tile plan from how many queries each sequence has:

* ``_index_scores_tile_kernel`` (prefill): program = (tile of BLOCK_T queries of one sequence, BLOCK_N
  entries) on a 1-D grid with the entry tile fastest (programs in flight share one query tile, whose q stays
  in L2). The key tile is loaded once; a loop over the H heads does [BLOCK_T, 128] x [128, BLOCK_N] dots,
  relu, times w[t, h], accumulated in fp32 registers. Tiles past every row's visible count only write -inf.
* ``_index_scores_group_kernel`` (decode, <= 4 queries per sequence): program = (group of G queries of one
  sequence, a run of N tiles). Keys are the M dimension and the G * H query heads the N dimension:
  [BLOCK_N, 128] x [128, G * H] per key tile, relu, times w, summed over heads; q stays on chip while the
  program streams its key tiles (memory bound).

Host side: queries are stably sorted by sequence and cut into tiles that never mix sequences
(:class:`QueryTiles`, built by :func:`plan_query_tiles` with one device->host sync, or without any sync by
:func:`plan_decode_tiles`); value checks cost one more sync unless ``validate=False`` (the kernels then clamp
every page id and block-table column, so bad values never cause an out-of-bounds access).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...cache import check_pool
from ...formats import ENTRIES_PER_PAGE, INDEX_HEAD_DIM, KeyFormat, is_centred
from .reference import check_queries, visible_counts

_KIND_CODE = {"bf16": 0, "fp8": 1, "fp4": 2}
_FP8_Q_DTYPES = (torch.float8_e4m3fn,)
_Q_DTYPES = (torch.float32, torch.float16, torch.bfloat16) + _FP8_Q_DTYPES


# --------------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------------


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
def _load_key_tile(values_ptr, scales_ptr, pages, slot, valid, KIND: tl.constexpr, FP8_DOT: tl.constexpr,
                   D: tl.constexpr):
    """Key tile [BLOCK_N, D] in the dot dtype for entries (pages[n], slot[n]); invalid entries read as 0.

    pages int64 [BLOCK_N] page ids, slot [BLOCK_N] entry in page, valid [BLOCK_N] bool.
    values_ptr / scales_ptr are typed views of the pool (bf16 / uint8 / fp32 / uint8, see the launcher).
    """
    dims = tl.arange(0, D)
    if KIND == 0:  # bf16: 64 x 128 bf16 values per page, no scales
        k = tl.load(values_ptr + pages[:, None] * (64 * D) + slot[:, None] * D + dims[None, :],
                    mask=valid[:, None], other=0.0)
    elif KIND == 1:  # fp8: 64 x 128 e4m3 bytes then 64 fp32 scales (applied by the caller, per column)
        raw = tl.load(values_ptr + pages[:, None] * (64 * D + 64 * 4) + slot[:, None] * D + dims[None, :],
                      mask=valid[:, None], other=0)
        k = raw.to(tl.float8e4nv, bitcast=True)
        if not FP8_DOT:
            k = k.to(tl.bfloat16)
    else:  # fp4: 64 x 64 packed bytes then 64 x 4 ue8m0 bytes; page = 64 * 68 bytes
        half = tl.arange(0, D // 2)
        page_base = pages[:, None] * (64 * (D // 2 + 4))
        raw = tl.load(values_ptr + page_base + slot[:, None] * (D // 2) + half[None, :],
                      mask=valid[:, None], other=0).to(tl.int32)
        # element 2i = low nibble, 2i + 1 = high nibble: join on a new last axis, then flatten
        codes = tl.reshape(tl.join(raw & 0xF, raw >> 4), (raw.shape[0], D))
        sbyte = tl.load(scales_ptr + page_base + 64 * (D // 2) + slot[:, None] * 4 + dims[None, :] // 32,
                        mask=valid[:, None], other=127).to(tl.int32)
        mag_code = codes & 7
        exponent = mag_code >> 1
        mantissa = mag_code & 1
        # e2m1: exponent 0 -> 0 or 0.5 (subnormal); else 2^(exponent - 1) * (1 + mantissa / 2), built as fp32
        # bits with integer arithmetic only (no boolean selects: when the tile feeds the dot from registers,
        # Triton 3.6 fails to lower i1 tensors in the dot-operand layout)
        is_normal = (exponent | (exponent >> 1)) & 1
        normal_bits = ((exponent + 126) << 23) | (mantissa << 22)
        mag_bits = is_normal * normal_bits + (1 - is_normal) * (mantissa * 0x3F000000)
        magnitude = mag_bits.to(tl.float32, bitcast=True)
        scale = (sbyte << 23).to(tl.float32, bitcast=True)  # 2^(s - 127) for s in 1..254
        value_bits = (magnitude * scale).to(tl.int32, bitcast=True) | ((codes & 8) << 28)  # sign bit 3 -> 31
        k = value_bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    return k


@triton.jit
def _load_pages(block_table_ptr, seq, stride_bt, offs_n, entry_ok, num_pages, max_pages):
    """int64 [BLOCK_N] page of each entry, clamped to the block-table row and to the pool (memory safety)."""
    column = tl.minimum(offs_n // 64, max_pages - 1)
    pages = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + column, mask=entry_ok, other=0)
    return tl.minimum(tl.maximum(pages, 0), num_pages - 1).to(tl.int64)


@triton.jit
def _load_key_scales(scales_ptr, pages, slot, valid, D: tl.constexpr):
    """fp8 per-entry fp32 scales [BLOCK_N] (scales_ptr is the fp32 view of the pool)."""
    page_words = (64 * D + 64 * 4) // 4
    return tl.load(scales_ptr + pages * page_words + (64 * D) // 4 + slot, mask=valid, other=0.0)


@triton.jit
def _index_scores_tile_kernel(
    q_ptr, w_ptr, q_scale_ptr, values_ptr, scales_ptr, block_table_ptr, counts_ptr, pos_ptr, rows_ptr,
    tile_seq_ptr, tile_start_ptr, tile_len_ptr, out_ptr,
    width, ratio, num_pages, num_seqs, max_pages,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh, stride_bt, stride_out,
    HAS_POS: tl.constexpr, HAS_Q_SCALE: tl.constexpr, KIND: tl.constexpr,
    FP8_DOT: tl.constexpr, H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # 1-D grid over (query tile, entry tile) with the entry tile fastest: programs running at the same time
    # share one query tile, so its q [BLOCK_T, H, D] stays in L2 while the (smaller) key tiles stream
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(width, BLOCK_N)
    tile = pid // n_tiles
    n_start = (pid % n_tiles) * BLOCK_N
    seq = tl.minimum(tl.load(tile_seq_ptr + tile), num_seqs - 1)  # clamps only matter with validate=False
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
    tile_visible = tl.max(visible, axis=0)

    offs_n = n_start + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    store_mask = row_ok[:, None] & (offs_n[None, :] < width)

    if n_start < tile_visible:
        entry_ok = offs_n < tile_visible
        pages = _load_pages(block_table_ptr, seq, stride_bt, offs_n, entry_ok, num_pages, max_pages)
        slot = offs_n % 64
        k = _load_key_tile(values_ptr, scales_ptr, pages, slot, entry_ok, KIND, FP8_DOT, D)  # [BLOCK_N, D]
        k_t = tl.trans(k)  # [D, BLOCK_N], K-major for the tensor cores

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
            # NaN propagates like torch.relu so that a NaN key or query is visible downstream
            acc += tl.maximum(logits, 0.0, propagate_nan=tl.PropagateNan.ALL) * w_h[:, None]
        if KIND == 1:
            acc *= _load_key_scales(scales_ptr, pages, slot, entry_ok, D)[None, :]
        result = tl.where(offs_n[None, :] < visible[:, None], acc, float("-inf"))
        tl.store(out_ptrs, result, mask=store_mask)
    else:
        tl.store(out_ptrs, tl.full([BLOCK_T, BLOCK_N], float("-inf"), tl.float32), mask=store_mask)


@triton.jit
def _index_scores_group_kernel(
    q_ptr, w_ptr, q_scale_ptr, values_ptr, scales_ptr, block_table_ptr, counts_ptr, pos_ptr, rows_ptr,
    tile_seq_ptr, tile_start_ptr, tile_len_ptr, out_ptr,
    width, ratio, num_pages, num_seqs, max_pages,
    stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh, stride_bt, stride_out,
    HAS_POS: tl.constexpr, HAS_Q_SCALE: tl.constexpr, KIND: tl.constexpr,
    FP8_DOT: tl.constexpr, H: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr,
):
    # grid: (query groups, cdiv(width, BLOCK_N * TILES_PER_PROGRAM))
    # dot per key tile: keys [BLOCK_N, D] (M) x q^T [D, GROUP * H] (N, column c = g * H + h); the head sum is
    # then a reduction along the dot's N axis, which stays inside a thread quad.
    group = tl.program_id(0)
    seq = tl.minimum(tl.load(tile_seq_ptr + group), num_seqs - 1)  # clamps only matter with validate=False
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
    c_rows = tl.load(rows_ptr + first + c_query, mask=c_ok, other=0).to(tl.int64)
    dims = tl.arange(0, D)
    q_t = tl.load(q_ptr + c_rows[None, :] * stride_qt + c_head[None, :] * stride_qh + dims[:, None],
                  mask=c_ok[None, :], other=0.0)  # [D, GROUP * H]
    if FP8_DOT:
        q_t = q_t.to(tl.float8e4nv)
    else:
        q_t = q_t.to(tl.bfloat16)  # bf16 or exact fp8 upcast
    w = tl.load(w_ptr + c_rows * stride_wt + c_head * stride_wh, mask=c_ok, other=0.0).to(tl.float32)
    if HAS_Q_SCALE:
        w *= tl.load(q_scale_ptr + c_rows * stride_st + c_head * stride_sh, mask=c_ok, other=0.0)

    chunk_start = tl.program_id(1) * (TILES_PER_PROGRAM * BLOCK_N)
    if INTERPRET:
        # the interpreter cannot take a computed loop bound: score every tile (invisible ones come out -inf)
        for i in range(TILES_PER_PROGRAM):
            _score_group_tile(chunk_start + i * BLOCK_N, q_t, w, seq, g_rows, g_ok, visible, group_visible,
                              values_ptr, scales_ptr, block_table_ptr, out_ptr, width, stride_bt, stride_out,
                              num_pages, max_pages, KIND, FP8_DOT, GROUP, H, BLOCK_N, D, INTERPRET)
    else:
        # tiles holding visible entries: a counted loop without a branch inside, so the key loads pipeline
        busy_tiles = tl.minimum(tl.maximum(tl.cdiv(group_visible - chunk_start, BLOCK_N), 0), TILES_PER_PROGRAM)
        for i in range(0, busy_tiles):
            _score_group_tile(chunk_start + i * BLOCK_N, q_t, w, seq, g_rows, g_ok, visible, group_visible,
                              values_ptr, scales_ptr, block_table_ptr, out_ptr, width, stride_bt, stride_out,
                              num_pages, max_pages, KIND, FP8_DOT, GROUP, H, BLOCK_N, D, INTERPRET)
        for i in range(busy_tiles, TILES_PER_PROGRAM):
            offs_n = chunk_start + i * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + g_rows[None, :] * stride_out + offs_n[:, None],
                     tl.full([BLOCK_N, GROUP], float("-inf"), tl.float32),
                     mask=g_ok[None, :] & (offs_n[:, None] < width))


@triton.jit
def _score_group_tile(n_start, q_t, w, seq, g_rows, g_ok, visible, group_visible,
                      values_ptr, scales_ptr, block_table_ptr, out_ptr, width, stride_bt, stride_out,
                      num_pages, max_pages, KIND: tl.constexpr, FP8_DOT: tl.constexpr, GROUP: tl.constexpr,
                      H: tl.constexpr,
                      BLOCK_N: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr):
    """Scores of one key tile (entries n_start ..+BLOCK_N) for a query group: store [BLOCK_N, GROUP] columns."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    entry_ok = offs_n < group_visible
    pages = _load_pages(block_table_ptr, seq, stride_bt, offs_n, entry_ok, num_pages, max_pages)
    slot = offs_n % 64
    k = _load_key_tile(values_ptr, scales_ptr, pages, slot, entry_ok, KIND, FP8_DOT, D)  # [BLOCK_N, D]
    logits = _dot(k, q_t, INTERPRET)  # [BLOCK_N, GROUP * H]
    weighted = tl.maximum(logits, 0.0, propagate_nan=tl.PropagateNan.ALL) * w[None, :]
    if GROUP == 1:
        scores = tl.sum(weighted, axis=1)[:, None]  # [BLOCK_N, 1]
    else:
        scores = tl.sum(tl.reshape(weighted, (BLOCK_N, GROUP, H)), axis=2)  # [BLOCK_N, GROUP]
    if KIND == 1:
        scores *= _load_key_scales(scales_ptr, pages, slot, entry_ok, D)[:, None]
    result = tl.where(offs_n[:, None] < visible[None, :], scores, float("-inf"))
    tl.store(out_ptr + g_rows[None, :] * stride_out + offs_n[:, None], result,
             mask=g_ok[None, :] & (offs_n[:, None] < width))


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


# Launch defaults measured on the H200 (benchmarks/results/scores_h200_c7d9b66.json, T = 8192 x N = 64K and
# B = 64 x N = 64K / 128K): prefill (BLOCK_T, BLOCK_N, warps, stages) = (64, 128, 4, 3) was fastest for every
# format; decode (BLOCK_N, tiles per program, warps, stages) = (64, 8, 4, 3) for bf16 / fp8 and (128, 8, 4, 3)
# for fp4.
PREFILL_BLOCK_T, PREFILL_BLOCK_N, PREFILL_WARPS, PREFILL_STAGES = 64, 128, 4, 3
DECODE_TILES_PER_PROGRAM, DECODE_WARPS, DECODE_STAGES = 8, 4, 3
DECODE_BLOCK_N = {"bf16": 64, "fp8": 64, "fp4": 128}
GROUP_MAX_QUERIES = 4  # the decode kernel handles up to 4 queries of one sequence per program


@dataclass(frozen=True)
class QueryTiles:
    """How the queries of a batch are cut into kernel tiles (a reusable plan; see :func:`plan_query_tiles`).

    Queries are stably sorted by sequence and cut into tiles of at most ``size`` rows that never mix
    sequences. ``kernel`` is "tile" (prefill: BLOCK_T = size) or "group" (decode: GROUP = size).
    rows int32 [T]: original row of each sorted position; tile_seq / tile_start / tile_len int32 [num_tiles].
    """

    kernel: str
    size: int
    rows: torch.Tensor
    tile_seq: torch.Tensor
    tile_start: torch.Tensor
    tile_len: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return int(self.tile_seq.shape[0])

    @property
    def num_queries(self) -> int:
        return int(self.rows.shape[0])


def _group_kernel_fits(num_heads: int, max_per_sequence: int) -> bool:
    heads_ok = num_heads >= 16 and num_heads & (num_heads - 1) == 0
    return heads_ok and max_per_sequence <= GROUP_MAX_QUERIES and max_per_sequence * num_heads <= 256


def _tile_size(kernel: str, max_per_sequence: int, block_t: int | None) -> int:
    if kernel == "group":
        return max(1, triton.next_power_of_2(max(1, max_per_sequence)))
    return block_t or max(16, min(PREFILL_BLOCK_T, triton.next_power_of_2(max(1, max_per_sequence))))


def _tiles_from_counts(per_seq: torch.Tensor, rows: torch.Tensor, num_tiles: int, kernel: str,
                       size: int) -> QueryTiles:
    device = per_seq.device
    num_seqs = per_seq.shape[0]
    tiles_per_seq = (per_seq + size - 1) // size
    tile_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), tiles_per_seq, output_size=num_tiles)
    seq_first_row = torch.cumsum(per_seq, 0) - per_seq
    seq_first_tile = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
    tile_in_seq = torch.arange(num_tiles, device=device) - seq_first_tile[tile_seq]
    tile_start = seq_first_row[tile_seq] + tile_in_seq * size
    tile_len = torch.clamp(per_seq[tile_seq] - tile_in_seq * size, max=size)
    return QueryTiles(kernel, size, rows.to(torch.int32), tile_seq.to(torch.int32), tile_start.to(torch.int32),
                      tile_len.to(torch.int32))


def plan_query_tiles(query_seq: torch.Tensor, num_seqs: int, num_heads: int, kernel: str = "auto",
                     block_t: int | None = None) -> QueryTiles:
    """Tile plan for queries ``query_seq`` int [T] (values 0..num_seqs-1) with H = ``num_heads``.

    One device->host sync. Build it once per batch and pass it as ``tiles=`` to every
    :func:`index_scores_triton` call on that batch (every indexer layer, every chunk of the same rows).
    kernel: "auto" (group kernel when each sequence has <= 4 queries and H is a power of two >= 16),
    "tile" or "group".
    """
    if kernel not in ("auto", "tile", "group"):
        raise ValueError(f"kernel must be 'auto', 'tile' or 'group', got {kernel!r}")
    if block_t is not None and (not isinstance(block_t, int) or block_t < 16 or block_t & (block_t - 1)):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t!r}")
    if query_seq.dim() != 1 or query_seq.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"query_seq must be int [T], got {query_seq.dtype} {list(query_seq.shape)}")
    if isinstance(num_seqs, bool) or not isinstance(num_seqs, int) or num_seqs < 0:
        raise ValueError(f"num_seqs must be an int >= 0, got {num_seqs!r}")
    seq = query_seq.long()
    out_of_range = ((seq < 0) | (seq >= num_seqs)).sum()
    # clamped so that bincount never sees a negative value; out-of-range values are refused below
    per_seq = torch.bincount(seq.clamp(0, max(num_seqs - 1, 0)), minlength=num_seqs)[:num_seqs]
    # the range check and every candidate tile size's tile count in the same sync as the largest count
    sizes = (1, 2, 4, 16, 32, 64, 128) if block_t is None else (1, 2, 4, block_t)
    if num_seqs:
        tile_counts = [((per_seq + z - 1) // z).sum() for z in sizes]
        bad, max_per_sequence, *counts = torch.stack([out_of_range, per_seq.max()] + tile_counts).tolist()
    else:
        bad, max_per_sequence, counts = seq.numel(), 0, [0] * len(sizes)
    if bad:
        raise ValueError(f"query_seq values must be in 0..{num_seqs - 1}, got range "
                         f"{int(seq.min())}..{int(seq.max())}")
    choice = kernel
    if kernel == "auto":
        choice = "group" if _group_kernel_fits(num_heads, max_per_sequence) else "tile"
    if choice == "group" and not _group_kernel_fits(num_heads, max_per_sequence):
        raise ValueError(f"kernel='group' needs a power-of-two head count >= 16 (got H = {num_heads}) and at most "
                         f"{GROUP_MAX_QUERIES} queries per sequence (got {max_per_sequence})")
    size = _tile_size(choice, max_per_sequence, block_t)
    rows = torch.argsort(seq, stable=True)
    return _tiles_from_counts(per_seq, rows, counts[sizes.index(size)], choice, size)


def plan_decode_tiles(batch: int, next_n: int, num_heads: int, device: "torch.device | str") -> QueryTiles:
    """Tile plan of a decode batch (row b * next_n + i = query i of sequence b) built without any host sync.

    Same plan as :func:`plan_query_tiles` on query_seq = repeat_interleave(arange(B), next_n): every sequence
    has next_n rows, so its tiles (cdiv(next_n, size) of them) follow from the shape alone.
    """
    for name, value, minimum in (("batch", batch, 0), ("next_n", next_n, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    kernel = "group" if _group_kernel_fits(num_heads, next_n) else "tile"
    size = _tile_size(kernel, next_n, None)
    tiles_per_seq = -(-next_n // size)
    tile = torch.arange(batch * tiles_per_seq, device=device, dtype=torch.int32)
    tile_seq = tile // tiles_per_seq
    first_row_in_seq = (tile % tiles_per_seq) * size
    return QueryTiles(kernel, size, torch.arange(batch * next_n, device=device, dtype=torch.int32), tile_seq,
                      tile_seq * next_n + first_row_in_seq, torch.clamp(next_n - first_row_in_seq, max=size))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _pool_views(pool: torch.Tensor, fmt: KeyFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed flat views (values, scales) of the uint8 pool, as the kernels index them."""
    flat = pool.view(-1)
    if fmt.kind == "bf16":
        return flat.view(torch.bfloat16), flat
    if fmt.kind == "fp8":
        return flat, flat.view(torch.float32)
    return flat, flat


def _check_shapes(q, weights, pool, fmt, block_table, entry_counts, query_seq, query_positions, ratio, q_scale,
                  out) -> None:
    """Shape / dtype / device checks (no device->host sync)."""
    check_queries(q, weights, INDEX_HEAD_DIM)
    check_pool(pool, fmt)
    t, num_heads, _ = q.shape
    if q.dtype not in _Q_DTYPES:
        raise ValueError(f"q dtype must be one of {[str(x) for x in _Q_DTYPES]}, got {q.dtype}")
    if not weights.is_floating_point() or weights.dtype in _FP8_Q_DTYPES:
        raise ValueError(f"weights must be fp32 / fp16 / bf16, got {weights.dtype}")
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int [B, max_pages], got {block_table.dtype} {list(block_table.shape)}")
    b = block_table.shape[0]
    if entry_counts.shape != (b,) or entry_counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"entry_counts must be int [B] = [{b}], got {entry_counts.dtype} {list(entry_counts.shape)}")
    if query_seq.shape != (t,) or query_seq.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"query_seq must be int [T] = [{t}], got {query_seq.dtype} {list(query_seq.shape)}")
    if query_positions is not None and (query_positions.shape != (t,)
                                        or query_positions.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"query_positions must be int [T] = [{t}] or None, got {list(query_positions.shape)}")
    if isinstance(ratio, bool) or not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"ratio must be a positive int, got {ratio!r}")
    if q_scale is not None and (not isinstance(q_scale, torch.Tensor) or q_scale.shape != (t, num_heads)
                                or q_scale.dtype != torch.float32):
        raise ValueError(f"q_scale must be fp32 [T, H] = [{t}, {num_heads}], got "
                         f"{getattr(q_scale, 'dtype', type(q_scale).__name__)} {list(getattr(q_scale, 'shape', []))}")
    if out is not None and (not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 2
                            or out.shape[0] < t or (out.shape[1] > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be fp32 [>= {t}, W'] with unit column stride, got "
                         f"{getattr(out, 'dtype', None)} {list(getattr(out, 'shape', []))}")
    if out is not None and t > 1 and out.shape[1] > 0 and out.stride(0) < out.shape[1]:
        # e.g. an expand()ed row: every query would overwrite the same memory, losing earlier rows' scores
        raise ValueError(f"out rows overlap in memory (row stride {out.stride(0)} < {out.shape[1]} columns)")
    named = {"weights": weights, "pool": pool, "block_table": block_table, "entry_counts": entry_counts,
             "query_seq": query_seq, "query_positions": query_positions, "q_scale": q_scale, "out": out}
    for name, tensor in named.items():
        if tensor is not None and tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}; put every input on one device")


def _check_values(pool, block_table, entry_counts, query_seq, query_positions, ratio, q_scale, width) -> None:
    """Value checks of every input, gathered into one device->host sync; raises ValueError naming the value."""
    t = query_seq.shape[0]
    b, max_pages = block_table.shape
    device = block_table.device
    zero = torch.zeros((), dtype=torch.int64, device=device)
    counts = entry_counts.long()
    needed = (counts.clamp(min=0) + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
    used = torch.arange(max_pages, device=device)[None, :] < needed[:, None]
    bad_pages = used & ((block_table < 0) | (block_table >= pool.shape[0]))
    seq = query_seq.long()
    in_range = (seq >= 0) & (seq < b)
    visible = visible_counts(counts.clamp(min=0)[seq.clamp(0, max(b - 1, 0))], query_positions, ratio) \
        if t and b else zero
    stats = torch.stack([
        counts.min() if b else zero, counts.max() if b else zero,
        (~in_range).sum() if t else zero, bad_pages.sum(),
        (q_scale <= 0).logical_or(q_scale.isnan()).sum() if q_scale is not None and t else zero,
        visible.max() if t and b else zero,
    ]).tolist()
    count_min, count_max, bad_seq, bad_page_count, bad_scale, visible_max = stats
    if count_min < 0 or count_max > max_pages * ENTRIES_PER_PAGE:
        raise ValueError(f"entry_counts must be in 0..{max_pages * ENTRIES_PER_PAGE} (block table width x 64), "
                         f"got {entry_counts.tolist()}")
    if bad_seq:
        raise ValueError(f"query_seq values must be in 0..{b - 1}, got range {int(seq.min())}..{int(seq.max())}")
    if bad_page_count:
        row, col = (int(v) for v in torch.nonzero(bad_pages)[0])
        raise ValueError(f"block_table[{row}, {col}] = {int(block_table[row, col])} is not a page of the pool "
                         f"(0..{pool.shape[0] - 1}) but sequence {row} needs it for its {int(counts[row])} entries")
    if bad_scale:
        raise ValueError("q_scale must be > 0 everywhere (it is moved through the relu: relu(c x) = c relu(x))")
    if width is not None and visible_max > width:
        raise ValueError(f"out has {width} columns but a query sees {visible_max} entries; "
                         f"W' must be >= every row's visible count")


def index_scores_triton(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: "KeyFormat | str",
                        block_table: torch.Tensor, entry_counts: torch.Tensor, query_seq: torch.Tensor,
                        query_positions: torch.Tensor | None = None, ratio: int = 1, *,
                        out: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
                        tiles: QueryTiles | None = None, validate: bool = True,
                        kernel: str = "auto", block_t: int | None = None, block_n: int | None = None,
                        num_warps: int | None = None, num_stages: int | None = None,
                        tiles_per_program: int | None = None) -> torch.Tensor:
    """Scores of a ragged batch against paged keys, in Triton -> fp32 [T, W], -inf where invisible.

    Arguments and semantics of :func:`dsakit.ops.scores.reference.index_scores`:
    q [T, H, 128] (fp32 / fp16 / bf16 / fp8 e4m3fn), weights [T, H], pool uint8 [P, page_bytes],
    block_table int [B, max_pages], entry_counts int [B], query_seq int [T], query_positions int [T] or None,
    ratio >= 1. All tensors on one device (CPU only under TRITON_INTERPRET=1).

    q_scale fp32 [T, H] > 0 (optional, typically with fp8 q): folded into the weights,
    S = sum_h w * q_scale * relu(q . k).

    out: optional fp32 [T_out >= T, W'] with unit column stride; rows 0..T-1, columns 0..W'-1 are written and
    out[:T] is returned. W' must be >= every row's visible count (entries past W' are never scored), so a
    caller can score a slice of rows into a bounded workspace. Without out, W = max(entry_counts).

    Host cost. Shape checks are free; ``validate=True`` adds one device->host sync for every value check
    (page ids, counts, query_seq range, q_scale > 0, W' >= visible counts); planning the tiles adds one more
    unless ``tiles`` (from :func:`plan_query_tiles` / :func:`plan_decode_tiles` for these queries) is given.
    With ``tiles``, ``out`` and ``validate=False`` a call does no sync (hot loops, CUDA graphs): the caller
    then guarantees the values, and the kernels still clamp every page id and block-table column into range,
    so bad values give wrong scores but never an out-of-bounds access; writes stay inside out[:T, :W'].

    kernel / block_t / block_n / num_warps / num_stages / tiles_per_program: tuning overrides (benchmarks and
    tests); ``kernel`` is "auto", "tile" (prefill) or "group" (decode, <= 4 queries per sequence).
    """
    fmt = KeyFormat.parse(fmt)
    if is_centred(fmt):
        raise ValueError(f"the Triton scores kernels do not read {fmt.name} pages yet; use backend='reference'")
    _check_shapes(q, weights, pool, fmt, block_table, entry_counts, query_seq, query_positions, ratio, q_scale, out)
    t, num_heads, d = q.shape
    if kernel not in ("auto", "tile", "group"):
        raise ValueError(f"kernel must be 'auto', 'tile' or 'group', got {kernel!r}")
    if tiles is not None and (not isinstance(tiles, QueryTiles) or tiles.num_queries != t
                              or tiles.rows.device != q.device):
        raise ValueError(f"tiles must be a QueryTiles plan of these {t} queries on {q.device}")
    if tiles is not None and tiles.kernel == "group" and not _group_kernel_fits(num_heads, tiles.size):
        raise ValueError(f"tiles plan the group kernel, which needs a power-of-two H >= 16, got H = {num_heads}")
    if validate:
        _check_values(pool, block_table, entry_counts, query_seq, query_positions, ratio, q_scale,
                      None if out is None else out.shape[1])
    device = q.device
    if out is None:
        width = int(entry_counts.max()) if entry_counts.numel() else 0
        out = torch.empty(t, width, dtype=torch.float32, device=device)
    width = out.shape[1]
    result = out[:t]
    if t == 0 or width == 0 or block_table.shape[0] == 0:
        return result
    if pool.shape[0] == 0 or block_table.shape[1] == 0:
        # No page to read: every entry is invisible (validate=True has already refused positive counts). The
        # kernels clamp page ids / columns to num_pages - 1 / max_pages - 1, which would be -1 here.
        return result.fill_(float("-inf"))

    if tiles is None:
        tiles = plan_query_tiles(query_seq, block_table.shape[0], num_heads, kernel, block_t)
    if q.dtype in (torch.float32, torch.float16):
        # Rounded once here (nearest even) rather than in the kernel: the interpreter truncates in-kernel
        # fp32 -> bf16 casts, and every head of every key tile would otherwise repeat the conversion.
        q = q.to(torch.bfloat16)
    if q.stride(2) != 1:
        q = q.contiguous()
    # The kernels read the small int metadata at unit stride (block-table columns, counts, positions):
    # copy strided views (cheap, no sync) instead of silently reading the wrong pages.
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    entry_counts = entry_counts.contiguous()
    if query_positions is not None:
        query_positions = query_positions.contiguous()
    fp8_dot = q.dtype in _FP8_Q_DTYPES and fmt.kind == "fp8"
    values_view, scales_view = _pool_views(pool, fmt)
    has_pos = query_positions is not None
    pos_arg = query_positions if has_pos else entry_counts  # any int tensor; never read when HAS_POS is False
    qs_arg = q_scale if q_scale is not None else weights
    qs_strides = (q_scale.stride(0), q_scale.stride(1)) if q_scale is not None else (0, 0)
    args = (q, weights, qs_arg, values_view, scales_view, block_table, entry_counts, pos_arg, tiles.rows,
            tiles.tile_seq, tiles.tile_start, tiles.tile_len, out,
            width, ratio, pool.shape[0], block_table.shape[0], block_table.shape[1],
            q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), *qs_strides,
            block_table.stride(0), out.stride(0))
    common = dict(HAS_POS=has_pos, HAS_Q_SCALE=q_scale is not None, KIND=_KIND_CODE[fmt.kind],
                  FP8_DOT=fp8_dot, H=num_heads, D=d, INTERPRET=_interpreting())

    if tiles.kernel == "group":
        bn = block_n or DECODE_BLOCK_N[fmt.kind]
        per_program = tiles_per_program or max(1, min(DECODE_TILES_PER_PROGRAM, triton.cdiv(width, bn * 4)))
        grid = (tiles.num_tiles, triton.cdiv(width, bn * per_program))
        _index_scores_group_kernel[grid](*args, GROUP=tiles.size, BLOCK_N=bn, TILES_PER_PROGRAM=per_program,
                                         num_warps=num_warps or DECODE_WARPS,
                                         num_stages=num_stages or DECODE_STAGES, **common)
        return result

    bn = block_n or PREFILL_BLOCK_N
    grid = (tiles.num_tiles * triton.cdiv(width, bn),)
    _index_scores_tile_kernel[grid](*args, BLOCK_T=tiles.size, BLOCK_N=bn,
                                    num_warps=num_warps or (PREFILL_WARPS if tiles.size * bn <= 64 * 128 else 8),
                                    num_stages=num_stages or PREFILL_STAGES, **common)
    return result


def index_scores_decode(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: "KeyFormat | str",
                        block_table: torch.Tensor, entry_counts: torch.Tensor,
                        query_positions: torch.Tensor | None = None, ratio: int = 1, *,
                        out: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
                        validate: bool = True) -> torch.Tensor:
    """Decode scores: q [B, next_n, H, 128], weights [B * next_n, H] or [B, next_n, H] -> fp32 [B * next_n, W].

    Row b * next_n + i is query i of sequence b. query_positions int [B, next_n] (or [B * next_n]) or None
    (every cached entry visible); q_scale fp32 [B * next_n, H] or [B, next_n, H]. Wrapper over
    :func:`index_scores_triton` with query_seq = repeat_interleave(arange(B), next_n) and a tile plan built
    without a host sync; with ``out`` and ``validate=False`` the call does no sync at all.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be [B, next_n, H, D], got "
                         f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    b, next_n, h, d = q.shape
    for name, value in (("weights", weights), ("block_table", block_table), ("entry_counts", entry_counts),
                        ("query_positions", query_positions), ("q_scale", q_scale)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be [B = {b}, max_pages], got {list(block_table.shape)}")
    if next_n < 1:
        raise ValueError(f"next_n must be >= 1, got q of shape {list(q.shape)}")
    rows = b * next_n
    if weights.shape not in ((rows, h), (b, next_n, h)):
        raise ValueError(f"weights must be [B * next_n, H] = [{rows}, {h}] or [B, next_n, H], "
                         f"got {list(weights.shape)}")
    if query_positions is not None and query_positions.shape not in ((b, next_n), (rows,)):
        raise ValueError(f"query_positions must be [B, next_n] = [{b}, {next_n}] or [B * next_n], "
                         f"got {list(query_positions.shape)}")
    if q_scale is not None and q_scale.shape not in ((rows, h), (b, next_n, h)):
        raise ValueError(f"q_scale must be [B * next_n, H] or [B, next_n, H], got {list(q_scale.shape)}")
    query_seq = torch.arange(b, device=q.device, dtype=torch.int32).repeat_interleave(next_n)
    return index_scores_triton(
        q.reshape(rows, h, d), weights.reshape(rows, h), pool, fmt, block_table, entry_counts, query_seq,
        None if query_positions is None else query_positions.reshape(rows), ratio, out=out,
        q_scale=None if q_scale is None else q_scale.reshape(rows, h),
        tiles=plan_decode_tiles(b, next_n, h, q.device), validate=validate)


def flops(visible_pairs: int, num_heads: int, head_dim: int = INDEX_HEAD_DIM) -> int:
    """Logit FLOPs for ``visible_pairs`` (query, visible entry) pairs: 2 * H * D each."""
    return 2 * num_heads * head_dim * int(visible_pairs)


__all__ = ["index_scores_triton", "index_scores_decode", "plan_query_tiles", "plan_decode_tiles", "QueryTiles",
           "flops"]
