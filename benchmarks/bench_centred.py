"""The page-centred key formats against their plain formats in one process on one GPU, --runs times.

    source benchmarks/anchors/build_deepgemm.sh .anchors/deepgemm-54e2261.tgz   # optional: the DeepGEMM rows
    PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/bench_centred.py --out DIR --runs 2
    # CPU smoke run of the code paths (toy sizes, no DeepGEMM, no timing claims):
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/bench_centred.py --out /tmp/ct --device cpu --smoke

The centred store is timed by ``bench_store.py --centred``. H 64, D 128, K 2048, every query sees every entry.
Sections (``--sections``, default all):

  check    once, before the runs: keys with a large shared part (|mu| / |z| = 30) stored through the Triton
           store and the CPU reference (fraction of equal bytes, centred and plain), and the Triton scores of
           the centred pool against the reference's (max |difference| relative to the largest score).

Each run times:

  prefill  T 8192 x N 65536, eager on every side (triton.testing.do_bench): ``index_topk`` with fp8 keys and
           with fp8-centred keys (fp8 q + q_scale), the centred one also with 8-warp prefill tiles
           (``prefill_warps=8``: a variant, not the default), and DeepGEMM ``fp8_fp4_mqa_logits`` + torch.topk
           on the fp8 keys (q_scale folded into the weights).
  decode   B 64 x N 65536 / 131072, one query per sequence, CUDA-graph replays on every side
           (do_bench_cudagraph): dsakit's decode plan (``plan_decode_topk`` + ``index_topk_decode``) with fp8,
           fp8-centred, fp4 and fp4-centred keys (fp8 q + q_scale; the centred page copies also with other
           register caps: fp8-centred at 248 (in effect uncapped), fp4-centred at 128, as variants), and DeepGEMM
           ``fp8_fp4_paged_mqa_logits``
           (context_lens [B, 1], clean_logits=False, metadata computed once outside) + torch.topk captured whole.

The centred pools hold the same residual bytes as the plain pools (random valid fp8 / fp4 pages) plus a bf16
centre per page, so centred / plain compares the same per-entry work plus the page term. Checks per case:
the selection against torch.topk on the same scores (dsakit's workspace), and for the centred decode rows the
scores of two queries against a torch statement of the rule (q . (s r) + q . c, relu, weights), relative error.

Targets (ratios of the same run): fp8-centred prefill <= 1.05x fp8 and <= 0.80x DeepGEMM + torch.topk;
fp8-centred decode <= 1.10x fp8 and <= 0.85x DeepGEMM + torch.topk; fp4-centred decode <= fp8 decode.
A peer that is not importable is reported missing with the reason, never timed from elsewhere.
Results: DIR/centred_targets_<commit>.json (written after every case): GPU, torch / triton versions, commit,
deep_gemm_version, the rows and a per-target summary per run.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch
from _common import DIM, bench_parser, environment, make_queries, median_ms, same_selection, timing_pool, write_json

from dsakit import PagedBatch
from dsakit.cache import PagedCache
from dsakit.formats import ENTRIES_PER_PAGE, KeyFormat
from dsakit.ops import indexer as scores_ops
from dsakit.ops import store as store_ops
from dsakit.presets import get_preset
from dsakit.ops.indexer.config import ScoresConfig
from dsakit.ops.indexer.config import TopkConfig
from dsakit.ops.indexer.triton import index_topk_decode
from dsakit.ops.indexer.plans import plan_decode_topk
from dsakit.ops.indexer.triton import index_topk_triton, release_workspaces

HEADS = 64
K = 2048
PLAIN = {"fp8-centred": "fp8", "fp4-centred": "fp4"}


def load_deep_gemm() -> tuple[object, dict]:
    """-> (the deep_gemm module or None, {"present", "version" | "reason"})."""
    try:
        import deep_gemm
    except Exception as error:  # noqa: BLE001 - any import failure means: no peer in this run
        reason = f"{type(error).__name__}: {str(error)[:200]}"
        print(f"deep_gemm missing ({reason}); its rows are marked missing", flush=True)
        return None, {"present": False, "reason": reason}
    return deep_gemm, {"present": True, "version": getattr(deep_gemm, "__version__", None)}


def centred_pool(name: str, plain_pool: torch.Tensor, seed: int) -> torch.Tensor:
    """A pool of format ``name`` holding plain_pool's entry bytes (its residuals) and a bf16 centre per page:
    one shared vector (elements ~ 10x a residual element) plus a per-page part at the residuals' scale, as for
    keys with a shared part (the centre is entry 0 of its page). Until d405359 every page had an independent
    centre 10x the residuals: the scores then cluster by page, which slows the streaming select several-fold
    (decode top-k 0.568 ms of which the scores kernels took 0.244) and no real pool looks like."""
    fmt = KeyFormat.parse(name)
    pool = torch.empty(plain_pool.shape[0], fmt.page_bytes, dtype=torch.uint8, device=plain_pool.device)
    pool[:, : plain_pool.shape[1]].copy_(plain_pool)
    g = torch.Generator(device=plain_pool.device).manual_seed(seed)
    shared = 10 * torch.randn(1, DIM, device=plain_pool.device, generator=g)
    centres = (shared + torch.randn(plain_pool.shape[0], DIM, device=plain_pool.device, generator=g)).to(torch.bfloat16)
    pool[:, fmt.centre_offset_in_page:].copy_(centres.view(torch.uint8))
    return pool


def ordered(pool: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's pool with its pages in table order (DeepGEMM's non-paged keys are then a plain view)."""
    pool = pool[table[0].long()].contiguous()
    return pool, torch.arange(pool.shape[0], device=pool.device, dtype=torch.int32).unsqueeze(0)


def fp8_keys(pool: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An ordered single-sequence fp8 pool -> DeepGEMM's non-paged kv (fp8 [n, 128], fp32 scales [n])."""
    pages = pool.shape[0]
    values = pool[:, : 64 * DIM].reshape(pages * 64, DIM)[:n]
    scales = pool[:, 64 * DIM:].contiguous().view(torch.float32).reshape(pages * 64)[:n]
    return values.contiguous().view(torch.float8_e4m3fn), scales.contiguous()


def centred_rule_error(name: str, pool: torch.Tensor, table: torch.Tensor, q: torch.Tensor, w: torch.Tensor,
                       qs: torch.Tensor, scores: torch.Tensor, rows: list[int], n: int) -> float:
    """Largest |kernel - torch statement| / largest |score| over ``rows`` (query b reads sequence b): the
    logit of entry j is q . (dequantized residual) + q . c[page(j)], relu, times the weights."""
    fmt = KeyFormat.parse(name)
    worst = 0.0
    for b in rows:
        pages = pool[table[b].long()[: -(-n // ENTRIES_PER_PAGE)]].cpu()
        values, scales = fmt.split_pages(pages)
        residual = fmt.dequantize_residual(values, scales)[:n].to(q.device)  # [n, 128]
        centres = fmt.page_centres(pages).to(q.device)  # [pages, 128]
        qf = q[b].float()  # [H, 128]
        logits = qf @ residual.T + (qf @ centres.T).repeat_interleave(64, dim=1)[:, :n]
        expect = ((logits.relu() * (w[b] * qs[b])[:, None]).sum(0))
        worst = max(worst, float((scores[b, :n] - expect).abs().max() / expect.abs().max()))
    return worst


def section_check(dev: str, smoke: bool) -> dict:
    """Store bytes (Triton against the CPU reference) and centred scores against the reference, per centred
    format; the plain format's store bytes beside them."""
    preset = get_preset("deepseek-v4-flash")
    table = preset.rope.cos_sin_table(8192).to(dev)
    n = 200 if smoke else 4096
    g = torch.Generator(device=dev).manual_seed(1)
    mu = torch.randn(1, DIM, device=dev, generator=g)
    keys = (30 * mu / mu.norm() * DIM ** 0.5 + torch.randn(n, DIM, device=dev, generator=g)).to(torch.bfloat16)
    positions = torch.arange(n, device=dev) * 4 % table.shape[0]
    out = {}

    def stored(fmt: KeyFormat, slots: torch.Tensor, pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool written by the Triton store, pool written by the CPU reference) of the same rows."""
        pool = torch.zeros(pages, fmt.page_bytes, dtype=torch.uint8, device=dev)
        store_ops.store_index_keys(keys, positions, slots.to(dev), pool, fmt, table, torch.ones(DIM, device=dev),
                                   None, preset.key_transform, backend="triton")
        ref = torch.zeros_like(pool, device="cpu")
        store_ops.store_index_keys(keys.cpu(), positions.cpu(), slots.cpu(), ref, fmt, table.cpu(), torch.ones(DIM),
                                   None, preset.key_transform, backend="reference")
        return pool, ref

    for name, plain_name in PLAIN.items():
        fmt, plain = KeyFormat.parse(name), KeyFormat.parse(plain_name)
        cache = PagedCache(fmt, -(-n // ENTRIES_PER_PAGE), device=dev)
        seq = cache.add_sequence()
        slots = cache.append(seq, n)
        pool, ref = stored(fmt, slots, cache.pool.shape[0])
        cache.pool.copy_(pool)
        plain_pool, plain_ref = stored(plain, slots, cache.pool.shape[0])
        q, w, _ = make_queries(plain_name, 4, HEADS, dev, 5)
        batch = cache.batch([seq], query_lens=[4])
        got = scores_ops.index_scores(q, w, batch, backend="triton").cpu()
        cpu_batch = PagedBatch.build(ref, fmt, cache.block_table([seq]).cpu(), cache.entry_counts([seq]).cpu(),
                                     torch.zeros(4, dtype=torch.int32))
        expect = scores_ops.index_scores(q.float().cpu(), w.cpu(), cpu_batch, backend="reference")
        out[name] = {"entries": n, "store_bytes_equal_fraction": float((ref == pool.cpu()).float().mean()),
                     f"{plain_name}_store_bytes_equal_fraction": float((plain_ref == plain_pool.cpu()).float().mean()),
                     "scores_max_rel_diff": float((got - expect).abs().max() / expect.abs().max())}
    return out


def main() -> int:
    ap = bench_parser(commit_default=None)
    ap.add_argument("--runs", type=int, default=2, help="repeat every case (run-to-run spread)")
    ap.add_argument("--rep", type=int, default=60, help="do_bench rep (ms)")
    ap.add_argument("--sections", default="check,prefill,decode")
    ap.add_argument("--decode-n", default="65536,131072", help="decode entry counts N")
    ap.add_argument("--no-variants", action="store_true", help="time the default launch settings only")
    args = ap.parse_args()
    dev = args.device
    smoke = args.smoke or dev != "cuda"
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    dg, dg_info = (None, {"present": False, "reason": "CUDA only (CPU smoke run)"}) if smoke else load_deep_gemm()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"centred_targets_{commit}.json"
    meta = environment(dev, commit)
    meta.update({"deep_gemm_version": dg_info.get("version"), "deep_gemm": dg_info, "H": HEADS, "D": DIM, "K": K,
                 "runs": args.runs, "timing": "prefill eager on every side, decode CUDA-graph replays on every side"})
    report = {"meta": meta, "prefill": [], "decode": [], "targets": []}
    if "check" in args.sections:
        report["check"] = section_check(dev, smoke)
        print(report["check"], flush=True)
        write_json(path, report)
    heads = 4 if smoke else HEADS
    k = 16 if smoke else K
    graph = dev == "cuda"

    def bench(fn, graph_on=False):
        return median_ms(fn, dev, args.rep, graph=graph_on and graph)

    def ratio(row: dict, mine: str, other: str) -> None:
        if mine in row and other in row:
            row[f"{mine[:-3]}_vs_{other[:-3]}"] = row[mine] / row[other]

    for run in range(1, args.runs + 1):
        if "prefill" in args.sections:
            t, n = (16, 300) if smoke else (8192, 65536)
            row = {"run": run, "case": "prefill", "T": t, "N": n, "K": k, "H": heads, "timing": "eager"}
            plain, table, counts = timing_pool(KeyFormat.FP8, [n], dev, seed=7)
            plain, table = ordered(plain, table)
            pools = {"fp8": plain, "fp8-centred": centred_pool("fp8-centred", plain, seed=8)}
            q, w, qs = make_queries("fp8", t, heads, dev, seed=9)
            if qs is None:  # the CPU smoke run: bf16 q
                qs = torch.rand(t, heads, device=dev) + 0.5
            seq = torch.zeros(t, dtype=torch.int32, device=dev)
            variants = [("fp8", None), ("fp8-centred", None),
                        ("fp8-centred_warps8", replace(TopkConfig.for_device(dev),
                                                       scores=replace(ScoresConfig.for_device(dev), prefill_warps=8)))]
            for label, config in variants[:2] if args.no_variants else variants:
                name = label.split("_")[0]
                batch = PagedBatch.build(pools[name], KeyFormat.parse(name), table, counts, seq)

                def ours(batch=batch, config=config):
                    return index_topk_triton(q, w, batch, k, q_scale=qs, config=config)

                ours()
                row[f"dsakit_{label}_ms"] = bench(ours)
                release_workspaces()
            ratio(row, "dsakit_fp8-centred_ms", "dsakit_fp8_ms")
            ratio(row, "dsakit_fp8-centred_warps8_ms", "dsakit_fp8_ms")
            if dg is not None:
                kv = fp8_keys(plain, n)
                ks = torch.zeros(t, dtype=torch.int32, device=dev)
                ke = torch.full((t,), n, dtype=torch.int32, device=dev)
                wq = (w * qs).contiguous()

                def dg_step():
                    logits = dg.fp8_fp4_mqa_logits((q, None), kv, wq, ks, ke, clean_logits=False)
                    return torch.topk(logits, k, dim=1)[1]

                try:
                    dg_step()
                    row["deepgemm_topk_ms"] = bench(dg_step)
                except Exception as error:  # noqa: BLE001 - a failing peer is a result
                    row["deepgemm_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                ratio(row, "dsakit_fp8-centred_ms", "deepgemm_topk_ms")
                ratio(row, "dsakit_fp8_ms", "deepgemm_topk_ms")
            else:
                row["deepgemm_topk_ms"] = None
                row["deepgemm_missing"] = dg_info.get("reason")
            del pools, plain, q, w, qs
            if dev == "cuda":
                torch.cuda.empty_cache()
            report["prefill"].append(row)
            print(row, flush=True)
            write_json(path, report)

        if "decode" in args.sections:
            b = 2 if smoke else 64
            for n in ([300] if smoke else [int(x) for x in args.decode_n.split(",")]):
                row = {"run": run, "case": "decode", "B": b, "next_n": 1, "N": n, "K": k, "H": heads,
                       "timing": "graph" if graph else "eager"}
                seq = torch.arange(b, device=dev, dtype=torch.int32)
                q, w, qs = make_queries("fp8", b, heads, dev, seed=12)
                if qs is None:
                    qs = torch.rand(b, heads, device=dev) + 0.5
                pools = {}
                for plain_name in ("fp8", "fp4"):
                    pool, table, counts = timing_pool(KeyFormat.parse(plain_name), [n] * b, dev, seed=11)
                    pools[plain_name] = pool
                    pools[f"{plain_name}-centred"] = centred_pool(f"{plain_name}-centred", pool, seed=13)
                # the last two: launch variants of the centred page copies (register caps), not defaults
                decode_variants = [("fp8", None), ("fp8-centred", None), ("fp4", None), ("fp4-centred", None),
                                   ("fp8-centred_uncapped", replace(ScoresConfig.for_device(dev), decode_maxnreg=248)),
                                   ("fp4-centred_cap128", replace(ScoresConfig.for_device(dev), decode_maxnreg=128))]
                if args.no_variants:
                    decode_variants = decode_variants[:4]
                for label, scores_config in decode_variants:
                    name = label.split("_")[0]
                    fmt = KeyFormat.parse(name)
                    batch = PagedBatch.build(pools[name], fmt, table, counts, seq)
                    plan = plan_decode_topk(b, 1, n, k, fmt, dev, num_heads=heads, scores=scores_config)

                    def ours(plan=plan, batch=batch):
                        return index_topk_decode(q, w, batch, k, plan=plan, q_scale=qs)

                    got = ours().clone()
                    check = same_selection(got, plan.workspace[:, :n], k)
                    row[f"dsakit_{label}_check"] = check
                    if plan.stream is not None:  # which path the select took per row (exact rows cost ~0.25 ms)
                        row[f"dsakit_{label}_select_paths"] = plan.stream.path_counts(b)
                    if name in PLAIN:
                        row[f"dsakit_{label}_rule_error"] = centred_rule_error(
                            name, pools[name], table, q, w, qs, plan.workspace, [0, b - 1], n)
                    row[f"dsakit_{label}_ms"] = bench(ours, graph_on=True)
                    del plan, batch
                for label, _ in decode_variants[1:]:
                    ratio(row, f"dsakit_{label}_ms", "dsakit_fp8_ms")
                if "dsakit_fp4-centred_ms" in row and "dsakit_fp4_ms" in row:
                    row["dsakit_fp4-centred_vs_dsakit_fp4"] = row["dsakit_fp4-centred_ms"] / row["dsakit_fp4_ms"]
                if dg is not None:
                    kv_cache = pools["fp8"].view(pools["fp8"].shape[0], 64, 1, DIM + 4)
                    context = torch.full((b, 1), n, dtype=torch.int32, device=dev)
                    q4 = q.reshape(b, 1, heads, DIM)
                    wq = (w * qs).contiguous()
                    try:
                        meta_dg = dg.get_paged_mqa_logits_metadata(context, 64, dg.get_num_sms())

                        def dg_step():  # the metadata is per batch, shared by every layer: computed once, outside
                            logits = dg.fp8_fp4_paged_mqa_logits((q4, None), kv_cache, wq, context, table, meta_dg,
                                                                 n, clean_logits=False)
                            return torch.topk(logits, k, dim=1)[1]

                        dg_step()
                        row["deepgemm_topk_ms"] = bench(dg_step, graph_on=True)
                    except Exception as error:  # noqa: BLE001 - a failing peer is a result
                        row["deepgemm_error"] = f"{type(error).__name__}: {str(error)[:200]}"
                    for name in ("fp8", "fp8-centred", "fp4-centred"):
                        ratio(row, f"dsakit_{name}_ms", "deepgemm_topk_ms")
                else:
                    row["deepgemm_topk_ms"] = None
                    row["deepgemm_missing"] = dg_info.get("reason")
                del pools, q, w, qs
                if dev == "cuda":
                    torch.cuda.empty_cache()
                report["decode"].append(row)
                print(row, flush=True)
                write_json(path, report)
        report["targets"].append(targets(report, run))
        write_json(path, report)
    for item in report["targets"]:
        print(item, flush=True)
    return 0


def targets(report: dict, run: int) -> dict:
    """The issue's targets for one run: each ratio, its bound, met or not (None where a side did not run)."""
    out = {"run": run}

    def check(key: str, value, bound: float) -> None:
        out[key] = {"ratio": value, "bound": bound, "met": None if value is None else value <= bound}

    for row in report["prefill"]:
        if row["run"] == run:
            check("prefill fp8-centred / fp8", row.get("dsakit_fp8-centred_vs_dsakit_fp8"), 1.05)
            check("prefill fp8-centred / DeepGEMM+topk", row.get("dsakit_fp8-centred_vs_deepgemm_topk"), 0.80)
    for row in report["decode"]:
        if row["run"] == run:
            n = row["N"]
            check(f"decode {n} fp8-centred / fp8", row.get("dsakit_fp8-centred_vs_dsakit_fp8"), 1.10)
            check(f"decode {n} fp8-centred / DeepGEMM+topk", row.get("dsakit_fp8-centred_vs_deepgemm_topk"), 0.85)
            check(f"decode {n} fp4-centred / fp8", row.get("dsakit_fp4-centred_vs_dsakit_fp8"), 1.00)
    return out


if __name__ == "__main__":
    sys.exit(main())
