"""Register use of the scores kernels on sm_90a, measured on a machine without a GPU.

    PYTHONPATH=. python3 benchmarks/tools/sm90_registers.py --out DIR [--formats fp8-centred,fp4-centred] [--quick]

Compiles ``_index_scores_group_kernel`` (decode) and ``_index_scores_tile_kernel`` (prefill) ahead of time for
sm_90a with Triton's own compiler and the ptxas it ships (no CUDA device or driver needed), with the
launch settings that :class:`dsakit.ops.indexer.config.ScoresConfig` resolves for the launcher (tile sizes,
warps, stages), and
records per case the registers per thread, the spill bytes and whether ptxas serialized the wgmma pipeline
for lack of registers. A case that ptxas refuses (register allocation failed) is recorded as an error and the
script exits 1. Writes DIR/sm90_registers.json. Use it before a GPU run after touching a scores kernel: a
spill is a slowdown, a failure is a kernel that does not launch.

The specialization follows what the launcher passes on the GPU (16-byte aligned pointers, row strides that
are multiples of 16, unit weight stride); it relies on Triton's ahead-of-time entry points
(``triton.compiler.ASTSource``, ``GPUTarget``), as of Triton 3.6.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real even from a shell that interprets

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from dsakit.formats.codes import KEY_CODECS, KeyCode  # noqa: E402
from dsakit.ops.indexer import index_scores_kernels  # noqa: E402
from dsakit.ops.indexer.config import ScoresConfig  # noqa: E402

INT_ARGS = ("width", "ratio", "num_pages", "num_seqs", "max_pages", "stride_qt", "stride_qh", "stride_wt",
            "stride_wh", "stride_st", "stride_sh", "stride_bt", "stride_out", "stride_ps", "stride_pp", "stride_ph")
ALIGNED_INTS = ("stride_qt", "stride_qh", "stride_bt", "stride_out")  # multiples of 16 in every real launch
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def compile_case(kernel, fmt: str, q_dtype: str, consts: dict, warps: int, stages: int) -> dict:
    """ptxas statistics of one specialization: registers, spill bytes, wgmma serialization, shared memory."""
    codec = KEY_CODECS[fmt]
    fp32_scales = codec.code in (KeyCode.FP8, KeyCode.FP8_CENTRED)
    pointers = {"q_ptr": "*" + q_dtype, "w_ptr": "*fp32", "q_scale_ptr": "*fp32",
                "values_ptr": "*bf16" if codec.code == KeyCode.BF16 else "*u8",
                "scales_ptr": "*fp32" if fp32_scales else "*u8", "block_table_ptr": "*i32", "counts_ptr": "*i32",
                "pos_ptr": "*i64" if consts["HAS_POS"] else "*i32", "rows_ptr": "*i32", "tile_seq_ptr": "*i32",
                "tile_start_ptr": "*i32", "tile_len_ptr": "*i32", "out_ptr": "*fp32", "pt_ptr": "*fp32"}
    constants = dict(consts, CODE=int(codec.code), FP8_DOT=q_dtype == "fp8e4nv" and codec.fp8_dot, D=128,
                     INTERPRET=False, PAGE_TERM=codec.page_term, stride_wh=1)
    if codec.page_term and "BLOCK_T" in consts:
        constants["stride_ps"] = 1  # the tile plan's page-term buffer [pages, H, rows]
    elif codec.page_term:
        constants["stride_ph"] = 1  # the group plan's [pages, rows, H]
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in INT_ARGS:
            signature[name] = "i32"
            if name in ALIGNED_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "constexpr"
    log = io.StringIO()
    try:
        with contextlib.redirect_stderr(log), contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "num_stages": stages})
    except Exception as exc:  # ptxas refusing the kernel is the finding, not a crash of this script
        text = str(exc)
        return {"error": "register allocation failed" if "C7600" in text else text.splitlines()[0][:300]}
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        info = subprocess.run([str(PTXAS), "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(ptx) + ".o"],
                              capture_output=True, text=True).stderr
    registers = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_store_bytes": int(spills.group(1)) if spills else None,
            "spill_load_bytes": int(spills.group(2)) if spills else None,
            "wgmma_serialized": "C7511" in info, "shared_bytes": compiled.metadata.shared}


def cases(formats: list[str], quick: bool):
    """(kernel name, format, q dtype, constexprs, warps, stages) with the settings ScoresConfig resolves."""
    config = ScoresConfig()
    groups = [(1, 64), (4, 64)] if quick else [(1, 16), (4, 16), (1, 64), (2, 64), (4, 64), (1, 128), (2, 128)]
    block_ts = [64] if quick else [16, 32, 64]
    for fmt in formats:
        codec = KEY_CODECS[fmt]
        fp4_blocks = codec.entry_code == KeyCode.FP4 and config.decode_fp4 == "blocks"
        for q_dtype in (["fp8e4nv", "bf16"] if codec.fp8_dot or fp4_blocks else ["bf16"]):
            q_scale = q_dtype == "fp8e4nv"
            for group, heads in groups:
                launch = config.group_launch(fmt, group * heads, 1 << 17, fp4_blocks)
                consts = dict(HAS_POS=False, HAS_Q_SCALE=q_scale, H=heads, GROUP=group, BLOCK_N=launch.block_n,
                              TILES_PER_PROGRAM=launch.per_program, FP4_BLOCKS=fp4_blocks)
                yield "group", fmt, q_dtype, consts, launch.warps, launch.stages
            for block_t in block_ts:
                launch = config.tile_launch(fmt, block_t)
                consts = dict(HAS_POS=True, HAS_Q_SCALE=q_scale, H=64, BLOCK_T=block_t, BLOCK_N=launch.block_n)
                yield "tile", fmt, q_dtype, consts, launch.warps, launch.stages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--formats", default=",".join(KEY_CODECS), help="comma-separated key format names")
    parser.add_argument("--quick", action="store_true", help="fewer shapes (decode 1 and 4 queries x 64 heads, "
                        "prefill 64-query tiles)")
    args = parser.parse_args()
    formats = args.formats.split(",")
    for fmt in formats:
        if fmt not in KEY_CODECS:
            raise SystemExit(f"unknown key format {fmt!r}; known: {', '.join(KEY_CODECS)}")
    kernels = index_scores_kernels()
    rows = []
    for name, fmt, q_dtype, consts, warps, stages in cases(formats, args.quick):
        row = {"kernel": name, "format": fmt, "q_dtype": q_dtype, "warps": warps, "stages": stages,
               **{k: v for k, v in consts.items() if k in ("H", "GROUP", "BLOCK_T", "BLOCK_N")}}
        row.update(compile_case(kernels[name], fmt, q_dtype, consts, warps, stages))
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"meta": {"kind": "compiled ahead of time for sm_90a (registers, spills, shared memory): no timing, "
                       "no GPU", "peer": None, "deep_gemm_version": None},
              "target": "sm_90a", "triton": triton.__version__, "rows": rows}
    (out / "sm90_registers.json").write_text(json.dumps(report, indent=1))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
