"""Bad input against ``dsakit recall``: output locations, sizes that cannot fit, and broken captured files."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from dsakit.cli import app
from dsakit.recall import cli as recall_cli
from dsakit.recall import report
from dsakit.recall.captured import CapturedTensors, load_captured, run_captured, save_captured

SMALL = ["recall", "--contexts", "1024", "--depths", "0,1", "--topk", "64", "--formats", "bf16", "--faults", "off",
         "--no-plot", "--quiet", "--horizon-topk", "32", "--horizon-trials", "4", "--horizon-min", "512",
         "--horizon-max", "1024"]


def _planted(n=200, needle=77, t=2, h=4):
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(n, 128, generator=gen)
    q = 0.3 * torch.randn(t, h, 128, generator=gen) + 4.0 * k[needle] / k[needle].norm()
    return CapturedTensors(q=q, k=k, weights=torch.rand(t, h, generator=gen) + 0.1,
                           needle_entries=torch.tensor([needle]), ratio=1, rotated=True)


def _flat(output: str) -> str:
    """CLI output without rich's box borders, line breaks and spaces (long paths wrap in narrow terminals)."""
    return "".join(output.replace("│", "").replace("╭", "").replace("╰", "").replace("─", "").split())


# -- output location -------------------------------------------------------------------------------

def test_bad_out_fails_before_the_sweep(tmp_path, monkeypatch):
    def no_sweep(*args, **kwargs):
        raise AssertionError("the sweep started although --out cannot be written")

    monkeypatch.setattr(recall_cli, "run_sweep", no_sweep)
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for out in (a_file, a_file / "below"):
        result = CliRunner().invoke(app, SMALL + ["--out", str(out)])
        assert result.exit_code == 2, result.output
        assert str(a_file).replace(" ", "") in _flat(result.output) and "Traceback" not in result.output
    captured = save_captured(tmp_path / "cap.safetensors", _planted())
    result = CliRunner().invoke(app, ["recall", "--captured", str(captured), "--formats", "bf16", "--topk", "8",
                                      "--out", str(a_file)])
    assert result.exit_code == 2 and str(a_file).replace(" ", "") in _flat(result.output), result.output


def test_rows_are_on_disk_as_they_finish(tmp_path, monkeypatch):
    """A failure after the sweep (here: in the horizon search) keeps every finished sweep row."""
    def broken_horizon(*args, **kwargs):
        raise RuntimeError("simulated failure after the sweep")

    monkeypatch.setattr(recall_cli, "recall_horizon", broken_horizon)
    result = CliRunner().invoke(app, SMALL + ["--out", str(tmp_path)])
    assert isinstance(result.exception, RuntimeError)
    rows = report.read_jsonl(tmp_path / report.JSONL_NAME)
    assert [(r["kind"], r["depth"]) for r in rows] == [("run", 0.0), ("run", 1.0)]
    assert all(r["seed"] == 0 and r["settings"]["contexts"] == [1024] for r in rows)


# -- sizes -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--contexts", "--horizon-max", "--fault-contexts"])
def test_contexts_that_cannot_fit_are_refused_naming_the_size(tmp_path, option, monkeypatch):
    monkeypatch.setattr(recall_cli, "run_sweep", lambda *a, **k: pytest.fail("the sweep started"))
    args = {"--contexts": [], "--horizon-max": [], "--fault-contexts": ["--faults", "causal-late"]}[option]
    argv = [a for a in SMALL if a not in ("--faults", "off")]
    if option != "--fault-contexts":
        argv += ["--faults", "off"]
    result = CliRunner().invoke(app, argv + args + [option, "400000000", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert "400000000tokensneedsabout" in _flat(result.output) and "GiB" in result.output
    assert not (tmp_path / report.JSONL_NAME).exists()


def test_haystack_memory_check():
    from dsakit.recall.settings import RecallSettings, check_haystack_fits

    check_haystack_fits("contexts", 1 << 16, memory=1 << 30)
    with pytest.raises(ValueError, match=r"contexts 1048576 tokens needs about 8 GiB.* 1 GiB"):
        check_haystack_fits("contexts", 1 << 20, memory=1 << 30)
    with pytest.raises(ValueError, match="horizon_max 400000000 tokens"):  # the library refuses it too
        RecallSettings(horizon_max=400_000_000)


def test_captured_topk_beyond_the_entries_runs_as_the_entry_count(monkeypatch):
    from dsakit.recall import captured as captured_module

    cap = _planted()
    select = captured_module.indexer_ops.select_topk

    def bounded_select(scores, k, **kwargs):  # a [T, 10**9] buffer would take the process down
        assert k <= scores.shape[1], f"select_topk asked for k={k} over {scores.shape[1]} entries"
        return select(scores, k, **kwargs)

    monkeypatch.setattr(captured_module.indexer_ops, "select_topk", bounded_select)
    assert run_captured(cap, ["bf16"], [10 ** 9])[0]["found"]
    huge, exact = run_captured(cap, ["bf16"], [10 ** 6, 200])  # [T, k] buffers stay small either way
    assert huge["index_topk"] == 10 ** 6 and exact["index_topk"] == 200
    for key in ("set_recall", "needle_rank", "found", "leaked", "exact_found"):
        assert huge[key] == exact[key], key


# -- captured files --------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage"])
def test_broken_safetensors_files_are_value_errors_naming_the_file(tmp_path, damage):
    path = save_captured(tmp_path / "cap.safetensors", _planted())
    data = path.read_bytes()
    path.write_bytes({"empty": b"", "truncated": data[: len(data) // 2], "garbage": b"\x00" * 64}[damage])
    with pytest.raises(ValueError, match="not a readable safetensors file") as info:
        load_captured(path)
    assert str(path) in str(info.value)
    result = CliRunner().invoke(app, ["recall", "--captured", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "notareadablesafetensorsfile" in _flat(result.output)
    assert "Traceback" not in result.output


def test_a_directory_is_not_reported_as_missing(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        load_captured(tmp_path)


@pytest.mark.parametrize("entries", [torch.tensor([3.7]), torch.tensor([True]), [3.0], [True]],
                         ids=["float-tensor", "bool-tensor", "float-list", "bool-list"])
def test_non_integer_needle_entries_are_refused(entries):
    cap = _planted()
    with pytest.raises(ValueError, match="needle_entries must hold integers"):
        CapturedTensors(q=cap.q, k=cap.k, weights=cap.weights, needle_entries=entries)
    with pytest.raises(ValueError, match="query_positions must hold integers"):
        CapturedTensors(q=cap.q, k=cap.k, weights=cap.weights, query_positions=torch.tensor([1.5, 2.5]))
    ok = CapturedTensors(q=cap.q, k=cap.k, weights=cap.weights, needle_entries=[3], query_positions=[5, 6])
    assert ok.needle_entries.tolist() == [3] and ok.query_positions.tolist() == [5, 6]


def test_float_needle_entries_in_a_file_are_refused(tmp_path):
    from safetensors.torch import save_file

    cap = _planted()
    path = tmp_path / "float-needles.safetensors"
    save_file({"q": cap.q, "k": cap.k, "weights": cap.weights, "needle_entries": torch.tensor([77.9])}, str(path),
              metadata={"ratio": "1", "rotated": "true"})
    with pytest.raises(ValueError, match="needle_entries must hold integers"):
        load_captured(path)


def test_topk_beyond_what_the_ops_select_is_refused_up_front():
    from dsakit.ops.indexer.config import MAX_K
    from dsakit.recall.settings import RecallSettings

    with pytest.raises(ValueError, match="topks"):
        RecallSettings(topks=(MAX_K + 1,))
    with pytest.raises(ValueError, match="horizon_topks"):
        RecallSettings(horizon_topks=(MAX_K + 1,))
    cap = _planted(n=MAX_K + 8, t=1, h=1)
    with pytest.raises(ValueError, match=f"at most {MAX_K}"):
        run_captured(cap, ["bf16"], [MAX_K + 1])


# -- flags that overflow fp32, and --captured naming no regular file ---------------------------------

@pytest.mark.parametrize("flag,value", [("--shared-ratio", "1e308"), ("--needle-strength", "1e40"),
                                        ("--outlier-scale", "1e30"), ("--query-noise", "1e300"),
                                        ("--head-weight-spread", "1000")])
def test_flags_that_overflow_are_refused_before_any_row(tmp_path, monkeypatch, flag, value):
    """They ran to completion and recorded NaN rows; now a usage error naming the value, and no rows."""
    def no_sweep(*args, **kwargs):
        raise AssertionError("the sweep started with a setting that overflows")

    monkeypatch.setattr(recall_cli, "run_sweep", no_sweep)
    result = CliRunner().invoke(app, SMALL + ["--out", str(tmp_path), flag, value])
    assert result.exit_code == 2, result.output
    assert "overflow" in _flat(result.output) and "Traceback" not in result.output
    assert not (tmp_path / report.JSONL_NAME).exists()


def test_settings_at_the_bounds_give_finite_rows():
    """At the largest accepted magnitudes every format's rows are free of NaN (the bound is not too loose)."""
    from dsakit.recall.settings import ALL_FORMATS, SYNTHETIC_MAXIMA, RecallSettings
    from dsakit.recall.sweep import run_sweep
    from dsakit.recall.synthetic import SyntheticConfig

    config = SyntheticConfig(outlier_channels=8, **SYNTHETIC_MAXIMA)
    settings = RecallSettings(config=config, formats=ALL_FORMATS, topks=(64,), contexts=(1024,), depths=(0.5,),
                              horizon=False, faults=())
    rows = run_sweep(settings, lambda row: None)
    assert len(rows) == len(ALL_FORMATS) and all(r["nan_fraction"] == 0.0 for r in rows)
    assert all(r["exact_margin"] is not None for r in rows)


def test_captured_that_is_no_regular_file_says_so(tmp_path):
    for path, kind in (("/dev/null", "a character device"),):
        result = CliRunner().invoke(app, ["recall", "--captured", path, "--out", str(tmp_path)])
        assert result.exit_code == 2, result.output
        assert f"is{kind}".replace(" ", "") in _flat(result.output) and "doesnotexist" not in _flat(result.output)
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    result = CliRunner().invoke(app, ["recall", "--captured", str(fifo), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "isaFIFO" in _flat(result.output), result.output
    missing = CliRunner().invoke(app, ["recall", "--captured", str(tmp_path / "none"), "--out", str(tmp_path)])
    assert missing.exit_code == 2 and "doesnotexist" in _flat(missing.output)
