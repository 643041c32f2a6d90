"""benchmarks/bench_distributed.py (the two-GPU run) stays runnable: its CPU smoke mode on two gloo ranks.

Checks the report's structure and its exactness columns (the two-rank rows equal the one-rank rows, every
pool equals the full pool after the exchange); CPU timings are not looked at.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_distributed_smoke_on_two_gloo_ranks(tmp_path):
    sys.path.insert(0, str(BENCH))  # spawned ranks import the script by name, with the parent's sys.path
    try:
        import bench_distributed
    finally:
        sys.path.remove(str(BENCH))
    rc = bench_distributed.main(["--out", str(tmp_path), "--device", "cpu", "--smoke", "--gpus", "2",
                                 "--contexts", "2048", "--formats", "fp8", "--ks", "8", "--reps", "1"])
    assert rc == 0
    report = json.loads((tmp_path / "distributed_2gpu.json").read_text())
    (row,) = report["results"]
    assert (row["tokens"], row["entries"], row["fmt"], row["k"]) == (2048, 512, "fp8", 8)
    assert row["exact"] == {"checksums_equal": True, "pools_equal": True}
    moved = row["bytes_moved"]
    assert moved["collective"] == "all_gather_pages" and moved["rows"] == 512 // 64
    assert moved["bytes_per_rank"] == moved["padded_rows"] * (8448 + 8)
    assert len(row["multi_gpu"]["per_rank_compute_ms"]) == 2 and report["skipped"] == []
