"""Scores-only benchmark and full-size correctness check of the Triton index-scores kernels (H200).

One run does, in this order:
  1. correctness at moderate size on the GPU for every key format x q dtype, prefill (ragged, causal, ratio
     1 and 4) and decode (next_n 1 and 2): exact -inf mask, tight bound against a torch fp32 computation on the
     same rounded / dequantized operands, and bitwise determinism across two runs;
     plus the DeepGEMM-compatible function against DeepGEMM's masking convention;
  2. prefill timing, T = 8192 queries of one sequence x N entries (every query sees every entry, as in the
     DeepGEMM anchor), H 64, D 128, per format and for a few tile configurations;
  3. decode timing, B = 64 sequences x N entries, next_n 1;
  4. peak memory of each timed call (the scores output itself is [T, N] fp32: this op materializes by design).

Usage: PYTHONPATH=. python3 benchmarks/bench_scores.py --out DIR [--commit SHA] [--quick]
Writes DIR/scores_h200.json and prints a table.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from _common import DIM, environment, timed, timing_pool, write_json

from dsakit.formats import KeyFormat
from dsakit.ops.indexer.deepgemm_compat import fp8_mqa_logits, fp8_paged_mqa_logits
from dsakit import PagedBatch
from dsakit.ops.indexer.config import ScoresConfig
from dsakit.ops.indexer.scores import index_scores_decode, index_scores_triton
from dsakit.ops.indexer.plans import plan_decode_tiles, plan_query_tiles

HEADS = 64
DEEPGEMM_LOGITS_MS = {8192: 1.08, 16384: 2.18, 32768: 4.40, 65536: 8.69}  # docs/performance.md §2, 8192 q, fp8
DEEPGEMM_DECODE_MS = {65536: 0.150, 131072: 0.288}  # docs/performance.md §2, B = 64


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
                return {"tflops": flop / ms / 1e9, "deepgemm_logits_ms": DEEPGEMM_LOGITS_MS.get(n)}

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
                        "deepgemm_logits_ms": DEEPGEMM_DECODE_MS.get(n)}

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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--quick", action="store_true", help="only N = 64K prefill / decode sizes")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--check-only", action="store_true", help="correctness only (CPU: TRITON_INTERPRET=1)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="smoke-size correctness cases")
    args = parser.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
