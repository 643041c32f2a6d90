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

from ..._memory import check_instance
from ...pool import num_slots
from ...formats import AttentionKVFormat
from .._backend import triton_interpreted
from ._kernels import _sparse_attention_combine_kernel, _sparse_attention_kernel
from .config import ATTENTION_DEFAULTS, HEAD_BLOCK, TRITON_HEADS, AttentionConfig
from .reference import SparseAttentionInputs

LOG2E = 1.4426950408889634
BLOCK_H = HEAD_BLOCK
# the H200 stage table (read it from AttentionConfig.for_device(device).stages; kept for the benchmarks)
DEFAULT_STAGES: dict[tuple[str, int], int] = ATTENTION_DEFAULTS["H200"].stages

__all__ = ["sparse_attention_triton", "choose_num_splits", "AttentionConfig", "TRITON_HEADS"]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _device_sm_count(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _tiles(k: int, block_n: int) -> int:
    return -(-k // block_n)


def choose_num_splits(num_queries: int, num_heads: int, tiles: int, device: torch.device,
                      config: AttentionConfig | None = None) -> int:
    """Splits per query of the device's config (:meth:`AttentionConfig.splits_for`)."""
    config = AttentionConfig.for_device(device) if config is None else config
    return config.splits_for(num_queries, num_heads, tiles, _device_sm_count(device))


def _is_fp8(fmt: AttentionKVFormat) -> bool:
    return fmt.kind == "fp8-rope-bf16"


def sparse_attention_triton(a: SparseAttentionInputs, config: AttentionConfig | None = None,
                            **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs -> (out [T, Hq, 512] in q.dtype, lse fp32 [T, Hq]).

    Every launch setting comes from ``config`` (default: :meth:`AttentionConfig.for_device` of q's device);
    ``overrides`` (block_n, num_warps, num_stages, num_splits, dv_split, ...: fields of AttentionConfig) replace
    single settings of it, for benchmarks and tests."""
    if config is None:
        config = AttentionConfig.for_device(a.q.device)
    else:
        check_instance("config", config, AttentionConfig, label="AttentionConfig or None")
    if overrides:
        config = config.replace(**overrides)
    block_n, dv_split = config.block_n, config.dv_split
    q = a.q
    t, hq, d = q.shape
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
    num_splits = choose_num_splits(t, hq, max(main_tiles + extra_tiles, 1), q.device, config)
    sink = a.sink.float().contiguous() if a.sink is not None else None
    if num_splits > 1:
        part_out = torch.empty(num_splits, t, hq, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_splits, t, hq, dtype=torch.float32, device=q.device)
        dst_out, dst_lse = part_out, part_lse
    else:
        dst_out, dst_lse = out, lse
    fmt, xfmt = a.kv_format, a.extra_kv_format or a.kv_format
    num_stages = config.stages_for(fmt.kind, hq)
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
        num_warps=config.num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        combine_block_h = config.combine_block_h
        _sparse_attention_combine_kernel[(t * (hq // combine_block_h),)](
            part_out, part_lse, sink if sink is not None else lse, out, lse, t, num_splits,
            HQ=hq, BLOCK_H=combine_block_h, HAS_SINK=sink is not None, INTERPRET=interp, num_warps=config.combine_warps,
        )
    return out, lse
