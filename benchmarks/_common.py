"""Helpers shared by the benchmark scripts: environment metadata, timing, peak memory, JSON, inputs.

The scripts import it as ``from _common import ...``: running ``python benchmarks/bench_x.py`` puts
``benchmarks/`` first on sys.path. On the CPU (``--device cpu`` under TRITON_INTERPRET=1) timings are one
wall-clock call and peak memory is 0: smoke runs exercise the code paths, they make no timing claims.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from pathlib import Path

import torch

from dsakit.formats import KeyFormat

DIM = 128  # index head dim D


def environment(device: str, commit: str) -> dict:
    """Metadata every result file starts with: device, library versions, commit, date."""
    import triton

    return {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def bench_parser(commit_default: "str | None" = "unknown") -> argparse.ArgumentParser:
    """The options every GPU benchmark script takes: --out DIR, --commit, --device (cuda; cpu = smoke run of
    the code paths under TRITON_INTERPRET=1), --smoke (toy sizes). Scripts add their own."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default=commit_default)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true")
    return parser


def sync_and_alloc(fn, alloc_key: str = "alloc_peak_bytes") -> dict:
    """CUDA only: run fn() once under ``torch.cuda.set_sync_debug_mode("error")``. -> {"sync_free": bool,
    ["sync_error": the message, when a synchronizing call raised], alloc_key: peak bytes allocated above
    what was allocated before the call}."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        out["sync_free"] = True
    except RuntimeError as error:  # a synchronizing call raised
        out["sync_free"] = False
        out["sync_error"] = str(error)[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    out[alloc_key] = int(torch.cuda.max_memory_allocated() - base)
    return out


def write_json(path: "Path | str", report: dict) -> None:
    """Write the report (called after every section, so partial results survive a timeout)."""
    Path(path).write_text(json.dumps(report, indent=1))


def median_ms(fn, device: str, rep_ms: int = 100, *, warmup: int = 25, graph: bool = False) -> float:
    """Median ms of fn() (triton.testing.do_bench; ``graph=True``: CUDA-graph replays, for sync-free calls,
    which removes the Python launch cost). On the CPU: one plain call, wall clock."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    import triton.testing

    if graph:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep_ms, return_mode="median"))


def peak_extra_bytes(fn, device: str) -> int:
    """Peak CUDA memory of one fn() call above what was allocated before it (0 on the CPU)."""
    if device != "cuda":
        fn()
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def timed(fn, device: str, rep_ms: int = 100, *, graph: bool = False) -> tuple[float, float]:
    """(median ms, peak extra GiB) of fn(): one warm-up call (compiles), one measured for memory, then timing.
    On the CPU: one call, peak 0."""
    if device != "cuda":
        return median_ms(fn, device), 0.0
    fn()
    peak = peak_extra_bytes(fn, device) / 2**30
    return median_ms(fn, device, rep_ms, graph=graph), float(peak)


def timing_pool(fmt: KeyFormat, lengths: list[int], device: str, seed: int):
    """Random valid page bytes built on the device (no CPU quantization of millions of keys), shuffled pages.

    -> (pool uint8 [P, page_bytes], block_table int32 [B, max_pages], entry_counts int32 [B]).
    bf16: randn values; fp8: randn as e4m3 with fp32 scales in [0.5, 1.5); fp4: random nibbles with ue8m0
    scale bytes 120..130; any other format: its reference codec on randn keys (CPU). Never zeros (zeros hide
    bugs and can run faster).
    """
    g = torch.Generator(device=device).manual_seed(seed)
    pages_per = [max(1, math.ceil(n / 64)) for n in lengths]
    num_pages = sum(pages_per)
    pool = torch.empty(num_pages, fmt.page_bytes, dtype=torch.uint8, device=device)
    values = pool[:, : fmt.scale_offset_in_page]
    if fmt.kind == "bf16" and fmt.page_bytes == 64 * 256:
        values.copy_(torch.randn(num_pages, 64 * DIM, device=device, generator=g).to(torch.bfloat16)
                     .view(torch.uint8))
    elif fmt.kind == "fp8" and fmt.page_bytes == 64 * 132:
        values.copy_(torch.randn(num_pages, 64 * DIM, device=device, generator=g).to(torch.float8_e4m3fn)
                     .view(torch.uint8))
        scales = torch.rand(num_pages, 64, device=device, generator=g) + 0.5
        pool[:, fmt.scale_offset_in_page:].copy_(scales.view(torch.uint8))
    elif fmt.kind == "fp4" and fmt.page_bytes == 64 * 68:
        values.copy_(torch.randint(0, 256, values.shape, device=device, generator=g, dtype=torch.uint8))
        pool[:, fmt.scale_offset_in_page:].copy_(
            torch.randint(120, 131, (num_pages, 256), device=device, generator=g, dtype=torch.uint8))
    else:  # any other format: its own reference codec on randn keys (CPU, slower; no per-format code here)
        keys = torch.randn(num_pages * 64, DIM, generator=torch.Generator().manual_seed(seed))
        pool.copy_(fmt.quantize_pages(keys).to(device))
    perm = torch.randperm(num_pages, device=device, generator=g).to(torch.int32)
    table = torch.full((len(lengths), max(pages_per)), -1, dtype=torch.int32, device=device)
    used = 0
    for b, p in enumerate(pages_per):
        table[b, :p] = perm[used:used + p]
        used += p
    return pool, table, torch.tensor(lengths, dtype=torch.int32, device=device)


def make_queries(fmt_kind: str, t: int, heads: int, device: str, seed: int):
    """q [T, H, 128] (fp8 e4m3 for fp8 keys on CUDA, else bf16), weights fp32 [T, H], q_scale fp32 [T, H] or None."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(t, heads, DIM, device=device, generator=g)
    w = torch.rand(t, heads, device=device, generator=g) + 0.05
    if fmt_kind == "fp8" and device == "cuda":
        return q.to(torch.float8_e4m3fn), w, torch.rand(t, heads, device=device, generator=g) + 0.5
    return q.to(torch.bfloat16), w, None


def same_selection(got: torch.Tensor, scores: torch.Tensor, k: int) -> dict:
    """Exactness of a selection int [T, >= k] against torch.topk on the same scores fp32 [T, N].

    values_equal: the selected values, sorted, equal torch.topk's values (the definition of an exact top-k);
    set_mismatch_rows: rows whose index sets differ (only possible where the k-th value is tied);
    pad_ok: columns past min(k, N) are -1."""
    k_eff = min(k, scores.shape[1])
    ref_vals, ref_idx = torch.topk(scores, k_eff, dim=1)
    valid = got[:, :k_eff] >= 0
    got_vals = torch.where(valid, scores.gather(1, got[:, :k_eff].long().clamp(min=0)),
                           torch.full_like(ref_vals, float("-inf")))
    got_sorted = torch.sort(got_vals, dim=1, descending=True).values
    values_equal = bool(torch.equal(got_sorted, ref_vals))
    ref_sorted_idx = torch.sort(ref_idx, dim=1).values
    got_sorted_idx = torch.sort(torch.where(valid, got[:, :k_eff].long(), ref_idx), dim=1).values
    mismatch = int((ref_sorted_idx != got_sorted_idx).any(dim=1).sum())
    return {"values_equal": values_equal, "set_mismatch_rows": mismatch,
            "pad_ok": bool((got[:, k_eff:] == -1).all())}
