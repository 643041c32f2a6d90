"""dsakit's indexer top-k beside DeepGEMM logits + torch.topk, timed in one process on one GPU.

Builds nothing: ``deep_gemm`` is imported if it is importable (on the GPU machine: ``source
benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz`` first); without it the DeepGEMM columns are
left out and everything else runs. H 64, D 128, K 2048, every query sees every entry (as DeepGEMM's
anchor cases). Sections:

  prefill  T = 8192 queries x N = 8192 / 32768 / 65536 / 262144 entries:
           DeepGEMM ``fp8_fp4_mqa_logits`` (fp8 q, fp8 keys + fp32 scales) and torch.topk on those logits
           (time, peak extra memory); dsakit's select alone vs torch.topk on the same fp32 logits
           (streaming select sorted and unsorted, exactness vs torch.topk); dsakit ``index_topk`` end to end
           with fp8 keys (fp8 q + q_scale), and bf16 / fp4 keys (bf16 q) at N = 65536; fp8 and bf16 also
           with ``TopkConfig(sort=False)`` (``dsakit_<fmt>_unsorted_ms``, beside torch.topk(sorted=False):
           the engines' contract is a set).
  decode   B = 64 sequences x N = 65536 / 131072, next_n = 1..4 (rows B * next_n):
           DeepGEMM ``fp8_fp4_paged_mqa_logits`` (+ ``get_paged_mqa_logits_metadata``, context_lens
           [B, next_n], clean_logits=False) + torch.topk, reading dsakit's fp8 pages; dsakit's select alone
           on those logits; dsakit's decode plan (``plan_decode_topk`` + ``index_topk_decode``) replayed in
           a CUDA graph, fp8 keys (at next_n = 1 also bf16 keys with bf16 q, fp4 keys with fp8 q + q_scale
           as the fp8 row, and fp4 keys with bf16 q: ``fp4_bf16q``). Times per call and per query row.

Every ratio is dsakit / peer from the same run (< 1: dsakit faster). Peak extra memory: max allocated during
one call above what was allocated before it (dsakit: a call after its cached workspaces were released, so
they count). Results: DIR/vs_deepgemm_<commit>.json (written after every
case), a table printed at the end.

Usage (GPU machine): source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz
                     PYTHONPATH=. python3 benchmarks/bench_vs_deepgemm.py --out DIR [--commit SHA] [--runs 2]
       (``--device cpu --smoke`` under TRITON_INTERPRET=1: toy sizes, no DeepGEMM, no timing claims)
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from _common import (DIM, bench_parser, environment, make_queries, median_ms, peak_extra_bytes, same_selection,
                     timing_pool, write_json)

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.indexer.scores import launch_index_scores, prepare_q
from dsakit.ops.indexer.config import TopkConfig
from dsakit.ops.indexer.triton import index_topk_decode
from dsakit.ops.indexer.plans import plan_decode_topk
from dsakit.ops.indexer.select import SelectBuffers, select_topk_stream
from dsakit.ops.indexer.triton import index_topk_triton, release_workspaces

PREFILL_VARIANTS = ("fp8_unsorted", "bf16", "bf16_unsorted", "fp4", "fp4_bf16q")

HEADS = 64
K = 2048


def load_deep_gemm():
    try:
        import deep_gemm
        return deep_gemm
    except Exception as error:  # noqa: BLE001 - any import failure means: no anchor in this run
        print(f"deep_gemm not importable ({type(error).__name__}: {error}); DeepGEMM columns left out", flush=True)
        return None


def fp8_keys_of_pool(pool: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n entries of a single-sequence dsakit fp8 pool whose pages are in table order ->
    DeepGEMM's non-paged kv = (fp8 [n, 128], fp32 scales [n]) (same bytes, same values)."""
    pages = pool.shape[0]
    values = pool[:, : 64 * DIM].reshape(pages * 64, DIM)[:n]
    scales = pool[:, 64 * DIM:].contiguous().view(torch.float32).reshape(pages * 64)[:n]
    return values.contiguous().view(torch.float8_e4m3fn), scales.contiguous()


def ordered_pool(fmt: KeyFormat, n: int, device: str, seed: int):
    """One sequence of n entries, pages in table order (page i = logical page i)."""
    pool, table, counts = timing_pool(fmt, [n], device, seed)
    pool = pool[table[0].long()].contiguous()
    table = torch.arange(pool.shape[0], device=device, dtype=torch.int32).unsqueeze(0)
    return pool, table, counts


def main() -> int:
    ap = bench_parser(commit_default=None)
    ap.add_argument("--runs", type=int, default=1, help="repeat the whole matrix (run-to-run spread)")
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms)")
    ap.add_argument("--sections", default="prefill,decode")
    ap.add_argument("--prefill-n", default="8192,32768,65536,262144", help="prefill entry counts N")
    ap.add_argument("--decode-n", default="65536,131072", help="decode entry counts N")
    ap.add_argument("--next-n", default="1,2,3,4", help="decode queries per sequence")
    args = ap.parse_args()
    dev = args.device
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    dg = None if args.smoke or dev != "cuda" else load_deep_gemm()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"vs_deepgemm_{commit}.json"
    meta = environment(dev, commit)
    meta.update({"deep_gemm_version": getattr(dg, "__version__", None), "H": HEADS, "D": DIM, "K": K,
                 "runs": args.runs, "notes": "every query sees every entry; ratios dsakit / peer of the same run"})
    report = {"meta": meta, "prefill": [], "decode": []}
    sections = args.sections.split(",")
    t = 16 if args.smoke else 8192
    heads = 4 if args.smoke else HEADS
    k = 16 if args.smoke else K
    prefill_n = [300, 1200] if args.smoke else [int(x) for x in args.prefill_n.split(",")]
    other_formats_n = 1200 if args.smoke else 65536
    decode_b = 2 if args.smoke else 64
    decode_n = [300] if args.smoke else [int(x) for x in args.decode_n.split(",")]
    t_start = time.time()

    def bench(fn, graph=False):
        return median_ms(fn, dev, args.rep, graph=graph)

    def select_alone(row: dict, logits: torch.Tensor, graph: bool) -> None:
        """dsakit's streaming select alone on the same fp32 logits as torch.topk (row holds torch_topk_ms, and
        torch_topk_unsorted_ms where the peer ran): exactness, paths, why rows took the exact passes, times."""
        rows, width = logits.shape
        buffers = SelectBuffers.allocate(rows, width, k, dev)
        row["select_check"] = same_selection(select_topk_stream(logits, k, buffers=buffers), logits, k)
        row["select_paths"] = buffers.path_counts(rows)
        row["select_exact_rows"] = buffers.exact_row_stats(rows)
        row["select_ms"] = bench(lambda: select_topk_stream(logits, k, buffers=buffers), graph=graph)
        row["select_unsorted_ms"] = bench(lambda: select_topk_stream(logits, k, buffers=buffers, sort=False),
                                          graph=graph)
        row["select_speedup_vs_torch_topk"] = row["torch_topk_ms"] / row["select_ms"]
        row["select_unsorted_speedup_vs_torch_topk"] = row["torch_topk_ms"] / row["select_unsorted_ms"]
        if "torch_topk_unsorted_ms" in row:
            row["select_unsorted_speedup_vs_torch_topk_unsorted"] = (row["torch_topk_unsorted_ms"]
                                                                     / row["select_unsorted_ms"])

    for run in range(args.runs):
        if "prefill" in sections:
            for n in prefill_n:
                fmt = KeyFormat.parse("fp8")
                pool, table, counts = ordered_pool(fmt, n, dev, seed=7)
                q, w, qs = make_queries("fp8", t, heads, dev, seed=8)
                batch = PagedBatch.build(pool, fmt, table, counts, torch.zeros(t, dtype=torch.int32, device=dev))
                row = {"run": run, "case": "prefill", "T": t, "N": n, "K": k}
                logits = None
                if dg is not None:
                    kv = fp8_keys_of_pool(pool, n)
                    ks = torch.zeros(t, dtype=torch.int32, device=dev)
                    ke = torch.full((t,), n, dtype=torch.int32, device=dev)
                    wq = (w * qs).contiguous()  # DeepGEMM has no q scale: fold it into the weights

                    def dg_logits():
                        return dg.fp8_fp4_mqa_logits((q, None), kv, wq, ks, ke, clean_logits=False)

                    logits = dg_logits()
                    row["dg_logits_ms"] = bench(dg_logits)
                    row["torch_topk_ms"] = bench(lambda: torch.topk(logits, k, dim=1))
                    row["torch_topk_unsorted_ms"] = bench(lambda: torch.topk(logits, k, dim=1, sorted=False))
                    row["dg_plus_topk_ms"] = row["dg_logits_ms"] + row["torch_topk_ms"]
                    row["dg_plus_topk_unsorted_ms"] = row["dg_logits_ms"] + row["torch_topk_unsorted_ms"]
                    row["dg_plus_topk_peak_gib"] = peak_extra_bytes(
                        lambda: torch.topk(dg_logits(), k, dim=1), dev) / 2**30
                else:  # the same fp32 scores for the select-alone columns, from dsakit's scores
                    from dsakit.ops.indexer.scores import index_scores_triton
                    logits = index_scores_triton(q, w, batch, q_scale=qs)
                    row["torch_topk_ms"] = bench(lambda: torch.topk(logits, k, dim=1))
                # select alone on the same fp32 logits
                select_alone(row, logits, graph=False)
                del logits
                # end to end
                formats = ["fp8"] + (["bf16", "fp4"] if n == other_formats_n else [])
                for name in formats:
                    if name != "fp8":
                        fmt = KeyFormat.parse(name)
                        pool, table, counts = ordered_pool(fmt, n, dev, seed=9)
                        q, w, qs = make_queries(name, t, heads, dev, seed=8)
                        batch = PagedBatch.build(pool, fmt, table, counts,
                                                 torch.zeros(t, dtype=torch.int32, device=dev))

                    def e2e():
                        return index_topk_triton(q, w, batch, k, q_scale=qs)

                    e2e()
                    release_workspaces()  # the peak includes the cached workspaces a first call allocates
                    if dev == "cuda":
                        torch.cuda.empty_cache()
                    row[f"dsakit_{name}_peak_gib"] = peak_extra_bytes(e2e, dev) / 2**30
                    row[f"dsakit_{name}_ms"] = bench(e2e)
                    if name in ("fp8", "bf16"):
                        # the unsorted set (what the sparse attention consumes)
                        for variant, change in (("unsorted", dict(sort=False)),):
                            cfg = replace(TopkConfig.for_device(dev), **change)
                            row[f"dsakit_{name}_{variant}_ms"] = bench(
                                lambda cfg=cfg: index_topk_triton(q, w, batch, k, q_scale=qs, config=cfg))
                    if "dg_plus_topk_ms" in row:
                        row[f"dsakit_{name}_vs_dg_plus_topk"] = row[f"dsakit_{name}_ms"] / row["dg_plus_topk_ms"]
                        if f"dsakit_{name}_unsorted_ms" in row:
                            row[f"dsakit_{name}_unsorted_vs_dg_plus_topk_unsorted"] = (
                                row[f"dsakit_{name}_unsorted_ms"] / row["dg_plus_topk_unsorted_ms"])
                report["prefill"].append(row)
                print({key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
                write_json(path, report)
                del pool, q, w, qs, batch
                if dev == "cuda":
                    torch.cuda.empty_cache()

        if "decode" in sections:
            b = decode_b
            for n in decode_n:
                fmt = KeyFormat.parse("fp8")
                pool, table, counts = timing_pool(fmt, [n] * b, dev, seed=11)
                for next_n in [int(x) for x in args.next_n.split(",")]:
                    rows = b * next_n
                    q, w, qs = make_queries("fp8", rows, heads, dev, seed=12)
                    seq = torch.arange(b, device=dev, dtype=torch.int32).repeat_interleave(next_n)
                    batch = PagedBatch.build(pool, fmt, table, counts, seq)
                    row = {"run": run, "case": "decode", "B": b, "next_n": next_n, "N": n, "K": k}
                    logits = None
                    if dg is not None:
                        kv_cache = pool.view(pool.shape[0], 64, 1, DIM + 4)
                        context = torch.full((b, next_n), n, dtype=torch.int32, device=dev)
                        q4 = q.reshape(b, next_n, heads, DIM)
                        wq = (w * qs).contiguous()
                        try:
                            meta_dg = dg.get_paged_mqa_logits_metadata(context, 64, dg.get_num_sms())

                            def dg_logits():
                                return dg.fp8_fp4_paged_mqa_logits((q4, None), kv_cache, wq, context, table,
                                                                   meta_dg, n, clean_logits=False)

                            logits = dg_logits()
                            row["dg_logits_ms"] = bench(dg_logits)
                            row["torch_topk_ms"] = bench(lambda: torch.topk(logits, k, dim=1))
                            row["torch_topk_unsorted_ms"] = bench(lambda: torch.topk(logits, k, dim=1, sorted=False))
                            row["dg_plus_topk_ms"] = row["dg_logits_ms"] + row["torch_topk_ms"]
                            row["dg_plus_topk_unsorted_ms"] = row["dg_logits_ms"] + row["torch_topk_unsorted_ms"]
                        except Exception as error:  # noqa: BLE001 - e.g. no next_n = 3 kernel on Hopper
                            row["dg_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                            logits = None
                    plan = plan_decode_topk(b, next_n, n, k, fmt, dev, num_heads=heads)

                    def call():
                        return index_topk_decode(q, w, batch, k, plan=plan, q_scale=qs)

                    call()
                    if logits is None:
                        logits = plan.workspace.clone()
                        row["torch_topk_ms"] = bench(lambda: torch.topk(logits, k, dim=1))
                    select_alone(row, logits, graph=dev == "cuda")
                    qp = prepare_q(q)
                    row["dsakit_fp8_scores_ms"] = bench(  # the scores kernel alone, as DeepGEMM's logits
                        lambda: launch_index_scores(qp, w, batch, plan.workspace[:, :n], plan.tiles, q_scale=qs,
                                                    config=plan.scores), graph=dev == "cuda")
                    row["dsakit_fp8_ms"] = bench(call, graph=dev == "cuda")
                    plan_set = plan_decode_topk(b, next_n, n, k, fmt, dev, num_heads=heads, sort=False)
                    index_topk_decode(q, w, batch, k, plan=plan_set, q_scale=qs)
                    row["dsakit_fp8_unsorted_ms"] = bench(
                        lambda: index_topk_decode(q, w, batch, k, plan=plan_set, q_scale=qs), graph=dev == "cuda")
                    del plan_set
                    row["dsakit_fp8_us_per_row"] = 1e3 * row["dsakit_fp8_ms"] / rows
                    row["check_plan_vs_torch_topk"] = same_selection(plan.indices, plan.workspace, k)
                    if "dg_plus_topk_ms" in row:
                        row["dg_plus_topk_us_per_row"] = 1e3 * row["dg_plus_topk_ms"] / rows
                        row["dsakit_fp8_vs_dg_plus_topk"] = row["dsakit_fp8_ms"] / row["dg_plus_topk_ms"]
                        row["dsakit_fp8_unsorted_vs_dg_plus_topk_unsorted"] = (row["dsakit_fp8_unsorted_ms"]
                                                                              / row["dg_plus_topk_unsorted_ms"])
                    if next_n == 1:
                        # fp4 keys with fp8 q (+ q_scale), as the fp8 row: the decode kernel's per-block fp8
                        # dots; fp4_bf16q: bf16 q (per-block bf16 dots)
                        for name, q_kind in (("bf16", "bf16"), ("fp4", "fp8"), ("fp4_bf16q", "bf16")):
                            fmt2 = KeyFormat.parse(name.split("_")[0])
                            pool2, table2, counts2 = timing_pool(fmt2, [n] * b, dev, seed=13)
                            q2, w2, qs2 = make_queries(q_kind, rows, heads, dev, seed=12)
                            batch2 = PagedBatch.build(pool2, fmt2, table2, counts2, seq)
                            plan2 = plan_decode_topk(b, 1, n, k, fmt2, dev, num_heads=heads)

                            def call2():
                                return index_topk_decode(q2, w2, batch2, k, plan=plan2, q_scale=qs2)

                            call2()
                            row[f"dsakit_{name}_ms"] = bench(call2, graph=dev == "cuda")
                            del pool2, plan2, batch2
                    report["decode"].append(row)
                    print({key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
                    write_json(path, report)
                    del plan, logits
                del pool

    report["meta"]["total_s"] = time.time() - t_start
    write_json(path, report)
    print(f"\n{'case':28s} {'DG+topk':>9s} {'dsakit':>9s} {'ratio':>6s} | select vs topk  (ms)")
    for r in report["prefill"]:
        print(f"prefill {r['T']}x{r['N']:<7d} run {r['run']} {r.get('dg_plus_topk_ms', float('nan')):9.3f} "
              f"{r['dsakit_fp8_ms']:9.3f} {r.get('dsakit_fp8_vs_dg_plus_topk', float('nan')):6.2f} | "
              f"{r['select_ms']:.3f} vs {r['torch_topk_ms']:.3f} = {r['select_speedup_vs_torch_topk']:.2f}x "
              f"(unsorted {r['select_unsorted_speedup_vs_torch_topk']:.2f}x)"
              + "".join(f" {f} {r[f'dsakit_{f}_ms']:.3f}" for f in PREFILL_VARIANTS if f"dsakit_{f}_ms" in r))
    for r in report["decode"]:
        print(f"decode {r['B']}x{r['N']} n{r['next_n']} run {r['run']} {r.get('dg_plus_topk_ms', float('nan')):9.3f} "
              f"{r['dsakit_fp8_ms']:9.3f} {r.get('dsakit_fp8_vs_dg_plus_topk', float('nan')):6.2f} | "
              f"{r['select_ms']:.3f} vs {r['torch_topk_ms']:.3f} = {r['select_speedup_vs_torch_topk']:.2f}x"
              + "".join(f" {f} {r[f'dsakit_{f}_ms']:.3f}" for f in ("bf16", "fp4", "fp4_bf16q") if f"dsakit_{f}_ms" in r))
    bad = [r for r in report["prefill"] + report["decode"] if not r["select_check"]["values_equal"]]
    print(f"done in {report['meta']['total_s']:.0f} s; {len(bad)} cases with an inexact select")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
