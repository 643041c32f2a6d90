"""The streaming select's kernels compiled for sm_90a on a machine without a GPU: registers, stack, and the SASS
instructions per streamed entry of the filter loop (warp filter against thread filter).

    PYTHONPATH=. python3 benchmarks/tools/sm90_select.py --out DIR

For each launch of ``SelectConfig().stream_for`` (warp filter, the default),
``SelectConfig(stream_filter="thread").stream_for`` (both with the register-blocked sort) at 8192 x 65536,
64 x 65536 and 64 x 131072 (K 2048), compiles the kernels the public launcher ``launch_stream_select`` launches for it (recorded on
meta tensors, nothing runs) with Triton's own compiler (``triton.compile`` with ``GPUTarget("cuda", 90, 32)``;
16-byte aligned pointers and a row stride that is a multiple of 16, as on the GPU), reads registers and stack
with the cuobjdump Triton ships, and counts the instructions of the filter's streaming loop (the largest
backward branch of the SASS that both loads and stores) per entry a thread streams, and the static
instruction and shuffle counts of the other kernels (for the sorts, straight-line bitonic networks, the work
per thread). A kernel that does not
compile is recorded as an error and the script exits 1: run it before a GPU run after touching a select kernel.
Instruction counts are a proxy (issue slots of an ALU-bound loop), not a timing. Writes DIR/sm90_select.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real even from a shell that interprets

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from dsakit.ops.indexer.config import SelectConfig, StreamConfig  # noqa: E402
from dsakit.ops.indexer.select import SelectBuffers, launch_stream_select  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SHAPES = [(8192, 65536, 2048), (64, 65536, 2048), (64, 131072, 2048)]


def _compile(kernel, consts: dict, warps: int) -> dict:
    """registers / stack of one specialization and its SASS text (or the error)."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in consts:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = {"scores_ptr": "*fp32", "cand_ptr": "*i64", "sorted_ptr": "*i64"}.get(name, "*i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name.startswith("stride") or name == "K":  # K = 2048: Triton specializes multiples of 16
                attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        compiled = triton.compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps})
    except Exception as exc:  # a kernel that does not compile is the finding
        return {"error": str(exc).splitlines()[-1][:300]}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True).stdout
        sass = subprocess.run([str(TOOLS / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2)), "sass": sass}


def _stream_loop_instructions(sass: str) -> int:
    """Instructions of the largest loop (backward branch) whose body has a global load and a global store."""
    labels, body = {}, []
    for line in sass.splitlines():
        label = re.match(r"^\.(L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(body)
            continue
        op = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if op:
            body.append(op.group(1).strip())
    best = 0
    for end, text in enumerate(body):
        target = re.search(r"BRA\s+`?\(?\.?(L_x_\d+)", text)
        if target and labels.get(target.group(1), end + 1) <= end:
            loop = body[labels[target.group(1)]:end + 1]
            if any("LDG" in x for x in loop) and any("STG" in x for x in loop):
                best = max(best, len(loop))
    return best


def launch_cases(cfg: StreamConfig, rows: int, width: int, k: int) -> list[tuple[str, object, dict, int, float]]:
    """(name, kernel, constexprs, warps, entries per thread per loop iteration) of the launches the public
    ``launch_stream_select`` makes with ``cfg``: it runs on meta tensors (shapes, no memory, no device) with
    Triton's launch replaced by a recorder, so what is compiled is what the launcher would launch."""
    scores = torch.empty((rows, width), dtype=torch.float32, device="meta")
    counts = torch.empty((rows,), dtype=torch.int32, device="meta")
    out = torch.empty((rows, k), dtype=torch.int32, device="meta")
    buffers = SelectBuffers.allocate(rows, width, k, "meta", cfg)
    recorded = []

    def record(kernel, *args, grid=None, warmup=False, **kwargs):
        warps = kwargs.pop("num_warps", 4)
        consts = {name: value for name, value in kwargs.items() if name in kernel.arg_names}
        recorded.append((kernel, consts, warps))

    original = JITFunction.run
    JITFunction.run = record
    try:
        launch_stream_select(scores, counts, out, k, True, buffers)
    finally:
        JITFunction.run = original
    cases = []
    for kernel, consts, warps in recorded:
        name = kernel.fn.__name__.strip("_").removesuffix("_kernel")
        if name == "filter_thread":
            name, per_thread = "filter", cfg.unroll
        elif name == "filter":
            per_thread = cfg.block / (32 * warps)
        else:
            per_thread = 0
        cases.append((name, kernel, consts, warps, per_thread))
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows_out = []
    for rows, width, k in SHAPES:
        for select in (SelectConfig(), SelectConfig(stream_filter="thread")):  # both with the register sort
            cfg = select.stream_for(rows, width, k)
            for name, kernel, consts, warps, per_thread in launch_cases(cfg, rows, width, k):
                row = {"rows": rows, "N": width, "K": k, "filter": cfg.filter, "register_sort": cfg.register_sort,
                       "kernel": name, "warps": warps,
                       **{key: value for key, value in consts.items() if key in ("LANES", "LCAP", "UNROLL", "V")}}
                result = _compile(kernel, consts, warps)
                sass = result.pop("sass", "")
                row.update(result)
                if per_thread and sass:
                    loop = _stream_loop_instructions(sass)
                    row.update(loop_instructions=loop, instructions_per_entry=round(loop / per_thread, 1))
                elif sass:
                    row["instructions"] = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass))
                    row["shuffles"] = len(re.findall(r"SHFL", sass))
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"meta": {"kind": "compiled ahead of time for sm_90 (registers, stack, SASS instructions of the "
                               "filter loop): no timing, no GPU", "triton": triton.__version__}, "rows": rows_out}
    (out / "sm90_select.json").write_text(json.dumps(report, indent=1))
    return 1 if any("error" in row for row in rows_out) else 0


if __name__ == "__main__":
    sys.exit(main())
