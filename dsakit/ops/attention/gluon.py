"""Launch code of the Gluon sparse-attention kernel for sm_90 (``_gluon_kernels.py``).

Chosen by :func:`dsakit.ops.attention.triton.choose_attention_kernel` (``AttentionConfig.kernel``); it takes
the inputs the portable kernel takes (q [T, Hq, 512] with Hq in {64, 128}, one or two bf16 pools, top-k
indices, ``topk_length``, sink, softmax scale) with the same work split and the same split merging
(``_launch.merge_splits``). Importing this module imports Gluon.
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from ...pool import num_slots
from ._gluon_kernels import GLUON_HEAD_BLOCK, GLUON_NUM_WARPS, sparse_attention_gluon_kernel
from .config import AttentionConfig
from .inputs import SparseAttentionInputs
from ._launch import LOG2E, merge_splits, plan_launch

__all__ = ["sparse_attention_gluon", "compile_gluon_kernel"]

_ALIGN = 16  # bytes: pool bases (dsakit.pool.check_pool) and the unit of the extra pool's offset
HEAD_BLOCK = int(GLUON_HEAD_BLOCK)  # heads per program
NUM_WARPS = int(GLUON_NUM_WARPS)  # two warpgroups


def _bf16_elements(fmt) -> int:
    return fmt.page_bytes // 2


def _extra_offset(a: SparseAttentionInputs) -> int:
    """(extra pool base - main pool base) in 16 B units (0 without an extra pool): both bases are 16 B aligned
    (check_pool), so the difference is a whole number of units."""
    if a.extra_kv_cache is None:
        return 0
    return (a.extra_kv_cache.data_ptr() - a.kv_cache.data_ptr()) // _ALIGN


def sparse_attention_gluon(a: SparseAttentionInputs, config: AttentionConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked inputs (bf16 pools on an sm_90 GPU) -> (out [T, Hq, 512] in q.dtype, lse fp32 [T, Hq])."""
    block_n = config.gluon_block_n
    plan = plan_launch(a, config, block_n)
    if plan.t == 0:
        return plan.out, plan.lse
    fmt, xfmt = a.kv_format, a.extra_kv_format or a.kv_format
    has_extra = a.extra_kv_cache is not None
    grid = (plan.t * (plan.hq // HEAD_BLOCK) * plan.num_splits,)
    extra_args = (_extra_offset(a), num_slots(a.extra_kv_cache) if has_extra else 0,
                  plan.xindices, plan.xindices.stride(0) if has_extra else 0, plan.xk, plan.extra_topk_length,
                  plan.sink_arg, plan.dst_out, plan.dst_lse,
                  plan.t, a.softmax_scale * LOG2E, plan.tiles_per_split, plan.xtiles_per_split)
    flags = dict(HQ=plan.hq, NUM_SPLITS=plan.num_splits, HAS_LEN=a.topk_length is not None, HAS_EXTRA=has_extra,
                 HAS_XLEN=a.extra_topk_length is not None, HAS_SINK=plan.sink is not None, num_warps=NUM_WARPS)
    main_args = (plan.q, plan.q.stride(0), plan.q.stride(1))
    index_args = (num_slots(a.kv_cache), plan.indices, plan.indices.stride(0), plan.k, plan.topk_length)
    sparse_attention_gluon_kernel[grid](
        *main_args, a.kv_cache.view(torch.bfloat16), *index_args, *extra_args,
        BLOCK_N=block_n, STAGES=config.gluon_stages, PAGE_ELEMS=_bf16_elements(fmt),
        XPAGE_ELEMS=_bf16_elements(xfmt), OVERLAP=config.gluon_overlap, **flags)
    return merge_splits(plan, config, interp=False)


def compile_gluon_kernel(*, heads: int = 128, block_n: int = 64, stages: int = 2, overlap: bool = False,
                         num_splits: int = 1,
                         q_dtype: str = "bf16", has_len: bool = True, has_extra: bool = True,
                         has_sink: bool = True, target: GPUTarget | None = None):
    """Compile the Gluon kernel ahead of time (no GPU needed) -> triton's CompiledKernel (asm: ttgir, ptx,
    cubin; metadata.shared bytes). ``target`` default: sm_90
    (``GPUTarget("cuda", 90, 32)``). Pointer arguments are declared 16 B aligned and integers int32, as Triton
    specializes them at launch for the usual sizes (the kernel widens what can exceed int32 before it
    multiplies)."""
    from ...formats import AttentionKVFormat

    out_dtype = q_dtype if num_splits == 1 else "fp32"
    pool_args = {"pool_ptr": "*bf16"}
    signature = {
        "q_ptr": f"*{q_dtype}", "stride_qt": "i32", "stride_qh": "i32", **pool_args,
        "num_slots": "i32", "idx_ptr": "*i32", "stride_it": "i32", "K": "i32",
        "len_ptr": "*i32", "extra_offset": "i32", "x_num_slots": "i32", "xidx_ptr": "*i32", "stride_xt": "i32",
        "XK": "i32", "xlen_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": f"*{out_dtype}", "lse_ptr": "*fp32",
        "T": "i32", "scale_log2": "fp32", "tiles_per_split": "i32", "xtiles_per_split": "i32",
    }
    constexprs = {"HQ": heads, "STAGES": stages, "NUM_SPLITS": num_splits, "HAS_LEN": has_len,
                  "HAS_EXTRA": has_extra, "HAS_XLEN": has_extra and has_len, "HAS_SINK": has_sink}
    page_elems = _bf16_elements(AttentionKVFormat.BF16)
    constexprs.update(BLOCK_N=block_n, PAGE_ELEMS=page_elems, XPAGE_ELEMS=page_elems, OVERLAP=overlap)
    kernel = sparse_attention_gluon_kernel
    signature.update({name: "constexpr" for name in constexprs})
    names = kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", _ALIGN]] for n, ty in signature.items() if ty.startswith("*")}
    source = GluonASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target or GPUTarget("cuda", 90, 32),
                          options={"num_warps": NUM_WARPS})
