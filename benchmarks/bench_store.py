"""Fused store kernels on the GPU: full-size byte checks, bandwidth, peak memory (fused vs unfused).

    PYTHONPATH=. python3 benchmarks/bench_store.py --out DIR --commit $(git rev-parse --short HEAD)

One run does everything and writes DIR/store_bench.json:

1. correctness at full size: every index-key format with the V4 key transform (RMSNorm, interleaved rope
   on the trailing dims, Hadamard) and the V3.2 one (LayerNorm + bias, half-split leading, Hadamard), and
   both attention-KV formats, compared byte for byte with the CPU reference (mismatching value codes must
   be one code apart, fp32 scales are reported in ulps);
2. bandwidth of the fused kernel for N = 1, 64, 4096, 65536, 1M entries per format (do_bench median, and
   CUDA-graph replay for the launch-bound sizes), bytes = keys read + cache bytes written + positions and
   slots + rope-table rows read, against the 4.27 TB/s copy ceiling (docs/performance.md §1), plus a copy measured here;
3. peak memory of storing a 22K-token and a 128K-token prefill: index keys (tokens / 4 entries, V4) and
   attention KV (tokens entries), fused versus the unfused torch-op sequence on the GPU (norm, rope,
   Hadamard matmul, quantize, scatter), above a baseline of cache + inputs;
4. ``--centred``: the page-centred store against the plain store of the same residual encoding, in the same
   process (fp8-centred vs fp8, fp4-centred vs fp4; V4 key transform; one launch each): a prefill chunk of
   N entries of one sequence (from entry 0 of its first page, pages shuffled, so every page's centre comes
   from a row of the same call) and a decode append (one row for each of B sequences at random fill levels,
   pages already started), timed through the launcher (eager do_bench and CUDA-graph replay) and through the
   public op (eager, with its host checks); ratio centred / plain per row (target <= 1.10). Its check: on
   the GPU, a bulk store, chunked stores and token-by-token appends write the same bytes, and the bulk bytes
   against the CPU reference (fraction equal, max code distance).

Only the centred section (what the issue 21 target needs):

    PYTHONPATH=. python3 benchmarks/bench_store.py --out DIR --commit SHA --skip check,bandwidth,memory --centred
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import torch
from _common import environment, median_ms, peak_extra_bytes, write_json

from dsakit.cache import read_entries
from dsakit.formats import ENTRIES_PER_PAGE, AttentionKVFormat, KeyFormat
from dsakit.formats import fp8_scale, ue8m0_exponent_ceil, ue8m0_to_float
from dsakit.formats.common import finite_amax as _finite_amax
from dsakit.formats.common import sanitize as _sanitize
from dsakit.ops.store import reference as store_reference
from dsakit.ops.store.config import StoreConfig
from dsakit.ops.store.triton import launch_store_attention_kv, launch_store_index_keys
from dsakit.presets import KeyTransform
from dsakit.transforms import ROPE_V4, ROPE_V32, RopeConfig, apply_norm, apply_rope, hadamard_transform

COPY_CEILING_TBS = 4.27  # docs/performance.md §1, device-to-device copy, bytes read + written
L2_BYTES = 60 * 2**20
V4_TRANSFORM = KeyTransform("rmsnorm", ROPE_V4, 64, True, 1e-6)
V32_TRANSFORM = KeyTransform("layernorm", ROPE_V32, 64, True, 1e-6)
KEY_FORMATS = ["bf16", "fp8", "fp8-ue8m0", "fp4", "fp4-rne"]
KV_FORMATS = ["fp8-rope-bf16", "bf16"]


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------


def scattered_slots(n: int, num_pages: int, generator: torch.Generator) -> torch.Tensor:
    """Slots of n consecutive entries of one sequence whose pages are a random permutation of the pool."""
    pages = torch.randperm(num_pages, generator=generator, device=DEVICE)
    j = torch.arange(n, device=DEVICE)
    return pages[j // ENTRIES_PER_PAGE] * ENTRIES_PER_PAGE + j % ENTRIES_PER_PAGE


DEVICE = "cuda"  # --device cpu runs the correctness section under TRITON_INTERPRET=1 (smoke test)


def make_case(n: int, dim: int, page_bytes: int, table_rows: int, ratio: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    pages = max(1, math.ceil(n / ENTRIES_PER_PAGE))
    rows = (torch.randn(n, dim, generator=g, device=DEVICE) * 2
            + torch.randn(1, dim, generator=g, device=DEVICE)).to(dtype)
    positions = (torch.arange(n, device=DEVICE) * ratio) % table_rows
    slots = scattered_slots(n, pages, g)
    pool = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8, generator=g, device=DEVICE)
    return rows, positions, slots, pool


# --------------------------------------------------------------------------------------------------
# the unfused path: the reference's math as separate torch ops on the GPU (every step materializes)
# --------------------------------------------------------------------------------------------------


def unfused_quantize_keys(fmt: KeyFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Device-side copy of KeyFormat.quantize (dsakit/formats/fp8.py, fp4.py), op by op."""
    n = x.shape[0]
    inf = torch.tensor(float("inf"), device=x.device)
    if fmt.kind == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8).reshape(n, 256), x.new_zeros(n, 0, dtype=torch.uint8)
    if fmt.kind == "fp8":
        scale = fp8_scale(_finite_amax(x), fmt.scale_fmt)
        v = torch.clamp(_sanitize(x, inf) * (1.0 / scale).unsqueeze(-1), -448.0, 448.0)
        return v.to(torch.float8_e4m3fn).view(torch.uint8), scale.reshape(n, 1).view(torch.uint8).reshape(n, 4)
    blocks = x.reshape(n, 4, 32)
    amax = torch.clamp(_finite_amax(blocks), min=1e-4)
    exponent = ue8m0_exponent_ceil(amax / 6.0)
    scale = ue8m0_to_float(exponent.to(torch.uint8))
    v = torch.clamp(_sanitize(blocks, inf) / scale.unsqueeze(-1), -6.0, 6.0)
    mag = v.abs()
    thresholds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=x.device)
    code = (mag.unsqueeze(-1) > thresholds).sum(dim=-1).to(torch.uint8)
    if fmt.rounding == "rne":
        tie = (mag.unsqueeze(-1) == thresholds).any(dim=-1)
        code = torch.where(tie & (code % 2 == 1), code + 1, code)
    code = (code | (((v < 0) & (code != 0)).to(torch.uint8) << 3)).reshape(n, 128)
    return code[:, 0::2] | (code[:, 1::2] << 4), exponent.to(torch.uint8)


def unfused_quantize_kv(fmt: AttentionKVFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[0]
    if fmt.kind == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8).reshape(n, 1024), x.new_zeros(n, 0, dtype=torch.uint8)
    inf = torch.tensor(float("inf"), device=x.device)
    nope = x[:, :448].reshape(n, 7, 64)
    scale = fp8_scale(_finite_amax(nope), "ue8m0")
    codes = torch.clamp(_sanitize(nope, inf) / scale.unsqueeze(-1), -448.0, 448.0).to(torch.float8_e4m3fn)
    rope = x[:, 448:].to(torch.bfloat16).view(torch.uint8)
    exponent = ue8m0_exponent_ceil(scale).to(torch.uint8)
    values = torch.cat([codes.view(torch.uint8).reshape(n, 448), rope], dim=1)
    return values, torch.cat([exponent, exponent.new_zeros(n, 1)], dim=1)


def unfused_scatter(pool: torch.Tensor, fmt, slots: torch.Tensor, values: torch.Tensor, scales: torch.Tensor):
    value_start, scale_start = fmt.byte_offsets(slots)
    flat = pool.view(-1)
    flat[(value_start.unsqueeze(1) + torch.arange(fmt.value_bytes, device=pool.device)).reshape(-1)] = values.reshape(-1)
    if fmt.scale_bytes:
        flat[(scale_start.unsqueeze(1) + torch.arange(fmt.scale_bytes, device=pool.device)).reshape(-1)] = scales.reshape(-1)


def unfused_rope(x, positions, table, layout):
    rows = table[positions]
    half = table.shape[1] // 2
    return apply_rope(x, rows[:, :half], rows[:, half:], layout, table.shape[1])


def unfused_store_index_keys(keys, positions, slots, pool, fmt, table, w, b, transform):
    x = apply_norm(keys.float(), transform.norm, w, b, transform.eps)
    x = unfused_rope(x, positions, table, transform.rope_layout)
    if transform.hadamard:
        x = hadamard_transform(x)
    values, scales = unfused_quantize_keys(fmt, x)
    unfused_scatter(pool, fmt, slots, values, scales)


def unfused_store_attention_kv(kv, positions, slots, pool, fmt, table, w):
    x = apply_norm(kv.float(), "rmsnorm", w, None, 1e-6)
    x = unfused_rope(x, positions, table, ROPE_V4)
    values, scales = unfused_quantize_kv(fmt, x)
    unfused_scatter(pool, fmt, slots, values, scales)


# --------------------------------------------------------------------------------------------------
# 1. correctness at full size
# --------------------------------------------------------------------------------------------------


def code_distance(fmt, ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Per value element: distance in codes (ordered) between reference and kernel bytes."""
    if fmt.kind == "bf16":
        a, b = ref.contiguous().view(torch.int16).int(), out.contiguous().view(torch.int16).int()
        ordered = lambda v: torch.where(v < 0, -(v & 0x7FFF), v)  # noqa: E731 sign-magnitude -> ordered
        return (ordered(a) - ordered(b)).abs()
    if fmt.kind == "fp4":
        ref = torch.stack([ref & 0xF, ref >> 4], -1).int()
        out = torch.stack([out & 0xF, out >> 4], -1).int()
        ordered = lambda v: torch.where((v & 8) != 0, -(v & 7), v & 7)  # noqa: E731
        return (ordered(ref) - ordered(out)).abs()
    a, b = ref.int(), out.int()  # e4m3 bytes (fp8 index keys, and the fp8 part of fp8-rope-bf16)
    ordered = lambda v: torch.where((v & 0x80) != 0, -(v & 0x7F), v & 0x7F)  # noqa: E731
    return (ordered(a) - ordered(b)).abs()


def dequantized_error(fmt, pool_cpu: torch.Tensor, slots: torch.Tensor, exact: torch.Tensor) -> float:
    """max |dequantized - exact| / max |exact row|, over the entries at slots (finite inputs only)."""
    x = fmt.dequantize(*read_entries(pool_cpu, fmt, slots))
    row_scale = exact.abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    return float(((x - exact).abs() / row_scale).max())


def check_index_keys(fmt_name: str, transform: KeyTransform, n: int, table: torch.Tensor, seed: int) -> dict:
    fmt = KeyFormat.parse(fmt_name)
    keys, positions, slots, pool = make_case(n, 128, fmt.page_bytes, table.shape[0], 4, seed)
    g = torch.Generator().manual_seed(seed + 1)
    w = (torch.rand(128, generator=g) + 0.5).to(DEVICE)
    b = (torch.randn(128, generator=g) * 0.1).to(DEVICE) if transform.norm == "layernorm" else None
    ref_pool = pool.cpu().clone()
    t0 = time.perf_counter()
    store_reference.store_index_keys(keys.cpu(), positions.cpu(), slots.cpu(), ref_pool, fmt, table.cpu(), w.cpu(),
                                     None if b is None else b.cpu(), transform)
    ref_s = time.perf_counter() - t0
    poison = pool.cpu().clone()
    launch_store_index_keys(keys, positions, slots, pool, table, w, b, fmt, transform.norm,
                            transform.rope_layout.pairing, transform.rope_layout.placement, transform.hadamard,
                            transform.eps)
    out = pool.cpu()
    written = torch.zeros_like(out, dtype=torch.bool)
    vstart, sstart = fmt.byte_offsets(slots.cpu())
    flat = written.view(-1)
    flat[(vstart.unsqueeze(1) + torch.arange(fmt.value_bytes)).reshape(-1)] = True
    flat[(sstart.unsqueeze(1) + torch.arange(fmt.scale_bytes)).reshape(-1)] = True
    rv, rs = read_entries(ref_pool, fmt, slots.cpu())
    ov, os_ = read_entries(out, fmt, slots.cpu())
    dist = code_distance(fmt, rv, ov)
    exact = store_reference.prepare_index_keys(keys.cpu(), positions.cpu(), table.cpu(), w.cpu(),
                                               None if b is None else b.cpu(), transform)
    err_ref, err_out = dequantized_error(fmt, ref_pool, slots.cpu(), exact), dequantized_error(fmt, out, slots.cpu(), exact)
    result = {"format": fmt_name, "transform": transform_name(transform), "n": n,
              "max_err_vs_fp32_reference": err_out, "max_err_of_reference_bytes": err_ref,
              "bytes_mismatched": int((ref_pool != out).sum()), "bytes_total_written": int(written.sum()),
              "value_codes_mismatched": int((dist > 0).sum()), "value_code_max_distance": int(dist.max()),
              "untouched_bytes_changed": int(((out != poison) & ~written).sum()), "reference_cpu_s": ref_s}
    if fmt.kind == "fp8" and fmt.scale_fmt == "fp32":
        a = rs.contiguous().view(torch.int32).flatten()
        c = os_.contiguous().view(torch.int32).flatten()
        result["scale_max_ulp_difference"] = int((a - c).abs().max())
    else:
        result["scale_bytes_mismatched"] = int((rs != os_).sum())
    # ok: the kernel's bytes are as close to the fp32 pipeline as the reference's own bytes (plus fp32 noise)
    result["ok"] = (err_out <= 1.01 * err_ref + 2**-16 and result["untouched_bytes_changed"] == 0
                    and result["value_codes_mismatched"] <= 1e-3 * dist.numel())
    return result


def check_attention_kv(fmt_name: str, n: int, table: torch.Tensor, seed: int) -> dict:
    fmt = AttentionKVFormat.parse(fmt_name)
    kv, positions, slots, pool = make_case(n, 512, fmt.page_bytes, table.shape[0], 1, seed)
    w = (torch.rand(512, generator=torch.Generator().manual_seed(seed + 1)) + 0.5).to(DEVICE)
    ref_pool = pool.cpu().clone()
    poison = pool.cpu().clone()
    store_reference.store_attention_kv(kv.cpu(), positions.cpu(), slots.cpu(), ref_pool, fmt, table.cpu(), w.cpu())
    launch_store_attention_kv(kv, positions, slots, pool, table, w, fmt, "interleaved", "trailing", 1e-6)
    out = pool.cpu()
    rv, rs = read_entries(ref_pool, fmt, slots.cpu())
    ov, os_ = read_entries(out, fmt, slots.cpu())
    if fmt.kind == "bf16":
        dist = code_distance(fmt, rv, ov)
    else:
        dist = torch.cat([code_distance(KeyFormat.FP8, rv[:, :448], ov[:, :448]).flatten(),
                          code_distance(KeyFormat.BF16, rv[:, 448:], ov[:, 448:]).flatten()])
    written = torch.zeros_like(out, dtype=torch.bool)
    vstart, sstart = fmt.byte_offsets(slots.cpu())
    written.view(-1)[(vstart.unsqueeze(1) + torch.arange(fmt.value_bytes)).reshape(-1)] = True
    if fmt.scale_bytes:
        written.view(-1)[(sstart.unsqueeze(1) + torch.arange(fmt.scale_bytes)).reshape(-1)] = True
    exact = store_reference.prepare_attention_kv(kv.cpu(), positions.cpu(), table.cpu(), w.cpu())
    err_ref, err_out = dequantized_error(fmt, ref_pool, slots.cpu(), exact), dequantized_error(fmt, out, slots.cpu(), exact)
    result = {"format": fmt_name, "transform": "rmsnorm/interleaved-trailing", "n": n,
              "max_err_vs_fp32_reference": err_out, "max_err_of_reference_bytes": err_ref,
              "bytes_mismatched": int((ref_pool != out).sum()), "bytes_total_written": int(written.sum()),
              "value_codes_mismatched": int((dist > 0).sum()), "value_code_max_distance": int(dist.max()),
              "scale_bytes_mismatched": int((rs != os_).sum()),
              "untouched_bytes_changed": int(((out != poison) & ~written).sum())}
    result["ok"] = (err_out <= 1.01 * err_ref + 2**-16 and result["untouched_bytes_changed"] == 0
                    and result["value_codes_mismatched"] <= 1e-3 * dist.numel())
    return result


def transform_name(t: KeyTransform) -> str:
    return f"{t.norm}/{t.rope_layout.name}/{'hadamard' if t.hadamard else 'no-hadamard'}"


# --------------------------------------------------------------------------------------------------
# 2. bandwidth
# --------------------------------------------------------------------------------------------------


def bench_ms(fn, graph: bool = False) -> float:
    """Median ms on the GPU (CUDA-graph replays with graph=True, for the launch-bound sizes)."""
    return median_ms(fn, "cuda", 50 if graph else 100, graph=graph)


def bandwidth_row(kind: str, fmt_name: str, n: int, table: torch.Tensor, block_n=None, num_warps=None,
                  generic: bool = False) -> dict:
    if kind == "index":
        fmt, dim, ratio = KeyFormat.parse(fmt_name), 128, 4
    else:
        fmt, dim, ratio = AttentionKVFormat.parse(fmt_name), 512, 1
    rope_dim = table.shape[1]
    bytes_per_row = dim * 2 + fmt.bytes_per_entry + 8 + 8 + rope_dim * 4  # bf16 in, entry out, int64 pos+slot, rope
    per_set = n * (dim * 2 + fmt.bytes_per_entry)
    sets = max(1, min(8, math.ceil(4 * L2_BYTES / max(per_set, 1)))) if n >= 4096 else 1
    cases = [make_case(n, dim, fmt.page_bytes, table.shape[0], ratio, seed=100 + i) for i in range(sets)]
    w = torch.rand(dim, device="cuda") + 0.5
    cycle = itertools.cycle(cases)
    settings = {}
    if block_n:
        settings = (dict(index_block_n=block_n, index_warps=num_warps) if kind == "index"
                    else dict(attention_block_n=block_n, attention_warps=num_warps))
    if generic:
        settings["index_kernel" if kind == "index" else "attention_kernel"] = "generic"
    kw = {"config": StoreConfig(**settings)} if settings else {}

    def run():
        rows, positions, slots, pool = next(cycle)
        if kind == "index":
            launch_store_index_keys(rows, positions, slots, pool, table, w, None, fmt, "rmsnorm", "interleaved",
                                    "trailing", True, 1e-6, **kw)
        else:
            launch_store_attention_kv(rows, positions, slots, pool, table, w, fmt, "interleaved", "trailing",
                                      1e-6, **kw)

    ms = bench_ms(run)
    row = {"kind": kind, "format": fmt_name, "n": n, "input_sets_rotated": sets, "bytes_per_entry_counted":
           bytes_per_row, "ms": ms, "us": ms * 1e3}
    if n <= 4096:
        row["us_cudagraph"] = bench_ms(run, graph=True) * 1e3
    seconds = (row.get("us_cudagraph", row["us"]) if n <= 4096 else row["us"]) * 1e-6
    row["gb_per_s"] = n * bytes_per_row / seconds / 1e9
    row["fraction_of_copy_ceiling"] = row["gb_per_s"] / (COPY_CEILING_TBS * 1e3)
    if block_n:
        row["block_n"], row["num_warps"] = block_n, num_warps
    row["kernel"] = "generic" if generic else "fast"
    del cases
    torch.cuda.empty_cache()
    return row


def configs_identical(table: torch.Tensor, index_configs, attention_configs) -> dict:
    """Every swept launch config must write the same bytes (the per-row arithmetic does not depend on it)."""
    verdict = {}
    for kind, fmt_name, configs in (("index", "fp4", index_configs), ("index", "fp8", index_configs),
                                    ("attention", "fp8-rope-bf16", attention_configs)):
        fmt = KeyFormat.parse(fmt_name) if kind == "index" else AttentionKVFormat.parse(fmt_name)
        rows, positions, slots, pool = make_case(4099, 128 if kind == "index" else 512, fmt.page_bytes,
                                                 table.shape[0], 4, seed=5)
        w = torch.rand(rows.shape[1], device=DEVICE) + 0.5
        outs = []
        for block_n, warps in configs:
            out = pool.clone()
            if kind == "index":
                launch_store_index_keys(rows, positions, slots, out, table, w, None, fmt, "rmsnorm", "interleaved",
                                        "trailing", True, 1e-6,
                                        config=StoreConfig(index_block_n=block_n, index_warps=warps))
            else:
                launch_store_attention_kv(rows, positions, slots, out, table, w, fmt, "interleaved", "trailing", 1e-6,
                                          config=StoreConfig(attention_block_n=block_n, attention_warps=warps))
            outs.append(out)
        verdict[f"{kind}/{fmt_name}"] = all(torch.equal(outs[0], o) for o in outs[1:])
    return verdict


def measure_copy_tbs() -> float:
    src = torch.randn(2**28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    tbs = 2 * src.numel() * 4 / (ms * 1e-3) / 1e12
    del src, dst
    torch.cuda.empty_cache()
    return tbs


# --------------------------------------------------------------------------------------------------
# 3. peak memory
# --------------------------------------------------------------------------------------------------


def memory_rows(tokens: int, table: torch.Tensor) -> list[dict]:
    rows = []
    for kind, fmt_name in (("index", "fp4"), ("index", "fp8"), ("index", "bf16"), ("attention", "fp8-rope-bf16"),
                           ("attention", "bf16")):
        if kind == "index":
            fmt, dim, n, ratio = KeyFormat.parse(fmt_name), 128, tokens // 4, 4
        else:
            fmt, dim, n, ratio = AttentionKVFormat.parse(fmt_name), 512, tokens, 1
        torch.cuda.empty_cache()
        rows_in, positions, slots, pool = make_case(n, dim, fmt.page_bytes, table.shape[0], ratio, seed=7)
        w = torch.rand(dim, device="cuda") + 0.5
        if kind == "index":
            fused = lambda: launch_store_index_keys(rows_in, positions, slots, pool, table, w, None, fmt,  # noqa
                                                    "rmsnorm", "interleaved", "trailing", True, 1e-6)
            unfused = lambda: unfused_store_index_keys(rows_in, positions, slots, pool, fmt, table, w, None,  # noqa
                                                       V4_TRANSFORM)
        else:
            fused = lambda: launch_store_attention_kv(rows_in, positions, slots, pool, table, w, fmt,  # noqa
                                                      "interleaved", "trailing", 1e-6)
            unfused = lambda: unfused_store_attention_kv(rows_in, positions, slots, pool, fmt, table, w)  # noqa
        fused()  # compile outside the measurement
        fused_extra = peak_extra_bytes(fused, "cuda")
        fused_pool = pool.clone()
        unfused_extra = peak_extra_bytes(unfused, "cuda")
        differing_bytes = int((fused_pool != pool).sum())  # fused vs unfused output, same slots
        unfused_ms = bench_ms(unfused)
        fused_ms = bench_ms(fused)
        rows.append({"tokens": tokens, "kind": kind, "format": fmt_name, "entries": n,
                     "cache_bytes": pool.numel(), "input_bytes": rows_in.numel() * rows_in.element_size(),
                     "fused_peak_extra_bytes": fused_extra, "unfused_peak_extra_bytes": unfused_extra,
                     "unfused_over_input_ratio": unfused_extra / (rows_in.numel() * rows_in.element_size()),
                     "fused_ms": fused_ms, "unfused_ms": unfused_ms, "fused_vs_unfused_bytes_differing": differing_bytes})
        del rows_in, positions, slots, pool, fused_pool
    return rows


# --------------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------------
# 4. page-centred store vs the plain store (--centred)
# --------------------------------------------------------------------------------------------------

CENTRED_PAIRS = [("fp8", "fp8-centred"), ("fp4", "fp4-centred")]


# the page-centred store's launch variants timed against each other (StoreConfig fields)
CENTRED_VARIANTS = {"one_launch": {}, "two_launches": {"page_term_two_launches_from": 1},
                    "one_launch_64x4": {"page_term_block_n": 64, "page_term_warps": 4}}


def _launch_v4(fmt, rows, positions, slots, pool, table, w, config=None):
    launch_store_index_keys(rows, positions, slots, pool, table, w, None, fmt, "rmsnorm", "interleaved", "trailing",
                            True, 1e-6, config=config)


def centred_identity_check(fmt_name: str, table: torch.Tensor, seed: int) -> dict:
    """On the device: bulk = chunks = token-by-token appends (3 sequences, one resuming mid-page), byte for
    byte; bulk vs the CPU reference (bytes equal fraction, centres equal, largest residual code distance)."""
    fmt = KeyFormat.parse(fmt_name)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    # (the CPU smoke run under the interpreter: shorter sequences, the same page patterns)
    lengths, starts, pages = ([300, 130, 200] if DEVICE == "cuda" else [70, 40, 66]), [0, 0, 17], 16
    order = torch.randperm(pages, generator=g, device=DEVICE)
    first_page = [0, 5, 8]
    keys = [torch.randn(n, 128, generator=g, device=DEVICE).to(torch.bfloat16) * 2 + 3 for n in lengths]
    slots = [order[first_page[i] + (starts[i] + torch.arange(n, device=DEVICE)) // 64] * 64
             + (starts[i] + torch.arange(n, device=DEVICE)) % 64 for i, n in enumerate(lengths)]
    positions = [(starts[i] + torch.arange(n, device=DEVICE)) * 4 for i, n in enumerate(lengths)]
    head_slots = order[first_page[2]] * 64 + torch.arange(starts[2], device=DEVICE)
    head = (torch.randn(starts[2], 128, generator=g, device=DEVICE).to(torch.bfloat16),
            torch.arange(starts[2], device=DEVICE) * 4, head_slots)
    w = torch.rand(128, generator=g, device=DEVICE) + 0.5

    def fresh():
        pool = torch.zeros(pages, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
        _launch_v4(fmt, *head, pool, table, w)
        return pool

    bulk = fresh()
    _launch_v4(fmt, torch.cat(keys), torch.cat(positions), torch.cat(slots), bulk, table, w)
    variants = {}
    for name, settings in CENTRED_VARIANTS.items():
        other = fresh()
        _launch_v4(fmt, torch.cat(keys), torch.cat(positions), torch.cat(slots), other, table, w,
                   StoreConfig(**settings))
        variants[name] = bool(torch.equal(bulk, other))
    chunked = fresh()
    for i, n in enumerate(lengths):
        for lo, hi in ((0, 1), (1, 100), (100, n)):
            _launch_v4(fmt, keys[i][lo:hi], positions[i][lo:hi], slots[i][lo:hi], chunked, table, w)
    appended = fresh()
    for t in range(max(lengths)):
        live = [i for i in range(3) if t < lengths[i]]
        _launch_v4(fmt, torch.stack([keys[i][t] for i in live]), torch.stack([positions[i][t] for i in live]),
                   torch.stack([slots[i][t] for i in live]), appended, table, w)
    ref = fresh().cpu()
    store_reference.store_index_keys(torch.cat(keys).cpu(), torch.cat(positions).cpu(), torch.cat(slots).cpu(),
                                     ref, fmt, table.cpu(), w.cpu(), None, V4_TRANSFORM)
    out = bulk.cpu()
    centre = slice(fmt.centre_offset_in_page, fmt.page_bytes)
    all_slots = torch.cat(slots).cpu()
    distance = code_distance(fmt.residual_format, read_entries(ref, fmt, all_slots)[0],
                             read_entries(out, fmt, all_slots)[0])
    row = {"format": fmt_name, "rows": sum(lengths),
           "bulk_equals_chunked": bool(torch.equal(bulk, chunked)),
           "bulk_equals_token_by_token": bool(torch.equal(bulk, appended)),
           "bulk_equals_launch_variants": variants,
           "bytes_equal_fraction_vs_reference": float((out == ref).float().mean()),
           "centre_bytes_equal_fraction_vs_reference": float((out[:, centre] == ref[:, centre]).float().mean()),
           "residual_code_max_distance_vs_reference": int(distance.max()),
           # entry 0 codes x - bf16(x), its own bf16 rounding error: one fp32 ulp of x (sum order of the
           # Hadamard) is several of its small codes there, so the other entries are reported apart
           "residual_code_max_distance_vs_reference_entries_after_0": int(distance[all_slots % 64 != 0].max())}
    row["ok"] = row["bulk_equals_chunked"] and row["bulk_equals_token_by_token"] and all(variants.values())
    return row


def centred_timing_rows(table: torch.Tensor, prefill_sizes: list[int], decode_batches: list[int]) -> list[dict]:
    """Plain and centred store of the same rows, same slots, timed in turn (launcher eager / CUDA graph, and
    the public op eager): prefill chunks of n entries, decode appends of B rows."""
    from dsakit.ops.store import store_index_keys

    rows_out = []
    w = torch.rand(128, device=DEVICE) + 0.5
    for case, sizes in (("prefill", prefill_sizes), ("decode", decode_batches)):
        for size in sizes:
            g = torch.Generator(device=DEVICE).manual_seed(size)
            if case == "prefill":  # one sequence's chunk from entry 0 of its first page, pages shuffled
                pages = math.ceil(size / 64)
                slots = scattered_slots(size, pages, g)
                positions = torch.arange(size, device=DEVICE) * 4
                prior = None
            else:  # B sequences, one page each in use, filled to a random level; the new row at that level
                pages = size
                fill = torch.randint(1, 64, (size,), generator=g, device=DEVICE)
                fill[:: 16] = 0  # one sequence in 16 starts a page with this token
                page_ids = torch.randperm(pages, generator=g, device=DEVICE)
                slots = page_ids * 64 + fill
                positions = fill * 4
                # the sequences' earlier entries 0..fill-1 (entry 0 included), stored before timing
                prior_slots = (page_ids[:, None] * 64 + torch.arange(64, device=DEVICE)[None, :])
                prior_slots = torch.where(torch.arange(64, device=DEVICE)[None, :] < fill[:, None], prior_slots, -1)
                prior = prior_slots.reshape(-1)
            keys = torch.randn(size, 128, generator=g, device=DEVICE).to(torch.bfloat16)
            row = {"case": case, "rows": size}
            for plain_name, centred_name in CENTRED_PAIRS:
                for name in (plain_name, centred_name):
                    fmt = KeyFormat.parse(name)
                    pool = torch.zeros(pages, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
                    if prior is not None:
                        _launch_v4(fmt, torch.randn(prior.numel(), 128, device=DEVICE).to(torch.bfloat16),
                                   torch.zeros_like(prior), prior, pool, table, w)

                    def launch(fmt=fmt, pool=pool, config=None):
                        _launch_v4(fmt, keys, positions, slots, pool, table, w, config)

                    def public(fmt=fmt, pool=pool):
                        store_index_keys(keys, positions, slots, pool, fmt, table, w, None, V4_TRANSFORM,
                                         backend="triton")

                    launch()
                    row[f"{name}_us"] = bench_ms(launch) * 1e3
                    row[f"{name}_us_cudagraph"] = bench_ms(launch, graph=True) * 1e3
                    row[f"{name}_op_eager_us"] = bench_ms(public) * 1e3
                    if name == centred_name:  # the other launch settings of the centred store, same rows
                        for variant, settings in CENTRED_VARIANTS.items():
                            if settings:
                                run = lambda launch=launch, config=StoreConfig(**settings): launch(config=config)  # noqa: E731
                                run()
                                row[f"{name}_{variant}_us"] = bench_ms(run) * 1e3
                                row[f"{name}_{variant}_us_cudagraph"] = bench_ms(run, graph=True) * 1e3
                                row[f"{name}_{variant}_over_{plain_name}_us_cudagraph"] = (
                                    row[f"{name}_{variant}_us_cudagraph"] / row[f"{plain_name}_us_cudagraph"])
                for key in ("us", "us_cudagraph", "op_eager_us"):
                    row[f"{centred_name}_over_{plain_name}_{key}"] = row[f"{centred_name}_{key}"] / row[f"{plain_name}_{key}"]
            print(row, flush=True)
            rows_out.append(row)
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--check-n", type=int, default=65536)
    parser.add_argument("--sizes", default="1,64,4096,65536,1048576")
    parser.add_argument("--sweep", action="store_true", help="also sweep BLOCK_N x num_warps at N = 1M")
    parser.add_argument("--device", default="cuda", help="cpu: correctness only, under TRITON_INTERPRET=1")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: check,bandwidth,memory")
    parser.add_argument("--centred", action="store_true", help="also the page-centred store vs the plain store")
    parser.add_argument("--centred-prefill", default="2048,16384", help="entries per prefill chunk (--centred)")
    parser.add_argument("--centred-decode", default="1,64,256", help="sequences per decode append (--centred)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    skip = set(filter(None, args.skip.split(",")))
    if DEVICE != "cuda":
        skip |= {"bandwidth", "memory"}
        args.sweep = False
    started = time.time()
    out_path = Path(args.out) / "store_bench.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result = {**environment(DEVICE, args.commit), "copy_ceiling_tbs_perf_md": COPY_CEILING_TBS,
              "input_dtype": "bf16", "positions_slots_dtype": "int64"}
    # V4 rope table; 1M positions (256 MiB) so that prefill positions 4j up to 4M wrap only at N = 1M
    table = RopeConfig(64, 160000.0).cos_sin_table(2**20 if DEVICE == "cuda" else 4096).to(DEVICE)
    result["rope_table_rows"] = table.shape[0]
    if DEVICE == "cuda":
        result["copy_tbs_measured_here"] = measure_copy_tbs()
        print(f"copy {result['copy_tbs_measured_here']:.2f} TB/s", flush=True)

    def section(name, fn):
        try:
            fn()
        except Exception:  # keep going: one failing section must not lose the others' numbers
            import traceback
            traceback.print_exc()
            result.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
        write_json(out_path, result)  # partial results survive a timeout

    def run_checks():
        checks = []
        for fmt_name in KEY_FORMATS:
            for transform in (V4_TRANSFORM, V32_TRANSFORM):
                checks.append(check_index_keys(fmt_name, transform, args.check_n, table, seed=len(checks)))
                print(checks[-1], flush=True)
        for fmt_name in KV_FORMATS:
            checks.append(check_attention_kv(fmt_name, args.check_n // 4, table, seed=len(checks)))
            print(checks[-1], flush=True)
        result["correctness"] = checks

    best = {"index": {}, "attention": {}}

    def run_sweep():
        sweep = []
        # index: two lanes per row, so BLOCK_N = 16 rows per warp (or 32: two row pairs per lane pair)
        index_configs = [(32, 2), (64, 4), (128, 8), (128, 4)]
        for fmt_name in ("fp4", "bf16"):
            for block_n, warps in index_configs:
                sweep.append(bandwidth_row("index", fmt_name, 2**20, table, block_n, warps))
                print({k: sweep[-1][k] for k in ("format", "block_n", "num_warps", "us", "gb_per_s")}, flush=True)
        totals = {cfg: sum(r["us"] for r in sweep if r["kind"] == "index" and (r["block_n"], r["num_warps"]) == cfg)
                  for cfg in index_configs}
        best["index"] = dict(zip(("block_n", "num_warps"), min(totals, key=totals.get)))
        # attention: eight lanes per row, so BLOCK_N = 4 rows per warp
        attention_configs = [(8, 2), (16, 4), (32, 8)]
        for block_n, warps in attention_configs:
            sweep.append(bandwidth_row("attention", "fp8-rope-bf16", 2**18, table, block_n, warps))
            print({k: sweep[-1][k] for k in ("format", "block_n", "num_warps", "us", "gb_per_s")}, flush=True)
        att = {(r["block_n"], r["num_warps"]): r["us"] for r in sweep if r["kind"] == "attention"}
        result["sweep_configs_identical_bytes"] = configs_identical(table, index_configs, attention_configs)
        best["attention"] = dict(zip(("block_n", "num_warps"), min(att, key=att.get)))
        # the generic kernels (any rope geometry; the v1 design) at the same sizes, for the record
        sweep.append(bandwidth_row("index", "fp4", 2**20, table, generic=True))
        sweep.append(bandwidth_row("attention", "fp8-rope-bf16", 2**18, table, generic=True))
        result["sweep"] = sweep
        result["chosen_config"] = best
        print("chosen", best, flush=True)

    def run_bandwidth():
        sizes = [int(s) for s in args.sizes.split(",")]
        bw = []
        for fmt_name in KEY_FORMATS:
            for n in sizes:
                bw.append(bandwidth_row("index", fmt_name, n, table, **best["index"]))
        for fmt_name in KV_FORMATS:
            for n in sizes:
                bw.append(bandwidth_row("attention", fmt_name, n, table, **best["attention"]))
        result["bandwidth"] = bw

    def run_memory():
        result["memory"] = memory_rows(22 * 1024, table) + memory_rows(128 * 1024, table)

    def run_centred():
        result["centred_check"] = [centred_identity_check(name, table, seed=7 + i)
                                   for i, (_, name) in enumerate(CENTRED_PAIRS)]
        print(result["centred_check"], flush=True)
        if DEVICE == "cuda":
            result["centred_timing_method"] = (
                "launcher (no host checks): do_bench median (eager) and do_bench_cudagraph median (graph); public "
                "op store_index_keys(backend='triton') eager with its host checks; plain and centred in turn, "
                "same rows / slots / positions, same process")
            result["centred"] = centred_timing_rows(
                table, [int(v) for v in args.centred_prefill.split(",")],
                [int(v) for v in args.centred_decode.split(",")])

    if "check" not in skip:
        section("check", run_checks)
    if args.centred:
        section("centred", run_centred)
    if args.sweep:
        section("sweep", run_sweep)
    if "bandwidth" not in skip:
        section("bandwidth", run_bandwidth)
    if "memory" not in skip:
        section("memory", run_memory)

    result["wall_s"] = time.time() - started
    write_json(out_path, result)

    # summary table last (the device reply keeps the tail of the output)
    if "correctness" in result:
        print("\ncorrectness (vs CPU reference):")
        for c in result["correctness"]:
            extra = c.get("scale_max_ulp_difference", c.get("scale_bytes_mismatched"))
            print(f"  {c['format']:<14} {c['transform']:<36} n={c['n']:<6} codes off={c['value_codes_mismatched']:<4}"
                  f" max dist={c['value_code_max_distance']} scale={extra} untouched changed="
                  f"{c['untouched_bytes_changed']} ok={c['ok']}")
    if "bandwidth" in result:
        print(f"\nbandwidth (copy ceiling {COPY_CEILING_TBS} TB/s; measured here {result['copy_tbs_measured_here']:.2f}):")
        for r in result["bandwidth"]:
            graph = f" graph {r['us_cudagraph']:.2f} us" if "us_cudagraph" in r else ""
            print(f"  {r['kind']:<9} {r['format']:<14} N={r['n']:<8} {r['us']:9.2f} us{graph:<22} "
                  f"{r['gb_per_s']:8.1f} GB/s {100 * r['fraction_of_copy_ceiling']:5.1f}%")
    if "sweep" in result:
        print("\nsweep (N = 1M index, 256K attention):")
        for r in result["sweep"]:
            print(f"  {r['kind']:<9} {r['format']:<14} {r['kernel']:<8} BLOCK_N={r.get('block_n', '-')!s:<4} "
                  f"warps={r.get('num_warps', '-')!s:<2} {r['us']:9.2f} us {r['gb_per_s']:8.1f} GB/s "
                  f"{100 * r['fraction_of_copy_ceiling']:5.1f}%")
    if "memory" in result:
        print("\npeak memory above cache + inputs (MiB):")
        for r in result["memory"]:
            print(f"  {r['tokens']:>6} tokens {r['kind']:<9} {r['format']:<14} cache {r['cache_bytes'] / 2**20:8.1f} "
                  f"input {r['input_bytes'] / 2**20:7.1f} fused +{r['fused_peak_extra_bytes'] / 2**20:.2f} unfused "
                  f"+{r['unfused_peak_extra_bytes'] / 2**20:.1f} ({r['fused_ms']:.3f} vs {r['unfused_ms']:.3f} ms)")
    if "centred" in result:
        print("\ncentred / plain store (target <= 1.10):")
        for r in result["centred"]:
            for plain, centred in CENTRED_PAIRS:
                print(f"  {r['case']:<8} rows={r['rows']:<6} {centred:<12} launcher {r[centred + '_us']:8.2f} / "
                      f"{r[plain + '_us']:8.2f} us = {r[f'{centred}_over_{plain}_us']:.2f}x   graph "
                      f"{r[centred + '_us_cudagraph']:7.2f} / {r[plain + '_us_cudagraph']:7.2f} us = "
                      f"{r[f'{centred}_over_{plain}_us_cudagraph']:.2f}x   op eager "
                      f"{r[f'{centred}_over_{plain}_op_eager_us']:.2f}x   graph two launches "
                      f"{r[f'{centred}_two_launches_over_{plain}_us_cudagraph']:.2f}x, 64x4 "
                      f"{r[f'{centred}_one_launch_64x4_over_{plain}_us_cudagraph']:.2f}x")
    failures = [c for c in result.get("correctness", []) + result.get("centred_check", []) if not c["ok"]]
    print(f"wall {result['wall_s']:.0f} s; check failures: {len(failures)}; section errors: "
          f"{sorted(result.get('errors', {}))}")
    sys.stdout.flush()
    return 1 if failures or result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
