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

    q dtype        key format   dot operands                  rounding versus the fp32 reference
    fp8 e4m3       fp8          e4m3 x e4m3 (fp8 tensor cores) none (both exact), fp32 accumulation
    fp8 e4m3       bf16 / fp4   bf16 x bf16 (q upcast, exact)  none
    bf16           any          bf16 x bf16 (keys exact)       none
    fp32 / fp16    any          bf16 x bf16                    q rounded to bf16 (nearest even)

Accumulation is fp32 but in a different order from the reference (per head, per 128-dim dot), so scores
differ from the reference by fp32 rounding only when the operands are equal.

Two kernels, chosen by the launcher from how many queries each sequence has:

* ``_index_scores_tile_kernel`` (prefill): program = (tile of BLOCK_T queries of one sequence, BLOCK_N
  entries). The key tile is loaded once; a loop over the H heads does [BLOCK_T, 128] x [128, BLOCK_N] dots,
  relu, times w[t, h], accumulated in fp32 registers. Tiles past every row's visible count only write -inf.
* ``_index_scores_group_kernel`` (decode, <= 4 queries per sequence): program = (group of G queries of one
  sequence, a run of N tiles). Keys are the M dimension and the G * H query heads the N dimension:
  [BLOCK_N, 128] x [128, G * H] per key tile, relu, times w, summed over heads; q stays on chip while the
  program streams its key tiles (memory bound).

Host metadata (one device->host sync for the number of tiles): queries are stably sorted by sequence and
cut into tiles that never mix sequences; each tile records (sequence, first sorted row, number of rows).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...cache import check_pool
from ...formats import ENTRIES_PER_PAGE, INDEX_HEAD_DIM, KeyFormat
from .reference import check_batch, check_queries

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
def _load_key_scales(scales_ptr, pages, slot, valid, D: tl.constexpr):
    """fp8 per-entry fp32 scales [BLOCK_N] (scales_ptr is the fp32 view of the pool)."""
    page_words = (64 * D + 64 * 4) // 4
    return tl.load(scales_ptr + pages * page_words + (64 * D) // 4 + slot, mask=valid, other=0.0)


@triton.jit
def _index_scores_tile_kernel(
    q_ptr, w_ptr, q_scale_ptr, values_ptr, scales_ptr, block_table_ptr, counts_ptr, pos_ptr, rows_ptr,
    tile_seq_ptr, tile_start_ptr, tile_len_ptr, out_ptr,
    width, ratio, stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh, stride_bt, stride_out,
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
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    count = tl.load(counts_ptr + seq)

    offs_t = tl.arange(0, BLOCK_T)
    row_ok = offs_t < length
    rows = tl.load(rows_ptr + first + offs_t, mask=row_ok, other=0).to(tl.int64)  # [BLOCK_T] original rows
    if HAS_POS:
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int32)
        visible = tl.minimum(tl.maximum((pos + 1) // ratio, 0), count)  # (pos+1) <= 0 gives <= 0 -> 0
    else:
        visible = tl.zeros([BLOCK_T], dtype=tl.int32) + count
    visible = tl.where(row_ok, visible, 0)
    tile_visible = tl.max(visible, axis=0)

    offs_n = n_start + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
    store_mask = row_ok[:, None] & (offs_n[None, :] < width)

    if n_start < tile_visible:
        entry_ok = offs_n < tile_visible
        pages = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + offs_n // 64, mask=entry_ok,
                        other=0).to(tl.int64)
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
    width, ratio, stride_qt, stride_qh, stride_wt, stride_wh, stride_st, stride_sh, stride_bt, stride_out,
    HAS_POS: tl.constexpr, HAS_Q_SCALE: tl.constexpr, KIND: tl.constexpr,
    FP8_DOT: tl.constexpr, GROUP: tl.constexpr, H: tl.constexpr, BLOCK_N: tl.constexpr,
    TILES_PER_PROGRAM: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr,
):
    # grid: (query groups, cdiv(width, BLOCK_N * TILES_PER_PROGRAM))
    # dot per key tile: keys [BLOCK_N, D] (M) x q^T [D, GROUP * H] (N, column c = g * H + h); the head sum is
    # then a reduction along the dot's N axis, which stays inside a thread quad.
    group = tl.program_id(0)
    seq = tl.load(tile_seq_ptr + group)
    first = tl.load(tile_start_ptr + group)
    length = tl.load(tile_len_ptr + group)
    count = tl.load(counts_ptr + seq)

    offs_g = tl.arange(0, GROUP)
    g_ok = offs_g < length
    g_rows = tl.load(rows_ptr + first + offs_g, mask=g_ok, other=0).to(tl.int64)  # [GROUP]
    if HAS_POS:
        pos = tl.load(pos_ptr + g_rows, mask=g_ok, other=0).to(tl.int32)
        visible = tl.minimum(tl.maximum((pos + 1) // ratio, 0), count)
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
                              KIND, FP8_DOT, GROUP, H, BLOCK_N, D, INTERPRET)
    else:
        # tiles holding visible entries: a counted loop without a branch inside, so the key loads pipeline
        busy_tiles = tl.minimum(tl.maximum(tl.cdiv(group_visible - chunk_start, BLOCK_N), 0), TILES_PER_PROGRAM)
        for i in range(0, busy_tiles):
            _score_group_tile(chunk_start + i * BLOCK_N, q_t, w, seq, g_rows, g_ok, visible, group_visible,
                              values_ptr, scales_ptr, block_table_ptr, out_ptr, width, stride_bt, stride_out,
                              KIND, FP8_DOT, GROUP, H, BLOCK_N, D, INTERPRET)
        for i in range(busy_tiles, TILES_PER_PROGRAM):
            offs_n = chunk_start + i * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(out_ptr + g_rows[None, :] * stride_out + offs_n[:, None],
                     tl.full([BLOCK_N, GROUP], float("-inf"), tl.float32),
                     mask=g_ok[None, :] & (offs_n[:, None] < width))


@triton.jit
def _score_group_tile(n_start, q_t, w, seq, g_rows, g_ok, visible, group_visible,
                      values_ptr, scales_ptr, block_table_ptr, out_ptr, width, stride_bt, stride_out,
                      KIND: tl.constexpr, FP8_DOT: tl.constexpr, GROUP: tl.constexpr, H: tl.constexpr,
                      BLOCK_N: tl.constexpr, D: tl.constexpr, INTERPRET: tl.constexpr):
    """Scores of one key tile (entries n_start ..+BLOCK_N) for a query group: store [BLOCK_N, GROUP] columns."""
    offs_n = n_start + tl.arange(0, BLOCK_N)
    entry_ok = offs_n < group_visible
    pages = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + offs_n // 64, mask=entry_ok,
                    other=0).to(tl.int64)
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


@dataclass(frozen=True)
class QueryTiles:
    """Queries stably sorted by sequence and cut into tiles of at most ``size`` rows of one sequence.

    rows int32 [T] original row of each sorted position; tile_seq / tile_start / tile_len int32 [num_tiles].
    """

    size: int
    rows: torch.Tensor
    tile_seq: torch.Tensor
    tile_start: torch.Tensor
    tile_len: torch.Tensor
    max_per_sequence: int

    @property
    def num_tiles(self) -> int:
        return int(self.tile_seq.shape[0])


def queries_per_sequence(query_seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """int64 [B]: how many queries each sequence has."""
    return torch.bincount(query_seq.long(), minlength=num_seqs)


def build_query_tiles(query_seq: torch.Tensor, num_seqs: int, size: int,
                      per_seq: torch.Tensor | None = None) -> QueryTiles:
    """Tile metadata for ``query_seq`` [T] (values in 0..num_seqs-1); one host sync for the tile count."""
    device = query_seq.device
    seq = query_seq.long()
    per_seq = queries_per_sequence(seq, num_seqs) if per_seq is None else per_seq
    rows = torch.argsort(seq, stable=True).to(torch.int32)
    tiles_per_seq = (per_seq + size - 1) // size
    num_tiles = int(tiles_per_seq.sum())
    max_per_sequence = int(per_seq.max()) if per_seq.numel() else 0
    tile_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), tiles_per_seq,
                                       output_size=num_tiles)
    seq_first_row = torch.cumsum(per_seq, 0) - per_seq
    seq_first_tile = torch.cumsum(tiles_per_seq, 0) - tiles_per_seq
    tile_in_seq = torch.arange(num_tiles, device=device) - seq_first_tile[tile_seq]
    tile_start = seq_first_row[tile_seq] + tile_in_seq * size
    tile_len = torch.clamp(per_seq[tile_seq] - tile_in_seq * size, max=size)
    return QueryTiles(size, rows, tile_seq.to(torch.int32), tile_start.to(torch.int32),
                      tile_len.to(torch.int32), max_per_sequence)


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


def _check_pages(block_table: torch.Tensor, entry_counts: torch.Tensor, num_pages: int) -> None:
    """Every page a sequence's entries need must be a valid page id (else the kernel would read outside)."""
    if block_table.numel() == 0:
        return
    needed = (entry_counts.long() + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE  # [B]
    used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < needed[:, None]
    bad = used & ((block_table < 0) | (block_table >= num_pages))
    if bool(bad.any()):
        b, p = (int(v) for v in torch.nonzero(bad)[0])
        raise ValueError(f"block_table[{b}, {p}] = {int(block_table[b, p])} is not a page of the pool "
                         f"(0..{num_pages - 1}) but sequence {b} needs it for its {int(entry_counts[b])} entries")


def _visible_counts(entry_counts: torch.Tensor, query_seq: torch.Tensor, query_positions: torch.Tensor | None,
                    ratio: int) -> torch.Tensor:
    counts = entry_counts.long()[query_seq.long()]
    if query_positions is None:
        return counts
    return torch.minimum(counts, torch.div(query_positions.long() + 1, ratio, rounding_mode="floor").clamp(min=0))


def _pick_kernel(num_heads: int, max_per_sequence: int) -> str:
    """Group kernel (heads as the dot's M) for decode-like batches, tile kernel otherwise."""
    heads_ok = num_heads >= 16 and num_heads & (num_heads - 1) == 0
    if heads_ok and max_per_sequence <= 4 and max_per_sequence * num_heads <= 256:
        return "group"
    return "tile"


def index_scores_triton(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: "KeyFormat | str",
                        block_table: torch.Tensor, entry_counts: torch.Tensor, query_seq: torch.Tensor,
                        query_positions: torch.Tensor | None = None, ratio: int = 1, *,
                        out: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
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

    kernel / block_t / block_n / num_warps / num_stages / tiles_per_program: tuning overrides (benchmarks and
    tests); ``kernel`` is "auto", "tile" (prefill) or "group" (decode, <= 4 queries per sequence).
    """
    fmt = KeyFormat.parse(fmt)
    check_queries(q, weights, INDEX_HEAD_DIM)
    check_pool(pool, fmt)
    t, num_heads, d = q.shape
    check_batch(block_table, entry_counts, query_seq, t, query_positions, ratio)
    if q.dtype not in _Q_DTYPES:
        raise ValueError(f"q dtype must be one of {[str(x) for x in _Q_DTYPES]}, got {q.dtype}")
    if not weights.is_floating_point() or weights.dtype in _FP8_Q_DTYPES:
        raise ValueError(f"weights must be fp32 / fp16 / bf16, got {weights.dtype}")
    device = q.device
    tensors = {"weights": weights, "pool": pool, "block_table": block_table, "entry_counts": entry_counts,
               "query_seq": query_seq}
    if query_positions is not None:
        tensors["query_positions"] = query_positions
    if q_scale is not None:
        if not isinstance(q_scale, torch.Tensor) or q_scale.shape != (t, num_heads) or q_scale.dtype != torch.float32:
            raise ValueError(f"q_scale must be fp32 [T, H] = [{t}, {num_heads}], got "
                             f"{getattr(q_scale, 'dtype', type(q_scale).__name__)} {list(getattr(q_scale, 'shape', []))}")
        if t and not bool((q_scale > 0).all()):
            raise ValueError("q_scale must be > 0 everywhere (it is moved through the relu: relu(c x) = c relu(x))")
        tensors["q_scale"] = q_scale
    if out is not None:
        tensors["out"] = out
    for name, tensor in tensors.items():
        if tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {device}; put every input on one device")
    if kernel not in ("auto", "tile", "group"):
        raise ValueError(f"kernel must be 'auto', 'tile' or 'group', got {kernel!r}")
    _check_pages(block_table, entry_counts, pool.shape[0])

    num_seqs = block_table.shape[0]
    visible = _visible_counts(entry_counts, query_seq, query_positions, ratio) if t else None
    if out is None:
        width = int(entry_counts.max()) if entry_counts.numel() else 0
        out = torch.empty(t, width, dtype=torch.float32, device=device)
    else:
        if out.dtype != torch.float32 or out.dim() != 2 or out.shape[0] < t or (out.shape[1] > 1 and out.stride(1) != 1):
            raise ValueError(f"out must be fp32 [>= {t}, W'] with unit column stride, got {out.dtype} "
                             f"{list(out.shape)} strides {list(out.stride())}")
        width = out.shape[1]
        if t and int(visible.max()) > width:
            raise ValueError(f"out has {width} columns but a query sees {int(visible.max())} entries; "
                             f"W' must be >= every row's visible count")
    result = out[:t]
    if t == 0 or width == 0:
        return result

    if q.dtype in (torch.float32, torch.float16):
        # Rounded once here (nearest even) rather than in the kernel: the interpreter truncates in-kernel
        # fp32 -> bf16 casts, and every head of every key tile would otherwise repeat the conversion.
        q = q.to(torch.bfloat16)
    if q.stride(2) != 1:
        q = q.contiguous()
    fp8_q = q.dtype in _FP8_Q_DTYPES
    fp8_dot = fp8_q and fmt.kind == "fp8"
    values_view, scales_view = _pool_views(pool, fmt)
    per_seq = queries_per_sequence(query_seq, num_seqs)
    max_per_sequence = int(per_seq.max())
    choice = _pick_kernel(num_heads, max_per_sequence) if kernel == "auto" else kernel
    has_pos = query_positions is not None
    pos_arg = query_positions if has_pos else entry_counts  # any int tensor; never read when HAS_POS is False
    qs_arg = q_scale if q_scale is not None else weights
    qs_strides = (q_scale.stride(0), q_scale.stride(1)) if q_scale is not None else (0, 0)
    common = dict(HAS_POS=has_pos, HAS_Q_SCALE=q_scale is not None, KIND=_KIND_CODE[fmt.kind],
                  FP8_DOT=fp8_dot, D=d, INTERPRET=_interpreting())

    if choice == "group":
        if num_heads & (num_heads - 1) or num_heads < 16:
            raise ValueError(f"kernel='group' needs a power-of-two head count >= 16, got H = {num_heads}")
        group = max(1, triton.next_power_of_2(max_per_sequence))
        if group > 4:
            raise ValueError(f"kernel='group' handles at most 4 queries per sequence, got {max_per_sequence}")
        tiles = build_query_tiles(query_seq, num_seqs, group, per_seq)
        bn = block_n or 64
        per_program = tiles_per_program or max(1, min(8, triton.cdiv(width, bn * 4)))
        grid = (tiles.num_tiles, triton.cdiv(width, bn * per_program))
        _index_scores_group_kernel[grid](
            q, weights, qs_arg, values_view, scales_view, block_table, entry_counts, pos_arg, tiles.rows,
            tiles.tile_seq, tiles.tile_start, tiles.tile_len, out,
            width, ratio, q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), *qs_strides,
            block_table.stride(0), out.stride(0),
            GROUP=group, H=num_heads, BLOCK_N=bn, TILES_PER_PROGRAM=per_program,
            num_warps=num_warps or 4, num_stages=num_stages or 2, **common)
        return result

    bt = block_t or max(16, min(128, triton.next_power_of_2(max_per_sequence)))
    bn = block_n or 128
    tiles = build_query_tiles(query_seq, num_seqs, bt, per_seq)
    grid = (tiles.num_tiles * triton.cdiv(width, bn),)
    _index_scores_tile_kernel[grid](
        q, weights, qs_arg, values_view, scales_view, block_table, entry_counts, pos_arg, tiles.rows,
        tiles.tile_seq, tiles.tile_start, tiles.tile_len, out,
        width, ratio, q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), *qs_strides,
        block_table.stride(0), out.stride(0),
        H=num_heads, BLOCK_T=bt, BLOCK_N=bn, num_warps=num_warps or (8 if bt * bn >= 128 * 128 else 4),
        num_stages=num_stages or 3, **common)
    return result


def index_scores_decode(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: "KeyFormat | str",
                        block_table: torch.Tensor, entry_counts: torch.Tensor,
                        query_positions: torch.Tensor | None = None, ratio: int = 1, *,
                        out: torch.Tensor | None = None, q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode scores: q [B, next_n, H, 128], weights [B * next_n, H] or [B, next_n, H] -> fp32 [B * next_n, W].

    Row b * next_n + i is query i of sequence b. query_positions int [B, next_n] (or [B * next_n]) or None
    (every cached entry visible); q_scale fp32 [B * next_n, H] or [B, next_n, H]. Thin wrapper over
    :func:`index_scores_triton` with query_seq = repeat_interleave(arange(B), next_n).
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be [B, next_n, H, D], got "
                         f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    b, next_n, h, d = q.shape
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be [B = {b}, max_pages], got {list(block_table.shape)}")
    rows = b * next_n
    if weights.shape not in ((rows, h), (b, next_n, h)):
        raise ValueError(f"weights must be [B * next_n, H] = [{rows}, {h}] or [B, next_n, H], got {list(weights.shape)}")
    if query_positions is not None and query_positions.shape not in ((b, next_n), (rows,)):
        raise ValueError(f"query_positions must be [B, next_n] = [{b}, {next_n}] or [B * next_n], "
                         f"got {list(query_positions.shape)}")
    if q_scale is not None and q_scale.shape not in ((rows, h), (b, next_n, h)):
        raise ValueError(f"q_scale must be [B * next_n, H] or [B, next_n, H], got {list(q_scale.shape)}")
    query_seq = torch.arange(b, device=q.device, dtype=torch.int32).repeat_interleave(next_n)
    return index_scores_triton(
        q.reshape(rows, h, d), weights.reshape(rows, h), pool, fmt, block_table, entry_counts, query_seq,
        None if query_positions is None else query_positions.reshape(rows), ratio, out=out,
        q_scale=None if q_scale is None else q_scale.reshape(rows, h))


def flops(visible_pairs: int, num_heads: int, head_dim: int = INDEX_HEAD_DIM) -> int:
    """Logit FLOPs for ``visible_pairs`` (query, visible entry) pairs: 2 * H * D each."""
    return 2 * num_heads * head_dim * int(visible_pairs)


__all__ = ["index_scores_triton", "index_scores_decode", "build_query_tiles", "QueryTiles", "flops"]
