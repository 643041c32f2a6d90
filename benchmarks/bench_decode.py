"""Decode top-k through the sync-free plan path (``plan_decode_topk`` + ``index_topk_decode``), on one GPU.

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

Usage: PYTHONPATH=. python3 benchmarks/bench_decode.py --out DIR --commit SHA
       (``--device cpu --smoke`` under TRITON_INTERPRET=1: toy sizes, no graphs, no timing claims)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from _common import (DIM, bench_parser, environment, make_queries, median_ms, same_selection, sync_and_alloc,
                     timing_pool, write_json)

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops.indexer.scores import launch_index_scores, prepare_q
from dsakit.ops.indexer.triton import index_topk_decode
from dsakit.ops.indexer.plans import plan_decode_topk
from dsakit.ops.indexer.triton import index_topk_triton
from dsakit.ops.indexer.select import launch_select

HBM_TB_PER_S = 4.27  # device-to-device copy ceiling (docs/performance.md §1)
# DeepGEMM 2.6.1 paged decode on the same H200, batch 64 (docs/performance.md §2): logits ms, torch.topk ms, K 512 / 2048
DEEPGEMM_DECODE = {65536: (0.150, 0.136, 0.139), 131072: (0.288, 0.186, 0.189)}
TIME_GUARD_S = 95  # stop starting new cases after this many seconds (the GPU call must stay < 150 s)


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


def main() -> int:
    args = bench_parser().parse_args()
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
              "decode": [], "skipped": []}
    start = time.time()

    def save():
        write_json(out_dir / "decode_h200.json", report)

    for fmt_name in ("fp8", "bf16", "fp4"):
        for n in ns:
            if time.time() - start > TIME_GUARD_S:
                report["skipped"].append({"format": fmt_name, "N": n, "why": "time guard"})
                continue
            report["decode"] += run_case(fmt_name, n, ks, b, heads, device, rep_ms, smoke)
            print(f"[{time.time() - start:.0f} s] {fmt_name} {n} done", flush=True)
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
    print(f"skipped: {report['skipped']}; check failures: {failures}; total {time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
