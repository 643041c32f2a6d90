"""The exact top-k alone on fp32 scores: streaming select vs the multi-pass radix select vs torch.topk.

Per shape (prefill 8192 x 65536 / 8192 x 8192, decode 64 x 65536 / 64 x 131072 / 256 x 131072) and score
distribution (relu-like weighted head sums, randn, randn + 100, relu rows made mostly of exact zeros, rows
rising with the index like a recency bias):
  check   the streaming select vs torch.topk (same selected values; index sets equal where the k-th value is
          not tied), which path the rows took (candidate buffer / tie lists / exact fallback), two runs
          bitwise equal;
  time    medians (triton.testing.do_bench) of the streaming select (sorted and unsorted), the multi-pass
          select of dsakit.ops.indexer.triton, torch.topk (sorted) on the same scores; ratios;
  sweep   (optional) launch configurations of the streaming select.

  filters (``--filters``, instead of the above) the streaming select with the warp filter (the default)
          against the thread filter (``SelectConfig(stream_filter="thread")``, and a few variants: unroll,
          16-warp final, register-blocked sort) and torch.topk, on 8192 x 65536, 64 x 65536, 64 x 131072 at K 2048, relu-like and +100
          shifted rows, two timing rounds each; every variant's sorted output must equal the warp filter's
          bitwise (both are exact) and torch.topk's values; writes DIR/select_filters_SHA.json (with --rep 10
          ~1-1.5 min on an H200, ~40 s of it Triton compiles).

  sample groups (``--sample-groups``) the threshold sample in groups of 8 (default) against 32 on random rows
          and rows whose pages carry offsets (``pages1``, ``pages3``): paths, exactness, time (~1 min)

Usage: PYTHONPATH=. python3 benchmarks/bench_select.py --out DIR --commit SHA [--sweep] [--quick]
       PYTHONPATH=. python3 benchmarks/bench_select.py --out DIR --commit SHA --filters
       (``--device cpu --smoke`` under TRITON_INTERPRET=1 runs toy sizes, no timing claims)
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch
from _common import bench_parser, environment, median_ms, same_selection, write_json

from dsakit.ops.indexer.config import SelectConfig, StreamConfig
from dsakit.ops.indexer.select import SelectBuffers, launch_stream_select, select_topk_stream, select_topk_triton


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
    # the plain sort as the baseline of both filters (the register-blocked sort is a variant below)
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
    and 3 standard deviations (benchmarks/select_sample_groups.py has the CPU emulation): paths taken, both
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


def main() -> int:
    ap = bench_parser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer distributions and shapes")
    ap.add_argument("--filters", action="store_true", help="only the warp vs thread filter comparison")
    ap.add_argument("--sample-groups", action="store_true",
                    help="only the threshold sample's group size (8 vs 32) on random and page-clustered rows")
    ap.add_argument("--rep", type=int, default=60)
    args = ap.parse_args()
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
                from dsakit.ops.indexer.reference import select_topk as reference_select
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


if __name__ == "__main__":
    sys.exit(main())
