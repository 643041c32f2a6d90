"""Sparse attention on the H200: full-size correctness, prefill TFLOP/s, decode TB/s.

    PYTHONPATH=. python3 benchmarks/bench_attention.py --out DIR --commit $(git rev-parse --short HEAD)

Writes DIR/attention_bench.json (after every section, so a timeout keeps what was measured):

1. correctness at full size, for each (cache format, heads): the kernel and a plain PyTorch bf16
   implementation (every op in bf16) are both compared with an fp32 PyTorch implementation on the same
   dequantized entries, on a subset of the queries; the flash-attention rule asks kernel error <= 2x the
   bf16 error (+1e-5), for out and lse.
2. prefill: T = 4096 queries, K = 512 / 1024 / 2048 random distinct slots of a pool of 8192 tokens, and the
   causal 128-token window (K = 128); Hq 64 and 128; bf16 and fp8 caches; sink on.
   FLOPs = T * Hq * K_valid * (2 * 512 (q . kv over 448 nope + 64 rope dims) + 2 * 512 (p @ kv)).
3. decode: B = 64 / 128 sequences of 8192 tokens each, next_n = 1 / 2 queries per sequence (each its own
   K = 2048 slots of its sequence), Hq 64 / 128, both caches.
   bytes = T * K * bytes_per_token + q bytes + out bytes (the index reads, 4 B per index, are left out);
   TB/s against the 4.27 TB/s copy ceiling; TFLOP/s by the formula above, since the shape is compute-heavy.
0. (section "sweep", runs first) pipeline stages and tile size on the prefill at K 2048 for every (format,
   heads); the fastest is then used by sections 1-3 (without the sweep: the library's DEFAULT_STAGES).
   Every row records its configuration. Sections 0-3 time the portable Triton kernel (kernel "triton").
4. (section "gluon", sm_90) the Gluon kernels beside the portable one on the same inputs, bf16 KV (three
   configurations of the bf16 kernel; the Gluon kernel reads bf16 pools only):
   prefill T 4096, K 2048, and decode B 64 / 128, next_n 1 / 2, K 2048, Hq 64 / 128; per row the times and
   rates of both, the speedup, the Gluon kernel's full-size check (rule of 1.) and its max difference from the
   portable kernel. Alone (``--sections gluon``) it is meant to take under 3 minutes.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from _common import environment, median_ms, write_json

from dsakit.formats import AttentionKVFormat
from dsakit.ops.attention import reference as ref
from dsakit.ops.attention import triton as attn_triton

COPY_CEILING_TBS = 4.27
COMBOS = [("bf16", 64), ("bf16", 128), ("fp8-rope-bf16", 64), ("fp8-rope-bf16", 128)]
SWEEP = [dict(num_stages=1), dict(num_stages=2), dict(block_n=32, num_stages=3)]
D = 512
FORMATS = {"bf16": AttentionKVFormat.BF16, "fp8-rope-bf16": AttentionKVFormat.FP8_ROPE_BF16}


def random_pool(fmt: AttentionKVFormat, tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Valid random page bytes built on the GPU: randn values, e4m3 codes with ue8m0 scales near 2^-6."""
    pages = tokens // 64
    pool = torch.zeros(pages, fmt.page_bytes, dtype=torch.uint8, device="cuda")
    if fmt.kind == "bf16":
        x = torch.randn(pages * 64, D, device="cuda", generator=gen).bfloat16()
        pool.copy_(x.view(torch.uint8).reshape(pages, -1))
        return pool
    nope = torch.randn(pages, 64, 448, device="cuda", generator=gen).clamp(-448, 448).to(torch.float8_e4m3fn)
    rope = torch.randn(pages, 64, 64, device="cuda", generator=gen).bfloat16()
    data = torch.cat([nope.view(torch.uint8), rope.view(torch.uint8).reshape(pages, 64, 128)], dim=2)
    pool[:, : 64 * 576] = data.reshape(pages, -1)
    scales = torch.randint(118, 124, (pages, 64, 8), device="cuda", generator=gen, dtype=torch.uint8)
    scales[:, :, 7] = 0
    pool[:, 64 * 576: 64 * 584] = scales.reshape(pages, -1)
    return pool


def random_indices(t: int, k: int, first_slot: torch.Tensor, span: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [t, k]: k distinct random slots in [first_slot[i], first_slot[i] + span) per row."""
    order = torch.rand(t, span, device="cuda", generator=gen).argsort(dim=1)[:, :k]
    return (order + first_slot.view(-1, 1)).to(torch.int32)


def dequant_gather(pool: torch.Tensor, fmt: AttentionKVFormat, idx: torch.Tensor) -> torch.Tensor:
    """fp32 [t, k, 512] entries of the (all valid) slots idx, dequantized with torch ops on the GPU."""
    slots = idx.long()
    page, e = slots // 64, slots % 64
    flat = pool.reshape(-1)
    if fmt.kind == "bf16":
        off = (page * fmt.page_bytes + e * 1024).unsqueeze(-1) + torch.arange(1024, device="cuda")
        return flat[off].view(torch.bfloat16).float()
    base = (page * fmt.page_bytes + e * 576).unsqueeze(-1)
    nope = flat[base + torch.arange(448, device="cuda")].view(torch.float8_e4m3fn).float()
    rope = flat[base + 448 + torch.arange(128, device="cuda")].view(torch.bfloat16).float()
    sc = flat[(page * fmt.page_bytes + 64 * 576 + e * 8).unsqueeze(-1) + torch.arange(7, device="cuda")]
    scale = torch.exp2(sc.float() - 127).repeat_interleave(64, dim=-1)
    return torch.cat([nope * scale, rope], dim=-1)


def torch_attention(q, kv, sink, scale, dtype):
    """Dense attention over gathered kv [t, k, D] with every op in ``dtype`` -> (out fp32, lse fp32)."""
    qd, kvd = q.to(dtype), kv.to(dtype)
    logits = torch.einsum("thd,tkd->thk", qd, kvd) * torch.tensor(scale, dtype=dtype, device=q.device)
    lse = torch.logsumexp(logits, dim=-1)
    col = sink.to(dtype).view(1, -1, 1).expand(logits.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, kvd).float(), lse.float()


def run_kernel(q, pool, fmt, idx, sink, **cfg):
    """The portable kernel unless cfg names another (kernel "gluon")."""
    a = ref.check_sparse_attention_inputs(q, pool, idx, kv_format=fmt, sink=sink)
    return attn_triton.sparse_attention_triton(a, **{"kernel": "triton", **cfg})


def check(q, pool, fmt, idx, sink, rows: int, cfg: dict) -> dict:
    out, lse = run_kernel(q, pool, fmt, idx, sink, **cfg)
    sel = torch.linspace(0, q.shape[0] - 1, rows, device="cuda").long()
    kv = dequant_gather(pool, fmt, idx[sel])
    scale = D ** -0.5
    want_out, want_lse = torch_attention(q[sel].float(), kv, sink, scale, torch.float32)
    b_out, b_lse = torch_attention(q[sel].float(), kv, sink, scale, torch.bfloat16)
    e_out = (out[sel].float() - want_out).abs().max().item()
    e_lse = (lse[sel] - want_lse).abs().max().item()
    b_e_out = (b_out - want_out).abs().max().item()
    b_e_lse = (b_lse - want_lse).abs().max().item()
    ok = e_out <= 2 * b_e_out + 1e-5 and e_lse <= 2 * b_e_lse + 1e-5 and bool(torch.isfinite(out).all())
    again = run_kernel(q, pool, fmt, idx, sink, **cfg)
    det = bool(torch.equal(again[0], out) and torch.equal(again[1], lse))
    return {"rows_checked": rows, "kernel_err_out": e_out, "bf16_torch_err_out": b_e_out, "kernel_err_lse": e_lse,
            "bf16_torch_err_lse": b_e_lse, "ok": ok, "deterministic": det}


def prefill_inputs(fmt, hq, k, gen, t=4096, pool_tokens=8192):
    pool = random_pool(fmt, pool_tokens, gen)
    q = torch.randn(t, hq, D, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(hq, device="cuda", generator=gen)
    if k == "window128":
        pos = torch.arange(t, device="cuda") + (pool_tokens - t)  # the last t tokens of the pool attend
        idx = (pos.view(-1, 1) - torch.arange(127, -1, -1, device="cuda").view(1, -1)).to(torch.int32)
    else:
        idx = random_indices(t, k, torch.zeros(t, dtype=torch.long, device="cuda"), pool_tokens, gen)
    return q, pool, idx, sink


def decode_inputs(fmt, hq, b, next_n, gen, k=2048, ctx=8192):
    pool = random_pool(fmt, b * ctx, gen)
    t = b * next_n
    q = torch.randn(t, hq, D, device="cuda", generator=gen).bfloat16()
    sink = torch.randn(hq, device="cuda", generator=gen)
    first = (torch.arange(t, device="cuda") // next_n) * ctx  # sequence b owns slots [b * ctx, (b + 1) * ctx)
    return q, pool, random_indices(t, k, first, ctx, gen), sink


def flops(t, hq, k):
    return t * hq * k * 4 * D


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--sections", default="sweep,prefill,decode,gluon",
                        help="comma list of sweep, prefill, decode, gluon")
    parser.add_argument("--rows", type=int, default=64, help="queries checked against fp32 torch per case")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "attention_bench.json"
    report = {"env": {**environment("cuda", args.commit),
                      "timing": "every kernel eager: triton.testing.do_bench median (warmup 10, rep 60 ms), "
                                "same inputs, same process"},
              "copy_ceiling_tbs": COPY_CEILING_TBS,
              "flop_formula": "T * Hq * K * (2 * 512 + 2 * 512)",
              "decode_bytes_formula": "T * K * bytes_per_token + q bytes + out bytes",
              "prefill": [], "decode": [], "sweep": [], "gluon": []}
    sections = args.sections.split(",")
    gen = torch.Generator(device="cuda").manual_seed(0)
    configs = {}  # (format, heads) -> kernel configuration used below (the library default without the sweep)
    if "sweep" in sections:
        for fmt_name, hq in COMBOS:
            fmt = FORMATS[fmt_name]
            q, pool, idx, sink = prefill_inputs(fmt, hq, 2048, gen)
            best = None
            for cfg in SWEEP:
                try:
                    ms = median_ms(lambda: run_kernel(q, pool, fmt, idx, sink, **cfg), "cuda", 60, warmup=10)
                    row = {"format": fmt_name, "heads": hq, "T": q.shape[0], "K": 2048, **cfg, "ms": ms,
                           "tflops": flops(q.shape[0], hq, 2048) / ms / 1e9}
                    if best is None or ms < best[0]:
                        best = (ms, cfg)
                except Exception as exc:  # a configuration that does not compile (shared memory) is reported
                    row = {"format": fmt_name, "heads": hq, **cfg, "error": repr(exc)[:300]}
                report["sweep"].append(row)
                print(row, flush=True)
                write_json(path, report)
            if best is not None:
                configs[(fmt_name, hq)] = best[1]
            del q, pool, idx
        report["chosen_configs"] = {f"{f}/{h}": c for (f, h), c in configs.items()}
    for combo in COMBOS:
        configs.setdefault(combo, dict(num_stages=attn_triton.DEFAULT_STAGES[(FORMATS[combo[0]].kind, combo[1])]))
    if "prefill" in sections:
        for fmt_name, hq in COMBOS:
            fmt, cfg = FORMATS[fmt_name], configs[(fmt_name, hq)]
            for k in [512, 1024, 2048, "window128"]:
                q, pool, idx, sink = prefill_inputs(fmt, hq, k, gen)
                row = {"format": fmt_name, "heads": hq, "T": q.shape[0], "K": k, "config": cfg}
                if k in (2048, "window128"):
                    row["check"] = check(q, pool, fmt, idx, sink, args.rows, cfg)
                ms = median_ms(lambda: run_kernel(q, pool, fmt, idx, sink, **cfg), "cuda", 60, warmup=10)
                kk = idx.shape[1]
                row.update(ms=ms, tflops=flops(q.shape[0], hq, kk) / ms / 1e9)
                report["prefill"].append(row)
                print(row, flush=True)
                write_json(path, report)
                del q, pool, idx
    if "decode" in sections:
        for fmt_name, hq in COMBOS:
            fmt, cfg = FORMATS[fmt_name], configs[(fmt_name, hq)]
            for b in (64, 128):
                for next_n in (1, 2):
                    q, pool, idx, sink = decode_inputs(fmt, hq, b, next_n, gen)
                    t, k = idx.shape
                    row = {"format": fmt_name, "heads": hq, "B": b, "next_n": next_n, "K": k, "config": cfg,
                           "splits": attn_triton.choose_num_splits(t, hq, math.ceil(k / 64), q.device)}
                    if b == 64 and next_n == 1:
                        row["check"] = check(q, pool, fmt, idx, sink, min(args.rows, t), cfg)
                    ms = median_ms(lambda: run_kernel(q, pool, fmt, idx, sink, **cfg), "cuda", 60, warmup=10)
                    nbytes = t * k * fmt.bytes_per_entry + 2 * q.numel() * q.element_size()
                    row.update(ms=ms, tbs=nbytes / ms / 1e9, frac_of_copy=nbytes / ms / 1e9 / COPY_CEILING_TBS,
                               tflops=flops(t, hq, k) / ms / 1e9)
                    report["decode"].append(row)
                    print(row, flush=True)
                    write_json(path, report)
                    del q, pool, idx
    if "gluon" in sections:
        gluon_section(report, path, gen, args.rows)
    print("wrote", path)


# the Gluon kernel's configurations per KV format. bf16: 64 rows x 2 buffers, 32 rows x 4 (deeper prefetch),
# and 32 x 4 in the FA3 order (softmax of a tile under the previous tile's PV product)
GLUON_CONFIGS = {
    "bf16": {"block64x2": dict(gluon_block_n=64, gluon_stages=2, gluon_overlap=False),
             "block32x4": dict(gluon_block_n=32, gluon_stages=4),
             "block32x4_overlap": dict(gluon_block_n=32, gluon_stages=4, gluon_overlap=True)},
}


def gluon_vs_portable(q, pool, fmt, idx, sink, rows: int, work: float, configs: dict) -> dict:
    """Both kernels on the same inputs: the portable kernel's time, and per Gluon configuration its time,
    speedup, check and max difference from the portable kernel; ``work`` (FLOPs or bytes) / ms / 1e9 gives
    TFLOP/s or TB/s. A configuration that fails to compile or launch is recorded, not raised."""
    row = {}
    p_out, p_lse = run_kernel(q, pool, fmt, idx, sink)
    row["portable_ms"] = median_ms(lambda: run_kernel(q, pool, fmt, idx, sink), "cuda", 60, warmup=10)
    row["portable_rate"] = work / row["portable_ms"] / 1e9
    for name, cfg in configs.items():
        cfg = dict(kernel="gluon", **cfg)
        res = {}
        try:
            g_out, g_lse = run_kernel(q, pool, fmt, idx, sink, **cfg)
            res["max_diff_vs_portable"] = {"out": (g_out.float() - p_out.float()).abs().max().item(),
                                           "lse": (g_lse - p_lse).abs().max().item()}
            del g_out, g_lse
            res["check"] = check(q, pool, fmt, idx, sink, rows, cfg)
            res["ms"] = median_ms(lambda: run_kernel(q, pool, fmt, idx, sink, **cfg), "cuda", 60, warmup=10)
            res["rate"] = work / res["ms"] / 1e9
            res["speedup"] = row["portable_ms"] / res["ms"]
        except Exception as exc:  # noqa: BLE001 - recorded in the JSON: the run goes on to the next case
            res["error"] = repr(exc)[:600]
        row[f"gluon_{name}"] = res
    return row


def gluon_section(report: dict, path: Path, gen: torch.Generator, rows: int) -> None:
    """Section 4: the Gluon sm_90 kernel (each of GLUON_CONFIGS) vs the portable kernel, bf16 KV,
    same inputs per row; rate = TFLOP/s for prefill, TB/s for decode."""
    if torch.cuda.get_device_capability() != attn_triton.GLUON_CAPABILITY or not attn_triton.gluon_importable():
        major, minor = torch.cuda.get_device_capability()
        report["gluon_skipped"] = (f"needs sm_90 and Gluon; this GPU is sm_{major}{minor}, Gluon importable: "
                                   f"{attn_triton.gluon_importable()}")
        write_json(path, report)
        return
    cases = [("prefill", hq, 4096, 1, 2048) for hq in (64, 128)]
    cases += [("decode", hq, b, next_n, 2048) for hq in (64, 128) for b in (64, 128) for next_n in (1, 2)]
    for (mode, hq, b, next_n, k), fmt_name in [(c, f) for f in GLUON_CONFIGS for c in cases]:
        fmt = FORMATS[fmt_name]
        if mode == "prefill":
            q, pool, idx, sink = prefill_inputs(fmt, hq, k, gen, t=b)
            row = {"mode": mode, "format": fmt_name, "heads": hq, "T": b, "K": k, "rate_unit": "TFLOP/s"}
            work = flops(b, hq, k)
        else:
            q, pool, idx, sink = decode_inputs(fmt, hq, b, next_n, gen, k=k)
            row = {"mode": mode, "format": fmt_name, "heads": hq, "B": b, "next_n": next_n, "K": k,
                   "rate_unit": "TB/s"}
            work = idx.shape[0] * k * fmt.bytes_per_entry + 2 * q.numel() * q.element_size()
        row.update(gluon_vs_portable(q, pool, fmt, idx, sink, min(rows, q.shape[0]), work, GLUON_CONFIGS[fmt_name]))
        report["gluon"].append(row)
        print(row, flush=True)
        write_json(path, report)
        del q, pool, idx


if __name__ == "__main__":
    main()
