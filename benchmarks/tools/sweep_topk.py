"""Launch-configuration sweep of the indexer's decode scores, streaming select and chunked prefill (H200).

Exploration runs behind the defaults in ``ScoresConfig`` / ``SelectConfig.stream_for`` / ``TopkConfig``:
  decode    scores kernel alone (CUDA-graph replays), fp8 keys + fp8 q, fp4 keys + fp8 q (each ``decode_fp4``
            mode the installed version knows), B = 64 sequences x N in {65536, 131072}, per
            (BLOCK_N, key tiles per program, warps, stages);
  select    the streaming select on relu-like rows (and relu zeros), per ``StreamConfig`` variant: whole
            select sorted / unsorted, filter only, filter + final, which path the rows took; torch.topk
            (sorted and unsorted) on the same scores;
  prefill   ``index_topk_triton`` end to end at T = 8192 x N = 65536, K 2048, fp8 / bf16 keys, for each
            ``TopkConfig`` variant the installed version has (e.g. chunk overlap on / off).
Every selection is checked against torch.topk (same values; a mismatch is recorded, not hidden).

Usage: PYTHONPATH=. python3 benchmarks/tools/sweep_topk.py --out DIR --commit SHA [--sections decode,select,prefill]
       (``--device cpu --smoke`` under TRITON_INTERPRET=1: toy sizes, no timing claims)
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _common and the bench_* scripts
from _common import (bench_parser, environment, make_queries, median_ms, peak_extra_bytes, same_selection, timing_pool,
                     write_json)
from bench_indexer import make_scores

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.indexer.config import ScoresConfig
from dsakit.ops.indexer.scores import launch_index_scores, prepare_q
from dsakit.ops.indexer.plans import plan_decode_tiles
from dsakit.ops.indexer.config import SelectConfig, StreamConfig, TopkConfig
from dsakit.ops.indexer.select import SelectBuffers, launch_stream_select
from dsakit.ops.indexer.triton import index_topk_triton

HEADS = 64


def decode_section(dev: str, smoke: bool, report: dict, path: Path, rep: int, formats: str = "",
                   next_n: int = 1) -> None:
    b = 2 if smoke else 64
    sizes = [300] if smoke else ([65536, 131072] if next_n == 1 else [65536])
    # (BLOCK_N, key tiles per program, warps, stages, register cap[, decode_loads]) per case. fp8: the gather
    # path's best against the page copies ("tma": one bulk copy per 64-entry page, tiles per program = pages),
    # the default since sweep_topk_h200_b4b4485 / ac42a7e, which hold the wider exploration of both
    fp8_like = [(128, 16, 4, 5, None, "gather"), (64, 32, 4, 5, None, "tma"), (64, 32, 4, 5, 128, "tma")]
    if next_n > 1:  # wider programs (next_n x 64 query-head columns): the launch defaults (None) of both paths
        fp8_like = [(None, None, 4, None, None, "gather"), (None, None, 4, None, None, "tma")]
    per_case = {("fp8", None): fp8_like,
                ("bf16", None): [(64, 8, 4, 3, None), (64, 16, 4, 5, None), (128, 16, 4, 5, None),
                                 (64, 16, 4, 3, None)],
                # fp4: the gather path's measured best (64, 16, 4, 5; sweep_topk_h200_20f5e89) against the page
                # copies (four [64, 16]-byte boxes per page), pages per program / warps / stages
                # (sweep_topk_h200_4a0a4ae: 32 pages / 5 stages 0.267 / 0.514 ms at 64 x 64K / 128K against 0.281 /
                # 0.550 gathering; 16-64 pages within 1 %, 8 warps or 3 stages 35-60 % slower). A 128-register
                # cap fits four programs per SM (168 registers: three; ptxas spills 48 bytes at 128)
                ("fp4", "blocks"): [(64, 16, 4, 5, None, "gather"), (None, None, 4, None, None, "tma"),
                                    (None, 32, 4, 5, 168, "tma"), (None, 32, 4, 6, 128, "tma"),
                                    (None, 64, 4, 5, 128, "tma")]}
    if next_n > 1:
        per_case[("fp4", "blocks")] = [(None, None, 4, None, None, "gather"), (None, None, 4, None, None, "tma"),
                                       (None, 32, 8, 3, None, "tma"), (None, 32, 8, 5, None, "tma"),
                                       (None, 16, 4, 5, None, "tma")]
    for (fmt_name, fp4_mode), configs in per_case.items():
        if formats and fmt_name not in formats.split(","):
            continue
        configs = configs[:2] if smoke else configs
        fmt = KeyFormat.parse(fmt_name)
        for n in sizes:
            pool, table, counts = timing_pool(fmt, [n] * b, dev, seed=9)
            ref = None
            q, w, qs = make_queries("bf16" if fmt_name == "bf16" else "fp8", b * next_n, HEADS, dev, seed=10)
            seq = torch.arange(b, dtype=torch.int32, device=dev).repeat_interleave(next_n)
            batch = PagedBatch.build(pool, fmt, table, counts, seq)
            tiles = plan_decode_tiles(b, next_n, HEADS, dev)
            out = torch.empty(b * next_n, n, device=dev)
            qp = prepare_q(q)
            for bn, per_prog, warps, stages, maxnreg, *loads in configs:
                extra = {} if fp4_mode is None else {"decode_fp4": fp4_mode}
                if loads:
                    extra["decode_loads"] = loads[0]
                cfg = ScoresConfig(kernel="group", decode_block_n=bn, decode_tiles_per_program=per_prog,
                                   decode_warps=warps, decode_stages=stages, decode_maxnreg=maxnreg, **extra)
                row = {"section": "decode", "format": fmt_name, "fp4_mode": fp4_mode, "B": b, "N": n, "next_n": next_n,
                       "config": [bn, per_prog, warps, stages, maxnreg, *loads]}

                def run(cfg=cfg):
                    launch_index_scores(qp, w, batch, out, tiles, q_scale=qs, config=cfg)
                try:
                    run()
                    if ref is None:
                        ref = out.clone()
                    row["max_abs_vs_first"] = float((out - ref).abs().max())
                    row["ms"] = median_ms(run, dev, rep, graph=dev == "cuda")
                    row["key_tb_per_s"] = b * n * fmt.bytes_per_entry / row["ms"] / 1e9
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                    row["error"] = repr(exc)[:300]
                report["decode"].append(row)
                print(row, flush=True)
                write_json(path, report)
            del pool, out, ref


def _stream_variants(rows: int, n: int, k: int, earlier: bool = False) -> list[tuple[str, StreamConfig]]:
    """Select variants against the default. earlier: also the order_chunks / v / cap / splits / rank-order
    variants of the earlier sweeps (sweep_topk_h200_{b4b4485,ac42a7e,8468ee4})."""
    base = SelectConfig().stream_for(rows, n, k)
    out = [("default", base)]
    # histogram buckets of the range narrowing (the filter's sample threshold and the final kernel): each step
    # costs a few block-wide operations, and wider steps (8-9 bits instead of 6) need fewer of them
    for bins in (128, 256, 512):
        out.append((f"bins={bins}", dataclasses.replace(base, bins=bins)))
    # a smaller threshold sample: less prologue per filter program, a looser threshold (more candidates)
    out.append((f"sample={base.sample // 2},bins=256", dataclasses.replace(base, sample=max(256, base.sample // 2),
                                                                          bins=256)))
    if not earlier:
        return out
    if hasattr(base, "order_chunks"):  # the sort split over C programs per row (chunk sorts + rank merge)
        for chunks in ((1, 2) if rows >= 1024 else (1, 8)):
            if chunks != base.order_chunks:
                out.append((f"order_chunks={chunks}", dataclasses.replace(base, order_chunks=chunks)))
    if rows < 1024:  # longer tiles per filter step (fewer block-wide scans per entry)
        for v in (64, 128):
            if base.splits * base.lanes * max(32, 2 * v) <= 16384 and base.lanes * v <= 16384:
                out.append((f"v={v}", dataclasses.replace(base, v=v, tie_cap=max(32, 2 * v))))
    if n <= base.cap:  # rows that fit the buffer skip the sample; a smaller cap makes them sample a threshold
        for cap in (2048, 4096):
            if cap < base.cap and cap >= 2 * k:
                lanes = max(16, min(128, cap // 64))
                v = max(8, 1024 // lanes)
                out.append((f"cap={cap}", dataclasses.replace(base, cap=cap, lanes=lanes, v=v, tie_cap=max(32, 2 * v),
                                                             sample=max(base.sample, 256))))
    if rows < 1024 and base.splits < 8 and False:  # measured slower (sweep_topk_h200_ac42a7e); kept for reference
        for splits in (8, 16):
            lanes = max(16, base.cap // (splits * 64))
            v = max(8, 1024 // lanes)
            cfg = dataclasses.replace(base, splits=splits, lanes=lanes, v=v, tie_cap=max(32, 2 * v))
            if splits * lanes * cfg.tie_cap <= 16384 and cfg.cap >= splits * lanes:
                out.append((f"splits={splits}", cfg))
    if hasattr(base, "rank_order"):  # the parallel rank order (few rows) against the bitonic sort
        out.append((f"rank_order={not base.rank_order}", dataclasses.replace(base, rank_order=not base.rank_order)))
        # the first sweep's tiles ([128, 256] compares per step) spilled: small tiles, <= 32 compares a thread
        for bi, bj, warps in ((128, 16, 4), (128, 32, 4), (64, 32, 2), (256, 16, 8), (32, 32, 1)):
            out.append((f"rank{bi}x{bj}w{warps}", dataclasses.replace(base, rank_order=True, rank_block_i=bi,
                                                                       rank_block_j=bj, rank_warps=warps)))
    return out


def select_section(dev: str, smoke: bool, report: dict, path: Path, rep: int, shapes: str = "",
                   earlier: bool = False) -> None:
    k = 16 if smoke else 2048
    shapes = [(4, 512)] if smoke else ([tuple(map(int, x.split("x"))) for x in shapes.split(",")] if shapes else
                                       [(64, 131072), (64, 65536), (256, 131072), (8192, 65536)])
    for rows, n in shapes:
        for kind in ("relu_like",):
            scores = make_scores(kind, rows, n, dev, seed=0)
            counts = torch.full((rows,), n, dtype=torch.int32, device=dev)
            out = torch.empty((rows, k), dtype=torch.int32, device=dev)
            base_row = {"section": "select", "rows": rows, "N": n, "K": k, "kind": kind}
            ref = {"torch_topk_ms": median_ms(lambda: torch.topk(scores, k, dim=1), dev, rep),
                   "torch_topk_unsorted_ms": median_ms(lambda: torch.topk(scores, k, dim=1, sorted=False), dev, rep)}
            report["select"].append({**base_row, **ref})
            print(report["select"][-1], flush=True)
            for name, cfg in _stream_variants(rows, n, k, earlier):
                row = {**base_row, "variant": name, "config": dataclasses.asdict(cfg)}
                try:
                    buffers = SelectBuffers.allocate(rows, n, k, dev, cfg)
                    launch_stream_select(scores, counts, out, k, True, buffers)
                    row["paths"] = buffers.path_counts(rows)
                    row["check"] = same_selection(out, scores, k)
                    ms = {}
                    for label, sort, stages in (("sorted", True, "all"), ("unsorted", False, "all"),
                                                ("filter", True, "filter"), ("filter+final", True, "filter+final")):
                        ms[label] = median_ms(lambda sort=sort, stages=stages: launch_stream_select(
                            scores, counts, out, k, sort, buffers, stages=stages), dev, rep, graph=dev == "cuda")
                    row["ms"] = ms
                    row["speedup_sorted"] = ref["torch_topk_ms"] / ms["sorted"]
                    row["speedup_unsorted_vs_unsorted"] = ref["torch_topk_unsorted_ms"] / ms["unsorted"]
                    del buffers
                except Exception as exc:  # noqa: BLE001
                    row["error"] = repr(exc)[:300]
                report["select"].append(row)
                print({a: b for a, b in row.items() if a != "config"}, flush=True)
                write_json(path, report)
            del scores, out


def prefill_section(dev: str, smoke: bool, report: dict, path: Path, rep: int, formats: str = "") -> None:
    t, n, k = (64, 300, 16) if smoke else (8192, 65536, 2048)
    variants = [("default", TopkConfig())]
    # scores tile kernel (BLOCK_T, BLOCK_N, warps, stages): the 64 x 128 tile at 4 warps holds 250 registers and
    # 80 KiB (3 stages), two programs per SM (ncu at 4a0a4ae: tensor pipe 62 %, 2 warps per scheduler). Measured
    # and dropped: 168 / 160-register caps for three programs per SM, 8 warps, 128 x 128 (f6afd91); the key tile
    # as the register A operand for every head with q_h^T from shared memory (c5a81f2: 1.6-2.7x slower)
    for bt, bn, warps, stages in ((64, 128, 4, 2),):
        variants.append((f"scores={bt}x{bn},w{warps},s{stages}", TopkConfig(scores=ScoresConfig(
            prefill_block_t=bt, prefill_block_n=bn, prefill_warps=warps, prefill_stages=stages))))
    for fmt_name in [f for f in ("fp8", "bf16") if not formats or f in formats.split(",")]:
        fmt = KeyFormat.parse(fmt_name)
        pool, table, counts = timing_pool(fmt, [n], dev, seed=7)
        q, w, qs = make_queries(fmt_name, t, HEADS, dev, seed=8)
        batch = PagedBatch.build(pool, fmt, table, counts, torch.zeros(t, dtype=torch.int32, device=dev))
        first = None
        for name, cfg in variants:
            row = {"section": "prefill", "format": fmt_name, "T": t, "N": n, "K": k, "variant": name}
            got = index_topk_triton(q, w, batch, k, config=cfg, q_scale=qs)
            first = got if first is None else first
            row["equal_to_default"] = bool(torch.equal(got, first))
            call = lambda cfg=cfg: index_topk_triton(q, w, batch, k, config=cfg, q_scale=qs)  # noqa: E731
            row["peak_extra_gib"] = peak_extra_bytes(call, dev) / 2**30
            row["ms"] = median_ms(call, dev, rep)
            report["prefill"].append(row)
            print(row, flush=True)
            write_json(path, report)
        del pool, q, w, first


def main() -> int:
    ap = bench_parser()
    ap.add_argument("--sections", default="decode,select,prefill")
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--decode-formats", default="", help="comma list: only these key formats in the decode section")
    ap.add_argument("--prefill-formats", default="", help="comma list: only these key formats in the prefill section")
    ap.add_argument("--next-n", default="1", help="comma list of queries per sequence for the decode section")
    ap.add_argument("--select-shapes", default="", help="rows x N list, e.g. 64x131072,64x65536 (default: all)")
    ap.add_argument("--select-earlier", action="store_true",
                    help="select section: also the variants of the earlier sweeps (order chunks, v, cap, splits)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "sweep_topk.json"
    report = {"meta": environment(args.device, args.commit), "decode": [], "select": [], "prefill": []}
    # launch choices only: the speed claims against the peer come from bench_peers.py in the same process
    report["meta"].update(deep_gemm_version=None, peer="none in this file: a launch-configuration sweep of "
                          "dsakit kernels (torch.topk on the same scores); ratios against DeepGEMM + "
                          "torch.topk come from bench_peers.py")
    start = time.time()
    sections = {"decode": decode_section, "select": select_section, "prefill": prefill_section}
    for name in args.sections.split(","):
        if name == "decode":
            for next_n in map(int, args.next_n.split(",")):
                decode_section(args.device, args.smoke, report, path, args.rep, args.decode_formats, next_n)
            continue
        extra = {"shapes": args.select_shapes, "earlier": args.select_earlier} if name == "select" else {}
        if name == "prefill":
            extra = {"formats": args.prefill_formats}
        sections[name](args.device, args.smoke, report, path, args.rep, **extra)
    report["meta"]["total_s"] = time.time() - start
    write_json(path, report)
    bad = [r for r in report["select"] if "check" in r and not r["check"]["values_equal"]]
    print(f"done in {report['meta']['total_s']:.0f} s; {len(bad)} inexact selections", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
