"""Triton kernels for the lightning-indexer scores, reading keys straight from the paged cache.

Same math and masking as :func:`dsakit.ops.indexer.reference.index_scores` (the spec)::

    S[t, j] = sum_h w[t, h] * q_scale[t, h] * relu(q[t, h, :] . k[j, :])       fp32 accumulation
    entry j visible to query t  iff  j < entry_counts[seq(t)] and j < (pos[t] + 1) // ratio
    invisible entries score -inf

Keys are dequantized in registers from the page layout of :mod:`dsakit.formats` (page = 64 entries, values
of all entries then scales of all entries):

    bf16  values bf16 [64, 128]                                   -> bf16 operand as stored
    fp8   values e4m3fn [64, 128], scales fp32 [64]               -> e4m3 operand; the per-entry scale c > 0
          multiplies the head-summed score per column (relu(c x) = c relu(x))
    fp4   values uint8 [64, 64] (low nibble = even element),      -> bf16 operand: e2m1 magnitude x 2^(s - 127),
          scales ue8m0 [64, 4] (one per 32 elements)                 exact in bf16 (<= 2 significant bits);
                                                                     decode (ScoresConfig.decode_fp4 "blocks"):
                                                                     per 32-element block an e4m3 operand (the
                                                                     e2m1 bits placed in e4m3 bits = value x 2^-6),
                                                                     the block scale per entry on that block's dot

Tensor-core operands (documented numerical semantics, tested against the reference run on the same
rounded inputs with a tight bound):

    q dtype        key format   dot operands                   rounding versus the fp32 reference
    fp8 e4m3       fp8          e4m3 x e4m3 (fp8 tensor cores)  products exact; Hopper's fp8 wgmma accumulates
                                                                with fewer than fp32 mantissa bits (measured
                                                                relative L2 6e-5 on the H200); exact under the
                                                                interpreter
    fp8 e4m3       fp4 decode   e4m3 x e4m3 per 32-dim block    as fp8 keys (the default decode_fp4 "blocks")
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

Host side: the batch is a validated :class:`dsakit.PagedBatch`, so nothing of it is checked again. Queries
are stably sorted by sequence and cut into tiles that never mix sequences (:class:`QueryTiles`). A batch
that knows its queries per sequence on the host (every validated batch) gets its tile plan without a
device->host sync, cached by shape; :func:`plan_query_tiles` builds one from a device ``query_seq`` with one
sync. The kernels clamp every page id and block-table column, so even an unchecked batch
(``PagedBatch.build(validate=False)``) never causes an out-of-bounds access. Kernels: ``_kernels.py``;
tuning: :class:`dsakit.ops.indexer.config.ScoresConfig`.
"""

from __future__ import annotations

import functools

import torch
import triton

from ..._memory import check_instance
from ...batch import PagedBatch, check_batch, check_same_device
from ...formats import INDEX_HEAD_DIM, key_codec
from ...formats.codes import KeyCode
from .._backend import triton_interpreted
from ._kernels import (_index_scores_group_kernel, _index_scores_group_tma_kernel, _index_scores_tile_kernel,
                       _page_term_group_kernel, _page_term_tile_kernel)
from .config import Launch, ScoresConfig
from .inputs import check_q_inputs, check_q_scale_values, decode_rows
from .plans import QueryTiles, _group_kernel_fits, plan_batch_tiles, plan_decode_tiles

try:  # host-side tensor descriptors (bulk copies) arrived in triton 3.3; older versions gather
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - the pinned triton has it
    TensorDescriptor = None

_FP8_Q_DTYPES = (torch.float8_e4m3fn,)

# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


def prepare_q(q: torch.Tensor) -> torch.Tensor:
    """q in a dtype the kernels read at unit stride along D (fp32 / fp16 rounded once to bf16)."""
    if q.dtype in (torch.float32, torch.float16):
        # Rounded once here (nearest even) rather than in the kernel: the interpreter truncates in-kernel
        # fp32 -> bf16 casts, and every head of every key tile would otherwise repeat the conversion.
        q = q.to(torch.bfloat16)
    return q if q.stride(2) == 1 else q.contiguous()


def _tma_pages(codec, fp8_dot: bool, pool: torch.Tensor, config: ScoresConfig) -> bool:
    """Whether the group kernel can read this pool's keys page by page with bulk tensor copies: fp8 entries
    (plain or page-centred residuals) with e4m3 queries (the page's 64 x 128 key bytes are one box at byte 0)
    or fp4 entries read by blocks (the page's 64 x 64 packed bytes, four boxes of 16 columns), a GPU with the
    tensor memory accelerator (sm_90+; the interpreter emulates it) and row coordinates that fit the copy's
    int32. The copy's 16-byte alignment rule is the batch's guarantee (``check_pool``)."""
    if TensorDescriptor is None:
        return False
    if codec.entry_code == KeyCode.FP8:
        if not fp8_dot:
            return False
    elif codec.entry_code != KeyCode.FP4 or config.decode_fp4 != "blocks":
        return False
    row_bytes = _tma_row_bytes(codec)
    if pool.shape[1] % row_bytes or pool.shape[0] * (pool.shape[1] // row_bytes) >= 2 ** 31:
        return False
    if triton_interpreted():
        return True
    return pool.is_cuda and _has_tma(pool.device.index if pool.device.index is not None else
                                     torch.cuda.current_device())


def _tma_row_bytes(codec) -> int:
    """Bytes of one entry's key values: the row width of the TMA view of the pool (fp8 128, fp4 64)."""
    return INDEX_HEAD_DIM // 2 if codec.entry_code == KeyCode.FP4 else INDEX_HEAD_DIM


def _launch_options(launch: Launch) -> dict:
    """The launch's warps, stages and register cap (no cap under the interpreter)."""
    options = {"num_warps": launch.warps, "num_stages": launch.stages}
    if launch.maxnreg is not None and not triton_interpreted():
        options["maxnreg"] = launch.maxnreg
    return options


@functools.lru_cache(maxsize=None)
def _has_tma(device_index: int) -> bool:
    """sm_90+ (asked once per device: the answer cannot change, and decode launches every step)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _check_page_term_tile(codec, fmt, launch: Launch) -> None:
    """The scores kernels add the page terms of at most two pages per key tile (BLOCK_N <= 128)."""
    if codec.page_term and launch.block_n > 128:
        raise ValueError(f"{fmt.name} keys take key tiles of at most 128 entries (two pages), got block_n = "
                         f"{launch.block_n}")


def page_term_buffer(kernel: str, rows: int, width: int, num_heads: int, device) -> tuple[torch.Tensor, tuple]:
    """The page-term buffer of a launch: fp32 q . c per (sorted query position s, page column p, head h) for
    ``rows`` queries and the cdiv(width, 64) page columns of ``width`` score columns, with its strides
    (stride_s, stride_p, stride_h) in the order the kernel reads it: tile plans [pages, H, rows] (a head's
    rows contiguous), group plans [pages, rows, H] (a group's query-head columns contiguous; the group kernels
    rely on this layout). Its size is that of the scores times H / 64 (4 bytes per row, head and page)."""
    pages = -(-width // 64)
    if kernel == "tile":
        buf = torch.empty(pages, num_heads, rows, dtype=torch.float32, device=device)
        return buf, (1, num_heads * rows, rows)
    buf = torch.empty(pages, rows, num_heads, dtype=torch.float32, device=device)
    return buf, (num_heads, rows * num_heads, 1)


def launch_index_scores(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, out: torch.Tensor,
                        tiles: QueryTiles, *, start: int = 0, q_scale: torch.Tensor | None = None,
                        config: ScoresConfig) -> torch.Tensor:
    """Launch the scores kernel for batch rows start .. start + len(q) into out [len(q), W'] (no checks, no
    sync). q from :func:`prepare_q`; ``tiles`` plans exactly these rows. Every launch setting comes from
    ``config`` (:meth:`ScoresConfig.tile_launch`, ``group_launch``, ``tma_launch``, ``page_term_launch``).

    Page-centred formats first run the page-term pass: q . c once per (query, head, page) into a buffer of
    :func:`page_term_buffer`, which the scores kernel adds to each entry's logit before the relu."""
    t, num_heads, d = q.shape
    width = out.shape[1]
    if t == 0 or width == 0 or batch.num_seqs == 0:
        return out
    pool, fmt, table = batch.pool, batch.fmt, batch.block_table
    if pool.shape[0] == 0 or table.shape[1] == 0:
        # No page to read: every entry is invisible (a validated batch has no positive count then). The
        # kernels clamp page ids / columns to num_pages - 1 / max_pages - 1, which would be -1 here.
        return out.fill_(float("-inf"))
    codec = key_codec(fmt)
    name = fmt.name if codec.page_term else fmt.kind
    positions = None if batch.query_positions is None else batch.query_positions[start:start + t]
    fp8_dot = q.dtype in _FP8_Q_DTYPES and codec.fp8_dot
    values_view, scales_view = codec.pool_views(pool)
    has_pos = positions is not None
    pos_arg = positions if has_pos else batch.entry_counts  # any int tensor; never read when HAS_POS is False
    qs_arg = q_scale if q_scale is not None else weights
    qs_strides = (q_scale.stride(0), q_scale.stride(1)) if q_scale is not None else (0, 0)
    if codec.page_term:
        page_terms, pt_strides = page_term_buffer(tiles.kernel, t, width, num_heads, out.device)
    else:
        page_terms, pt_strides = out, (0, 0, 0)  # never read without PAGE_TERM
    args = (q, weights, qs_arg, values_view, scales_view, table, batch.entry_counts, pos_arg, tiles.rows,
            tiles.tile_seq, tiles.tile_start, tiles.tile_len, out,
            width, batch.ratio, pool.shape[0], table.shape[0], table.shape[1],
            q.stride(0), q.stride(1), weights.stride(0), weights.stride(1), *qs_strides,
            table.stride(0), out.stride(0), page_terms, *pt_strides)
    if codec.page_term:
        term = config.page_term_launch(0 if tiles.kernel == "tile" else tiles.size * num_heads)
        grid = (tiles.num_tiles, triton.cdiv(triton.cdiv(width, 64), term.block_n))
        pass_kernel = _page_term_tile_kernel if tiles.kernel == "tile" else _page_term_group_kernel
        size = {"BLOCK_T": tiles.size} if tiles.kernel == "tile" else {"GROUP": tiles.size}
        pass_kernel[grid](*args, HAS_POS=has_pos, CODE=int(codec.code), H=num_heads, PAGE_BLOCK=term.block_n,
                          D=d, INTERPRET=triton_interpreted(), **size, **_launch_options(term))
    common = dict(HAS_POS=has_pos, HAS_Q_SCALE=q_scale is not None, CODE=int(codec.code), FP8_DOT=fp8_dot,
                  H=num_heads, D=d, INTERPRET=triton_interpreted(), PAGE_TERM=codec.page_term)
    columns = tiles.size * num_heads
    if tiles.kernel == "group" and config.decode_loads == "tma" and _tma_pages(codec, fp8_dot, pool, config):
        launch = config.tma_launch(codec.entry_code == KeyCode.FP4, columns, width, codec.page_term)
        grid = (tiles.num_tiles, triton.cdiv(width, 64 * launch.per_program))
        row_bytes = _tma_row_bytes(codec)
        if codec.entry_code == KeyCode.FP4:
            # [P * PAGE_ROWS, 64] bytes: a page's 64 packed value rows, then its scales; one box per scale block
            key_rows = pool.view(torch.uint8).view(-1, row_bytes)
            box = [64, 16]
        else:
            key_rows = pool.view(torch.float8_e4m3fn).view(-1, row_bytes)  # a page's keys, then its scales
            box = [64, row_bytes]
        key_desc = TensorDescriptor(key_rows, list(key_rows.shape), list(key_rows.stride()), box)
        tma_args = args[:3] + (key_desc,) + args[4:]  # the descriptor in place of values_view
        _index_scores_group_tma_kernel[grid](
            *tma_args, HAS_POS=has_pos, HAS_Q_SCALE=q_scale is not None, H=num_heads, GROUP=tiles.size,
            PAGES_PER_PROGRAM=launch.per_program, PAGE_ROWS=fmt.page_bytes // row_bytes, D=d,
            INTERPRET=triton_interpreted(), CODE=int(codec.code), PAGE_TERM=codec.page_term,
            LOOKAHEAD=launch.lookahead, **_launch_options(launch))
        return out
    if tiles.kernel == "group":
        fp4_blocks = codec.entry_code == KeyCode.FP4 and config.decode_fp4 == "blocks"
        launch = config.group_launch(name, columns, width, fp4_blocks)
        _check_page_term_tile(codec, fmt, launch)
        grid = (tiles.num_tiles, triton.cdiv(width, launch.block_n * launch.per_program))
        _index_scores_group_kernel[grid](*args, GROUP=tiles.size, BLOCK_N=launch.block_n,
                                         TILES_PER_PROGRAM=launch.per_program, FP4_BLOCKS=fp4_blocks,
                                         **_launch_options(launch), **common)
        return out
    launch = config.tile_launch(name, tiles.size)
    _check_page_term_tile(codec, fmt, launch)
    grid = (tiles.num_tiles * triton.cdiv(width, launch.block_n),)
    _index_scores_tile_kernel[grid](*args, BLOCK_T=tiles.size, BLOCK_N=launch.block_n, **_launch_options(launch),
                                    **common)
    return out


def index_scores_triton(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, *,
                        out: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
                        tiles: QueryTiles | None = None, config: ScoresConfig | None = None,
                        check_q_scale: bool = True) -> torch.Tensor:
    """Scores of a ragged batch against paged keys, in Triton -> fp32 [T, W], -inf where invisible.

    Semantics of :func:`dsakit.ops.indexer.reference.index_scores`: q [T, H, 128] (fp32 / fp16 / bf16 / fp8
    e4m3fn), weights [T, H], batch a :class:`dsakit.PagedBatch` on q's device (CPU only under
    TRITON_INTERPRET=1).

    q_scale fp32 [T, H] > 0 (optional, typically with fp8 q): folded into the weights,
    S = sum_h w * q_scale * relu(q . k); checking it costs one sync.

    out: optional fp32 [T_out >= T, W'] with unit column stride and W' >= batch.max_entries; rows 0..T-1,
    columns 0..W'-1 are written and out[:T] is returned. Without out, W = batch.max_entries.

    Host cost: shape checks only; the tile plan comes from the batch's host metadata (cached by shape) unless
    ``tiles`` (from :func:`plan_batch_tiles` / :func:`plan_query_tiles` / :func:`plan_decode_tiles` for these
    queries) is given. With ``out`` and no q_scale a call makes no device->host sync (hot loops, CUDA graphs).
    config: launch tuning (:class:`ScoresConfig`; default: the measured table of the GPU).
    """
    check_q_inputs(q, weights, batch, q_scale)
    if check_q_scale:  # a caller that checked it once (hierarchical top-k) skips the sync
        check_q_scale_values(q_scale)
    t, num_heads, _ = q.shape
    config = config or ScoresConfig.for_device(batch.device)
    check_instance("config", config, ScoresConfig)
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or out.dim() != 2 \
                or out.shape[0] < t or (out.shape[1] > 1 and out.stride(1) != 1):
            raise ValueError(f"out must be fp32 [>= {t}, W'] with unit column stride, got "
                             f"{getattr(out, 'dtype', None)} {list(getattr(out, 'shape', []))}")
        if t > 1 and out.shape[1] > 0 and out.stride(0) < out.shape[1]:
            # e.g. an expand()ed row: every query would overwrite the same memory, losing earlier rows' scores
            raise ValueError(f"out rows overlap in memory (row stride {out.stride(0)} < {out.shape[1]} columns)")
        if out.shape[1] < batch.max_entries:
            raise ValueError(f"out has {out.shape[1]} columns but a sequence of the batch has {batch.max_entries} "
                             f"entries; W' must be >= every visible count (batch.max_entries)")
        check_same_device(batch.device, out=out)
    if tiles is not None and (not isinstance(tiles, QueryTiles) or tiles.num_queries != t
                              or tiles.rows.device != q.device):
        raise ValueError(f"tiles must be a QueryTiles plan of these {t} queries on {q.device}")
    if tiles is not None and tiles.kernel == "group" and not _group_kernel_fits(num_heads, tiles.size):
        raise ValueError(f"tiles plan the group kernel, which needs a power-of-two H >= 16, got H = {num_heads}")
    if out is None:
        out = torch.empty(t, batch.max_entries, dtype=torch.float32, device=batch.device)
    result = out[:t]
    if t == 0 or out.shape[1] == 0:
        return result
    if tiles is None:
        tiles = plan_batch_tiles(batch, num_heads, config)
    return launch_index_scores(prepare_q(q), weights, batch, result, tiles, q_scale=q_scale, config=config)


def index_scores_decode(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, *,
                        out: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
                        config: ScoresConfig | None = None) -> torch.Tensor:
    """Decode scores: q [B, next_n, H, 128], weights [B * next_n, H] or [B, next_n, H] -> fp32 [B * next_n, W].

    Row b * next_n + i is query i of sequence b (the batch's rows must be in that order: a batch from
    ``PagedCache.batch(seq_ids, query_lens=[next_n] * B)``). q_scale fp32 [B * next_n, H] or [B, next_n, H].
    The tile plan follows from the shape (no sync); with ``out`` and no q_scale the call makes no sync.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be [B, next_n, H, D], got "
                         f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    b, next_n, h, d = q.shape
    check_batch(batch)
    if next_n < 1:
        raise ValueError(f"next_n must be >= 1, got q of shape {list(q.shape)}")
    if batch.num_seqs != b or (batch.next_n is not None and batch.next_n != next_n):
        raise ValueError(f"q is [B, next_n] = [{b}, {next_n}] but the batch has {batch.num_seqs} sequences"
                         f"{'' if batch.next_n is None else f' of {batch.next_n} queries each'}")
    rows = b * next_n
    return index_scores_triton(
        q.reshape(rows, h, d), decode_rows("weights", weights, b, next_n, h), batch, out=out,
        q_scale=decode_rows("q_scale", q_scale, b, next_n, h), tiles=plan_decode_tiles(b, next_n, h, q.device),
        config=config)


def flops(visible_pairs: int, num_heads: int, head_dim: int = INDEX_HEAD_DIM) -> int:
    """Logit FLOPs for ``visible_pairs`` (query, visible entry) pairs: 2 * H * D each."""
    return 2 * num_heads * head_dim * int(visible_pairs)


__all__ = ["index_scores_triton", "index_scores_decode", "launch_index_scores", "prepare_q", "page_term_buffer",
           "ScoresConfig", "flops"]
