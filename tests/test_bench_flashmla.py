"""benchmarks/bench_peers.py, attention sections (dsakit's sparse attention beside FlashMLA): its CPU smoke run
writes the result file it promises (FlashMLA reported missing, never timed), and its flash-attention tolerance
rule accepts and rejects what it should."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"


def _bench():
    sys.path.insert(0, str(BENCHMARKS))  # the script imports its siblings (_common, bench_attention) by name
    try:
        spec = importlib.util.spec_from_file_location("bench_peers", BENCHMARKS / "bench_peers.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_smoke_run_writes_the_promised_json(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, str(BENCHMARKS / "bench_peers.py"), "--device", "cpu", "--smoke",
                    "--sections", "attention-prefill,attention-decode", "--out", str(tmp_path), "--commit", "abc1234"],
                   check=True, env=env, timeout=120, capture_output=True)
    assert not (tmp_path / "peers_abc1234.json").exists()  # the indexer sections were not asked for
    report = json.loads((tmp_path / "attention_vs_flashmla_abc1234.json").read_text())
    meta = report["meta"]
    assert meta["dsakit_commit"] == "abc1234" and meta["timing_claims"] is False
    assert meta["flashmla"]["present"] is False and meta["flashmla"]["reason"]
    assert {"gpu", "torch", "triton", "python", "head_dim", "flop_formula"} <= set(meta)
    # prefill: bf16 and fp8 KV; decode: next_n 1 and 2 for both KV formats
    assert {r["kv_format"] for r in report["prefill"]} == {"bf16", "fp8-rope-bf16"}
    assert sorted((r["kv_format"], r["next_n"]) for r in report["decode"]) == [
        ("bf16", 1), ("bf16", 2), ("fp8-rope-bf16", 1), ("fp8-rope-bf16", 2)]
    for row in report["prefill"] + report["decode"]:
        assert row["flashmla"] == {"missing": meta["flashmla"]["reason"]}  # missing, never a number
        assert "ratio_eager" not in row
        eager = row["dsakit"]["eager"]
        assert eager["ms"] > 0 and eager["tflops"] > 0
        check = row["check"]
        assert set(check) == {"rows_checked", "dsakit", "agree"} and check["rows_checked"] == row["T"]
        assert check["dsakit"]["out"]["ok"] and check["dsakit"]["lse"]["ok"] and check["agree"]


def test_flash_rule_accepts_twice_the_low_precision_error_and_rejects_more():
    rule = _bench().flash_rule
    gen = torch.Generator().manual_seed(0)
    want = torch.randn(8, 4, 32, generator=gen)
    low = want + 0.01 * torch.randn(want.shape, generator=gen)  # a bf16-like implementation's error
    low_err = (low - want).abs().max().item()
    rounding = (want.bfloat16().float() - want).abs().max().item()
    close = want.clone()
    close[0, 0, 0] += 2 * low_err  # exactly at the bound (rounding is the slack on top)
    res = rule(close, want, low, torch.bfloat16)
    assert res["ok"] and res["low_precision_err"] == low_err and res["rounding"] == rounding
    far = want.clone()
    far[3, 2, 1] += 2 * low_err + 2 * rounding + 1e-3
    assert not rule(far, want, low, torch.bfloat16)["ok"]
    nan = want.clone()
    nan[1, 1, 1] = float("nan")
    assert not rule(nan, want, low, torch.bfloat16)["ok"]
    # fp32 outputs (lse): the slack is the 1e-6 floor, not a bf16 rounding
    lse_want = torch.randn(8, 4, generator=gen)
    res = rule(lse_want + 1e-3, lse_want, lse_want + 1e-4, torch.float32)
    assert res["rounding"] == 1e-6 and not res["ok"]
    assert rule(lse_want + 1e-4, lse_want, lse_want + 1e-4, torch.float32)["ok"]


class _RecordingFlashMLA:
    """Stands in for the flash_mla module on the CPU: records what the benchmark hands FlashMLA's entry
    points and answers with zeros of FlashMLA's output shapes."""

    def __init__(self):
        self.calls = []

    def get_mla_metadata(self):
        return object(), None

    def flash_mla_with_kvcache(self, q, k_cache, block_table, cache_seqlens, head_dim_v, meta, num_splits, **kw):
        self.calls.append(dict(q=q, k_cache=k_cache, head_dim_v=head_dim_v, **kw))
        b, s_q, h, _ = q.shape
        return torch.zeros(b, s_q, h, head_dim_v, dtype=q.dtype), torch.zeros(b, h, s_q)

    def flash_mla_sparse_fwd(self, q, kv, indices, sm_scale, d_v, attn_sink):
        self.calls.append(dict(q=q, kv=kv, indices=indices, sm_scale=sm_scale, d_v=d_v, attn_sink=attn_sink))
        return torch.zeros(*q.shape[:2], d_v, dtype=q.dtype), torch.zeros(q.shape[:2]), torch.zeros(q.shape[:2])


def _model1_dequantize(k_cache: torch.Tensor) -> torch.Tensor:
    """FlashMLA's own MODEL1 fp8 decoding (its tests/quant.py, dequantize_k_cache), on its k_cache view
    [blocks, block_size, 1, 584] -> fp32 [blocks * block_size, 512]."""
    blocks, block_size = k_cache.shape[:2]
    flat = k_cache.view(blocks, -1)
    data = flat[:, : block_size * 576].reshape(blocks, block_size, 576)
    nope = data[..., :448].view(torch.float8_e4m3fn).float()
    rope = data[..., 448:].contiguous().view(torch.bfloat16).float()
    scales = flat[:, block_size * 576:].reshape(blocks, block_size, 8)[..., :7].contiguous()
    scales = scales.view(torch.float8_e8m0fnu).float().repeat_interleave(64, dim=-1)
    return torch.cat([nope * scales, rope], dim=-1).reshape(blocks * block_size, 512)


def test_flashmla_reads_the_same_bytes_dsakit_reads():
    bench = _bench()
    gen = torch.Generator().manual_seed(1)
    fake = _RecordingFlashMLA()
    # decode, fp8 KV: FlashMLA's MODEL1 block with block size 64 is dsakit's fp8-rope-bf16 page
    fmt = bench.FORMATS["fp8-rope-bf16"]
    q, pool, idx, sink = bench.make_inputs(fmt, 64, 4, 16, 128, 2, "cpu", gen)
    out, lse = bench.flashmla_decode_call(fake, q, pool, idx, sink, 0.125, next_n=2)()
    assert out.shape == (4, 64, 512) and lse.shape == (4, 64)
    call = fake.calls[-1]
    k_cache = call["k_cache"]
    assert k_cache.shape == (4, 64, 1, 584) and k_cache.stride()[:2] == (fmt.page_bytes, 584)
    assert k_cache.data_ptr() == pool.data_ptr()  # a view of the pool, not a copy
    assert torch.equal(_model1_dequantize(k_cache), fmt.dequantize_pages(pool))
    assert torch.equal(call["indices"], idx.view(2, 2, 16)) and call["is_fp8_kvcache"]
    assert call["attn_sink"] is sink and call["softmax_scale"] == 0.125
    # prefill, bf16 KV: the pool's bytes are FlashMLA's kv [s_kv, 1, 512], slot = row
    fmt = bench.FORMATS["bf16"]
    q, pool, idx, sink = bench.make_inputs(fmt, 64, 4, 16, 128, 1, "cpu", gen)
    bench.flashmla_prefill(fake, q, pool, idx, sink, 0.125)
    call = fake.calls[-1]
    assert call["kv"].shape == (128, 1, 512) and call["kv"].data_ptr() == pool.data_ptr()
    assert torch.equal(call["kv"][:, 0].float(), fmt.dequantize_pages(pool))
    assert torch.equal(call["indices"], idx.view(4, 1, 16)) and call["d_v"] == 512
