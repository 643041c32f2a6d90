"""dsakit's sparse attention beside FlashMLA's, on the same inputs in one process (issue 25, deliverable 1).

Usage (GPU machine, FlashMLA built from the carried tarball first):

    source benchmarks/anchors/build_flashmla.sh .anchors/flashmla-9241ae3.tgz
    PYTHONPATH=$PWD:$PYTHONPATH python3 benchmarks/bench_attention_vs_flashmla.py --out DIR

(``--device cpu --smoke`` under TRITON_INTERPRET=1: toy sizes, dsakit's reference path only, FlashMLA
reported missing; it exercises the plumbing and makes no timing claims.)

Both sides read the same bytes: dsakit's pools are FlashMLA's layouts, viewed, never copied.

* bf16 KV: a dsakit page (64 x 512 bf16, 65536 B) is 64 rows of FlashMLA's prefill ``kv [s_kv, 1, 512]``;
  the global slot ``page * 64 + offset`` is the row index FlashMLA takes.
* fp8 KV (584 B/token): dsakit's ``fp8-rope-bf16`` page is FlashMLA's MODEL1 fp8 block with block size 64:
  64 x (448 e4m3 + 64 bf16 rope = 576 B), then 64 x (7 ue8m0 scales + 1 pad byte), padded to 37440 B
  (a multiple of 576). FlashMLA's ``k_cache`` is the view ``pool[:, :64 * 584].view(P, 64, 1, 584)``
  (stride 584 between tokens, 37440 between blocks), indices ``[B, next_n, K]`` are the same global slots.
* sink: fp32 [Hq] on both sides, same meaning (absorbs softmax mass, contributes no value, leaves lse alone).

Which side has what (FlashMLA 9241ae3, sm_90): sparse prefill ``flash_mla_sparse_fwd`` takes bf16 KV only;
sparse decode ``flash_mla_with_kvcache(indices=...)`` takes fp8 KV only. Rows where FlashMLA has no kernel
time dsakit alone and say so (``flashmla: {"unsupported": ...}``); a FlashMLA that is not importable is
reported as missing with the reason, never substituted.

Sections (Hq 64 and 128, head dim 512 (d_qk = d_v = 512), sink on, every index valid and distinct):
  prefill  T 4096 queries over a pool of 8192 tokens, K 512 / 1024 / 2048 random slots; bf16 and fp8 KV;
           timed eager on both sides (triton.testing.do_bench).
  decode   B 64 / 128 sequences of 8192 tokens, next_n 1 / 2 (T = B * next_n), K 512 / 2048 slots of each
           query's own sequence; fp8 and bf16 KV; timed eager and as CUDA-graph replays, both sides alike.
FLOPs = 2 * T * K * Hq * (d_qk + d_v); ratios are dsakit ms / FlashMLA ms of the same run (< 1: dsakit faster).

Agreement (the flash-attention rule): on a subset of queries each kernel's max |error| against an fp32
PyTorch implementation on the same dequantized entries must be at most twice the error of the same
computation done with every op in bf16, plus the rounding of the fp32 answer to the output dtype; for out
and lse alike. The two outputs agree when both pass; their direct max difference is reported too.
Results: DIR/attention_vs_flashmla_<commit>.json, written after every row.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import torch
from _common import bench_parser, environment, median_ms, write_json
from bench_attention import FORMATS, flops, random_pool, torch_attention
from bench_peers import _anchor_sources

from dsakit.ops.attention import sparse_attention

D = 512  # d_qk = d_v = 512 (V4: 448 no-rope + 64 rope dims, shared K = V)
HEADS = (64, 128)
FLASHMLA_PREFILL_KV = "bf16"  # the only KV cache FlashMLA's sparse prefill takes
FLASHMLA_DECODE_KV = "fp8-rope-bf16"  # the only KV cache FlashMLA's sparse decode takes (MODEL1, 584 B)
FLOP_FORMULA = "2 * T * K * Hq * (d_qk + d_v), d_qk = d_v = 512"


# ------------------------------------------------------------------------------------------ tolerance
def flash_rule(got: torch.Tensor, want: torch.Tensor, low: torch.Tensor, out_dtype: torch.dtype) -> dict:
    """The flash-attention tolerance rule for one output.

    got: the kernel's result; want: an fp32 implementation's; low: the same implementation with every op in
    the kernel's precision (bf16); all the same shape. ok when every value of got is finite and
    max|got - want| <= 2 * max|low - want| + rounding, rounding = max|want cast to out_dtype - want| (the error
    of writing the exact answer in the kernel's output dtype; at least 1e-6)."""
    got, want, low = got.float(), want.float(), low.float()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    low_err = (low - want).abs().max().item() if low.numel() else 0.0
    rounding = max((want.to(out_dtype).float() - want).abs().max().item() if want.numel() else 0.0, 1e-6)
    finite = bool(torch.isfinite(got).all())
    return {"err": err, "low_precision_err": low_err, "rounding": rounding,
            "ok": finite and err <= 2 * low_err + rounding}


def gathered_entries(pool: torch.Tensor, fmt, idx: torch.Tensor) -> torch.Tensor:
    """fp32 [R, K, 512] on pool's device: the entries of the (all valid) slots idx int [R, K], decoded by the
    format's own CPU codec (the spec) from only the pages idx touches."""
    slots = idx.long().cpu()
    pages, where = torch.unique(slots // 64, return_inverse=True)
    entries = fmt.dequantize_pages(pool[pages.to(pool.device)].cpu())  # [U * 64, 512]
    return entries[where * 64 + slots % 64].to(pool.device)


def agreement(q, pool, fmt, idx, sink, scale, results: dict, rows: int) -> dict:
    """The flash rule for each side's (out [T, H, 512], lse [T, H]) in results on `rows` evenly spaced queries,
    and the two sides' direct max difference."""
    sel = torch.linspace(0, q.shape[0] - 1, min(rows, q.shape[0])).long().to(q.device)
    kv = gathered_entries(pool, fmt, idx[sel])
    want_out, want_lse = torch_attention(q[sel].float(), kv, sink, scale, torch.float32)
    low_out, low_lse = torch_attention(q[sel].float(), kv, sink, scale, torch.bfloat16)
    report = {"rows_checked": int(sel.numel())}
    for side, (out, lse) in results.items():
        rule_out = flash_rule(out[sel], want_out, low_out, out.dtype)
        rule_lse = flash_rule(lse[sel], want_lse, low_lse, lse.dtype)
        report[side] = {"out": rule_out, "lse": rule_lse, "ok": rule_out["ok"] and rule_lse["ok"]}
    if len(results) == 2:
        (a_out, a_lse), (b_out, b_lse) = results.values()
        report["max_diff_out"] = (a_out.float() - b_out.float()).abs().max().item()
        report["max_diff_lse"] = (a_lse - b_lse).abs().max().item()
    report["agree"] = all(report[side]["ok"] for side in results)
    return report


# ------------------------------------------------------------------------------------------- inputs
def make_pool(fmt, tokens: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """uint8 [tokens / 64, page_bytes] of random valid entries: on CUDA built there (bench_attention's
    random_pool), on the CPU through the format's reference codec."""
    if device == "cuda":
        return random_pool(fmt, tokens, gen)
    return fmt.quantize_pages(torch.randn(tokens, D, generator=gen))


def make_inputs(fmt, hq: int, t: int, k: int, span: int, seqs: int, device: str, gen: torch.Generator):
    """q bf16 [T, Hq, 512], pool of seqs * span tokens, indices int32 [T, K] (query i draws K distinct slots
    of its own sequence i * seqs // T, i.e. slots [s * span, (s + 1) * span)), sink fp32 [Hq]."""
    pool = make_pool(fmt, seqs * span, device, gen)
    q = torch.randn(t, hq, D, device=device, generator=gen).bfloat16()
    sink = torch.randn(hq, device=device, generator=gen)
    first = (torch.arange(t, device=device) * seqs // t) * span
    order = torch.rand(t, span, device=device, generator=gen).argsort(dim=1)[:, :k]
    return q, pool, (order + first.view(-1, 1)).to(torch.int32), sink


# ------------------------------------------------------------------------------------------- FlashMLA
def load_flashmla(device: str) -> tuple[object, dict]:
    """-> (the flash_mla module or None, {"present", "version", "sources" | "reason"})."""
    if device != "cuda":
        return None, {"present": False, "reason": "FlashMLA runs on CUDA only (CPU smoke run)"}
    try:
        import flash_mla
    except Exception as exc:  # not built, or built against another torch: reported, never faked
        return None, {"present": False, "reason": f"import flash_mla failed: {exc!r}"[:300]}
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return None, {"present": False, "reason": f"this build has sm_90a kernels only; GPU is sm_{major}{minor}"}
    return flash_mla, {"present": True, "version": getattr(flash_mla, "__version__", "?"),
                       "sources": _anchor_sources(flash_mla)}


def flashmla_prefill(flash_mla, q, pool, idx, sink, scale):
    """FlashMLA sparse prefill on dsakit's bf16 pool: kv [P * 64, 1, 512] is the pool's bytes.
    -> (out bf16 [T, H, 512], lse fp32 [T, H])."""
    kv = pool.view(torch.bfloat16).view(-1, 1, D)
    out, _max_logits, lse = flash_mla.flash_mla_sparse_fwd(q, kv, idx.view(idx.shape[0], 1, -1), scale, D, sink)
    return out, lse


def flashmla_decode_call(flash_mla, q, pool, idx, sink, scale, next_n: int):
    """A no-argument FlashMLA sparse decode on dsakit's fp8 pool (see the module docstring for the view), its
    scheduling metadata made on the first call and kept. The call -> (out [T, H, 512], lse fp32 [T, H])."""
    t, h, _ = q.shape
    b = t // next_n
    k_cache = pool[:, : 64 * 584].view(pool.shape[0], 64, 1, 584)
    q4, idx3 = q.view(b, next_n, h, D), idx.view(b, next_n, -1)
    meta, _ = flash_mla.get_mla_metadata()

    def call():
        out, lse = flash_mla.flash_mla_with_kvcache(q4, k_cache, None, None, D, meta, None, softmax_scale=scale,
                                                    is_fp8_kvcache=True, indices=idx3, attn_sink=sink)
        if lse.shape == (b, h, next_n):  # documented as [B, H, next_n]; accept [B, next_n, H] as well
            lse = lse.transpose(1, 2)
        return out.reshape(t, h, D), lse.reshape(t, h)

    return call


# ---------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = bench_parser(commit_default=None)
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--sections", default="prefill,decode")
    ap.add_argument("--rows", type=int, default=16, help="queries checked against fp32 torch per checked row")
    args = ap.parse_args()
    dev, smoke = args.device, args.smoke
    sections = args.sections.split(",")
    unknown = [name for name in sections if name not in ("prefill", "decode")]
    if unknown:
        ap.error(f"unknown sections {unknown}: choose from prefill, decode")
    if dev == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU (use --device cpu --smoke for the plumbing)")
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True, cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    flash_mla, fm_info = load_flashmla(dev)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"attention_vs_flashmla_{commit}.json"
    meta = environment(dev, commit)
    meta.update({"dsakit_commit": commit, "flashmla": fm_info, "head_dim": D, "flop_formula": FLOP_FORMULA,
                 "timing": "prefill eager both sides; decode eager and CUDA-graph replays, both sides alike; "
                           "ratio = dsakit ms / FlashMLA ms", "timing_claims": dev == "cuda"})
    report = {"meta": meta, "prefill": [], "decode": []}
    gen = torch.Generator(device=dev).manual_seed(0)
    scale = D ** -0.5
    t_start = time.time()

    def bench(fn, graph=False) -> dict:
        try:
            fn()  # compile / first-call scheduling outside the timing
            ms = median_ms(fn, dev, args.rep, graph=graph and dev == "cuda")
        except Exception as exc:  # e.g. a call that cannot be captured in a graph: reported per side
            return {"error": repr(exc)[:300]}
        return {"ms": ms}

    def timed_sides(row: dict, sides: dict, graph: bool, tag: str) -> None:
        t, k, hq = row["T"], row["K"], row["heads"]
        for side, fn in sides.items():
            if fn is None:
                continue
            res = bench(fn, graph)
            if "ms" in res:
                res["tflops"] = flops(t, hq, k) / res["ms"] / 1e9  # 2 * T * K * Hq * (512 + 512)
            row[side][tag] = res
        both = [row[s].get(tag, {}).get("ms") for s in ("dsakit", "flashmla")]
        if None not in both:
            row[f"ratio_{tag}"] = both[0] / both[1]

    def emit(section: str, row: dict) -> None:
        row["elapsed_s"] = round(time.time() - t_start, 1)
        report[section].append(row)
        print(row, flush=True)
        write_json(path, report)

    def run_row(section, fmt_name, hq, t, k, span, seqs, next_n, check: bool) -> None:
        fmt = FORMATS[fmt_name]
        q, pool, idx, sink = make_inputs(fmt, hq, t, k, span, seqs, dev, gen)
        row = {"kv_format": fmt_name, "heads": hq, "T": t, "K": k, "dsakit": {}, "flashmla": {}}
        if section == "decode":
            row.update(B=seqs, next_n=next_n)

        def ours():
            return sparse_attention(q, pool, idx, kv_format=fmt, sink=sink, softmax_scale=scale)

        theirs = None
        supported = FLASHMLA_PREFILL_KV if section == "prefill" else FLASHMLA_DECODE_KV
        if flash_mla is None:
            row["flashmla"] = {"missing": fm_info["reason"]}
        elif fmt_name != supported:
            row["flashmla"] = {"unsupported": f"FlashMLA's sparse {section} takes {supported} KV only"}
        elif section == "prefill":
            def theirs():
                return flashmla_prefill(flash_mla, q, pool, idx, sink, scale)
        else:
            theirs = flashmla_decode_call(flash_mla, q, pool, idx, sink, scale, next_n)
        if check:
            results = {"dsakit": ours()}
            if theirs is not None:
                try:
                    results["flashmla"] = theirs()
                except Exception as exc:  # a FlashMLA that rejects the inputs is reported, not dropped
                    row["flashmla"] = {"error": repr(exc)[:300]}
                    theirs = None
            row["check"] = agreement(q, pool, fmt, idx, sink, scale, results, args.rows)
        sides = {"dsakit": ours, "flashmla": theirs}
        timed_sides(row, sides, graph=False, tag="eager")
        if section == "decode" and dev == "cuda":
            timed_sides(row, sides, graph=True, tag="graph")
        emit(section, row)

    heads = (64,) if smoke else HEADS
    if "prefill" in sections:
        t, span, ks = (4, 128, (64,)) if smoke else (4096, 8192, (512, 1024, 2048))
        for fmt_name in ("bf16", "fp8-rope-bf16"):
            for hq in heads:
                for k in ks:
                    run_row("prefill", fmt_name, hq, t, k, span, 1, 1, check=smoke or k == 2048)
    if "decode" in sections:
        span, batches, ks = (128, (2,), (64,)) if smoke else (8192, (64, 128), (512, 2048))
        for fmt_name in ("fp8-rope-bf16", "bf16"):
            for hq in heads:
                for b in batches:
                    for next_n in (1, 2):
                        for k in ks:
                            run_row("decode", fmt_name, hq, b * next_n, k, span, b, next_n,
                                    check=smoke or (k == 2048 and b == 64))
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
