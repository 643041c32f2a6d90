"""CPU smoke run of benchmarks/bench_layer.py at a tiny geometry: every section runs and writes its JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_layer.py"


def test_bench_layer_smoke(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_layer", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rc = bench.main(["--out", str(tmp_path), "--device", "cpu", "--small", "--tokens", "64",
                         "--decode-context", "70", "--reps", "1"])
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "bench_layer.json").read_text())
    assert rc == 0 and report["errors"] == []
    row = report["prefill"][0]
    assert row["tokens"] == 64 and row["entries"] == 16
    assert set(row["stages"]) == {"compress", "store", "project", "topk", "attention", "output"}
    assert row["layer"]["ms"] > 0
    decode = report["decode"]
    assert decode["context"] == 70 and set(decode["stages"]) == set(row["stages"])
    assert decode["step_ms"] > 0 and decode["sum_of_stages_ms"] > 0
    model = report["patched_model"]
    if importlib.util.find_spec("transformers") is None:
        assert "skipped" in model
    else:
        assert [layer["layer_type"] for layer in model["layers"]] == ["csa", "hca"]
        assert model["model_step_ms"] > 0 and model["rest_of_model_ms"] > 0
