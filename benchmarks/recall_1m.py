"""Recall at 1M tokens: one synthetic haystack of 262144 compressed entries, one needle run per key format.

Runs the recall lab's format path (store -> scores -> top-k through dsakit's public ops, ``--backend triton``
on a GPU) and its exact fp32 path at production length, and times each op. Writes one JSON file.

    # GPU (H200): the real run
    python benchmarks/recall_1m.py --backend triton --out benchmarks/results/recall_1m_h200.json
    # CPU smoke test at a tiny size
    python benchmarks/recall_1m.py --backend reference --context-tokens 8192 --out /tmp/recall_small.json

What is timed (medians over ``--repeats`` after one warm-up, CUDA-synchronized): the store of the whole
haystack into a fresh paged cache, ``index_scores`` (all query tokens x all entries, materialized [T, N]) and
``index_topk`` for each k (never materializes [T, N] on the Triton backend). Peak GPU memory is recorded
around the format path. The needle metrics are the lab's (rank under the format and under exact scoring,
found, set recall against exact top-k, margin).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dsakit.formats import KeyFormat  # noqa: E402
from dsakit.ops import indexer as indexer_ops  # noqa: E402
from dsakit.ops import store as store_ops  # noqa: E402
from dsakit.recall import report  # noqa: E402
from dsakit.recall.faults import FAULTS  # noqa: E402
from dsakit.recall.haystack import StoredHaystack  # noqa: E402
from dsakit.recall.settings import ALL_FORMATS, generator_for, lab_device, op_backends  # noqa: E402
from dsakit.recall.synthetic import SyntheticConfig, make_haystack, model_weights, query_positions  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int) -> tuple[float, object]:
    """Median seconds of fn() over `repeats` runs after one warm-up; returns (seconds, last result)."""
    result = fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context-tokens", type=int, default=1 << 20, help="context length (tokens), default 1M")
    parser.add_argument("--formats", default=",".join(ALL_FORMATS), help="key formats, comma-separated")
    parser.add_argument("--topk", default="512,1024,2048", help="index_topk values, comma-separated")
    parser.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (one run per format and depth)")
    parser.add_argument("--query-tokens", type=int, default=4)
    parser.add_argument("--shared-ratio", type=float, default=SyntheticConfig.shared_ratio)
    parser.add_argument("--needle-strength", type=float, default=SyntheticConfig.needle_strength)
    parser.add_argument("--backend", default="triton", choices=["triton", "reference", "auto"])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per op (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True, help="JSON output file")
    args = parser.parse_args(argv)

    formats = [KeyFormat.parse(f).name for f in args.formats.split(",") if f.strip()]
    ks = [int(k) for k in args.topk.split(",") if k.strip()]
    depths = [float(d) for d in args.depths.split(",") if d.strip()]
    config = SyntheticConfig(shared_ratio=args.shared_ratio, needle_strength=args.needle_strength,
                             query_tokens=args.query_tokens)
    if args.context_tokens % config.ratio or args.context_tokens < 64 * config.ratio:
        raise SystemExit(f"--context-tokens must be a multiple of {config.ratio} and at least {64 * config.ratio}")
    device = lab_device(args.backend)
    geo = config.geometry
    entries = args.context_tokens // config.ratio
    print(f"recall_1m: {args.context_tokens} tokens = {entries} entries, formats {formats}, k {ks}, "
          f"backend {args.backend} on {device}", flush=True)

    started = time.perf_counter()
    norm_weight, ape = model_weights(config, generator_for(args.seed, "model"))
    haystack = make_haystack(config, entries, generator_for(args.seed, "haystack", args.context_tokens, 0),
                             norm_weight, ape)
    generate_s = time.perf_counter() - started
    table = geo.rope.cos_sin_table(args.context_tokens + 1)
    print(f"  haystack generated and pooled in {generate_s:.1f} s", flush=True)

    result = {
        "benchmark": "recall_1m", "context_tokens": args.context_tokens, "entries": entries, "formats": {},
        "index_topk": ks, "depths": depths, "query_tokens": args.query_tokens, "backend": args.backend,
        "ops_backend": op_backends(args.backend), "device": str(device), "config": config.as_dict(),
        "seed": args.seed, "versions": report.versions(), "commit": report.git_commit(),
        "haystack_generate_s": generate_s,
    }
    qpos = query_positions(config, args.context_tokens)
    for name in formats:
        fmt = KeyFormat.parse(name)
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        stored = StoredHaystack(haystack, [fmt.name], FAULTS["none"], table, args.backend, device)
        _sync(device)
        first_store_s = time.perf_counter() - t0  # includes the exact path's fp32 key preparation (CPU)
        cache, _, slots = stored.caches[fmt.name]
        dev = dict(keys=haystack.keys.to(device), positions=stored.entry_positions.to(device), slots=slots.to(device),
                   pool=cache.pool, fmt=fmt, rope_cos_sin=table.to(device),
                   norm_weight=haystack.norm_weight.to(device), transform=stored.key_transform)
        store_s, _ = _time(lambda: store_ops.store_index_keys(**dev, backend=args.backend), device, args.repeats)
        runs = []
        for i, depth in enumerate(depths):
            runs += stored.run_depth(depth, generator_for(args.seed, "needle", args.context_tokens, 0, i), ks)
        # op timings on the stored haystack with queries of the last run's shape (no needle needed for speed)
        q = torch.randn(qpos.numel(), geo.index_heads, geo.index_head_dim,
                        generator=generator_for(args.seed, "timing-q")).to(device)
        w = torch.rand(qpos.numel(), geo.index_heads, generator=generator_for(args.seed, "timing-w")).to(device)
        common = stored.op_kwargs(fmt.name, q, w, qpos)
        scores_s, _ = _time(lambda: indexer_ops.index_scores(**common, backend=args.backend), device, args.repeats)
        topk_s = {}
        for k in ks:
            topk_s[str(k)], _ = _time(lambda: indexer_ops.index_topk(**common, k=k, backend=args.backend), device,
                                      args.repeats)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        result["formats"][fmt.name] = {
            "first_store_and_prepare_s": first_store_s, "store_s": store_s,
            "store_entries_per_s": entries / store_s, "index_scores_ms": 1e3 * scores_s,
            "index_topk_ms": {k: 1e3 * v for k, v in topk_s.items()}, "peak_gpu_mem_gib": peak,
            "pool_bytes": cache.pool.numel(), "runs": runs,
        }
        for r in runs:
            print("  " + report.format_run_line(r), flush=True)
        print(f"  {fmt.name}: store {store_s * 1e3:.2f} ms, scores {scores_s * 1e3:.2f} ms, topk "
              + ", ".join(f"k={k} {v * 1e3:.2f} ms" for k, v in topk_s.items())
              + (f", peak {peak:.2f} GiB" if peak is not None else ""), flush=True)
        del stored, cache
    result["total_s"] = time.perf_counter() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report.json_safe(result), indent=1, sort_keys=True))
    print(f"wrote {args.out} ({result['total_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main()
