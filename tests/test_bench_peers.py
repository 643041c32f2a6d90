"""benchmarks/bench_peers.py hands the peers the same keys dsakit reads: its pool -> peer-layout helpers agree
with the formats' own decoding, and its recall counts what it says (CPU, no kernels)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from dsakit.formats import KeyFormat

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its siblings ((_common, bench_indexer)) by name
    try:
        spec = importlib.util.spec_from_file_location("bench_peers", BENCHMARKS / "bench_peers.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_peer_key_layouts_are_the_pool_bytes():
    bench = _bench()
    n = 150  # 3 pages, the last one partly used
    fmt = KeyFormat.parse("bf16")
    pool, table, counts = bench.ordered_pool(fmt, n, "cpu", seed=3)
    assert torch.equal(table, torch.arange(pool.shape[0], dtype=torch.int32).unsqueeze(0))
    keys = bench.bf16_keys(pool, n)
    assert keys.shape == (1, n, 128) and keys.dtype == torch.bfloat16
    assert torch.equal(keys[0].float(), fmt.dequantize_pages(pool)[:n])
    fmt = KeyFormat.parse("fp8")
    pool, _, _ = bench.ordered_pool(fmt, n, "cpu", seed=4)
    values, scales = bench.fp8_keys(pool, n)
    assert values.shape == (n, 128) and scales.shape == (n,)
    want = fmt.dequantize_pages(pool)[:n]
    assert torch.allclose(values.float() * scales.unsqueeze(1), want, rtol=1e-6, atol=0)
    # decode: shuffled pages of 3 sequences, gathered through the block table
    fmt = KeyFormat.parse("bf16")
    pool, table, counts = bench.timing_pool(fmt, [n] * 3, "cpu", seed=5)
    keys = bench.bf16_keys_paged(pool, table, n)
    every = fmt.dequantize_pages(pool).reshape(pool.shape[0], 64, 128)
    for seq in range(3):
        want = every[table[seq].long()].reshape(-1, 128)[:n]
        assert torch.equal(keys[seq].float(), want)


def test_recall_counts_dsakit_indices_found_by_the_peer():
    bench = _bench()
    ours = torch.tensor([[5, 3, 9, -1], [0, 1, 2, 3]], dtype=torch.int32)
    theirs = torch.tensor([[9, 5, 7, 8], [3, 2, 1, 0]])
    assert bench._recall(theirs, ours) == (2 + 4) / 7
    assert bench._dsakit_set_equal(theirs[1:], ours[1:], 4) and not bench._dsakit_set_equal(theirs, ours, 4)
