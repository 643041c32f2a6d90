"""Launch code of the sparse-attention Triton kernels (``_kernels.py``).

Work decomposition: one program per (query, block of 64 heads, split). Prefill (many queries) uses one
split, so each program streams its whole index set and writes the final output. Decode (few queries) would
leave most SMs idle, so the index set of each query is cut into ``num_splits`` contiguous ranges of tiles
(main and extra index sets each), every split writes a partial (out, lse) in fp32, and a small second kernel
merges them by log-sum-exp and applies the sink. Neither path synchronizes with the host or allocates
more than the outputs and the partial buffers.
"""

from __future__ import annotations

import torch

from ..._memory import check_instance
from ...pool import num_slots
from ...formats import AttentionKVFormat
from .._backend import GLUON_CAPABILITY, gluon_importable, gluon_platform_reason, triton_interpreted
from .._backend import device_capability as _device_capability
from ._kernels import _sparse_attention_kernel
from ._launch import LOG2E, choose_num_splits, merge_splits, plan_launch
from .config import ATTENTION_DEFAULTS, ATTENTION_KERNELS, HEAD_BLOCK, TRITON_HEADS, AttentionConfig
from .inputs import SparseAttentionInputs

BLOCK_H = HEAD_BLOCK
# the H200 stage table (read it from AttentionConfig.for_device(device).stages; kept for the benchmarks)
DEFAULT_STAGES: dict[tuple[str, int], int] = ATTENTION_DEFAULTS["H200"].stages

__all__ = ["sparse_attention_triton", "choose_num_splits", "choose_attention_kernel", "gluon_importable",
           "AttentionConfig", "TRITON_HEADS"]

def _is_fp8(fmt: AttentionKVFormat) -> bool:
    return fmt.kind == "fp8-rope-bf16"


def gluon_unsupported_reason(a: SparseAttentionInputs, capability: tuple[int, int] | None,
                             importable: bool | None = None) -> str | None:
    """Why the Gluon kernel cannot run these inputs (None: it can). ``capability``: the GPU's (major, minor),
    None off CUDA; ``importable``: None = :func:`gluon_importable`, asked only on an sm_90 GPU."""
    reason = gluon_platform_reason(f"q is on {a.q.device}", capability, "the Gluon kernel", importable)
    if reason is not None:
        return reason
    kinds = {a.kv_format.kind} | ({a.extra_kv_format.kind} if a.extra_kv_format is not None else set())
    if kinds != {"bf16"}:
        names = sorted({a.kv_format.name} | ({a.extra_kv_format.name} if a.extra_kv_format is not None else set()))
        return f"kv_format {', '.join(names)}: the Gluon kernel reads bf16 pools only"
    if a.q.shape[1] not in TRITON_HEADS:
        return f"Hq = {a.q.shape[1]}, the Gluon kernel takes Hq in {TRITON_HEADS}"
    return None


def choose_attention_kernel(a: SparseAttentionInputs, config: AttentionConfig,
                            capability: "tuple[int, int] | None | str" = "detect",
                            importable: bool | None = None) -> str:
    """"gluon" or "triton" (portable) for checked inputs ``a`` under ``config.kernel``.

    "auto" takes Gluon exactly where :func:`gluon_unsupported_reason` finds nothing against it (bf16 pools on
    an sm_90 GPU); the portable kernel otherwise (fp8 or mixed pools, other GPUs, the CPU interpreter); "gluon"
    takes Gluon wherever it can run and raises ValueError with the reason instead of falling back; "triton" is
    always the portable kernel. ``capability`` and ``importable`` default to the device's and this Triton's
    (tests pass them to force the choice)."""
    kernel = config.kernel
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"config.kernel must be one of {ATTENTION_KERNELS}, got {kernel!r}")
    if kernel == "triton":
        return "triton"
    if capability == "detect":
        capability = _device_capability(a.q.device)
    reason = gluon_unsupported_reason(a, capability, importable)
    if reason is None:
        return "gluon"
    if kernel == "gluon":
        raise ValueError(f"kernel='gluon' cannot run these inputs: {reason}; use kernel='auto' or 'triton'")
    return "triton"


def sparse_attention_triton(a: SparseAttentionInputs, config: AttentionConfig | None = None,
                            **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs -> (out [T, Hq, 512] in q.dtype, lse fp32 [T, Hq]).

    Every launch setting comes from ``config`` (default: :meth:`AttentionConfig.for_device` of q's device);
    ``overrides`` (block_n, num_warps, num_stages, num_splits, ...: fields of AttentionConfig) replace
    single settings of it, for benchmarks and tests."""
    if config is None:
        config = AttentionConfig.for_device(a.q.device)
    else:
        check_instance("config", config, AttentionConfig, label="AttentionConfig or None")
    if overrides:
        config = config.replace(**overrides)
    if choose_attention_kernel(a, config) == "gluon":
        from .gluon import sparse_attention_gluon  # imports Gluon: only where it was found usable

        return sparse_attention_gluon(a, config)
    plan = plan_launch(a, config, config.block_n)
    if plan.t == 0:
        return plan.out, plan.lse
    fmt, xfmt = a.kv_format, a.extra_kv_format or a.kv_format
    interp = triton_interpreted() and not plan.q.is_cuda
    grid = (plan.t * (plan.hq // BLOCK_H) * plan.num_splits,)
    has_extra = a.extra_kv_cache is not None
    _sparse_attention_kernel[grid](
        plan.q, plan.q.stride(0), plan.q.stride(1),
        a.kv_cache, num_slots(a.kv_cache), plan.indices, plan.indices.stride(0), plan.k, plan.topk_length,
        a.extra_kv_cache if has_extra else a.kv_cache, num_slots(a.extra_kv_cache) if has_extra else 0,
        plan.xindices, plan.xindices.stride(0) if has_extra else 0, plan.xk, plan.extra_topk_length,
        plan.sink_arg, plan.dst_out, plan.dst_lse,
        plan.t, a.softmax_scale * LOG2E, plan.tiles_per_split, plan.xtiles_per_split,
        HQ=plan.hq, BLOCK_H=BLOCK_H, BLOCK_N=config.block_n, NUM_SPLITS=plan.num_splits,
        FP8=_is_fp8(fmt), PAGE_BYTES=fmt.page_bytes, XFP8=_is_fp8(xfmt), XPAGE_BYTES=xfmt.page_bytes,
        HAS_LEN=a.topk_length is not None, HAS_EXTRA=has_extra, HAS_XLEN=a.extra_topk_length is not None,
        HAS_SINK=plan.sink is not None,
        INTERPRET=interp, INTERP_TILES=plan.tiles_per_split if interp else 0,
        INTERP_XTILES=plan.xtiles_per_split if interp else 0,
        num_warps=config.num_warps, num_stages=config.stages_for(fmt.kind, plan.hq),
    )
    return merge_splits(plan, config, interp)
