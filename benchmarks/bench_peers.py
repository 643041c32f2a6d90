"""dsakit beside every peer present on the machine, timed the same way on the same inputs in one process.

Peers (each built or unpacked by a script of benchmarks/anchors/ from the ignored folder .anchors/; a peer
that is not importable is reported as missing with the reason, never timed from elsewhere):

  DeepGEMM     ``deep_gemm``: fp8 MQA logits (prefill), paged fp8 MQA logits (decode); + torch.topk
               (source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz)
  StreamIndex  ``flash_sparse``: Triton V4 indexer, bf16 q and keys, chunked scores + torch.topk merge
               (source benchmarks/anchors/build_streamindex.sh .anchors/streamindex-06e9216.tgz)
  FlashInfer   ``flashinfer.top_k`` (sorted, deterministic, ties to the lower index), when importable
  DeepSelect   ``deep_select.topk`` (fp32 input, sorted), when importable
  torch.topk   always

Timing rule (issue 26): prefill calls are timed eager on both sides (triton.testing.do_bench); decode calls
are timed as CUDA-graph replays on both sides (do_bench_cudagraph), the peer's whole step (logits + top-k)
captured in one graph like dsakit's plan. Sections:

  select   the exact top-k alone on the same fp32 rows: 8192 x 65536 (eager) and 64 x 131072 (graph), K 2048,
           rows randn / relu (half exact zeros) / relu_zeros (~99 % zeros: the k-th value is a tied zero) /
           shift100 (randn + 100); dsakit's streaming select vs torch.topk and each select peer; exactness
           (selected values equal torch.topk's), index sets equal to dsakit's, two calls bitwise equal
  prefill  indexer top-k end to end, T 8192 x N 8192 / 32768 / 65536 / 262144, H 64, K 2048, every query sees
           every entry: dsakit fp8 keys vs DeepGEMM fp8 logits + torch.topk (one eager call: logits then
           top-k); dsakit bf16 keys vs StreamIndex (bf16, chunk_s 2048, chunk_t 8192); peak extra memory
  decode   B 64 x N 65536 / 131072, next_n 1 / 2 / 4 (rows B * next_n), graph on both sides: dsakit fp8 and
           fp4 keys (fp8 q + q_scale) vs DeepGEMM paged fp8 logits + torch.topk; at next_n 1 also dsakit bf16
           vs StreamIndex; times per call and per query row; the fp8 step's select alone on the scores that
           step wrote (``dsakit_fp8_select_of_step_ms``, graph: the step's split between scores and select)

Ratios are dsakit / peer from the same run (< 1: dsakit faster). Results: DIR/peers_<commit>.json (written
after every case) with GPU, versions, commit and each peer's version and source commit.

Usage (GPU machine):
    source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz
    source benchmarks/anchors/build_streamindex.sh .anchors/streamindex-06e9216.tgz
    PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/bench_peers.py --out DIR [--sections select,prefill,decode]
(``--device cpu --smoke`` under TRITON_INTERPRET=1: toy sizes, dsakit and torch only, no timing claims)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch
from _common import (DIM, bench_parser, environment, make_queries, median_ms, peak_extra_bytes, same_selection,
                     timing_pool, write_json)
from bench_select import make_scores

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.indexer.triton import index_topk_decode
from dsakit.ops.indexer.plans import plan_decode_topk
from dsakit.ops.indexer.select import SelectBuffers, launch_select, select_topk_stream
from dsakit.ops.indexer.triton import index_topk_triton, release_workspaces

HEADS = 64
K = 2048
SELECT_KINDS = ("randn", "relu", "relu_zeros", "shift100")


# ----------------------------------------------------------------------------------------------- peers
def _anchor_sources(module) -> "str | None":
    """The ANCHOR_SOURCES record the pack script put beside the package (source commits), if any."""
    for parent in Path(module.__file__).resolve().parents[:3]:
        record = parent / "ANCHOR_SOURCES"
        if record.is_file():
            return record.read_text().strip()
    return None


def load_peers(device: str) -> tuple[dict, dict]:
    """-> (modules of the peers present, {peer: {"present", "version", "sources" | "reason"}})."""
    modules, info = {}, {}
    wanted = {"deep_gemm": "deep_gemm", "streamindex": "flash_sparse.triton.chunked_indexer",
              "flashinfer": "flashinfer", "deep_select": "deep_select"}
    for peer, name in wanted.items():
        if device != "cuda":
            info[peer] = {"present": False, "reason": "CUDA only (CPU smoke run)"}
            continue
        try:
            module = __import__(name, fromlist=["_"])
        except Exception as error:  # noqa: BLE001 - any import failure means: this peer is missing here
            info[peer] = {"present": False, "reason": f"{type(error).__name__}: {str(error)[:200]}"}
            print(f"peer {peer} missing: {info[peer]['reason']}", flush=True)
            continue
        top = sys.modules[name.split(".")[0]]
        modules[peer] = module
        info[peer] = {"present": True, "version": getattr(top, "__version__", None),
                      "sources": _anchor_sources(top)}
    return modules, info


def _try(row: dict, key: str, fn):
    """Run fn() and return its result; on failure record ``<key>_error`` in the row and return None."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - a peer failing on a case is a result, not a crash
        row[f"{key}_error"] = f"{type(error).__name__}: {str(error)[:200]}"
        print(f"  {key} failed: {row[f'{key}_error']}", flush=True)
        return None


def _ratio(row: dict, mine: str, peer: str) -> None:
    if mine in row and peer in row:
        row[f"{mine[:-3]}_vs_{peer[:-3]}"] = row[mine] / row[peer]


def _dsakit_set_equal(got: torch.Tensor, ours: torch.Tensor, k: int) -> bool:
    """Whether a peer's index set equals dsakit's on every row (order ignored)."""
    a = torch.sort(got[:, :k].long(), dim=1).values
    b = torch.sort(ours[:, :k].long(), dim=1).values
    return bool(torch.equal(a, b))


def _time_prefill_peer(row: dict, name: str, prefix: str, step, mine: torch.Tensor, ours_key: str, bench,
                       dev) -> None:
    """Run a peer's prefill step once (its recall of dsakit's indices), then its peak extra memory and time
    under ``<prefix>_peak_gib`` / ``<prefix>_ms`` and the ratio to ``ours_key``; a failing peer leaves
    ``<name>_error`` in the row instead."""
    got = _try(row, name, step)
    if got is None:
        return
    row[f"{name}_recall_of_dsakit"] = _recall(got, mine)
    del got
    row[f"{prefix}_peak_gib"] = peak_extra_bytes(step, dev) / 2**30
    row[f"{prefix}_ms"] = bench(step)
    _ratio(row, ours_key, f"{prefix}_ms")


def _recall(got: torch.Tensor, ours: torch.Tensor) -> float:
    """Mean fraction of dsakit's valid indices (>= 0) that the peer selected too (row by row)."""
    ours = ours.long()
    theirs = torch.sort(got.long(), dim=1).values.contiguous()
    pos = torch.searchsorted(theirs, ours.contiguous()).clamp(max=theirs.shape[1] - 1)
    hit = (theirs.gather(1, pos) == ours) & (ours >= 0)
    return float(hit.sum()) / max(int((ours >= 0).sum()), 1)


# ---------------------------------------------------------------------------------------------- select
def select_case(row: dict, scores: torch.Tensor, k: int, graph: bool, peers: dict, bench) -> None:
    rows, width = scores.shape
    buffers = SelectBuffers.allocate(rows, width, k, scores.device)

    def ours():
        return select_topk_stream(scores, k, buffers=buffers)

    mine = ours().clone()
    row["dsakit_check"] = same_selection(mine, scores, k)
    row["dsakit_deterministic"] = bool(torch.equal(mine, ours()))
    row["dsakit_paths"] = buffers.path_counts(rows)
    row["dsakit_ms"] = bench(ours, graph)
    row["torch_topk_ms"] = bench(lambda: torch.topk(scores, k, dim=1), graph)
    _ratio(row, "dsakit_ms", "torch_topk_ms")
    row["dsakit_speedup_vs_torch_topk"] = row["torch_topk_ms"] / row["dsakit_ms"]
    callers = {}
    if "flashinfer" in peers:
        fi = peers["flashinfer"]
        callers["flashinfer"] = lambda: fi.top_k(scores, k, sorted=True, deterministic=True, tie_break=1,
                                                 dsa_graph_safe=graph)[1]
    if "deep_select" in peers:
        ds = peers["deep_select"]
        callers["deep_select"] = lambda: ds.topk(scores, k, sorted=True, return_value=False)[1]
    for name, call in callers.items():
        got = _try(row, name, call)
        if got is None:
            continue
        got = got.clone()
        row[f"{name}_check"] = same_selection(got, scores, k)
        row[f"{name}_same_set_as_dsakit"] = _dsakit_set_equal(got, mine, k)
        row[f"{name}_deterministic"] = bool(torch.equal(got, call()))
        timed = _try(row, f"{name}_time", lambda call=call: bench(call, graph))
        if timed is not None:
            row[f"{name}_ms"] = timed
            _ratio(row, "dsakit_ms", f"{name}_ms")


# --------------------------------------------------------------------------------------------- helpers
def ordered_pool(fmt: KeyFormat, n: int, device: str, seed: int):
    """One sequence of n entries whose pages are in table order (page i = logical page i), so the peers'
    contiguous key tensors are views of the same bytes dsakit reads."""
    pool, table, counts = timing_pool(fmt, [n], device, seed)
    pool = pool[table[0].long()].contiguous()
    table = torch.arange(pool.shape[0], device=device, dtype=torch.int32).unsqueeze(0)
    return pool, table, counts


def fp8_keys(pool: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ordered fp8 pool -> DeepGEMM's kv (fp8 [n, 128], fp32 scales [n]): the same bytes."""
    values = pool[:, : 64 * DIM].reshape(-1, DIM)[:n]
    scales = pool[:, 64 * DIM:].contiguous().view(torch.float32).reshape(-1)[:n]
    return values.contiguous().view(torch.float8_e4m3fn), scales.contiguous()


def bf16_keys(pool: torch.Tensor, entries_per_seq: int, seqs: int = 1) -> torch.Tensor:
    """Ordered bf16 pool (sequence s owns pages s * P .. s * P + P - 1) -> StreamIndex's k_idx [seqs, n, 128]."""
    values = pool[:, : 64 * 2 * DIM].contiguous().view(torch.bfloat16).reshape(seqs, -1, DIM)
    return values[:, :entries_per_seq].contiguous()


def bf16_keys_paged(pool: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """bf16 pool + block table [B, pages] (every sequence n entries) -> the same keys gathered into
    StreamIndex's contiguous k_idx [B, n, 128]."""
    pages = pool[table.long().clamp(min=0)]  # [B, pages, page_bytes]
    return pages.reshape(table.shape[0], -1).view(torch.bfloat16).reshape(table.shape[0], -1, DIM)[:, :n].contiguous()


# ---------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = bench_parser(commit_default=None)
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms)")
    ap.add_argument("--sections", default="select,prefill,decode")
    ap.add_argument("--prefill-n", default="8192,32768,65536,262144")
    ap.add_argument("--decode-n", default="65536,131072")
    ap.add_argument("--next-n", default="1,2,4")
    args = ap.parse_args()
    dev = args.device
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    peers, peer_info = load_peers(dev)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"peers_{commit}.json"
    meta = environment(dev, commit)
    meta.update({"peers": peer_info, "H": 4 if args.smoke else HEADS, "D": DIM, "K": 16 if args.smoke else K,
                 "timing": "prefill eager both sides, decode "
                 "CUDA-graph replays both sides; ratios dsakit / peer of the same run"})
    report = {"meta": meta, "select": [], "prefill": [], "decode": []}
    sections = args.sections.split(",")
    unknown = [name for name in sections if name not in ("select", "prefill", "decode")]
    if unknown:
        ap.error(f"unknown sections {unknown}: choose from select, prefill, decode")
    smoke = args.smoke
    k = 16 if smoke else K
    heads = 4 if smoke else HEADS
    t_start = time.time()
    graph_ok = dev == "cuda"

    def bench(fn, graph=False):
        return median_ms(fn, dev, args.rep, graph=graph and graph_ok)

    def emit(section: str, row: dict) -> None:
        report[section].append(row)
        print({key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
        write_json(path, report)

    def section_select() -> None:
        shapes = [(16, 600, False), (4, 2000, True)] if smoke else [(8192, 65536, False), (64, 131072, True)]
        for rows, n, graph in shapes:
            for kind in SELECT_KINDS:
                scores = make_scores("randn" if kind == "relu" else kind, rows, n, dev, seed=5)
                if kind == "relu":  # half the row exact zeros, the top k all positive
                    scores.relu_()
                row = {"case": "decode" if graph else "prefill", "rows": rows, "N": n, "K": k, "kind": kind,
                       "timing": "graph" if graph and graph_ok else "eager"}
                select_case(row, scores, k, graph, peers, bench)
                emit("select", row)
                del scores

    def section_prefill() -> None:
        t = 16 if smoke else 8192
        for n in ([300, 1200] if smoke else [int(x) for x in args.prefill_n.split(",")]):
            row = {"case": "prefill", "T": t, "N": n, "K": k, "H": heads, "timing": "eager"}
            fmt = KeyFormat.parse("fp8")
            pool, table, counts = ordered_pool(fmt, n, dev, seed=7)
            q, w, qs = make_queries("fp8", t, heads, dev, seed=8)
            batch = PagedBatch.build(pool, fmt, table, counts, torch.zeros(t, dtype=torch.int32, device=dev))

            def ours():
                return index_topk_triton(q, w, batch, k, q_scale=qs)

            mine = ours().clone()
            release_workspaces()  # the peak counts the workspaces a first call allocates
            row["dsakit_fp8_peak_gib"] = peak_extra_bytes(ours, dev) / 2**30
            row["dsakit_fp8_ms"] = bench(ours)
            if "deep_gemm" in peers:
                dg = peers["deep_gemm"]
                kv = fp8_keys(pool, n)
                ks = torch.zeros(t, dtype=torch.int32, device=dev)
                ke = torch.full((t,), n, dtype=torch.int32, device=dev)
                wq = (w * qs).contiguous()  # DeepGEMM has no q scale: folded into the weights

                def dg_step():
                    logits = dg.fp8_fp4_mqa_logits((q, None), kv, wq, ks, ke, clean_logits=False)
                    return torch.topk(logits, k, dim=1)[1]

                _time_prefill_peer(row, "deepgemm", "deepgemm_topk", dg_step, mine, "dsakit_fp8_ms", bench, dev)
            del pool, q, w, qs, batch, mine
            # bf16 keys: dsakit vs StreamIndex on the same bf16 bytes
            fmt = KeyFormat.parse("bf16")
            pool, table, counts = ordered_pool(fmt, n, dev, seed=9)
            q, w, _ = make_queries("bf16", t, heads, dev, seed=8)
            batch = PagedBatch.build(pool, fmt, table, counts, torch.zeros(t, dtype=torch.int32, device=dev))

            def ours_bf16():
                return index_topk_triton(q, w, batch, k)

            mine = ours_bf16().clone()
            release_workspaces()
            row["dsakit_bf16_peak_gib"] = peak_extra_bytes(ours_bf16, dev) / 2**30
            row["dsakit_bf16_ms"] = bench(ours_bf16)
            if "streamindex" in peers:
                si = peers["streamindex"]
                keys = bf16_keys(pool, n)
                q4, w3 = q.unsqueeze(0).contiguous(), w.unsqueeze(0).contiguous()

                def si_step():
                    return si.chunked_indexer_topk(q4, keys, w3, top_k=k, chunk_s=2048, chunk_t=8192)[0][0]

                _time_prefill_peer(row, "streamindex", "streamindex", si_step, mine, "dsakit_bf16_ms", bench, dev)
            del pool, q, w, batch, mine
            release_workspaces()
            if dev == "cuda":
                torch.cuda.empty_cache()
            emit("prefill", row)

    def section_decode() -> None:
        b = 2 if smoke else 64
        for n in ([300] if smoke else [int(x) for x in args.decode_n.split(",")]):
            pools = {name: timing_pool(KeyFormat.parse(name), [n] * b, dev, seed=11) for name in ("fp8", "fp4")}
            for next_n in [int(x) for x in args.next_n.split(",")]:
                rows = b * next_n
                row = {"case": "decode", "B": b, "next_n": next_n, "N": n, "K": k, "H": heads,
                       "timing": "graph" if graph_ok else "eager"}
                seq = torch.arange(b, device=dev, dtype=torch.int32).repeat_interleave(next_n)
                q, w, qs = make_queries("fp8", rows, heads, dev, seed=12)
                mine = None
                for name, (pool, table, counts) in pools.items():
                    fmt = KeyFormat.parse(name)
                    batch = PagedBatch.build(pool, fmt, table, counts, seq)
                    plan = plan_decode_topk(b, next_n, n, k, fmt, dev, num_heads=heads)

                    def ours(plan=plan, batch=batch):
                        return index_topk_decode(q, w, batch, k, plan=plan, q_scale=qs)

                    got = ours().clone()
                    if name == "fp8":
                        mine = got
                        row["dsakit_fp8_check"] = same_selection(got, plan.workspace[:, :n], k)
                        # the step's select alone, on the scores the step just wrote (its own buffers, graph):
                        # where the step's time goes between scores and select
                        select_only = lambda plan=plan: launch_select(  # noqa: E731
                            plan.workspace[:, :n], plan.visible, plan.indices, k, plan.sort, config=plan.select,
                            cand_vals=plan.cand_vals, cand_idx=plan.cand_idx, stream_buffers=plan.stream)
                        row["dsakit_fp8_select_of_step_ms"] = bench(select_only, graph=True)
                    row[f"dsakit_{name}_ms"] = bench(ours, graph=True)
                    row[f"dsakit_{name}_us_per_row"] = 1e3 * row[f"dsakit_{name}_ms"] / rows
                    del plan, batch
                row["fp4_vs_fp8"] = row["dsakit_fp4_ms"] / row["dsakit_fp8_ms"]
                if "deep_gemm" in peers:
                    dg = peers["deep_gemm"]
                    pool, table, counts = pools["fp8"]
                    kv_cache = pool.view(pool.shape[0], 64, 1, DIM + 4)
                    context = torch.full((b, next_n), n, dtype=torch.int32, device=dev)
                    q4 = q.reshape(b, next_n, heads, DIM)
                    wq = (w * qs).contiguous()
                    meta_dg = _try(row, "deepgemm", lambda: dg.get_paged_mqa_logits_metadata(context, 64,
                                                                                              dg.get_num_sms()))

                    def dg_step():  # the metadata is per batch, shared by every layer: computed once, outside
                        logits = dg.fp8_fp4_paged_mqa_logits((q4, None), kv_cache, wq, context, table, meta_dg, n,
                                                             clean_logits=False)
                        return torch.topk(logits, k, dim=1)[1]

                    got = None if meta_dg is None else _try(row, "deepgemm", dg_step)
                    if got is not None:
                        row["deepgemm_recall_of_dsakit"] = _recall(got, mine)
                        timed = _try(row, "deepgemm_graph", lambda: bench(dg_step, graph=True))
                        row["deepgemm_timing"] = "graph"
                        if timed is None:  # not capturable here: time it eager and say so (not the same rule)
                            timed = bench(dg_step)
                            row["deepgemm_timing"] = "eager (graph capture failed)"
                        if timed is not None:
                            row["deepgemm_topk_ms"] = timed
                            row["deepgemm_topk_us_per_row"] = 1e3 * timed / rows
                            _ratio(row, "dsakit_fp8_ms", "deepgemm_topk_ms")
                            _ratio(row, "dsakit_fp4_ms", "deepgemm_topk_ms")
                if next_n == 1:
                    # bf16 keys with bf16 q: dsakit's plan vs StreamIndex (one query per sequence)
                    fmt = KeyFormat.parse("bf16")
                    pool, table, counts = timing_pool(fmt, [n] * b, dev, seed=13)
                    qb, wb, _ = make_queries("bf16", rows, heads, dev, seed=12)
                    batch = PagedBatch.build(pool, fmt, table, counts, seq)
                    plan = plan_decode_topk(b, 1, n, k, fmt, dev, num_heads=heads)

                    def ours_bf16():
                        return index_topk_decode(qb, wb, batch, k, plan=plan)

                    mine_bf16 = ours_bf16().clone()
                    row["dsakit_bf16_ms"] = bench(ours_bf16, graph=True)
                    if "streamindex" in peers:
                        si = peers["streamindex"]
                        keys = bf16_keys_paged(pool, table, n)
                        q4, w3 = qb.reshape(b, 1, heads, DIM).contiguous(), wb.reshape(b, 1, heads).contiguous()

                        def si_step():
                            return si.chunked_indexer_topk(q4, keys, w3, top_k=k, chunk_s=2048, chunk_t=8192)[0]

                        got = _try(row, "streamindex", si_step)
                        if got is not None:
                            row["streamindex_recall_of_dsakit"] = _recall(got.reshape(rows, k), mine_bf16)
                            timed = _try(row, "streamindex_graph", lambda: bench(si_step, graph=True))
                            row["streamindex_timing"] = "graph"
                            if timed is None:  # its host code may not be capturable: time it eager, say so
                                timed = bench(si_step)
                                row["streamindex_timing"] = "eager (graph capture failed)"
                            row["streamindex_ms"] = timed
                            _ratio(row, "dsakit_bf16_ms", "streamindex_ms")
                        del keys
                    del pool, batch, plan
                emit("decode", row)
            del pools
            if dev == "cuda":
                torch.cuda.empty_cache()

    runs = {"select": section_select, "prefill": section_prefill, "decode": section_decode}
    for name in sections:  # in the order given, so the most wanted section runs first
        runs[name]()

    report["meta"]["total_s"] = time.time() - t_start
    write_json(path, report)
    summary(report)
    inexact = [r for r in report["select"] if not r["dsakit_check"]["values_equal"]]
    inexact += [r for r in report["decode"] if not r["dsakit_fp8_check"]["values_equal"]]
    print(f"done in {report['meta']['total_s']:.0f} s; {len(inexact)} cases where dsakit's select was inexact")
    return 1 if inexact else 0


def summary(report: dict) -> None:
    def cell(row, key):
        return f" {row[key]:8.3f}" if key in row else "        -"

    print(f"\n{'select':34s} {'dsakit':>8s} {'torch':>8s} {'flashinf':>8s} {'deepsel':>8s}  (ms)")
    for r in report["select"]:
        print(f"{r['case']} {r['rows']}x{r['N']} {r['kind']:10s} {r['timing']:5s}"
              + "".join(cell(r, key) for key in ("dsakit_ms", "torch_topk_ms", "flashinfer_ms", "deep_select_ms")))
    print(f"\n{'prefill':24s} {'fp8':>8s} {'DG+topk':>8s} {'bf16':>8s} {'StreamIx':>8s}  (ms)")
    for r in report["prefill"]:
        print(f"{r['T']}x{r['N']:<17d}" + "".join(cell(r, key) for key in (
            "dsakit_fp8_ms", "deepgemm_topk_ms", "dsakit_bf16_ms", "streamindex_ms")))
    print(f"\n{'decode':24s} {'fp8':>8s} {'fp4':>8s} {'DG+topk':>8s} {'bf16':>8s} {'StreamIx':>8s}  (ms)")
    for r in report["decode"]:
        print(f"{r['B']}x{r['N']} next_n {r['next_n']:<8d}" + "".join(cell(r, key) for key in (
            "dsakit_fp8_ms", "dsakit_fp4_ms", "deepgemm_topk_ms", "dsakit_bf16_ms", "streamindex_ms")))


if __name__ == "__main__":
    sys.exit(main())
