"""Launch code of the sparse-attention Triton kernels (``_kernels.py``).

Work decomposition: one program per (query, block of 64 heads, split). Prefill (many queries) uses one
split, so each program streams its whole index set and writes the final output. Decode (few queries) would
leave most SMs idle, so the index set of each query is cut into ``num_splits`` contiguous ranges of tiles
(main and extra index sets each), every split writes a partial (out, lse) in fp32, and a small second kernel
merges them by log-sum-exp and applies the sink. Neither path synchronizes with the host or allocates
more than the outputs and the partial buffers.
"""

from __future__ import annotations

import functools

import torch

from ...pool import num_slots
from ...formats import AttentionKVFormat
from .._backend import triton_interpreted
from ._kernels import _sparse_attention_combine_kernel, _sparse_attention_kernel
from .reference import SparseAttentionInputs

LOG2E = 1.4426950408889634
TRITON_HEADS = (64, 128)
BLOCK_H = 64


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tiles(k: int, block_n: int) -> int:
    return -(-k // block_n)


def choose_num_splits(num_queries: int, num_heads: int, tiles: int, device: torch.device) -> int:
    """Splits per query so that the (query, head block, split) programs fill the SMs about once."""
    if device.type != "cuda":
        return 1
    programs = num_queries * (num_heads // BLOCK_H)
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms or tiles <= 1:
        return 1
    return max(1, min(tiles, sms // programs))


# Pipeline stages per (main-pool format, Hq), measured on the H200 (benchmarks/bench_attention.py sweep):
# with 128 heads the two head blocks of a query run side by side and the cp.async pipeline (2 stages) pays
# off; with 64 heads, and for the fp8 dequantization in registers, gathering straight through registers
# (1 stage, no shared-memory double buffer) is faster.
DEFAULT_STAGES: dict[tuple[str, int], int] = {
    ("bf16", 64): 1, ("bf16", 128): 2, ("fp8-rope-bf16", 64): 1, ("fp8-rope-bf16", 128): 1,
}


def _is_fp8(fmt: AttentionKVFormat) -> bool:
    return fmt.kind == "fp8-rope-bf16"


def sparse_attention_triton(a: SparseAttentionInputs, *, num_splits: int | None = None, block_n: int = 64,
                            num_warps: int = 8, num_stages: int | None = None,
                            dv_split: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs -> (out [T, Hq, 512] in q.dtype, lse fp32 [T, Hq]).

    ``num_splits`` None = automatic (``choose_num_splits``); ``num_stages`` None = ``DEFAULT_STAGES``.
    ``block_n`` (gathered rows per tile), ``num_warps`` and ``num_stages`` are tuning knobs for benchmarks;
    one program holds a [64, 512] fp32 accumulator, so 8 warps is the only count without heavy spills.
    ``dv_split=2`` (experimental, not the default, not yet timed on a GPU): two programs per (query, head block),
    each owning 256 of the 512 output dims (half the accumulator, so with ``num_warps=4`` and ``block_n=32``
    two programs fit on an SM and can hide each other's gathers) and both computing the full q . kv."""
    q = a.q
    t, hq, d = q.shape
    if dv_split not in (1, 2) or isinstance(dv_split, bool):
        raise ValueError(f"dv_split must be 1 or 2, got {dv_split!r}")
    if hq not in TRITON_HEADS:
        raise ValueError(f"the Triton kernel supports Hq in {TRITON_HEADS}, got q {list(q.shape)}; "
                         f"use backend='reference'")
    if q.stride(2) != 1:
        q = q.contiguous()  # an input read, not a cache write: a copy is harmless
    indices = a.indices if a.indices.stride(-1) == 1 else a.indices.contiguous()
    k = indices.shape[1]
    has_extra = a.extra_kv_cache is not None
    xindices = None
    xk = 0
    if has_extra:
        xindices = a.extra_indices if a.extra_indices.stride(-1) == 1 else a.extra_indices.contiguous()
        xk = xindices.shape[1]
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    main_tiles, extra_tiles = _tiles(k, block_n), _tiles(xk, block_n)
    if num_splits is None:
        num_splits = choose_num_splits(t, hq, max(main_tiles + extra_tiles, 1), q.device)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    sink = a.sink.float().contiguous() if a.sink is not None else None
    if num_splits > 1:
        part_out = torch.empty(num_splits, t, hq, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_splits, t, hq, dtype=torch.float32, device=q.device)
        dst_out, dst_lse = part_out, part_lse
    else:
        dst_out, dst_lse = out, lse
    fmt, xfmt = a.kv_format, a.extra_kv_format or a.kv_format
    if num_stages is None:
        num_stages = DEFAULT_STAGES[(fmt.kind, hq)]
    dummy = indices
    tiles_per_split, xtiles_per_split = _tiles(main_tiles, num_splits), _tiles(extra_tiles, num_splits)
    interp = triton_interpreted() and not q.is_cuda
    grid = (t * (hq // BLOCK_H) * num_splits * dv_split,)
    _sparse_attention_kernel[grid](
        q, q.stride(0), q.stride(1),
        a.kv_cache, num_slots(a.kv_cache), indices, indices.stride(0), k,
        a.topk_length if a.topk_length is not None else dummy,
        a.extra_kv_cache if has_extra else a.kv_cache, num_slots(a.extra_kv_cache) if has_extra else 0,
        xindices if has_extra else dummy, xindices.stride(0) if has_extra else 0, xk,
        a.extra_topk_length if a.extra_topk_length is not None else dummy,
        sink if sink is not None else lse,
        dst_out, dst_lse,
        t, a.softmax_scale * LOG2E, tiles_per_split, xtiles_per_split,
        HQ=hq, BLOCK_H=BLOCK_H, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        FP8=_is_fp8(fmt), PAGE_BYTES=fmt.page_bytes, XFP8=_is_fp8(xfmt), XPAGE_BYTES=xfmt.page_bytes,
        HAS_LEN=a.topk_length is not None, HAS_EXTRA=has_extra, HAS_XLEN=a.extra_topk_length is not None,
        HAS_SINK=sink is not None,
        DV_SPLIT=dv_split, INTERPRET=interp, INTERP_TILES=tiles_per_split if interp else 0,
        INTERP_XTILES=xtiles_per_split if interp else 0,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        combine_block_h = 16
        _sparse_attention_combine_kernel[(t * (hq // combine_block_h),)](
            part_out, part_lse, sink if sink is not None else lse, out, lse, t, num_splits,
            HQ=hq, BLOCK_H=combine_block_h, HAS_SINK=sink is not None, INTERPRET=interp, num_warps=4,
        )
    return out, lse
