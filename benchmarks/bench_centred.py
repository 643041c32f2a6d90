"""Page-centred key formats against their plain formats on the GPU, in the same run: store, scores, top-k.

    PYTHONPATH=. python3 benchmarks/bench_centred.py --out DIR --commit $(git rev-parse --short HEAD)
    # CPU smoke test of the code paths (interpreter, tiny sizes, no timing claims):
    TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/bench_centred.py --out /tmp/bc --device cpu --small

Pairs (fp8, fp8-centred) and (fp4, fp4-centred), V4 key transform (RMSNorm, interleaved rope on the
trailing 64 dims, Hadamard), H = 64 heads. Writes DIR/centred_bench.json (after every section):

1. check: a small store through the Triton kernel and the CPU reference, bytes equal (fraction), and Triton
   scores of the centred pool against the reference's on the same pool (max |difference| relative to the
   largest score);
2. store: bulk prefill of N rows (a sequence's keys in order, pages shuffled) and decode appends (one row per
   sequence for B sequences at random fill levels), median ms, the centred format's two launches included;
3. scores + top-k: prefill (T queries of one sequence of N entries, ``index_scores`` materialized and
   ``index_topk`` k = 2048) and decode (B sequences of N entries, one query each, ``index_topk`` k = 2048),
   fp8 queries with q_scale for the fp8 pair and bf16 queries for the fp4 pair (as bench_scores does).

Each timed row records plain ms, centred ms and the ratio centred / plain (target <= 1.1).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, make_queries, timed, write_json  # noqa: E402

from dsakit import PagedBatch  # noqa: E402
from dsakit.cache import PagedCache  # noqa: E402
from dsakit.formats import ENTRIES_PER_PAGE, KeyFormat  # noqa: E402
from dsakit.ops import indexer as indexer_ops  # noqa: E402
from dsakit.ops import store as store_ops  # noqa: E402
from dsakit.presets import get_preset  # noqa: E402

PAIRS = (("fp8", "fp8-centred"), ("fp4", "fp4-centred"))
PRESET = get_preset("deepseek-v4-flash")
TRANSFORM = PRESET.key_transform


def shared_keys(n: int, device: str, seed: int) -> torch.Tensor:
    """Pre-norm keys with a large shared part (|mu| / |z| = 30), bf16, like pooled keys."""
    g = torch.Generator(device=device).manual_seed(seed)
    mu = torch.randn(1, 128, device=device, generator=g)
    return (30 * mu / mu.norm() * math.sqrt(128) + torch.randn(n, 128, device=device, generator=g)).to(torch.bfloat16)


def filled_cache(fmt: KeyFormat, lengths: list[int], device: str, seed: int, table: torch.Tensor):
    """A PagedCache of ``fmt`` holding sequences of the given lengths, written by the store op (pages in a
    shuffled order); -> (cache, sequence ids)."""
    pages = sum(math.ceil(n / ENTRIES_PER_PAGE) for n in lengths) + len(lengths)
    cache = PagedCache(fmt, pages, device=device)
    g = torch.Generator().manual_seed(seed)
    cache._free = [int(p) for p in torch.randperm(pages, generator=g)]  # shuffled page order
    seqs = []
    for i, n in enumerate(lengths):
        seq = cache.add_sequence()
        slots = cache.append(seq, n).to(device)
        keys = shared_keys(n, device, seed + i)
        positions = torch.arange(n, device=device) * 4 % table.shape[0]
        store_ops.store_index_keys(keys, positions, slots, cache.pool, fmt, table, torch.ones(128, device=device),
                                   None, TRANSFORM, backend="triton")
        seqs.append(seq)
    return cache, seqs


def section_check(device: str, table: torch.Tensor, small: bool) -> dict:
    out = {}
    n = 200 if small else 4096
    for _, name in PAIRS:
        fmt = KeyFormat.parse(name)
        keys = shared_keys(n, device, 1)
        positions = torch.arange(n, device=device) * 4 % table.shape[0]
        cache = PagedCache(fmt, math.ceil(n / 64), device=device)
        seq = cache.add_sequence()
        slots = cache.append(seq, n)
        store_ops.store_index_keys(keys, positions, slots.to(device), cache.pool, fmt, table,
                                   torch.ones(128, device=device), None, TRANSFORM, backend="triton")
        ref_pool = torch.zeros_like(cache.pool, device="cpu")
        store_ops.store_index_keys(keys.cpu(), positions.cpu(), slots.cpu(), ref_pool, fmt, table.cpu(),
                                   torch.ones(128), None, TRANSFORM, backend="reference")
        equal = float((ref_pool == cache.pool.cpu()).float().mean())
        q, w, q_scale = make_queries(fmt.kind, 4, 64, device, 5)
        batch = cache.batch([seq], query_lens=[4])
        tri = indexer_ops.index_scores(q, w, batch, backend="triton").cpu()
        cpu_batch = PagedBatch.build(cache.pool.cpu(), fmt, cache.block_table([seq]).cpu(),
                                     cache.entry_counts([seq]).cpu(), torch.zeros(4, dtype=torch.int32))
        ref = indexer_ops.index_scores(q.float().cpu(), w.cpu(), cpu_batch, backend="reference")
        plain = KeyFormat.parse(fmt.kind)  # the plain format through the same check, for comparison
        plain_pool = torch.zeros(math.ceil(n / 64), plain.page_bytes, dtype=torch.uint8, device=device)
        store_ops.store_index_keys(keys, positions, slots.to(device), plain_pool, plain, table,
                                   torch.ones(128, device=device), None, TRANSFORM, backend="triton")
        plain_ref = torch.zeros_like(plain_pool, device="cpu")
        store_ops.store_index_keys(keys.cpu(), positions.cpu(), slots.cpu(), plain_ref, plain, table.cpu(),
                                   torch.ones(128), None, TRANSFORM, backend="reference")
        out[name] = {"entries": n, "store_bytes_equal_fraction": equal,
                     f"{plain.name}_store_bytes_equal_fraction": float((plain_ref == plain_pool.cpu()).float().mean()),
                     "scores_max_rel_diff": float((tri - ref).abs().max() / ref.abs().max())}
    return out


def section_store(device: str, table: torch.Tensor, small: bool, seed: int) -> list[dict]:
    rows = []
    n_bulk = 256 if small else 262144  # 1M tokens at ratio 4
    n_decode = 4 if small else 64
    for plain, centred in PAIRS:
        for case in ("prefill", "decode"):
            times = {}
            for name in (plain, centred):
                fmt = KeyFormat.parse(name)
                g = torch.Generator().manual_seed(seed)
                if case == "prefill":
                    n = n_bulk
                    pages = math.ceil(n / 64)
                    perm = torch.randperm(pages, generator=g)
                    j = torch.arange(n)
                    slots = (perm[j // 64] * 64 + j % 64).to(device)
                else:  # one row per sequence, each at a random fill level of its own page
                    n = n_decode
                    pages = n
                    slots = (torch.randperm(pages, generator=g) * 64 + torch.randint(0, 64, (n,), generator=g)).to(device)
                pool = torch.zeros(pages, fmt.page_bytes, dtype=torch.uint8, device=device)
                keys = shared_keys(n, device, seed)
                positions = torch.arange(n, device=device) * 4 % table.shape[0]
                weight = torch.ones(128, device=device)
                fn = lambda: store_ops.store_index_keys(keys, positions, slots, pool, fmt, table, weight,  # noqa: E731
                                                        None, TRANSFORM, backend="triton")
                times[name] = timed(fn, device)[0]
            rows.append({"op": f"store-{case}", "rows": n, "plain": plain, "centred": centred,
                         "plain_ms": times[plain], "centred_ms": times[centred],
                         "ratio": times[centred] / times[plain] if times[plain] else None})
    return rows


def section_scores(device: str, table: torch.Tensor, small: bool, seed: int) -> list[dict]:
    rows = []
    heads, k = (16 if small else 64), 2048
    n = 256 if small else 65536
    t_prefill = 16 if small else 4096
    b_decode = 2 if small else 64
    for plain, centred in PAIRS:
        caches = {name: filled_cache(KeyFormat.parse(name), [n] * b_decode, device, seed, table)
                  for name in (plain, centred)}
        for case in ("prefill-scores", "prefill-topk", "decode-topk"):
            times = {}
            for name in (plain, centred):
                fmt = KeyFormat.parse(name)
                cache, seqs = caches[name]
                if case.startswith("prefill"):  # the last t tokens of one sequence, causal
                    t = t_prefill
                    batch = cache.batch(seqs[:1], query_lens=[t],
                                        query_positions=torch.arange(n - t, n, device=device))
                else:  # one query per sequence, every entry visible
                    t = b_decode
                    batch = cache.batch(seqs)
                q, w, q_scale = make_queries(fmt.kind, t, heads, device, seed)
                if case == "prefill-scores":
                    from dsakit.ops.indexer.scores import index_scores_triton

                    fn = lambda: index_scores_triton(q, w, batch, q_scale=q_scale)  # noqa: E731
                else:
                    from dsakit.ops.indexer.triton import index_topk_triton

                    fn = lambda: index_topk_triton(q, w, batch, min(k, n), q_scale=q_scale)  # noqa: E731
                times[name] = timed(fn, device)[0]
            rows.append({"op": case, "entries": n, "queries": t_prefill if case.startswith("prefill") else b_decode,
                         "heads": heads, "k": min(k, n), "plain": plain, "centred": centred,
                         "plain_ms": times[plain], "centred_ms": times[centred],
                         "ratio": times[centred] / times[plain] if times[plain] else None})
        del caches
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="smoke sizes (CPU interpreter)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "centred_bench.json"
    device = args.device
    table = PRESET.rope.cos_sin_table(8192 if args.small else 1 << 20).to(device)
    report = {"env": environment(device, args.commit), "preset": PRESET.name, "target_ratio": 1.1}
    report["check"] = section_check(device, table, args.small)
    write_json(path, report)
    report["store"] = section_store(device, table, args.small, args.seed)
    write_json(path, report)
    report["scores"] = section_scores(device, table, args.small, args.seed)
    write_json(path, report)
    if device == "cuda":
        report["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    write_json(path, report)
    for row in report["store"] + report["scores"]:
        print(f"{row['op']:15s} {row['plain']:4s} {row['plain_ms']:9.3f} ms  {row['centred']:11s} "
              f"{row['centred_ms']:9.3f} ms  x{row['ratio']:.3f}" if row["ratio"] else row)
    print(report["check"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
