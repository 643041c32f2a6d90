"""What the two sparse-attention kernels share at launch (the portable one, ``triton.py``, and the Gluon sm_90
one, ``gluon.py``): the split count, the contiguous inputs, the outputs and split partials
(:class:`LaunchPlan`), and the merge of the splits by the combine kernel (``_kernels.py``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._kernels import _sparse_attention_combine_kernel
from .config import TRITON_HEADS, AttentionConfig
from .inputs import SparseAttentionInputs

LOG2E = 1.4426950408889634

__all__ = ["LaunchPlan", "plan_launch", "merge_splits", "choose_num_splits", "LOG2E"]


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



@dataclass
class LaunchPlan:
    """What both attention kernels (portable and Gluon) are launched with: contiguous q / indices, the outputs,
    the split count and the buffers the splits write (the outputs themselves for one split)."""

    q: torch.Tensor
    t: int
    hq: int
    indices: torch.Tensor
    k: int
    xindices: torch.Tensor  # the main indices when there is no extra pool (never read then)
    xk: int
    topk_length: torch.Tensor  # a dummy int32 tensor where absent (HAS_LEN False)
    extra_topk_length: torch.Tensor
    sink: torch.Tensor | None
    sink_arg: torch.Tensor  # sink, or a dummy fp32 tensor
    out: torch.Tensor
    lse: torch.Tensor
    num_splits: int
    tiles_per_split: int
    xtiles_per_split: int
    dst_out: torch.Tensor
    dst_lse: torch.Tensor


def plan_launch(a: SparseAttentionInputs, config: AttentionConfig, block_n: int) -> LaunchPlan:
    """Checked inputs -> :class:`LaunchPlan` for a kernel gathering ``block_n`` rows per tile (ValueError for
    a head count the kernels do not take)."""
    q = a.q
    t, hq, d = q.shape
    if hq not in TRITON_HEADS:
        raise ValueError(f"the Triton kernel supports Hq in {TRITON_HEADS}, got q {list(q.shape)}; "
                         f"use backend='reference'")
    if q.stride(2) != 1:
        q = q.contiguous()  # an input read, not a cache write: a copy is harmless
    indices = a.indices if a.indices.stride(-1) == 1 else a.indices.contiguous()
    k = indices.shape[1]
    xindices, xk = indices, 0
    if a.extra_kv_cache is not None:
        xindices = a.extra_indices if a.extra_indices.stride(-1) == 1 else a.extra_indices.contiguous()
        xk = xindices.shape[1]
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    main_tiles, extra_tiles = _tiles(k, block_n), _tiles(xk, block_n)
    num_splits = choose_num_splits(t, hq, max(main_tiles + extra_tiles, 1), q.device, config) if t else 1
    dst_out, dst_lse = out, lse
    if num_splits > 1:
        dst_out = torch.empty(num_splits, t, hq, d, dtype=torch.float32, device=q.device)
        dst_lse = torch.empty(num_splits, t, hq, dtype=torch.float32, device=q.device)
    sink = a.sink.float().contiguous() if a.sink is not None else None
    return LaunchPlan(
        q=q, t=t, hq=hq, indices=indices, k=k, xindices=xindices, xk=xk,
        topk_length=a.topk_length if a.topk_length is not None else indices,
        extra_topk_length=a.extra_topk_length if a.extra_topk_length is not None else indices,
        sink=sink, sink_arg=sink if sink is not None else lse, out=out, lse=lse, num_splits=num_splits,
        tiles_per_split=_tiles(main_tiles, num_splits), xtiles_per_split=_tiles(extra_tiles, num_splits),
        dst_out=dst_out, dst_lse=dst_lse)


def merge_splits(plan: LaunchPlan, config: AttentionConfig, interp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out, lse) of ``plan``: the split partials merged by log-sum-exp (with the sink) when there are
    several splits; the kernel's own outputs otherwise."""
    if plan.num_splits > 1:
        combine_block_h = config.combine_block_h
        _sparse_attention_combine_kernel[(plan.t * (plan.hq // combine_block_h),)](
            plan.dst_out, plan.dst_lse, plan.sink_arg, plan.out, plan.lse, plan.t, plan.num_splits,
            HQ=plan.hq, BLOCK_H=combine_block_h, HAS_SINK=plan.sink is not None, INTERPRET=interp,
            num_warps=config.combine_warps,
        )
    return plan.out, plan.lse
