"""The indexer op (index scores + exact top-k select, prefill and decode) on one GPU: one script, four commands.

    PYTHONPATH=. python3 benchmarks/bench_indexer.py COMMAND --out DIR --commit $(git rev-parse --short HEAD) [options]
    PYTHONPATH=. python3 benchmarks/bench_indexer.py COMMAND --help

Every command runs with ``--device cpu`` and its smoke flag (``--smoke``; ``scores``: ``--small --check-only``)
under TRITON_INTERPRET=1: toy sizes, the code paths only, no timing claims. DeepGEMM and the other peers in
the same process: ``bench_peers.py``.

``matrix``: the fused indexer end to end, with full-size checks.
    Benchmark matrix of the fused indexer (Triton scores + exact radix top-k), with full-size checks.

    One run does, in this order (everything on one GPU, results in DIR/indexer_h200.json, a table printed last):
      1. select checks at full size: the radix select on 8192 x 65536 random fp32 scores vs torch.topk (exact:
         same selected values; index sets equal wherever the k-th value is not tied), heavy ties / NaN / -inf rows
         vs the CPU reference ``select_topk`` (bit for bit), determinism across two runs;
      2. select tuning sweep (BLOCK x num_warps) on 8192 x 65536 (prefill) and 64 x 131072 (decode), torch.topk
         next to it; the fastest configurations are used for the rest of the run;
      3. prefill matrix: T = 8192 queries of one sequence x N = 8K/16K/32K/64K entries, every query sees every
         entry (as in the DeepGEMM anchor), H 64, D 128, per key format (fp8 keys with fp8 q + q_scale; bf16 and
         fp4 keys with bf16 q), K 512 and 2048: end-to-end ``index_topk_triton`` (time, TFLOP/s = 2*H*D per
         visible pair, peak extra memory), its parts (scores into a materialized [T, N], select alone), torch.topk
         on the same scores, the naive torch path (einsum + relu + weighted head sum on bf16 keys, materialized,
         + torch.topk) where it fits in memory (N <= 32K), and the DeepGEMM anchors of docs/performance.md;
         each end-to-end result is checked against torch.topk of the materialized scores (same values selected);
      4. (the decode matrix is the ``decode`` command)
      5. N = 262144 entries (1M tokens at ratio 4), T = 8192, K = 2048, per format: completes with the default
         512 MiB workspace; peak extra memory recorded (target < 1 GiB; materialized fp32 logits are 8 GiB).

    Usage: bench_indexer.py matrix --out DIR --commit SHA
           (``--device cpu --smoke`` under TRITON_INTERPRET=1 runs every section at toy sizes, no timing claims)

``scores``: the index-scores kernels alone.
    Scores-only benchmark and full-size correctness check of the Triton index-scores kernels (H200).

    One run does, in this order:
      1. correctness at moderate size on the GPU for every key format x q dtype, prefill (ragged, causal, ratio
         1 and 4) and decode (next_n 1 and 2): exact -inf mask, tight bound against a torch fp32 computation on the
         same rounded / dequantized operands, and bitwise determinism across two runs;
         plus the DeepGEMM-compatible function against DeepGEMM's masking convention;
      2. prefill timing, T = 8192 queries of one sequence x N entries (every query sees every entry, as in the
         DeepGEMM anchor), H 64, D 128, per format and for a few tile configurations;
      3. decode timing, B = 64 sequences x N entries, next_n 1;
      4. peak memory of each timed call (the scores output itself is [T, N] fp32: this op materializes by design).

    Usage: PYTHONPATH=. python3 benchmarks/bench_indexer.py scores --out DIR [--commit SHA] [--quick]
    Writes DIR/scores_h200.json and prints a table.

``select``: the exact top-k alone.
    The exact top-k alone on fp32 scores: streaming select vs the multi-pass radix select vs torch.topk.

    Per shape (prefill 8192 x 65536 / 8192 x 8192, decode 64 x 65536 / 64 x 131072 / 256 x 131072) and score
    distribution (relu-like weighted head sums, randn, randn + 100, relu rows made mostly of exact zeros, rows
    rising with the index like a recency bias):
      check   the streaming select vs torch.topk (same selected values; index sets equal where the k-th value is
              not tied), which path the rows took (candidate buffer / tie lists / exact fallback), two runs
              bitwise equal;
      time    medians (triton.testing.do_bench) of the streaming select (sorted and unsorted), the multi-pass
              select of dsakit.ops.indexer.select, torch.topk (sorted) on the same scores; ratios;
      sweep   (optional) launch configurations of the streaming select.

      filters (``--filters``, instead of the above) the streaming select with the warp filter (the default)
              against the thread filter (``SelectConfig(stream_filter="thread")``, and a few variants: unroll,
              16-warp final, register-blocked sort) and torch.topk, on 8192 x 65536, 64 x 65536, 64 x 131072 at K 2048, relu-like and +100
              shifted rows, two timing rounds each; every variant's sorted output must equal the warp filter's
              bitwise (both are exact) and torch.topk's values; writes DIR/select_filters_SHA.json (with --rep 10
              ~1-1.5 min on an H200, ~40 s of it Triton compiles).

      sample groups (``--sample-groups``) the threshold sample in groups of 8 (default) against 32 on random rows
              and rows whose pages carry offsets (``pages1``, ``pages3``): paths, exactness, time (~1 min)

    Usage: PYTHONPATH=. python3 benchmarks/bench_indexer.py select --out DIR --commit SHA [--sweep] [--quick]
           PYTHONPATH=. python3 benchmarks/bench_indexer.py select --out DIR --commit SHA --filters
           (``--device cpu --smoke`` under TRITON_INTERPRET=1 runs toy sizes, no timing claims)

``decode``: the decode path.
    Decode top-k through the sync-free plan path (``plan_decode_topk`` + ``index_topk_decode``), on one GPU.

    Cases: B = 64 sequences, next_n 1, N = 64K / 128K cached entries each (every entry visible, the DeepGEMM
    paged-decode anchor's setting), H 64, D 128, key formats fp8 (fp8 q + q_scale), bf16 and fp4 (bf16 q),
    K 512 and 2048. Per case (do_bench medians; do_bench clears L2 before every call, and two input sets of
    > 60 MB each are rotated for the graph replays):

      public      ``index_topk_triton`` on the same batch (cached workspaces; allocates its outputs per call)
      plan eager  ``index_topk_decode`` with a prebuilt plan, launched from Python
      graph       the same call captured in a torch.cuda.CUDAGraph, replays alternating over two input sets
      parts       scores kernel alone and select kernel alone (each captured in a graph), torch.topk on the
                  same [B, N] scores, DeepGEMM logits + torch.topk anchor (docs/performance.md §2)

    Checks at full size (recorded per case): the plan call raises no device->host sync
    (``torch.cuda.set_sync_debug_mode("error")``) and allocates nothing; graph replays equal the eager result
    for both input sets; the plan path equals the public path bit for bit (same kernels); the selection is
    exact on the scores it selected from (selected values == torch.topk values for every row); for 3 rows the
    kernel scores against fp32 torch scores of the dequantized keys (relative L2) and the top-k overlap with
    torch.topk of those reference-semantics scores.

    Section ``host`` (``--sections decode,host``, default both): the host cost of the plain public call.
    fp8 keys, bf16 q, the same B / N, K 2048 and 512; the batch is built from host metadata
    (``PagedBatch.from_host``, no sync, as ``PagedCache.batch`` does). Per case: ``dsakit.ops.index_topk``
    (cached workspaces and tile plans, fresh outputs per call) against the plan eager and graph; recorded: the
    public call from its second call on raises no device->host sync and allocates no more than its output,
    public and plan results equal bit for bit, ``public_over_plan`` = public / plan eager (target <= 1.2).

    Usage: PYTHONPATH=. python3 benchmarks/bench_indexer.py decode --out DIR --commit SHA [--sections decode,host]
           (``--device cpu --smoke`` under TRITON_INTERPRET=1: toy sizes, no graphs, no timing claims)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch
from _common import (DIM, bench_parser, environment, make_queries, median_ms, same_selection, sync_and_alloc, timed,
                     timing_pool, write_json)

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.indexer.config import ScoresConfig
from dsakit.ops.indexer.deepgemm_compat import fp8_mqa_logits, fp8_paged_mqa_logits
from dsakit.ops.indexer.scores import flops, index_scores_decode, index_scores_triton, launch_index_scores, prepare_q
from dsakit.ops.indexer.plans import plan_decode_tiles, plan_query_tiles
from dsakit.ops.indexer import index_topk
from dsakit.ops.indexer.config import SelectConfig, StreamConfig, TopkConfig
from dsakit.ops.indexer.triton import index_topk_decode
from dsakit.ops.indexer.plans import plan_decode_topk
from dsakit.ops.indexer.reference import select_topk as reference_select
from dsakit.ops.indexer.config import DEFAULT_WORKSPACE_BYTES, rows_per_chunk
from dsakit.ops.indexer.select import SelectBuffers, launch_select, launch_stream_select, select_topk_stream, select_topk_triton
from dsakit.ops.indexer.triton import index_topk_triton
from dsakit.ops.indexer.plans import workspace_width

HEADS = 64
HBM_TB_PER_S = 4.27  # device-to-device copy ceiling (docs/performance.md section 1)
# DeepGEMM 2.6.1 on the same H200 (docs/performance.md section 2): logits ms, torch.topk ms for k = 512 / 2048;
# prefill 8192 fp8 q x N keys, decode batch 64 paged
DEEPGEMM_PREFILL = {8192: (1.08, 1.32, 1.54), 16384: (2.18, 2.23, 2.46), 32768: (4.40, 4.06, 4.33),
                    65536: (8.69, 7.67, 7.98)}
DEEPGEMM_DECODE = {65536: (0.150, 0.136, 0.139), 131072: (0.288, 0.186, 0.189)}
TIME_GUARD_S = 95  # decode: stop starting new cases after this many seconds (the GPU call must stay < 150 s)


# -- matrix ---------------------------------------------------------------------------------------------------

# Select configuration when the sweep section is skipped: None = the library's tuned defaults
# (dsakit.ops.indexer.config.SelectConfig.resolve), i.e. what a caller gets.
LIBRARY_DEFAULTS = {"block": None, "num_warps": None, "bins": None}


class Sizes:
    def __init__(self, smoke: bool):
        self.t = 64 if smoke else 8192
        self.heads = 4 if smoke else HEADS
        self.prefill_n = [256, 512] if smoke else [8192, 16384, 32768, 65536]
        self.decode_b = 4 if smoke else 64
        self.decode_n = [300] if smoke else [65536, 131072]
        self.big_n = 1000 if smoke else 262144
        self.ks = [8, 32] if smoke else [512, 2048]
        self.naive_max_n = 512 if smoke else 32768
        # (BLOCK, num_warps, BINS) of the select kernel
        self.sweep = [(64, 4, 32)] if smoke else [(2048, 8, 64), (2048, 8, 128), (2048, 4, 64), (4096, 8, 64),
                                                   (8192, 16, 64)]
        self.decode_sweep = [(64, 4, 32)] if smoke else [(8192, 16, 64), (4096, 8, 64), (8192, 8, 64)]
        self.rep_ms = 5 if smoke else 100


def select_checks(device: str, sz: Sizes) -> list[dict]:
    rows = []
    g = torch.Generator(device=device).manual_seed(11)
    n = sz.prefill_n[-1]
    scores = torch.randn(sz.t, n, device=device, generator=g)
    for k in sz.ks:
        got = select_topk_triton(scores, k)
        again = select_topk_triton(scores, k)
        row = {"check": "select randn vs torch.topk", "T": sz.t, "N": n, "K": k,
               "deterministic": bool(torch.equal(got, again)), **same_selection(got, scores, k)}
        rows.append(row)
        print(row, flush=True)
    del scores
    # Heavy ties, NaN, -inf, -0.0 and short rows: bit-for-bit against the CPU reference (order included).
    special = torch.randint(0, 40, (64, n), device=device, generator=g).float()
    special[1::4] = torch.randn(16, n, device=device, generator=g)
    special[2::4, ::3] = float("-inf")
    special[3::4, 7::11] = float("nan")
    special[3::4, 5::13] = -0.0
    special[4] = float("-inf")
    special[5, 100:] = float("-inf")
    for k in sz.ks:
        got = select_topk_triton(special, k).cpu()
        ref = reference_select(special.cpu(), k)
        row = {"check": "select ties/NaN/-inf vs reference (bitwise)", "T": 64, "N": n, "K": k,
               "equal": bool(torch.equal(got, ref)), "rows_differing": int((got != ref).any(dim=1).sum())}
        rows.append(row)
        print(row, flush=True)
    return rows


def select_sweep(device: str, sz: Sizes) -> tuple[list[dict], dict]:
    rows = []
    best = {}
    g = torch.Generator(device=device).manual_seed(12)
    for regime, (t, n, configs) in {"prefill": (sz.t, sz.prefill_n[-1], sz.sweep),
                                    "decode": (sz.decode_b, sz.decode_n[-1], sz.decode_sweep)}.items():
        scores = torch.randn(t, n, device=device, generator=g).abs_()  # indexer scores are mostly >= 0
        k = sz.ks[-1]
        for block, warps, bins in configs:
            ms, _ = timed(lambda: select_topk_triton(scores, k, config=SelectConfig(block, warps, bins)), device,
                          sz.rep_ms)
            row = {"sweep": regime, "T": t, "N": n, "K": k, "block": block, "num_warps": warps, "bins": bins,
                   "ms": ms, "gb_per_s_one_read": t * n * 4 / ms / 1e6}
            rows.append(row)
            print(row, flush=True)
            if regime not in best or ms < best[regime]["ms"]:
                best[regime] = {"block": block, "num_warps": warps, "bins": bins, "ms": ms}
        b = best[regime]
        ms, _ = timed(lambda: select_topk_triton(scores, k, config=SelectConfig(b["block"], b["num_warps"], b["bins"]),
                                                 sort=False), device, sz.rep_ms)
        rows.append({"sweep": regime, "T": t, "N": n, "K": k, "block": b["block"], "num_warps": b["num_warps"],
                     "bins": b["bins"], "sort": False, "ms": ms})
        ms, _ = timed(lambda: torch.topk(scores, k, dim=1), device, sz.rep_ms)
        rows.append({"sweep": regime, "T": t, "N": n, "K": k, "torch_topk_ms": ms})
        print(rows[-2], rows[-1], flush=True)
        del scores
    return rows, best


def naive_indexer(q_bf16, w, keys_bf16, k):
    """Materialized torch path: logits [T, H, N] (einsum), relu, weighted head sum -> [T, N] fp32, torch.topk."""
    logits = torch.einsum("thd,nd->thn", q_bf16, keys_bf16)
    scores = (logits.relu() * w.to(torch.bfloat16).unsqueeze(-1)).sum(1).float()
    return torch.topk(scores, k, dim=1).indices


def e2e_call(q, w, q_scale, batch: PagedBatch, k: int, sel: dict, sort: bool = True):
    """The timed end-to-end call: index_topk_triton with the select configuration ``sel``."""
    config = TopkConfig(sort=sort, select=SelectConfig(sel["block"], sel["num_warps"], sel["bins"]))
    return lambda: index_topk_triton(q, w, batch, k, q_scale=q_scale, config=config)


def topk_columns(run_e2e, run_scores, scores: torch.Tensor, k: int, sel: dict, device: str, rep_ms: int) -> dict:
    """Columns every (format, N, K) case shares: exactness of the e2e call against torch.topk on the
    materialized scores (run_scores fills ``scores``), e2e time and peak, the select alone, torch.topk."""
    got = run_e2e()
    run_scores()
    check = same_selection(got, scores, k)
    del got
    ms_e2e, peak_e2e = timed(run_e2e, device, rep_ms)
    ms_sel, _ = timed(lambda: select_topk_triton(scores, k, config=SelectConfig(sel["block"], sel["num_warps"],
                                                                                sel["bins"])), device, rep_ms)
    ms_torch_topk, _ = timed(lambda: torch.topk(scores, k, dim=1), device, rep_ms)
    return {"ms": ms_e2e, "peak_extra_gib": peak_e2e, "select_ms": ms_sel, "torch_topk_ms": ms_torch_topk,
            "check_vs_torch_topk": check}


def deepgemm_columns(anchor: tuple | None, k: int, ms: float) -> dict:
    """DeepGEMM logits + torch.topk anchor of docs/performance.md (None where there is none) and our speedup over it."""
    total = None if anchor is None else anchor[0] + anchor[1 if k == 512 else 2]
    return {"deepgemm_plus_topk_ms": total, "vs_deepgemm": None if total is None else total / ms}


def prefill_matrix(device: str, sz: Sizes, best: dict) -> list[dict]:
    rows = []
    sel = best.get("prefill", LIBRARY_DEFAULTS)
    t = sz.t
    for fmt_name in ("fp8", "bf16", "fp4"):
        fmt = KeyFormat.parse(fmt_name)
        q, w, q_scale = make_queries(fmt.kind, t, sz.heads, device, seed=21)
        query_seq = torch.zeros(t, dtype=torch.int32, device=device)
        for n in sz.prefill_n:
            pool, table, counts = timing_pool(fmt, [n], device, seed=22)
            batch = PagedBatch.build(pool, fmt, table, counts, query_seq)
            scores = torch.empty(t, n, device=device)

            def run_scores():
                index_scores_triton(q, w, batch, out=scores, q_scale=q_scale)

            ms_scores, peak_scores = timed(run_scores, device, sz.rep_ms)
            for k in sz.ks:
                inputs = (q, w, q_scale, batch, k, sel)
                shared = topk_columns(e2e_call(*inputs), run_scores, scores, k, sel, device, sz.rep_ms)
                ms_unsorted, _ = timed(e2e_call(*inputs, sort=False), device, sz.rep_ms)
                row = {"case": "prefill", "format": fmt_name, "q": str(q.dtype), "T": t, "N": n, "H": sz.heads,
                       "D": DIM, "K": k, **shared, "tflops": flops(t * n, sz.heads) / shared["ms"] / 1e9,
                       "unsorted_ms": ms_unsorted, "scores_ms": ms_scores, "scores_peak_gib": peak_scores,
                       "triton_scores_plus_torch_topk_ms": ms_scores + shared["torch_topk_ms"],
                       **deepgemm_columns(DEEPGEMM_PREFILL.get(n), k, shared["ms"])}
                rows.append(row)
                print(row, flush=True)
            del pool, scores, batch
            if fmt_name == "fp8" and n <= sz.naive_max_n:
                g = torch.Generator(device=device).manual_seed(23)
                keys = torch.randn(n, DIM, device=device, generator=g).to(torch.bfloat16)
                q16 = torch.randn(t, sz.heads, DIM, device=device, generator=g).to(torch.bfloat16)
                for k in sz.ks:
                    try:
                        ms_naive, peak_naive = timed(lambda: naive_indexer(q16, w, keys, k), device, sz.rep_ms)
                        naive = {"naive_ms": ms_naive, "naive_peak_gib": peak_naive}
                    except torch.OutOfMemoryError as exc:
                        naive = {"naive_error": repr(exc)[:200]}
                    rows.append({"case": "prefill naive torch (bf16 keys, format-independent)", "T": t, "N": n,
                                 "K": k, **naive})
                    print(rows[-1], flush=True)
                del keys, q16
                if device == "cuda":
                    torch.cuda.empty_cache()
    return rows


def big_run(device: str, sz: Sizes, best: dict) -> list[dict]:
    """N = 262144 entries x T = 8192 queries, K 2048, default workspace: completes, peak extra memory < 1 GiB."""
    rows = []
    sel = best.get("prefill", LIBRARY_DEFAULTS)
    t, n, k = sz.t, sz.big_n, sz.ks[-1]
    for fmt_name in ("fp8", "bf16", "fp4"):
        fmt = KeyFormat.parse(fmt_name)
        q, w, q_scale = make_queries(fmt.kind, t, sz.heads, device, seed=41)
        query_seq = torch.zeros(t, dtype=torch.int32, device=device)
        pool, table, counts = timing_pool(fmt, [n], device, seed=42)
        batch = PagedBatch.build(pool, fmt, table, counts, query_seq)

        run_e2e = e2e_call(q, w, q_scale, batch, k, sel)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        got = run_e2e()
        # exactness on the first 256 rows against torch.topk of the materialized scores of those rows
        check_rows = min(256, t)
        part_batch = PagedBatch.build(pool, fmt, table, counts, query_seq[:check_rows])
        part = index_scores_triton(q[:check_rows], w[:check_rows], part_batch,
                                   q_scale=None if q_scale is None else q_scale[:check_rows])
        check = same_selection(got[:check_rows], part, k)
        del got, part
        ms, peak = timed(run_e2e, device, sz.rep_ms)
        row = {"case": "big prefill", "format": fmt_name, "q": str(q.dtype), "T": t, "N": n, "K": k, "ms": ms,
               "tflops": flops(t * n, sz.heads) / ms / 1e9, "peak_extra_gib": peak,
               "workspace_bytes": DEFAULT_WORKSPACE_BYTES,
               "rows_per_chunk": rows_per_chunk(t, workspace_width(n), DEFAULT_WORKSPACE_BYTES),
               "materialized_fp32_gib": t * n * 4 / 2**30, "check_first_rows_vs_torch_topk": check}
        rows.append(row)
        print(row, flush=True)
        del pool, q, w, batch, part_batch
    return rows


def profile_e2e(device: str, sz: Sizes, out_dir: Path) -> str:
    """torch.profiler table of the default end-to-end call (decode fp8 64K and prefill fp8 64K, K 2048)."""
    from torch.profiler import ProfilerActivity, profile

    text = []
    for label, rows, n in (("decode B=64", sz.decode_b, sz.decode_n[0]), ("prefill T=8192", sz.t, sz.prefill_n[-1])):
        fmt = KeyFormat.parse("fp8")
        q, w, q_scale = make_queries(fmt.kind, rows, sz.heads, device, seed=51)
        lengths = [n] * rows if label.startswith("decode") else [n]
        query_seq = (torch.arange(rows, dtype=torch.int32, device=device) if label.startswith("decode")
                     else torch.zeros(rows, dtype=torch.int32, device=device))
        pool, table, counts = timing_pool(fmt, lengths, device, seed=52)
        batch = PagedBatch.build(pool, fmt, table, counts, query_seq)
        k = sz.ks[-1]

        def run():
            return index_topk_triton(q, w, batch, k, q_scale=q_scale)

        run()
        if device == "cuda":
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
            if device == "cuda":
                torch.cuda.synchronize()
        table_text = prof.key_averages().table(sort_by="cuda_time_total" if device == "cuda" else "cpu_time_total",
                                               row_limit=12)
        text.append(f"== {label}, N {n}, fp8, K {k}: 3 calls ==\n{table_text}")
        del pool
    (out_dir / "indexer_profile.txt").write_text("\n".join(text))
    return "\n".join(text)


def main_matrix(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_indexer.py matrix")
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="toy sizes (CPU interpreter); no timing claims")
    parser.add_argument("--sections", default="checks,sweep,prefill,big,profile")
    args = parser.parse_args(argv)
    device = args.device
    sz = Sizes(args.smoke)
    sections = set(args.sections.split(","))
    meta = {**environment(device, args.commit), "H": sz.heads, "D": DIM, "workspace_bytes": DEFAULT_WORKSPACE_BYTES,
            "notes": "prefill: one sequence, every query sees every entry (query_positions=None), as the DeepGEMM "
                     "anchor; fp8 keys use fp8 e4m3 q with q_scale, bf16/fp4 keys bf16 q. Times are medians of "
                     "triton.testing.do_bench; peak = max_memory_allocated over what was allocated before the "
                     "call. Naive torch = einsum + relu + weighted head sum over bf16 keys (materialized "
                     "[T, H, N]) + torch.topk, run only where it fits (prefill N <= 32K)."}
    report = {"meta": meta}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / ("indexer_smoke.json" if args.smoke else "indexer_h200.json")

    def save():
        write_json(path, report)

    t0 = time.time()
    best: dict = {}
    if "checks" in sections:
        report["select_checks"] = select_checks(device, sz)
        save()
    if "sweep" in sections:
        report["select_sweep"], best = select_sweep(device, sz)
        report["select_best"] = best
        save()
    print(f"[{time.time() - t0:.0f} s] checks and sweep done", flush=True)
    if "prefill" in sections:
        report["prefill"] = prefill_matrix(device, sz, best)
        save()
        print(f"[{time.time() - t0:.0f} s] prefill done", flush=True)
    if "big" in sections:
        report["big"] = big_run(device, sz, best)
        save()
    if "profile" in sections:
        print(profile_e2e(device, sz, out_dir), flush=True)
    print(f"total {time.time() - t0:.0f} s")

    print("\ncase     fmt   N       K     e2e ms  TFLOP/s  peak GiB  scores ms  select ms  torch.topk  "
          "DeepGEMM+topk  speedup  naive ms  exact")
    naive = {(r["N"], r["K"]): r.get("naive_ms") for r in report.get("prefill", []) if "naive" in r["case"]}
    for r in report.get("prefill", []) + report.get("decode", []) + report.get("big", []):
        if "ms" not in r:
            continue
        chk = r.get("check_vs_torch_topk") or r.get("check_first_rows_vs_torch_topk")
        nv = r.get("naive_ms", naive.get((r["N"], r["K"])) if r["case"] == "prefill" else None)
        print(f"{r['case'][:8]:8} {r['format']:5} {r['N']:7} {r['K']:5} {r['ms']:8.3f} {r['tflops']:8.1f} "
              f"{r['peak_extra_gib']:8.3f} {r.get('scores_ms') or 0:10.3f} {r.get('select_ms') or 0:10.3f} "
              f"{r.get('torch_topk_ms') or 0:10.3f} {r.get('deepgemm_plus_topk_ms') or 0:13.3f} "
              f"{r.get('vs_deepgemm') or 0:8.2f} {nv or 0:9.2f}  {chk['values_equal']}")
    failures = [r for r in report.get("select_checks", [])
                if not (r.get("equal", True) and r.get("values_equal", True) and r.get("deterministic", True))]
    failures += [r for r in report.get("prefill", []) + report.get("decode", []) + report.get("big", [])
                 if "ms" in r and not (r.get("check_vs_torch_topk") or r.get("check_first_rows_vs_torch_topk"))["values_equal"]]
    print(f"check failures: {len(failures)}")
    return 1 if failures else 0


# -- scores --------------------------------------------------------------------------------------------------------

def build_pool(fmt: KeyFormat, lengths: list[int], device: str,
               seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random keys for sequences of ``lengths`` entries in shuffled pages.

    Returns (pool uint8 [P, page_bytes], block_table int32 [B, max_pages], entry_counts int32 [B],
    dequantized keys fp32 [P * 64, 128] on device (slot order)).
    """
    g = torch.Generator().manual_seed(seed)
    pages_per = [max(1, math.ceil(n / 64)) for n in lengths]
    num_pages = sum(pages_per) + 3
    keys = torch.randn(num_pages * 64, DIM, generator=g)
    pool = fmt.quantize_pages(keys)
    dequant = fmt.dequantize_pages(pool)
    perm = torch.randperm(num_pages, generator=g)
    table = torch.full((len(lengths), max(pages_per)), -1, dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages_per):
        table[b, :p] = perm[used:used + p].to(torch.int32)
        used += p
    return (pool.to(device), table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device),
            dequant.to(device))


def torch_scores(q32: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, table: torch.Tensor, counts: torch.Tensor,
                 query_seq: torch.Tensor, positions: torch.Tensor | None, ratio: int, width: int) -> torch.Tensor:
    """fp32 torch computation of the reference semantics on the GPU (same operands as the kernel)."""
    t = q32.shape[0]
    out = torch.full((t, width), float("-inf"), device=q32.device)
    for b in range(table.shape[0]):
        rows = torch.nonzero(query_seq == b).flatten()
        n = int(counts[b])
        if rows.numel() == 0 or n == 0:
            continue
        idx = torch.arange(n, device=q32.device)
        slots = table[b].long()[idx // 64] * 64 + idx % 64
        k = keys[slots]
        for start in range(0, rows.numel(), 256):
            r = rows[start:start + 256]
            logits = torch.einsum("thd,nd->thn", q32[r], k)
            s = (logits.relu() * w[r].unsqueeze(-1)).sum(1)
            vis = torch.full((r.numel(),), n, device=q32.device)
            if positions is not None:
                vis = torch.minimum(vis, torch.div(positions[r].long() + 1, ratio, rounding_mode="floor").clamp(min=0))
            s = s.masked_fill(idx[None, :] >= vis[:, None], float("-inf"))
            out[r, :n] = s
    return out


# Tight bound (relative L2 against the same operands in fp32). fp8 x fp8 tensor-core products are accumulated
# by Hopper's wgmma with fewer than fp32 mantissa bits (DeepGEMM promotes to fp32 on CUDA cores for long K;
# here K = 128 is one chain), measured ~6e-5 relative; every other operand pair accumulates in fp32.
TIGHT_REL_L2 = {"fp8xfp8": 3e-4, "other": 1e-5}


def tight_bound(fmt_name: str, q_dtype: str) -> float:
    return TIGHT_REL_L2["fp8xfp8" if fmt_name.startswith("fp8") and "float8" in q_dtype else "other"]


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    mask_ok = bool(torch.equal(torch.isneginf(out), torch.isneginf(ref)))
    fin = torch.isfinite(ref)
    if fin.any():
        diff = (out[fin].double() - ref[fin].double())
        rel = float(diff.norm() / ref[fin].double().norm().clamp(min=1e-30))
        max_abs = float(diff.abs().max() / ref[fin].abs().max().clamp(min=1e-30))
    else:
        rel = max_abs = 0.0
    return {"mask_exact": mask_ok, "rel_l2": rel, "max_rel_to_max": max_abs, "nan": bool(torch.isnan(out).any())}


def error_row(case: str, fmt_name: str, q_dtype: torch.dtype, exc: Exception) -> dict:
    row = {"case": case, "format": fmt_name, "q": str(q_dtype), "error": repr(exc)[-600:], "mask_exact": False,
           "rel_l2": float("inf"), "nan": True}
    print({k: v for k, v in row.items() if k != "error"}, "ERROR", repr(exc)[-300:], flush=True)
    return row


def correctness(device: str, small: bool = False) -> list[dict]:
    """small=True: a few-second smoke version of the same cases (CPU interpreter)."""
    results = []
    shrink = 16 if small else 1
    for fmt_name in ("bf16", "fp8", "fp8-ue8m0", "fp4", "fp4-rne"):
        fmt = KeyFormat.parse(fmt_name)
        for q_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            # prefill: 3 sequences, ragged and unsorted queries, causal with ratio 4 and ratio 1
            lengths = [3000 // shrink, 0, 1537 // shrink]
            pool, table, counts, keys = build_pool(fmt, lengths, device, seed=1)
            for ratio in (4, 1):
                g = torch.Generator(device=device).manual_seed(2)
                t = 700 // shrink
                query_seq = torch.randint(0, 3, (t,), device=device, generator=g).to(torch.int32)
                positions = torch.randint(0, max(lengths) * ratio + 50, (t,), device=device,
                                          generator=g).to(torch.int32)
                q = torch.randn(t, HEADS, DIM, device=device, generator=g)
                w = torch.rand(t, HEADS, device=device, generator=g) - 0.3
                q_k = q.to(q_dtype)
                q_scale = None
                if q_dtype == torch.float8_e4m3fn:
                    q_scale = torch.rand(t, HEADS, device=device, generator=g) + 0.5
                out = torch.full((t, max(lengths)), float("nan"), device=device)
                try:
                    batch = PagedBatch.build(pool, fmt, table, counts, query_seq, positions, ratio)
                    index_scores_triton(q_k, w, batch, out=out, q_scale=q_scale)
                    again = index_scores_triton(q_k, w, batch, q_scale=q_scale)
                except Exception as exc:  # record and continue: one run must report every case
                    results.append(error_row("prefill", fmt_name, q_dtype, exc))
                    continue
                w_eff = w if q_scale is None else w * q_scale
                ref = torch_scores(q_k.float(), w_eff, keys, table, counts, query_seq, positions, ratio, max(lengths))
                row = {"case": "prefill", "format": fmt_name, "q": str(q_dtype), "ratio": ratio, "T": t,
                       "lengths": lengths, "deterministic": bool(torch.equal(out, again)), **compare(out, ref)}
                results.append(row)
                print(row, flush=True)
            # decode: B = 8, next_n 1 and 2, variable lengths, no causal cut / causal cut
            lengths = [1, 63, 64, 65, 1000 // shrink, 4097 // shrink, 0, 2500 // shrink]
            pool, table, counts, keys = build_pool(fmt, lengths, device, seed=3)
            for next_n in (1, 2):
                b = len(lengths)
                g = torch.Generator(device=device).manual_seed(4)
                q = torch.randn(b * next_n, HEADS, DIM, device=device, generator=g)
                w = torch.rand(b * next_n, HEADS, device=device, generator=g)
                query_seq = torch.arange(b, device=device, dtype=torch.int32).repeat_interleave(next_n)
                positions = (counts.long().repeat_interleave(next_n) - next_n
                             + torch.arange(next_n, device=device).repeat(b)).to(torch.int32)
                q_k = q.to(q_dtype)
                out = torch.full((b * next_n, max(lengths)), float("nan"), device=device)
                try:
                    index_scores_triton(q_k, w, PagedBatch.build(pool, fmt, table, counts, query_seq, positions),
                                        out=out)
                except Exception as exc:
                    results.append(error_row(f"decode next_n={next_n}", fmt_name, q_dtype, exc))
                    continue
                ref = torch_scores(q_k.float(), w, keys, table, counts, query_seq, positions, 1, max(lengths))
                row = {"case": f"decode next_n={next_n}", "format": fmt_name, "q": str(q_dtype), "ratio": 1,
                       "T": b * next_n, "lengths": lengths, **compare(out, ref)}
                results.append(row)
                print(row, flush=True)
    # DeepGEMM compatibility: context_lens [B], next_n 2, masking rule j <= len - next_n + i
    fmt = KeyFormat.FP8
    lengths = [5, 700, 2049, 64]
    pool, table, counts, keys = build_pool(fmt, lengths, device, seed=5)
    b, next_n, max_len = len(lengths), 2, 2100
    g = torch.Generator(device=device).manual_seed(6)
    q = torch.randn(b, next_n, HEADS, DIM, device=device, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(b * next_n, HEADS, device=device, generator=g)
    logits = fp8_paged_mqa_logits(q, pool.view(-1, 64, 1, 132), w, counts, table, max_len)
    query_seq = torch.arange(b, device=device).repeat_interleave(next_n)
    positions = counts.long().repeat_interleave(next_n) - next_n + torch.arange(next_n, device=device).repeat(b)
    ref = torch_scores(q.reshape(b * next_n, HEADS, DIM).float(), w, keys, table, counts, query_seq, positions, 1,
                       max_len)
    row = {"case": "deepgemm fp8_paged_mqa_logits next_n=2", "format": "fp8", "q": str(q.dtype),
           **compare(logits, ref)}
    results.append(row)
    print(row, flush=True)
    # non-paged DeepGEMM convention: row t sees kv[ks[t]:ke[t]]
    t, n = 300 // shrink, 5000 // shrink
    keys32 = torch.randn(n, DIM, device=device, generator=g)
    scale = keys32.abs().amax(dim=1).clamp(min=1e-4) / 448
    values = (keys32 / scale[:, None]).to(torch.float8_e4m3fn)
    q = torch.randn(t, HEADS, DIM, device=device, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(t, HEADS, device=device, generator=g)
    ke = torch.randint(0, n + 1, (t,), device=device, generator=g).to(torch.int32)
    ks = (ke - torch.randint(0, n // 2, (t,), device=device, generator=g)).clamp(min=0).to(torch.int32)
    logits = fp8_mqa_logits(q, (values, scale), w, ks, ke)
    k = values.float() * scale[:, None]
    ref = torch.cat([(torch.einsum("thd,nd->thn", q[i:i + 50].float(), k).relu() * w[i:i + 50, :, None]).sum(1)
                     for i in range(0, t, 50)])
    j = torch.arange(n, device=device)[None, :]
    ref = ref.masked_fill((j < ks[:, None].long()) | (j >= ke[:, None].long()), float("-inf"))
    row = {"case": "deepgemm fp8_mqa_logits (non-paged)", "format": "fp8", "q": str(q.dtype), **compare(logits, ref)}
    results.append(row)
    print(row, flush=True)
    return results


def failed(row: dict) -> bool:
    return (not row["mask_exact"] or row["nan"] or row.get("deterministic") is False
            or row["rel_l2"] > tight_bound(row["format"], row["q"]))


def measure(results: list[dict], base: dict, fn, graph: bool, extra) -> None:
    """Time fn, append base + timing + extra(ms) to results (errors are recorded, not fatal)."""
    try:
        ms, peak = timed(fn, "cuda", 200, graph=graph)  # graph=True: CUDA-graph replays, no Python launch cost
    except Exception as exc:  # a config that does not compile (shared memory) is reported, not fatal
        row = {**base, "error": repr(exc)[:300]}
    else:
        row = {**base, "ms": ms, "peak_extra_gib": peak, **extra(ms)}
    results.append(row)
    print(row, flush=True)


def prefill_bench(device: str, quick: bool, t: int = 8192, sizes: list[int] | None = None) -> list[dict]:
    """Kernel rows: tiles planned once, CUDA-graph timing. One "default call" row per size:
    the plain public call (validation + planning + launch), to show the host cost."""
    results = []
    configs = {  # (block_t, block_n, num_warps, num_stages); the first is the launcher default
        "fp8": [(64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (64, 256, 8, 3), (64, 64, 4, 3)],
        "bf16": [(64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3)],
        "fp4": [(64, 128, 4, 3), (128, 128, 8, 3), (64, 256, 8, 3)],
    }
    sizes = sizes or ([65536] if quick else [8192, 16384, 32768, 65536])
    for fmt_name, q_dtype in (("fp8", torch.float8_e4m3fn), ("bf16", torch.bfloat16), ("fp4", torch.bfloat16)):
        fmt = KeyFormat.parse(fmt_name)
        for n in sizes:
            pool, table, counts = timing_pool(fmt, [n], device, seed=7)
            g = torch.Generator(device=device).manual_seed(8)
            q = torch.randn(t, HEADS, DIM, device=device, generator=g).to(q_dtype)
            w = torch.rand(t, HEADS, device=device, generator=g)
            query_seq = torch.zeros(t, dtype=torch.int32, device=device)
            out = torch.empty(t, n, device=device)
            batch = PagedBatch.build(pool, fmt, table, counts, query_seq)
            flop = 2 * HEADS * DIM * t * n

            def extra(ms, n=n, flop=flop):
                return {"tflops": flop / ms / 1e9, "deepgemm_logits_ms": DEEPGEMM_PREFILL.get(n, (None,))[0]}

            base = {"case": "prefill", "format": fmt_name, "q": str(q_dtype), "T": t, "N": n, "H": HEADS, "D": DIM}
            measure(results, {**base, "mode": "default call"},
                    lambda: index_scores_triton(q, w, batch, out=out),
                    False, extra)
            cfgs = configs[fmt_name] if n == sizes[-1] else configs[fmt_name][:1]
            for bt, bn, warps, stages in cfgs:
                plan = plan_query_tiles(query_seq, 1, HEADS, kernel="tile", block_t=bt)

                def run(plan=plan, bn=bn, warps=warps, stages=stages):
                    config = ScoresConfig(kernel="tile", prefill_block_n=bn, prefill_warps=warps, prefill_stages=stages)
                    index_scores_triton(q, w, batch, out=out, tiles=plan, config=config)
                measure(results, {**base, "mode": "planned, graph", "config": [bt, bn, warps, stages]}, run, True,
                        extra)
            del pool, out
    return results


def decode_bench(device: str, quick: bool, b: int = 64, sizes: list[int] | None = None) -> list[dict]:
    results = []
    configs = {  # (block_n, tiles per program, num_warps, num_stages); the first is the launcher default
        "fp8": [(64, 8, 4, 3), (64, 16, 4, 4), (128, 8, 4, 3), (64, 4, 4, 3)],
        "bf16": [(64, 8, 4, 3), (64, 16, 4, 4), (128, 8, 4, 3)],
        "fp4": [(128, 8, 4, 3), (64, 8, 4, 3), (128, 4, 4, 3)],
    }
    for fmt_name, q_dtype in (("fp8", torch.float8_e4m3fn), ("bf16", torch.bfloat16), ("fp4", torch.bfloat16)):
        fmt = KeyFormat.parse(fmt_name)
        for n in sizes or ((65536,) if quick else (65536, 131072)):
            pool, table, counts = timing_pool(fmt, [n] * b, device, seed=9)
            g = torch.Generator(device=device).manual_seed(10)
            q = torch.randn(b, 1, HEADS, DIM, device=device, generator=g).to(q_dtype)
            w = torch.rand(b, HEADS, device=device, generator=g)
            query_seq = torch.arange(b, dtype=torch.int32, device=device)
            out = torch.empty(b, n, device=device)
            batch = PagedBatch.build(pool, fmt, table, counts, query_seq)
            unchecked = PagedBatch.build(pool, fmt, table, counts, query_seq, validate=False, max_entries=n)
            key_bytes = b * n * fmt.bytes_per_entry

            def extra(ms, key_bytes=key_bytes, n=n):
                return {"key_tb_per_s": key_bytes / ms / 1e9, "out_tb_per_s": b * n * 4 / ms / 1e9,
                        "deepgemm_logits_ms": DEEPGEMM_DECODE.get(n, (None,))[0]}

            base = {"case": "decode", "format": fmt_name, "q": str(q_dtype), "B": b, "next_n": 1, "N": n}
            measure(results, {**base, "mode": "default call"},
                    lambda: index_scores_decode(q, w, batch, out=out), False, extra)
            measure(results, {**base, "mode": "decode wrapper, unchecked batch"},
                    lambda: index_scores_decode(q, w, unchecked, out=out), False, extra)
            plan = plan_decode_tiles(b, 1, HEADS, device)
            for bn, per_prog, warps, stages in configs[fmt_name]:
                def run(bn=bn, per_prog=per_prog, warps=warps, stages=stages):
                    config = ScoresConfig(kernel="group", decode_block_n=bn, decode_tiles_per_program=per_prog,
                                          decode_warps=warps, decode_stages=stages)
                    index_scores_triton(q.view(b, HEADS, DIM), w, unchecked, out=out, tiles=plan, config=config)
                measure(results, {**base, "mode": "planned, graph", "config": [bn, per_prog, warps, stages]}, run,
                        True, extra)
            del pool, out
    return results


def main_scores(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_indexer.py scores")
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--quick", action="store_true", help="only N = 64K prefill / decode sizes")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--check-only", action="store_true", help="correctness only (CPU: TRITON_INTERPRET=1)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="smoke-size correctness cases")
    args = parser.parse_args(argv)
    device = args.device
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch comparison must be true fp32
    report = {"meta": {**environment(device, args.commit), "H": HEADS, "D": DIM}}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "scores_h200.json"

    def save():
        write_json(path, report)

    t0 = time.time()
    if not args.skip_check:
        report["correctness"] = correctness(device, small=args.small)
        save()
        print(f"correctness done in {time.time() - t0:.0f} s", flush=True)
    if args.check_only:
        bad = [r for r in report["correctness"] if failed(r)]
        print(f"correctness failures: {len(bad)}")
        return 1 if bad else 0
    report["prefill"] = prefill_bench(device, args.quick)
    save()
    report["decode"] = decode_bench(device, args.quick)
    save()
    print(f"total {time.time() - t0:.0f} s")
    print("\nformat  case     N       mode                            config            "
          "ms      TFLOP/s  key TB/s  peak GiB")
    for row in report["prefill"] + report["decode"]:
        head = f"{row['format']:6}  {row['case']:7}  {row['N']:6}  {row['mode']:30}  {str(row.get('config', '')):16}"
        if "ms" not in row:
            print(f"{head}  ERROR")
            continue
        print(f"{head}  {row['ms']:7.3f}  {row.get('tflops', 0):7.1f}  {row.get('key_tb_per_s', 0):8.2f}  "
              f"{row['peak_extra_gib']:7.2f}")
    bad = [r for r in report.get("correctness", []) if failed(r)]
    print(f"correctness failures: {len(bad)}")
    return 1 if bad else 0


# -- select --------------------------------------------------------------------------------------------------------

def make_scores(kind: str, rows: int, n: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, n, device=device, generator=g)
    if kind == "relu_like":     # sum over 8 heads of w * relu(.): positive, one or two octaves, like real logits
        s = torch.zeros(rows, n, device=device)
        for _ in range(8):
            s += torch.rand(rows, 1, device=device, generator=g) * torch.relu(
                torch.randn(rows, n, device=device, generator=g))
        return s
    if kind == "randn":
        return x
    if kind.startswith("pages"):  # "pages1", "pages3": each 64-entry page offset by sigma x N(0, 1)
        sigma = float(kind[len("pages"):])
        page = torch.randn(rows, -(-n // 64), device=device, generator=g) * sigma
        return (page.repeat_interleave(64, dim=1)[:, :n] + x).contiguous()
    if kind == "shift100":
        return x + 100.0
    if kind == "relu_zeros":    # ~99 % exact zeros: the top-k needs zeros, lower index wins
        return torch.relu(x - 2.33)
    if kind == "rising":        # recency-like trend: the top entries sit at the end of each row
        return x + torch.linspace(0, 8, n, device=device)
    raise ValueError(kind)


def filter_variants(rows: int, n: int, k: int) -> list[tuple[str, StreamConfig]]:
    """(name, launch) of the filters compared by ``--filters``: the default (warp filter), the thread filter's
    launch rule, its unroll (tiles per step) one step either side, 16 warps for its final (and threshold)
    kernel (the final kernel's range narrowing is ~1,350 SASS instructions per thread and step at 8 warps, 32
    buffer slots a thread, ~870 at 16: 128 registers instead of 208, two programs per SM), and where one
    program sorts a row (>= 1024 rows) the register-blocked sort (``StreamConfig.register_sort``)."""
    warp = dataclasses.replace(SelectConfig(stream_filter="warp").stream_for(rows, n, k), register_sort=False)
    thread = dataclasses.replace(SelectConfig(stream_filter="thread").stream_for(rows, n, k), register_sort=False)
    out = [("warp", warp), ("thread", thread)]
    for unroll in (thread.unroll // 2, thread.unroll * 2):
        if 1 <= unroll <= 64:
            out.append((f"thread_unroll{unroll}", dataclasses.replace(thread, unroll=unroll)))
    out.append(("thread_final16", dataclasses.replace(thread, final_warps=16)))
    if thread.sort_chunks(k) == 1:  # the one-program sort (>= 1024 rows) with its low strides in registers
        out.append(("thread_regsort", dataclasses.replace(thread, register_sort=True)))
        out.append(("warp_regsort", dataclasses.replace(warp, register_sort=True)))
        out.append((f"thread_unroll{thread.unroll * 2}_regsort",
                    dataclasses.replace(thread, unroll=thread.unroll * 2, register_sort=True)))
    return out


def compare_filters(args, report: dict, path: Path) -> list[str]:
    """The ``--filters`` section (see the module docstring). Returns the names of the failed checks."""
    dev = args.device
    # smoke: a split row (decode-like: threshold kernel + 4 split programs) and whole rows wider than the buffer
    shapes = [(2, 20000, 64), (4, 9000, 64)] if args.smoke else [(64, 131072, 2048), (64, 65536, 2048),
                                                                 (8192, 65536, 2048)]
    graph = dev == "cuda"
    failed = []
    for rows, n, k in shapes:
        for number, kind in enumerate(("relu_like", "shift100")):
            scores = make_scores(kind, rows, n, dev, seed=number)
            counts = torch.full((rows,), n, dtype=torch.int32, device=dev)
            # the variants on relu-like rows; shifted rows (all keys in one narrow range: other narrowing
            # steps) compare the two launch rules
            variants = [(name, cfg, SelectBuffers.allocate(rows, n, k, dev, cfg),
                         torch.empty((rows, k), dtype=torch.int32, device=dev))
                        for name, cfg in filter_variants(rows, n, k) if number == 0 or name in ("warp", "thread")]
            base = {"rows": rows, "N": n, "K": k, "kind": kind}
            first = None
            for name, cfg, buffers, out in variants:
                launch_stream_select(scores, counts, out, k, True, buffers)
                again = torch.empty_like(out)
                launch_stream_select(scores, counts, again, k, True, buffers)
                first = out.clone() if first is None else first
                check = {**base, "variant": name, "config": dataclasses.asdict(cfg), "paths": buffers.path_counts(rows),
                         "equals_warp_filter": bool(torch.equal(out, first)),
                         "deterministic": bool(torch.equal(out, again)), **same_selection(out, scores, k)}
                report["filters_check"].append(check)
                if not (check["equals_warp_filter"] and check["deterministic"] and check["values_equal"]
                        and check["pad_ok"]):
                    failed.append(f"{rows}x{n} {kind} {name}")
                print({a: b for a, b in check.items() if a != "config"}, flush=True)
            for round_number in ((1,) if args.smoke else (1, 2)):
                # eager torch.topk: >= 40 ms of calls (a prefill call takes ~8 ms; the graphs repeat calls
                # up to --rep ms per replay, 10 replays)
                ms = {"torch_topk": median_ms(lambda: torch.topk(scores, k, dim=1), dev, max(args.rep, 40)),
                      "torch_topk_graph": median_ms(lambda: torch.topk(scores, k, dim=1), dev, args.rep, graph=graph)}
                for name, cfg, buffers, out in variants:
                    labels = (("sorted", True, "all"), ("filter", True, "filter") if "unroll" in name else
                              ("filter+final", True, "filter+final"))
                    if name.endswith("_regsort"):  # only the sort differs from its base variant
                        labels = (("sorted", True, "all"),)
                    if name in ("warp", "thread"):  # the two launch rules: every stage; variants: two
                        labels += (("unsorted", False, "all"), ("filter", True, "filter"))
                    for label, sort, stages in labels:
                        ms[f"{name}:{label}"] = median_ms(
                            lambda sort=sort, stages=stages, buffers=buffers, out=out: launch_stream_select(
                                scores, counts, out, k, sort, buffers, stages=stages), dev, args.rep, graph=graph)
                row = {**base, "round": round_number, "timing": "cuda graph replays (torch_topk: eager and graph)"
                       if graph else "one wall-clock call (cpu smoke, no claim)", "ms": ms,
                       "speedup_sorted_vs_torch_topk": {name: ms["torch_topk"] / ms[f"{name}:sorted"]
                                                        for name, *_ in variants}}
                report["filters_time"].append(row)
                print({**base, "round": round_number, **{a: round(b, 4) for a, b in ms.items()}}, flush=True)
                write_json(path, report)
            del scores, variants
    return failed


def compare_sample_groups(args, report: dict) -> list[str]:
    """The ``--sample-groups`` section: the default streaming select (threshold sample in groups of 8 at
    walking offsets) against groups of 32, on random rows and on rows whose 64-entry pages carry offsets of 1
    and 3 standard deviations (benchmarks/tools/select_sample_groups.py has the CPU emulation): paths taken, both
    exact, time sorted (decode shapes in CUDA graphs). Returns the failed checks."""
    dev = args.device
    shapes = [(4, 20000, 64)] if args.smoke else [(64, 65536, 2048), (64, 131072, 2048), (8192, 65536, 2048)]
    graph = dev == "cuda"
    failed = []
    for rows, n, k in shapes:
        for number, kind in enumerate(("relu_like", "pages1", "pages3")):
            scores = make_scores(kind, rows, n, dev, seed=100 + number)
            counts = torch.full((rows,), n, dtype=torch.int32, device=dev)
            row = {"rows": rows, "N": n, "K": k, "kind": kind}
            first = None
            for group in (8, 32):
                cfg = dataclasses.replace(SelectConfig().stream_for(rows, n, k), sample_group=group)
                buffers = SelectBuffers.allocate(rows, n, k, dev, cfg)
                out = torch.empty((rows, k), dtype=torch.int32, device=dev)
                launch_stream_select(scores, counts, out, k, True, buffers)
                first = out.clone() if first is None else first
                row[f"group{group}_paths"] = buffers.path_counts(rows)
                check = same_selection(out, scores, k)
                row[f"group{group}_exact"] = check["values_equal"] and bool(torch.equal(out, first))
                if not row[f"group{group}_exact"]:
                    failed.append(f"{rows}x{n} {kind} group {group}")
                row[f"group{group}_ms"] = median_ms(lambda: launch_stream_select(scores, counts, out, k, True, buffers),
                                                    dev, args.rep, graph=graph and rows < 512)
            print(row, flush=True)
            report["sample_groups"].append(row)
    return failed


def main_select(argv: list[str] | None = None) -> int:
    ap = bench_parser()
    ap.prog = "bench_indexer.py select"
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer distributions and shapes")
    ap.add_argument("--filters", action="store_true", help="only the warp vs thread filter comparison")
    ap.add_argument("--sample-groups", action="store_true",
                    help="only the threshold sample's group size (8 vs 32) on random and page-clustered rows")
    ap.add_argument("--rep", type=int, default=60)
    args = ap.parse_args(argv)
    dev = args.device
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.sample_groups:
        path = out_dir / f"select_sample_groups_{args.commit}.json"
        report = {"meta": environment(dev, args.commit), "sample_groups": []}
        failed = compare_sample_groups(args, report)
        report["failed_checks"] = failed
        write_json(path, report)
        print(f"failed checks: {failed}", flush=True)
        return 1 if failed else 0
    if args.filters:
        path = out_dir / f"select_filters_{args.commit}.json"
        report = {"meta": environment(dev, args.commit), "filters_check": [], "filters_time": []}
        t_start = time.time()
        failed = compare_filters(args, report, path)  # --rep 10: ~1-1.5 min on the H200, ~40 s of it compiles
        report["meta"]["total_s"] = time.time() - t_start
        report["failed_checks"] = failed
        write_json(path, report)
        print(f"done in {report['meta']['total_s']:.0f} s; failed checks: {failed}", flush=True)
        return 1 if failed else 0
    path = out_dir / f"select_{args.commit}.json"
    report = {"meta": environment(dev, args.commit), "check": [], "time": [], "sweep": []}
    t_start = time.time()

    if args.smoke:
        shapes = [(16, 3000, 8), (2, 20000, 64)]
        kinds = ["relu_like", "relu_zeros", "rising"]
    else:
        shapes = [(8192, 65536, 2048), (8192, 65536, 512), (64, 131072, 2048), (64, 65536, 2048),
                  (256, 131072, 2048), (8192, 8192, 2048)]
        kinds = ["relu_like", "randn", "shift100", "relu_zeros", "rising"]
        if args.quick:
            shapes = shapes[:1] + shapes[2:4]
            kinds = ["relu_like", "relu_zeros", "rising"]

    for rows, n, k in shapes:
        for number, kind in enumerate(kinds):
            scores = make_scores(kind, rows, n, dev, seed=number)
            buffers = SelectBuffers.allocate(rows, n, k, dev)
            got = select_topk_stream(scores, k, buffers=buffers)
            paths = buffers.path_counts(rows)
            again = select_topk_stream(scores, k, buffers=buffers)
            row = {"rows": rows, "N": n, "K": k, "kind": kind, "config": dataclasses.asdict(buffers.config),
                   "buffer_mb": buffers.nbytes / 2**20, "paths": paths,
                   "deterministic": bool(torch.equal(got, again)), **same_selection(got, scores, k)}
            if kind in ("relu_zeros",) and rows * n <= 64 * 131072:
                row["equals_reference"] = bool(torch.equal(got.cpu(), reference_select(scores.cpu(), k)))
            if kind in ("relu_like", "relu_zeros") or number == 0:
                ms = {}
                ms["stream"] = median_ms(lambda: select_topk_stream(scores, k, buffers=buffers), dev, args.rep)
                ms["stream_unsorted"] = median_ms(
                    lambda: select_topk_stream(scores, k, buffers=buffers, sort=False), dev, args.rep)
                counts = torch.full((rows,), n, dtype=torch.int32, device=dev)
                out = torch.empty((rows, k), dtype=torch.int32, device=dev)
                for stages in ("filter", "filter+final"):
                    ms[stages] = median_ms(lambda: launch_stream_select(scores, counts, out, k, True, buffers,
                                                                        stages=stages), dev, args.rep)
                ms["multipass"] = median_ms(
                    lambda: select_topk_triton(scores, k, config=SelectConfig(algorithm="multipass")), dev, args.rep)
                ms["torch_topk"] = median_ms(lambda: torch.topk(scores, k, dim=1), dev, args.rep)
                row["ms"] = ms
                row["speedup_vs_torch"] = ms["torch_topk"] / ms["stream"]
                row["speedup_unsorted_vs_torch"] = ms["torch_topk"] / ms["stream_unsorted"]
                report["time"].append({"rows": rows, "N": n, "K": k, "kind": kind, **ms})
            report["check"].append(row)
            print(f"{rows:5d} x {n:6d} K {k:4d} {kind:10s} paths {paths} exact {row['values_equal']} "
                  f"sets-off {row['set_mismatch_rows']} det {row['deterministic']} "
                  + (" ".join(f"{a} {b:.3f}" for a, b in row.get("ms", {}).items())), flush=True)
            write_json(path, report)
            del scores, buffers

    if args.sweep and not args.smoke:
        for rows, n, k in [(8192, 65536, 2048), (64, 131072, 2048)]:
            scores = make_scores("relu_like", rows, n, dev, seed=0)
            base = SelectConfig().stream_for(rows, n, k)
            variants = [base]
            if rows >= 512:
                variants += [dataclasses.replace(base, v=16), dataclasses.replace(base, num_warps=8, v=16),
                             dataclasses.replace(base, order_warps=4), dataclasses.replace(base, final_warps=8)]
            else:
                variants += [dataclasses.replace(base, splits=2, lanes=128), dataclasses.replace(base, v=16),
                             dataclasses.replace(base, order_warps=4)]
            for cfg in variants:
                buffers = SelectBuffers.allocate(rows, n, k, dev, cfg)
                ms = median_ms(lambda: select_topk_stream(scores, k, buffers=buffers), dev, args.rep)
                counts = torch.full((rows,), n, dtype=torch.int32, device=dev)
                out = torch.empty((rows, k), dtype=torch.int32, device=dev)
                filt = median_ms(lambda: launch_stream_select(scores, counts, out, k, True, buffers, stages="filter"),
                                 dev, args.rep)
                report["sweep"].append({"rows": rows, "N": n, "K": k, "config": dataclasses.asdict(cfg), "ms": ms,
                                        "filter_ms": filt})
                print(f"sweep {rows} x {n}: {cfg} -> {ms:.3f} ms (filter {filt:.3f})", flush=True)
                write_json(path, report)
            del scores
    report["meta"]["total_s"] = time.time() - t_start
    write_json(path, report)
    bad = [r for r in report["check"] if not (r["values_equal"] and r["pad_ok"] and r["deterministic"])]
    print(f"done in {report['meta']['total_s']:.0f} s; {len(bad)} inexact rows sets", flush=True)
    return 1 if bad else 0


# -- decode --------------------------------------------------------------------------------------------------------

def bench(fn, device: str, rep_ms: int) -> float:
    return median_ms(fn, device, rep_ms, warmup=10)


def reference_rows(s: dict, fmt: KeyFormat, rows: list[int], n: int) -> torch.Tensor:
    """fp32 scores [len(rows), n] with the reference semantics: dequantized keys (CPU decode of the page bytes),
    S = sum_h w * q_scale * relu(q . k), fp32 matmul on the inputs' device (TF32 off)."""
    out = []
    pages_per_seq = (n + 63) // 64
    for b in rows:
        pages = s["pool"][s["table"][b, :pages_per_seq].long()]
        keys = fmt.dequantize_pages(pages)[:n].to(s["pool"].device)             # [n, 128] fp32
        q = s["q"][b, 0].float()                                                 # [H, 128]
        w = s["w"][b].float() * (s["qs"][b] if s["qs"] is not None else 1.0)    # [H]
        out.append((torch.relu(q @ keys.T) * w[:, None]).sum(0))
    return torch.stack(out)


def run_case(fmt_name: str, n: int, ks: list[int], b: int, heads: int, device: str, rep_ms: int,
             smoke: bool) -> list[dict]:
    fmt = KeyFormat.parse(fmt_name)
    sets = []
    for number in range(2):  # two input sets: graph replays alternate between them
        pool, table, counts = timing_pool(fmt, [n] * b, device, seed=100 + number)
        q, w, qs = make_queries(fmt.kind, b, heads, device, seed=200 + number)
        seq = torch.arange(b, device=device, dtype=torch.int32)
        sets.append({"q": q.reshape(b, 1, heads, DIM), "w": w, "qs": qs, "pool": pool, "table": table,
                     "counts": counts, "batch": PagedBatch.build(pool, fmt, table, counts, seq)})
    check_rows = [0, 1, b - 1]
    ref = reference_rows(sets[0], fmt, check_rows, n)  # reference-semantics scores of 3 rows (set 0)
    rows_out = []
    for k in ks:
        plan = plan_decode_topk(b, 1, n, k, fmt, device, num_heads=heads)

        def call(s):
            return index_topk_decode(s["q"], s["w"], s["batch"], k, plan=plan, q_scale=s["qs"])

        def public(s=sets[0]):
            return index_topk_triton(s["q"].reshape(b, heads, DIM), s["w"], s["batch"], k, q_scale=s["qs"])

        a = sets[0]
        eager = call(a).clone()  # compiles
        row = {"case": "decode", "format": fmt.name, "q": str(a["q"].dtype), "B": b, "next_n": 1, "N": n,
               "H": heads, "K": k, "plan_bytes": plan.workspace_bytes}
        # no sync, no allocation in the plan call
        if device == "cuda":
            row.update(sync_and_alloc(lambda: call(a), alloc_key="alloc_extra_bytes"))
        pub = public()
        row["equal_to_public"] = bool(torch.equal(pub, eager))
        # exact selection on the scores the plan selected from (all rows), format error on 3 rows
        row["check_select_vs_torch_topk"] = same_selection(eager, plan.workspace, k)
        got_scores = plan.workspace[check_rows]
        row["scores_rel_l2_vs_fp32"] = float((got_scores - ref).norm() / ref.norm())
        ref_idx = torch.topk(ref, min(k, n), dim=1).indices
        overlap = [len(set(eager[r].tolist()) & set(ref_idx[i].tolist())) / min(k, n)
                   for i, r in enumerate(check_rows)]
        row["topk_overlap_vs_fp32_reference"] = min(overlap)

        # timings
        row["public_ms"] = bench(public, device, rep_ms)
        row["plan_eager_ms"] = bench(lambda: call(a), device, rep_ms)
        row["torch_topk_ms"] = bench(lambda: torch.topk(plan.workspace, k, dim=1), device, rep_ms)
        if device == "cuda" and not smoke:
            call(sets[1])  # every kernel is compiled for both input sets before any capture
            torch.cuda.synchronize()
            graphs = []
            for s in sets:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    call(s)
                graphs.append(graph)
            replayed = []
            for graph in graphs:
                graph.replay()
                replayed.append(plan.indices.clone())
            row["graph_equals_eager"] = bool(torch.equal(replayed[0], eager)
                                             and torch.equal(replayed[1], call(sets[1])))
            turn = [0]

            def replay():
                graphs[turn[0] & 1].replay()
                turn[0] += 1

            row["graph_ms"] = bench(replay, device, rep_ms)

            scores_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(scores_graph):
                launch_index_scores(prepare_q(a["q"].reshape(b, heads, DIM)), a["w"], a["batch"], plan.workspace,
                                    plan.tiles, q_scale=a["qs"], config=plan.scores)
            select_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(select_graph):
                launch_select(plan.workspace, plan.visible, plan.indices, k, True, config=plan.select,
                              cand_vals=plan.cand_vals, cand_idx=plan.cand_idx)
            row["scores_graph_ms"] = bench(scores_graph.replay, device, rep_ms)
            row["select_graph_ms"] = bench(select_graph.replay, device, rep_ms)
            del graphs, scores_graph, select_graph
        anchor = DEEPGEMM_DECODE.get(n)
        if anchor:
            row["deepgemm_logits_ms"] = anchor[0]
            row["deepgemm_plus_topk_ms"] = anchor[0] + (anchor[1] if k == 512 else anchor[2])
        best = row.get("graph_ms", row["plan_eager_ms"])
        key_bytes = b * n * fmt.bytes_per_entry
        row["key_tb_per_s"] = key_bytes / best / 1e9
        row["key_bw_fraction"] = row["key_tb_per_s"] / HBM_TB_PER_S
        if "scores_graph_ms" in row:
            row["scores_key_tb_per_s"] = key_bytes / row["scores_graph_ms"] / 1e9
        if anchor:
            row["vs_deepgemm"] = row["deepgemm_plus_topk_ms"] / best
        print(row, flush=True)
        rows_out.append(row)
        del plan
    return rows_out


def host_case(n: int, k: int, b: int, heads: int, device: str, rep_ms: int, smoke: bool) -> dict:
    """The public ``index_topk`` (batch from host metadata) against the planned decode path: host cost."""
    fmt = KeyFormat.FP8
    pool, table, counts = timing_pool(fmt, [n] * b, device, seed=n + k)
    batch = PagedBatch.from_host(pool, fmt, table.cpu().tolist(), [n] * b)
    static = PagedBatch.build(pool, fmt, table, counts, torch.arange(b, dtype=torch.int32, device=device),
                              validate=False, max_entries=n)  # for the graph
    q, w, _ = make_queries("bf16", b, heads, device, seed=7)
    plan = plan_decode_topk(b, 1, n, k, fmt, device, num_heads=heads)

    def public():
        return index_topk(q, w, batch, k)

    def planned():
        return index_topk_decode(q, w, static, k, plan=plan)

    first = public().clone()  # compiles, fills the workspace and plan caches
    row = {"case": "host", "format": fmt.name, "q": str(q.dtype), "B": b, "next_n": 1, "N": n, "H": heads, "K": k,
           "output_bytes": b * k * 4}
    if device == "cuda":
        row.update(sync_and_alloc(public))
    row["public_equals_plan"] = bool(torch.equal(first, planned()))
    row["public_ms"] = bench(public, device, rep_ms)
    row["plan_eager_ms"] = bench(planned, device, rep_ms)
    if device == "cuda" and not smoke:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            planned()
        graph.replay()
        torch.cuda.synchronize()
        row["graph_equals_public"] = bool(torch.equal(plan.indices, first))
        row["plan_graph_ms"] = bench(graph.replay, device, rep_ms)
        del graph
    row["public_over_plan"] = row["public_ms"] / row["plan_eager_ms"]
    print(row, flush=True)
    return row


def main_decode(argv: list[str] | None = None) -> int:
    parser = bench_parser()
    parser.prog = "bench_indexer.py decode"
    parser.add_argument("--sections", default="decode,host", help="comma list: decode (plan path), host (public call)")
    args = parser.parse_args(argv)
    device = args.device
    smoke = args.smoke
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    b, heads = (4, 16) if smoke else (64, 64)
    ns = [300] if smoke else [65536, 131072]
    ks = [8, 32] if smoke else [512, 2048]
    rep_ms = 5 if smoke else 60
    report = {"meta": {**environment(device, args.commit), "B": b, "H": heads, "D": DIM, "next_n": 1, "N": ns,
                       "K": ks, "formats": ["fp8", "bf16", "fp4"], "timing": "triton.testing.do_bench median, ms"},
              "decode": [], "host": [], "skipped": []}
    start = time.time()

    def save():
        write_json(out_dir / "decode_h200.json", report)

    for fmt_name in ("fp8", "bf16", "fp4") if "decode" in args.sections else ():
        for n in ns:
            if time.time() - start > TIME_GUARD_S:
                report["skipped"].append({"format": fmt_name, "N": n, "why": "time guard"})
                continue
            report["decode"] += run_case(fmt_name, n, ks, b, heads, device, rep_ms, smoke)
            print(f"[{time.time() - start:.0f} s] {fmt_name} {n} done", flush=True)
            save()
            if device == "cuda":
                torch.cuda.empty_cache()
    for n in ns if "host" in args.sections else ():
        for k in (ks[-1], ks[0]):
            report["host"].append(host_case(n, k, b, heads, device, rep_ms, smoke))
            save()
            if device == "cuda":
                torch.cuda.empty_cache()
    report["meta"]["total_s"] = time.time() - start
    save()

    failures = 0
    print("\nfmt   N       K     public  eager   graph   scores  select  topk    DG+topk  key TB/s  exact  sync-free")
    for r in report["decode"]:
        ok = (r["check_select_vs_torch_topk"]["values_equal"] and r["equal_to_public"]
              and r.get("graph_equals_eager", True) and r.get("sync_free", True)
              and r.get("alloc_extra_bytes", 0) == 0)
        failures += not ok
        print(f"{r['format']:5} {r['N']:7} {r['K']:5} {r['public_ms']:7.3f} {r['plan_eager_ms']:7.3f} "
              f"{r.get('graph_ms', 0):7.3f} {r.get('scores_graph_ms', 0):7.3f} {r.get('select_graph_ms', 0):7.3f} "
              f"{r['torch_topk_ms']:7.3f} {r.get('deepgemm_plus_topk_ms', 0):8.3f} {r['key_tb_per_s']:8.2f}  "
              f"{ok!s:5}  {r.get('sync_free', '-')}  rel_l2 {r['scores_rel_l2_vs_fp32']:.1e} "
              f"overlap {r['topk_overlap_vs_fp32_reference']:.3f}")
    print("\nhost: N       K     public  plan    graph   public/plan  sync-free  alloc-peak  equal")
    for r in report["host"]:
        ok = r["public_equals_plan"] and r.get("sync_free") is not False and r.get("graph_equals_public", True)
        failures += not ok
        print(f"      {r['N']:7} {r['K']:5} {r['public_ms']:7.3f} {r['plan_eager_ms']:7.3f} "
              f"{r.get('plan_graph_ms', 0):7.3f} {r['public_over_plan']:11.2f}  {r.get('sync_free')!s:9}  "
              f"{r.get('alloc_peak_bytes')!s:10}  {ok}")
    print(f"skipped: {report['skipped']}; check failures: {failures}; total {time.time() - start:.0f} s")
    return 1 if failures else 0


COMMANDS = {"matrix": main_matrix, "scores": main_scores, "select": main_select, "decode": main_decode}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    wants_help = argv[:1] in (["-h"], ["--help"])
    if not argv or argv[0] not in COMMANDS:
        print(__doc__ if wants_help else f"usage: bench_indexer.py {{{','.join(COMMANDS)}}} [options] "
                                         "(bench_indexer.py --help says what each does)")
        return 0 if wants_help else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
