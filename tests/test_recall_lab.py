"""Recall lab: generator, bisection, fault signatures, determinism, JSONL schema, heatmap, CLI (CPU, small)."""

import json
import math

import pytest
import torch

from dsakit.ops.compress import compress_projected
from dsakit.ops.indexer import index_scores_dense
from dsakit.recall import haystack, horizon, report, settings as lab_settings
from dsakit.recall.faults import FAULTS, decode_fp8_entries, parse_faults
from dsakit.recall import RecallSettings, recall_horizon, run_faults, run_sweep
from dsakit.recall.synthetic import (SyntheticConfig, make_haystack, model_weights, needle_direction,
                                     needle_entry_for_depth, place_needle, place_needles)

SMALL = SyntheticConfig(query_tokens=4)


def _small_settings(**kw) -> RecallSettings:
    base = dict(config=SMALL, formats=("bf16", "fp8"), topks=(64,), contexts=(1024,), depths=(0.0, 1.0),
                horizon=False, faults=(), fault_contexts=(1024,), fault_depths=(0.5, 1.0), seed=3)
    base.update(kw)
    return RecallSettings(**base)


def _haystack(n=64, seed=0, config=SMALL):
    gen = torch.Generator().manual_seed(seed)
    norm_weight, ape = model_weights(config, gen)
    return make_haystack(config, n, gen, norm_weight, ape), gen


# -- generator ---------------------------------------------------------------------------------------


def test_haystack_knobs_have_their_meaning():
    hay, gen = _haystack(n=256)
    individual = hay.keys - hay.mu
    assert float(individual.pow(2).mean().sqrt()) == pytest.approx(hay.sigma, rel=1e-5)
    assert float(hay.mu.norm()) / float(individual.norm(dim=1).mean()) == pytest.approx(SMALL.shared_ratio, rel=0.05)
    rope_dims = slice(64, 128)  # V4: rope on the trailing 64 dims, the shared part avoids them
    assert float(hay.mu[rope_dims].abs().max()) == 0.0
    u = needle_direction(hay, gen)
    assert abs(float(u @ hay.mu)) < 1e-3 * float(hay.mu.norm())
    needle = place_needle(hay, 100, u)
    assert needle.entries.tolist() == [100, 101]
    lift = (needle.keys[0] - hay.keys[100]) @ u
    assert float(lift) == pytest.approx(SMALL.needle_strength * hay.sigma, rel=1e-4)
    assert 0 < float((needle.keys[1] - hay.keys[101]) @ u)  # the overlapping window carries some of it


def test_needle_pooling_matches_the_compressor_on_the_whole_context():
    """place_needles' windowed pooling equals pooling the whole token sequence with the needle written in."""
    hay, gen = _haystack(n=16)
    u = needle_direction(hay, gen)
    for entry in (0, 7, 15):
        needle = place_needles(hay, [entry], u.unsqueeze(0))[0]
        rows = torch.zeros_like(hay.gate)
        rows[entry * 4:(entry + 1) * 4] = torch.cat([u, u])
        pooled = compress_projected(rows, hay.gate, hay.ape, 4)
        scale = SMALL.needle_strength * hay.sigma / float(pooled[entry] @ u)
        expected = hay.keys[needle.entries] + scale * pooled[needle.entries]
        torch.testing.assert_close(needle.keys, expected, rtol=1e-5, atol=1e-5)
        assert needle.entries.tolist() == ([entry, entry + 1] if entry < 15 else [entry])


def test_generator_validates_and_is_deterministic():
    with pytest.raises(ValueError, match="shared_ratio"):
        SyntheticConfig(shared_ratio=-1.0)
    with pytest.raises(ValueError, match="unknown preset"):
        SyntheticConfig(preset="deepseek-v9")
    with pytest.raises(ValueError, match="depth"):
        needle_entry_for_depth(1.5, 10)
    a, _ = _haystack(seed=5)
    b, _ = _haystack(seed=5)
    assert torch.equal(a.keys, b.keys)
    assert needle_entry_for_depth(1.0, 10) == 9 and needle_entry_for_depth(0.0, 10) == 0


def test_v32_preset_runs_without_compressor():
    settings = _small_settings(config=SyntheticConfig(preset="deepseek-v3.2", query_tokens=2), contexts=(256,),
                               formats=("fp8-ue8m0",), topks=(32,))
    runs = run_sweep(settings)
    assert {r["entries"] for r in runs} == {256}
    assert all(r["exact_rank"] == 0 for r in runs)


# -- sweep records, determinism, JSONL, heatmap --------------------------------------------------------

RUN_KEYS = {"kind", "source", "fault", "format", "index_topk", "context_tokens", "entries", "depth", "needle_entry",
            "needle_entries", "needle_rank", "exact_rank", "found", "exact_found", "set_recall", "margin",
            "exact_margin", "nan_fraction", "leaked", "needle_score_ratio", "query_tokens", "trial"}


@pytest.fixture(scope="module")
def sweep_runs():
    return run_sweep(_small_settings())


def test_sweep_records_are_consistent(sweep_runs):
    assert len(sweep_runs) == 1 * 2 * 2 * 1  # contexts x depths x formats x topks
    for r in sweep_runs:
        assert RUN_KEYS <= set(r)
        assert r["found"] == (r["needle_rank"] is not None and r["needle_rank"] < r["index_topk"])
        assert r["exact_rank"] == 0 and 0.0 <= r["set_recall"] <= 1.0 and r["leaked"] == 0
    bf16 = [r for r in sweep_runs if r["format"] == "bf16"]
    assert all(r["needle_rank"] <= 2 and r["found"] and r["set_recall"] > 0.8 for r in bf16)
    assert {r["needle_entry"] for r in sweep_runs} == {0, 255}


def test_sweep_is_deterministic(sweep_runs):
    assert run_sweep(_small_settings()) == sweep_runs
    other = run_sweep(_small_settings(seed=4))
    assert [r["margin"] for r in other] != [r["margin"] for r in sweep_runs]


def test_jsonl_schema_and_heatmap(sweep_runs, tmp_path):
    common = {"seed": 3, "versions": report.versions(), "commit": report.git_commit(),
              "settings": _small_settings().as_dict()}
    path = report.write_jsonl(tmp_path / "runs.jsonl", sweep_runs + [{"kind": "horizon", "margin": math.inf}], common)
    rows = report.read_jsonl(path)
    assert len(rows) == len(sweep_runs) + 1
    for row in rows[:-1]:
        assert RUN_KEYS | {"seed", "versions", "commit", "settings"} <= set(row)
        assert row["settings"]["config"]["shared_ratio"] == SMALL.shared_ratio
        assert {"dsakit", "torch"} <= set(row["versions"])
    assert rows[-1]["margin"] is None  # non-finite floats become null, the file stays valid JSON
    json.loads(path.read_text().splitlines()[0])
    png = report.plot_heatmap(sweep_runs, tmp_path / "heatmap.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    import matplotlib.pyplot as plt

    open_before = plt.get_fignums()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError):  # a file where the folder should be: writing fails, the figure is closed anyway
        report.plot_heatmap(sweep_runs, tmp_path / "file" / "heatmap.png")
    assert plt.get_fignums() == open_before
    line = report.format_run_line(sweep_runs[0])
    assert line.startswith("fmt=bf16 ") and "ctx_tok=  1024 depth=0.00 needle_rank=" in line and "found=True" in line


# -- horizon bisection ---------------------------------------------------------------------------------


def test_horizon_bisection_finds_the_edge(monkeypatch):
    """With ranks that grow as context / 8, the horizon for k is the longest grid length with ctx / 8 < k."""

    def fake_ranks(self, formats, context_tokens, trial_ids):
        return {f: [context_tokens // 8 if f == "fp8" else 0 for _ in trial_ids] for f in formats}

    monkeypatch.setattr(horizon.HorizonHaystack, "ranks", fake_ranks)
    monkeypatch.setattr(horizon.HorizonHaystack, "__init__", lambda self, *a, **k: None)
    monkeypatch.setattr(horizon, "make_haystack", lambda *a, **k: None)
    settings = _small_settings(horizon_topks=(64, 128, 4096), horizon_trials=10, horizon_min=256,
                               horizon_max=8192, horizon_steps_per_octave=2)
    grid = horizon.horizon_grid(settings)
    assert grid[0] == 256 and grid[-1] == 8192 and all(b > a for a, b in zip(grid, grid[1:]))
    rows, points = recall_horizon(settings)
    by = {(r["format"], r["index_topk"]): r for r in rows}
    for k in (64, 128):
        expected = max(c for c in grid if c // 8 < k)
        assert by[("fp8", k)]["horizon_tokens"] == expected and by[("fp8", k)]["status"] == "ok"
        assert by[("fp8", k)]["first_failing_tokens"] == min(c for c in grid if c // 8 >= k)
    assert by[("fp8", 4096)]["status"] == "at-max" and by[("bf16", 64)]["status"] == "at-max"
    assert len(points) < 2 * len(grid)  # bisection, not a scan


def test_horizon_below_min_and_quantile(monkeypatch):
    calls = []

    def fake_ranks(self, formats, context_tokens, trial_ids):
        calls.append(len(trial_ids))
        return {f: [10_000 if t % 50 == 0 else 0 for t in trial_ids] for f in formats}  # 2 misses in 100

    monkeypatch.setattr(horizon.HorizonHaystack, "ranks", fake_ranks)
    monkeypatch.setattr(horizon.HorizonHaystack, "__init__", lambda self, *a, **k: None)
    monkeypatch.setattr(horizon, "make_haystack", lambda *a, **k: None)
    settings = _small_settings(formats=("fp4",), horizon_topks=(8,), horizon_min=256, horizon_max=1024)
    rows, _ = recall_horizon(settings)
    assert rows[0]["status"] == "below-min" and rows[0]["horizon_tokens"] is None
    relaxed = _small_settings(formats=("fp4",), horizon_topks=(8,), horizon_min=256, horizon_max=1024,
                              horizon_quantile=0.98)
    assert recall_horizon(relaxed)[0][0]["status"] == "at-max"


def test_real_horizon_orders_formats():
    """End to end on tiny sizes: bf16 reaches at least as far as fp4 with the same trials."""
    settings = _small_settings(formats=("bf16", "fp4"), horizon_topks=(16,), horizon_trials=20,
                               horizon_min=256, horizon_max=2048, horizon_steps_per_octave=1)
    rows, points = recall_horizon(settings)
    reach = {r["format"]: r["horizon_tokens"] or 0 for r in rows}
    assert reach["bf16"] >= reach["fp4"]
    assert reach["bf16"] == 2048
    assert all(p["trials_run"] <= 20 for p in points)


def test_horizon_prefix_equals_fresh_haystack():
    hay, _ = _haystack(n=64)
    prefix = horizon.haystack_prefix(hay, 40)
    assert prefix.num_entries == 40 and prefix.gate.shape[0] == 160
    torch.testing.assert_close(compress_projected(torch.zeros(160, 256), prefix.gate, hay.ape, 4),
                               torch.zeros(40, 128))
    with pytest.raises(ValueError):
        horizon.haystack_prefix(hay, 65)


# -- faults ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fault_runs():
    settings = _small_settings(faults=tuple(FAULTS), fault_format="bf16", fault_contexts=(2048,),
                               fault_depths=(0.5, 1.0), topks=(64,))
    return run_faults(settings)


def _group(runs, fault):
    rows = [r for r in runs if r["fault"] == fault]
    assert rows, fault
    return rows


def test_fault_rows_are_named_and_carried(fault_runs):
    pairs = {(r["fault"], r["format"]) for r in fault_runs}
    assert ("none", "bf16") in pairs and ("none", "fp8") in pairs
    assert ("fp8-read-as-fnuz", "fp8") in pairs and ("missing-key-scale", "fp8") in pairs
    assert ("rope-layout-mismatch", "bf16") in pairs and ("causal-late", "bf16") in pairs
    assert all(r["kind"] == "fault" and r["exact_rank"] == 0 for r in fault_runs)


def test_fault_signatures(fault_runs):
    base = {r["depth"]: r for r in fault_runs if r["fault"] == "none" and r["format"] == "bf16"}
    base_fp8 = {r["depth"]: r for r in fault_runs if r["fault"] == "none" and r["format"] == "fp8"}
    # causal-late: the newest complete entry is hidden; other depths unaffected
    late = {r["depth"]: r for r in _group(fault_runs, "causal-late")}
    assert late[1.0]["needle_rank"] is None and not late[1.0]["found"]
    assert late[0.5]["needle_rank"] == base[0.5]["needle_rank"]
    # causal-early: future entries get selected
    assert all(r["leaked"] > 0 for r in _group(fault_runs, "causal-early"))
    assert all(r["leaked"] == 0 for r in base.values())
    # Hadamard on one side only and rope-layout mismatch: the top-k sets drift away from exact scoring
    for fault in ("hadamard-keys-only", "rope-layout-mismatch"):
        rows = _group(fault_runs, fault)
        assert sum(r["set_recall"] for r in rows) < sum(r["set_recall"] for r in base.values()) - 0.2, fault
    # fnuz: every finite fp8 value halves; missing scale: scores blow up by ~448 / amax
    for r in _group(fault_runs, "fp8-read-as-fnuz"):
        if r["needle_score_ratio"] is not None:
            assert r["needle_score_ratio"] == pytest.approx(base_fp8[r["depth"]]["needle_score_ratio"] / 2, rel=1e-3)
    for r in _group(fault_runs, "missing-key-scale"):
        assert r["needle_score_ratio"] > 20


def test_fnuz_decoder_makes_nan_of_negative_zero():
    values = torch.tensor([[0x80, 0x38, 0x00] + [0] * 125], dtype=torch.uint8)
    scales = torch.tensor([1.0]).view(torch.uint8).reshape(1, 4)
    fn = decode_fp8_entries(values, scales, FAULTS["none"])
    fnuz = decode_fp8_entries(values, scales, FAULTS["fp8-read-as-fnuz"])
    assert fn[0, 1] == 1.0 and fnuz[0, 1] == 0.5 and math.isnan(float(fnuz[0, 0])) and fn[0, 0] == 0.0
    unscaled = decode_fp8_entries(values, torch.tensor([0.25]).view(torch.uint8).reshape(1, 4),
                                  FAULTS["missing-key-scale"])
    assert unscaled[0, 1] == 1.0
    with pytest.raises(ValueError, match=r"\[N, 4\]"):  # used to be a RuntimeError from view()
        decode_fp8_entries(values, scales[:, :2], FAULTS["none"])
    with pytest.raises(ValueError, match=r"\[N, 128\]"):
        decode_fp8_entries(values[:, :64], scales, FAULTS["none"])


def test_parse_faults():
    assert parse_faults("off") == []
    assert [f.name for f in parse_faults("causal-late")] == ["none", "causal-late"]
    # the baseline comes first even when named later; a repeated name gives one fault row, not two
    assert [f.name for f in parse_faults("causal-late,none,causal-late")] == ["none", "causal-late"]
    assert [f.name for f in parse_faults(["none", "none"])] == ["none"]
    assert len(parse_faults("all")) == len(FAULTS)
    with pytest.raises(ValueError, match="unknown fault"):
        parse_faults("rope-typo")


def test_settings_validate():
    with pytest.raises(ValueError, match="multiple of the compression ratio"):
        _small_settings(contexts=(1023,))
    with pytest.raises(ValueError, match="unknown key format"):
        _small_settings(formats=("fp6",))
    with pytest.raises(ValueError, match="depth"):
        _small_settings(depths=(1.5,))
    with pytest.raises(ValueError, match="unknown backend"):
        _small_settings(backend="cuda")
    assert lab_settings.op_backends("auto")["index_scores"] == ("triton" if torch.cuda.is_available() else "reference")
    # wrong types name the field instead of failing with a TypeError deep inside
    for kwargs, field in (({"formats": "bf16"}, "formats"), ({"depths": ("a",)}, "depth"),
                          ({"topks": (True,)}, "topks"), ({"seed": "x"}, "seed"), ({"horizon_quantile": "x"}, "quantile")):
        with pytest.raises(ValueError, match=field):
            _small_settings(**kwargs)
    assert _small_settings(formats=["bf16", "fp8"], depths=[0.5]).formats == ("bf16", "fp8")  # lists become tuples
    for kwargs, field in (({"shared_ratio": "x"}, "shared_ratio"), ({"query_tokens": True}, "query_tokens"),
                          ({"outlier_channels": 1.5}, "outlier_channels")):
        with pytest.raises(ValueError, match=field):
            SyntheticConfig(**kwargs)


def test_dense_scoring_used_by_the_horizon_matches_the_paged_op():
    """The horizon path scores dequantized keys with index_scores_dense; the sweep path uses the paged op."""
    hay, gen = _haystack(n=128)
    settings = _small_settings(contexts=(512,))
    table = lab_settings.rope_table(settings, 512)
    stored = haystack.StoredHaystack(hay, ["fp8"], FAULTS["none"], table, "reference", torch.device("cpu"))
    cache, seq, _ = stored.caches["fp8"]
    q = torch.randn(3, 64, 128, generator=gen)
    w = torch.rand(3, 64, generator=gen)
    pos = torch.tensor([509, 510, 511])
    paged, _, _ = stored._scores_and_topk("fp8", q, w, pos, [8])
    dense = index_scores_dense(q, w, cache.gather(seq), pos, 4)
    torch.testing.assert_close(paged, dense)


# -- CLI --------------------------------------------------------------------------------------------------


def test_cli_small_run(tmp_path):
    from typer.testing import CliRunner

    from dsakit.cli import app

    result = CliRunner().invoke(app, [
        "recall", "--contexts", "1024", "--depths", "0,1", "--topk", "64", "--formats", "bf16,fp4",
        "--horizon-topk", "32", "--horizon-trials", "4", "--horizon-min", "512", "--horizon-max", "1024",
        "--faults", "causal-late", "--fault-contexts", "1024", "--seed", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "fmt=bf16      ctx_tok=  1024 depth=0.00 needle_rank=" in result.output
    assert "recall horizon" in result.output and "causal-late" in result.output
    rows = report.read_jsonl(tmp_path / "runs.jsonl")
    kinds = {r["kind"] for r in rows}
    assert {"run", "fault", "horizon", "horizon-point"} <= kinds
    assert all(r["seed"] == 1 for r in rows)
    assert (tmp_path / "heatmap.png").stat().st_size > 0
    bad = CliRunner().invoke(app, ["recall", "--formats", "fp6", "--out", str(tmp_path)])
    assert bad.exit_code != 0 and "fp6" in bad.output


def test_query_construction_validates_and_matches_the_needle():
    """The ideal query, roped at its own position, points at the needle's stored key."""
    from dsakit.recall.synthetic import make_queries, prepare_queries

    hay, gen = _haystack(n=64)
    needle = place_needle(hay, 20, needle_direction(hay, gen))
    positions = torch.tensor([252, 253, 254, 255])
    q_pre, w = make_queries(hay, needle, positions, gen)
    assert q_pre.shape == (4, 64, 128) and w.shape == (4, 64) and bool((w > 0).all())
    settings = _small_settings(contexts=(256,))
    table = lab_settings.rope_table(settings, 256)
    tr = SMALL.geometry.key_transform
    q = prepare_queries(q_pre, positions, table, tr.rope_layout, tr.rope_dim, tr.hadamard)
    stored = haystack.StoredHaystack(hay, ["bf16"], FAULTS["none"], table, "reference", torch.device("cpu"))
    exact = stored.exact_keys.clone()
    from dsakit.ops.store import prepare_index_keys

    exact[needle.entries] = prepare_index_keys(keys=needle.keys, positions=needle.entries * 4, rope_cos_sin=table,
                                               norm_weight=hay.norm_weight, transform=tr)
    scores = index_scores_dense(q, w, exact, positions, 4)
    assert all(int(scores[t].argmax()) in needle.entries.tolist() for t in range(4))
    with pytest.raises(ValueError, match="precedes the needle"):
        make_queries(hay, needle, torch.tensor([10]), gen)
    with pytest.raises(ValueError, match="outside the rope table"):
        prepare_queries(q_pre, positions + 1000, table, tr.rope_layout, tr.rope_dim, tr.hadamard)
    with pytest.raises(ValueError, match="non-empty"):  # used to be a RuntimeError from max() of nothing
        prepare_queries(q_pre[:0], positions[:0], table, tr.rope_layout, tr.rope_dim, tr.hadamard)


def test_recall_1m_benchmark_runs_on_the_cpu_at_a_tiny_size(tmp_path):
    """benchmarks/recall_1m.py (the GPU run at 1M tokens) stays runnable: same code path at 1024 tokens."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "recall_1m.py"
    spec = importlib.util.spec_from_file_location("recall_1m", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "r.json"
    result = module.main(["--backend", "reference", "--context-tokens", "1024", "--formats", "bf16,fp8",
                          "--topk", "16", "--depths", "0.5", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text())["entries"] == 256 == result["entries"]
    for name in ("bf16", "fp8"):
        entry = result["formats"][name]
        assert entry["index_scores_ms"] > 0 and set(entry["index_topk_ms"]) == {"16"}
        (run,) = entry["runs"]
        assert run["format"] == name and run["exact_rank"] == 0 and run["context_tokens"] == 1024


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_triton_backend_without_cuda_or_interpreter_is_refused_up_front(monkeypatch):
    """Not mid-sweep after the haystack was drawn (the CLI turns this ValueError into a usage error)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        _small_settings(backend="triton")
