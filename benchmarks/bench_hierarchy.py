"""Hierarchical top-k (page representatives, then exact scores in the pages kept) beside the flat top-k and
DeepGEMM + torch.topk, on the same inputs in one process (issue 31, docs/hierarchy.md).

Sections:
  check    full-size agreement on the GPU: per format (fp8, bf16, fp8-centred) and context, the default
           hierarchy's mean set IoU against the flat top-k and the needle's rank kept; the exact mode equal to
           the flat top-k bit for bit, with the pages it scored (keys: a random walk along the sequence plus
           noise, i.e. neighbouring entries alike as pooled keys are; and plain randn keys)
  prefill  T 8192 x N entries (default 32768, 131072, 262144, 1048576), H 64, K 2048, every query sees every
           entry: flat dsakit, hierarchical dsakit (default m) and DeepGEMM fp8 logits + torch.topk, all eager;
           fp8 keys (fp8 q + q_scale), bf16 keys (bf16 q), fp8-centred keys (fp8 q); peak extra memory
  decode   B 64 x N (default 65536, 131072, 1048576), next_n 1: flat dsakit (its decode plan) vs hierarchical,
           both eager and both as CUDA-graph replays where the call can be captured; DeepGEMM paged logits +
           torch.topk in a graph

Ratios are hierarchical / flat and hierarchical / DeepGEMM of the same run. Results: DIR/hierarchy_<commit>.json
(written after every row) with GPU, versions and commit.

Usage (GPU machine):
    source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz
    PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/bench_hierarchy.py --out DIR [--sections check,prefill,decode]
(``--device cpu --smoke`` under TRITON_INTERPRET=1: toy sizes, no peers, no timing claims)
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import torch
from _common import (DIM, bench_parser, environment, make_queries, median_ms, peak_extra_bytes, timing_pool,
                     write_json)
from bench_peers import deepgemm_prefill_step, load_peers, ordered_pool

from dsakit import PagedBatch
from dsakit.formats import KeyFormat, is_centred
from dsakit.ops.indexer import HierarchyConfig
from dsakit.ops.indexer.triton import index_topk_decode
from dsakit.ops.indexer.plans import plan_decode_topk
from dsakit.ops.indexer.hierarchy import hierarchical_topk_triton
from dsakit.ops.indexer.triton import index_topk_triton, release_workspaces
from dsakit.pool import PageSummaries

HEADS = 64
K = 2048
FORMATS = ("fp8", "bf16", "fp8-centred")


def decoded_pages(pool: torch.Tensor, fmt: KeyFormat) -> torch.Tensor:
    """fp32 [P, 64, 128]: the keys the score kernels read, decoded on the pool's device (vectorized)."""
    p = pool.shape[0]
    if fmt.kind == "bf16":
        return pool[:, : 64 * 256].contiguous().view(torch.bfloat16).view(p, 64, DIM).float()
    values = pool[:, : 64 * DIM].contiguous().view(torch.float8_e4m3fn).view(p, 64, DIM).float()
    scale_at = 64 * DIM
    scales = pool[:, scale_at: scale_at + 64 * 4].contiguous().view(torch.float32).view(p, 64, 1)
    keys = values * scales
    if is_centred(fmt):
        offset = fmt.centre_offset_in_page
        keys = keys + pool[:, offset: offset + 256].contiguous().view(torch.bfloat16).float().view(p, 1, DIM)
    return keys


def device_summaries(pool: torch.Tensor, fmt: KeyFormat, chunk: int = 4096) -> PageSummaries:
    """Summaries of full pages computed on the device (the benchmark's pools are written in bulk, not through
    the store; mean by torch's reduction order, min / max exact, rounded outward like the spec)."""
    from dsakit.pool import _round_outward

    out = PageSummaries.zeros(pool.shape[0], pool.device)
    for start in range(0, pool.shape[0], chunk):
        keys = decoded_pages(pool[start:start + chunk], fmt)
        out.centre[start:start + chunk] = keys.mean(dim=1).to(torch.bfloat16)
        out.lower[start:start + chunk] = _round_outward(keys.amin(dim=1), down=True)
        out.upper[start:start + chunk] = _round_outward(keys.amax(dim=1), down=False)
    return out


def walk_keys(n: int, seed: int) -> torch.Tensor:
    """fp32 [n, 128]: a slow random walk (neighbouring entries alike) + a shared direction + noise."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randn(n, DIM, generator=g) * 0.05
    return torch.cumsum(steps, 0) / (1 + torch.arange(n).unsqueeze(1) * 1e-4) ** 0.5 + torch.randn(1, DIM, generator=g) \
        + 0.5 * torch.randn(n, DIM, generator=g)


def iou(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean over rows of |A & B| / |A | B| of the valid (>= 0) indices of a, b int [T, K]."""
    total = 0.0
    for row_a, row_b in zip(a.cpu().tolist(), b.cpu().tolist()):
        sa, sb = {x for x in row_a if x >= 0}, {x for x in row_b if x >= 0}
        total += len(sa & sb) / max(1, len(sa | sb))
    return total / max(1, a.shape[0])


def main() -> int:
    ap = bench_parser(commit_default=None)
    ap.add_argument("--rep", type=int, default=40, help="do_bench rep (ms)")
    ap.add_argument("--sections", default="check,prefill,decode")
    ap.add_argument("--prefill-n", default="32768,131072,262144,1048576")
    ap.add_argument("--decode-n", default="65536,131072,1048576")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    dev = args.device
    smoke = args.smoke
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    peers, peer_info = load_peers(dev)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"hierarchy_{commit}{args.tag}.json"
    k = 16 if smoke else K
    heads = 4 if smoke else HEADS
    config = HierarchyConfig()
    meta = environment(dev, commit)
    meta.update({"peers": peer_info, "H": heads, "K": k, "hierarchy": {"pages": config.pages_for(k),
                 "first_pages": config.first_pages, "recent_pages": config.recent_pages},
                 "timing": "prefill eager on every side; decode eager and CUDA-graph rows, each compared with the "
                           "same timing"})
    report = {"meta": meta, "check": [], "prefill": [], "decode": []}
    formats = args.formats.split(",")
    t_start = time.time()

    def bench(fn, graph=False):
        return median_ms(fn, dev, args.rep, graph=graph and dev == "cuda")

    def emit(section: str, row: dict) -> None:
        report[section].append(row)
        print({key: (round(v, 4) if isinstance(v, float) else v) for key, v in row.items()}, flush=True)
        write_json(path, report)

    def queries(fmt: KeyFormat, t: int, seed: int):
        q, w, qs = make_queries("fp8" if fmt.kind == "fp8" else "bf16", t, heads, dev, seed)
        return q, w, qs

    def section_check() -> None:
        t = 8 if smoke else 256
        for n in ([600] if smoke else [32768, 131072]):
            for keys_kind in ("walk", "randn"):
                keys = walk_keys(n, seed=3) if keys_kind == "walk" else torch.randn(n, DIM,
                                                                                    generator=torch.Generator().manual_seed(3))
                for name in formats:
                    fmt = KeyFormat.parse(name)
                    pages = -(-n // 64)
                    padded = torch.cat([keys, torch.zeros(pages * 64 - n, DIM)])
                    pool = fmt.quantize_pages(padded).to(dev)
                    table = torch.arange(pages, dtype=torch.int32, device=dev).unsqueeze(0)
                    counts = torch.tensor([n], dtype=torch.int32, device=dev)
                    positions = torch.linspace(n // 2, n - 1, t).long().to(dev)  # ratio 1: causal cut mid-way on
                    batch = PagedBatch.build(pool, fmt, table, counts, torch.zeros(t, dtype=torch.int32, device=dev),
                                             positions, 1)
                    summaries = device_summaries(pool, fmt)
                    # queries that look like keys of the sequence (a needle each), so the top-k has a clear head
                    g = torch.Generator().manual_seed(5)
                    targets = torch.randint(0, n // 2, (t,), generator=g)
                    q = (keys[targets].unsqueeze(1) + 0.5 * torch.randn(t, heads, DIM, generator=g)).to(dev)
                    q = q.to(torch.bfloat16)
                    w = (torch.rand(t, heads, generator=g) + 0.05).to(dev)
                    flat = index_topk_triton(q, w, batch, k)
                    hier, _, pages_scored = hierarchical_topk_triton(q, w, batch, k, config, summaries)
                    exact, _, exact_pages = hierarchical_topk_triton(q, w, batch, k,
                                                                     HierarchyConfig(exact=True), summaries)
                    visible_pages = (positions + 1 + 63) // 64
                    needle_flat = (flat.long() == targets.to(dev).unsqueeze(1)).any(1)
                    needle_hier = (hier.long() == targets.to(dev).unsqueeze(1)).any(1)
                    row = {"N": n, "T": t, "format": name, "keys": keys_kind, "K": k,
                           "iou_mean": iou(hier, flat), "needle_in_flat": int(needle_flat.sum()),
                           "needle_in_hier": int((needle_hier & needle_flat).sum()),
                           "pages_scored_frac": float((pages_scored.float() / visible_pages.float()).mean()),
                           "exact_equal_flat": bool(torch.equal(exact, flat)),
                           "exact_pages_scored_frac": float((exact_pages.float() / visible_pages.float()).mean())}
                    emit("check", row)
                    del pool, batch, summaries

    def section_prefill() -> None:
        t = 16 if smoke else 8192
        for n in ([300, 1200] if smoke else [int(x) for x in args.prefill_n.split(",")]):
            for name in formats:
                fmt = KeyFormat.parse(name)
                row = {"case": "prefill", "T": t, "N": n, "K": k, "H": heads, "format": name, "timing": "eager"}
                pool, table, counts = ordered_pool(fmt, n, dev, seed=7)
                q, w, qs = queries(fmt, t, seed=8)
                batch = PagedBatch.build(pool, fmt, table, counts, torch.zeros(t, dtype=torch.int32, device=dev))
                summaries = device_summaries(pool, fmt)

                def flat():
                    return index_topk_triton(q, w, batch, k, q_scale=qs)

                def hier():
                    return hierarchical_topk_triton(q, w, batch, k, config, summaries, q_scale=qs)[0]

                mine = flat().clone()
                row["hier_iou_vs_flat"] = iou(hier()[:256], mine[:256])
                for key, fn in (("flat", flat), ("hier", hier)):
                    release_workspaces()
                    row[f"{key}_peak_gib"] = peak_extra_bytes(fn, dev) / 2**30
                    row[f"{key}_ms"] = bench(fn)
                row["hier_vs_flat"] = row["hier_ms"] / row["flat_ms"]
                if name == "fp8" and "deep_gemm" in peers:
                    dg_step = deepgemm_prefill_step(peers["deep_gemm"], pool, n, q, w, qs, k)
                    try:
                        row["deepgemm_topk_peak_gib"] = peak_extra_bytes(dg_step, dev) / 2**30
                        row["deepgemm_topk_ms"] = bench(dg_step)
                    except Exception as error:  # noqa: BLE001 - a peer failing on a case is a result
                        row["deepgemm_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                    torch.cuda.empty_cache() if dev == "cuda" else None
                if "deepgemm_topk_ms" in row or any("deepgemm_topk_ms" in r for r in report["prefill"] if r["N"] == n):
                    peer = row.get("deepgemm_topk_ms") or next(r["deepgemm_topk_ms"] for r in report["prefill"]
                                                                if r["N"] == n and "deepgemm_topk_ms" in r)
                    row["hier_vs_deepgemm_fp8"] = row["hier_ms"] / peer
                    row["flat_vs_deepgemm_fp8"] = row["flat_ms"] / peer
                del pool, q, w, qs, batch, summaries, mine
                release_workspaces()
                if dev == "cuda":
                    torch.cuda.empty_cache()
                emit("prefill", row)

    def section_decode() -> None:
        b = 2 if smoke else 64
        for n in ([300] if smoke else [int(x) for x in args.decode_n.split(",")]):
            for name in formats:
                fmt = KeyFormat.parse(name)
                if is_centred(fmt) and n * b > (1 << 24):
                    continue  # its pool is quantized on the host (timing_pool): 64M keys take too long there
                pool, table, counts = timing_pool(fmt, [n] * b, dev, seed=11)
                seq = torch.arange(b, device=dev, dtype=torch.int32)
                q, w, qs = queries(fmt, b, seed=12)
                batch = PagedBatch.build(pool, fmt, table, counts, seq)
                summaries = device_summaries(pool, fmt)
                plan = plan_decode_topk(b, 1, n, k, fmt, dev, num_heads=heads)
                row = {"case": "decode", "B": b, "next_n": 1, "N": n, "K": k, "H": heads, "format": name}

                def flat_plan():
                    return index_topk_decode(q, w, batch, k, plan=plan, q_scale=qs)

                def flat_eager():
                    return index_topk_triton(q, w, batch, k, q_scale=qs)

                def hier():
                    return hierarchical_topk_triton(q, w, batch, k, config, summaries, q_scale=qs)[0]

                row["hier_iou_vs_flat"] = iou(hier(), flat_eager())
                row["flat_plan_graph_ms"] = bench(flat_plan, graph=True)
                row["flat_eager_ms"] = bench(flat_eager)
                row["hier_eager_ms"] = bench(hier)
                row["hier_peak_gib"] = peak_extra_bytes(hier, dev) / 2**30
                row["hier_vs_flat_eager"] = row["hier_eager_ms"] / row["flat_eager_ms"]
                try:
                    row["hier_graph_ms"] = bench(hier, graph=True)
                    row["hier_vs_flat_graph"] = row["hier_graph_ms"] / row["flat_plan_graph_ms"]
                except Exception as error:  # noqa: BLE001 - not capturable: reported, eager rows stand
                    row["hier_graph_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                if name == "fp8" and "deep_gemm" in peers:
                    dg = peers["deep_gemm"]
                    kv_cache = pool.view(pool.shape[0], 64, 1, DIM + 4)
                    context = torch.full((b, 1), n, dtype=torch.int32, device=dev)
                    q4 = q.reshape(b, 1, heads, DIM)
                    wq = (w * qs).contiguous()
                    try:
                        meta_dg = dg.get_paged_mqa_logits_metadata(context, 64, dg.get_num_sms())

                        def dg_step():
                            logits = dg.fp8_fp4_paged_mqa_logits((q4, None), kv_cache, wq, context, table, meta_dg, n,
                                                                 clean_logits=False)
                            return torch.topk(logits, k, dim=1)[1]

                        dg_step()
                        row["deepgemm_topk_graph_ms"] = bench(dg_step, graph=True)
                        if "hier_graph_ms" in row:
                            row["hier_vs_deepgemm_graph"] = row["hier_graph_ms"] / row["deepgemm_topk_graph_ms"]
                    except Exception as error:  # noqa: BLE001
                        row["deepgemm_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                del pool, batch, summaries, plan, q, w, qs
                release_workspaces()
                if dev == "cuda":
                    torch.cuda.empty_cache()
                emit("decode", row)

    runs = {"check": section_check, "prefill": section_prefill, "decode": section_decode}
    for name in args.sections.split(","):
        runs[name]()
    report["meta"]["total_s"] = time.time() - t_start
    write_json(path, report)
    print(f"done in {report['meta']['total_s']:.0f} s -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
