"""Launch code of the Gluon prefill scores kernel for sm_90 (``_gluon_kernels.py``), bf16 index keys.

Chosen by :func:`dsakit.ops.indexer.scores.choose_prefill_kernel` (``ScoresConfig.prefill_kernel``) for tile
plans; it takes the arguments the Triton tile kernel takes (:func:`dsakit.ops.indexer.scores.launch_index_scores`
builds them once for both) on the same grid. Importing this module imports Gluon.
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

from ._gluon_kernels import GLUON_BLOCK_T, index_scores_gluon_tile_kernel
from .config import Launch

__all__ = ["launch_gluon_tile", "gluon_q", "compile_gluon_scores_kernel", "GLUON_BLOCK_T"]

BLOCK_T = int(GLUON_BLOCK_T)  # query rows per program (plans' tiles of <= 64 rows are padded to it)
_ALIGN = 16  # bytes: cp.async copies 16 B per thread


def gluon_q(q: torch.Tensor) -> torch.Tensor:
    """q [T, H, 128] as the Gluon kernel gathers it: bf16 (fp8 e4m3 widened exactly, as the Triton kernel does
    in registers; fp32 / fp16 were rounded by ``prepare_q``), contiguous (row t, head h at element
    (t * H + h) * 128: the kernel computes that offset instead of holding per-row addresses across its head
    loop) and 16 B aligned, so that every row's 16 B copies are provably aligned (a copy otherwise)."""
    if q.dtype != torch.bfloat16:
        q = q.to(torch.bfloat16)
    if not q.is_contiguous() or q.data_ptr() % _ALIGN:
        q = q.clone(memory_format=torch.contiguous_format)
    return q


def launch_gluon_tile(args: tuple, grid: tuple, *, has_pos: bool, has_q_scale: bool, num_heads: int,
                      launch: Launch) -> None:
    """Launch the Gluon tile kernel with the Triton tile kernel's arguments ``args`` (q from :func:`gluon_q`,
    values as the pool's bf16 view) on ``grid``; ``launch`` from :meth:`ScoresConfig.gluon_launch`."""
    index_scores_gluon_tile_kernel[grid](*args, HAS_POS=has_pos, HAS_Q_SCALE=has_q_scale, H=num_heads,
                                         BLOCK_N=launch.block_n, STAGES=launch.stages, num_warps=launch.warps)


def compile_gluon_scores_kernel(*, heads: int = 64, block_n: int = 128, stages: int = 4, warps: int = 8,
                                has_pos: bool = True, has_q_scale: bool = False, weights_dtype: str = "fp32",
                                maxnreg: int | None = None, target: GPUTarget | None = None):
    """Compile the Gluon tile kernel ahead of time (no GPU needed) -> triton's CompiledKernel (asm: ttgir, ptx,
    cubin; metadata.shared bytes). ``maxnreg``: a register cap (None: the launcher's, i.e. none); ``target``
    default: sm_90 (``GPUTarget("cuda", 90, 32)``). Pointers are declared 16 B aligned, as Triton specializes
    them at launch (the pool's base: ``check_pool``; q: :func:`gluon_q`)."""
    signature = {
        "q_ptr": "*bf16", "w_ptr": f"*{weights_dtype}", "q_scale_ptr": "*fp32", "values_ptr": "*bf16",
        "scales_ptr": "*u8", "block_table_ptr": "*i32", "counts_ptr": "*i32", "pos_ptr": "*i32", "rows_ptr": "*i32",
        "tile_seq_ptr": "*i32", "tile_start_ptr": "*i32", "tile_len_ptr": "*i32", "out_ptr": "*fp32",
        "width": "i32", "ratio": "i32", "num_pages": "i32", "num_seqs": "i32", "max_pages": "i32",
        "stride_qt": "i32", "stride_qh": "i32", "stride_wt": "i32", "stride_wh": "i32", "stride_st": "i32",
        "stride_sh": "i32", "stride_bt": "i32", "stride_out": "i32",
        "pt_ptr": "*fp32", "stride_ps": "i32", "stride_pp": "i32", "stride_ph": "i32",
    }
    constexprs = {"HAS_POS": has_pos, "HAS_Q_SCALE": has_q_scale, "H": heads, "BLOCK_N": block_n, "STAGES": stages}
    signature.update({name: "constexpr" for name in constexprs})
    kernel = index_scores_gluon_tile_kernel
    names = kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", _ALIGN]] for n, ty in signature.items() if ty.startswith("*")}
    source = GluonASTSource(kernel, signature, constexprs, attrs)
    options = {"num_warps": warps} if maxnreg is None else {"num_warps": warps, "maxnreg": maxnreg}
    return triton.compile(source, target=target or GPUTarget("cuda", 90, 32), options=options)
