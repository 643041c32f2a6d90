"""The Gluon sm_90 prefill scores kernel (bf16 keys, asynchronous wgmma): which kernel runs (forced on the CPU),
its launch arguments (recorded, not run), its ahead-of-time compile for sm_90 (no GPU needed: ptxas keeps the
wgmma asynchronous, no spills, shared memory within an SM), and, with the ``gpu`` marker, its scores and the
bf16 prefill top-k at full size against the reference and the Triton tile kernel."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
from _sm90_compile import (RecordedLaunch, assert_async_and_spill_free,  # tests/ on sys.path
                           compiled_variants_fixture, needs_sm90)
import torch

from dsakit import PagedBatch
from dsakit.formats import KeyFormat
from dsakit.ops._backend import gluon_importable
from dsakit.ops.indexer import ScoresConfig
from dsakit.ops.indexer.config import GLUON_TILES
from dsakit.ops.indexer.reference import index_scores as reference_scores

pytest.importorskip("triton")
from dsakit.ops.indexer import scores as scores_triton  # noqa: E402
from dsakit.ops.indexer.scores import choose_prefill_kernel  # noqa: E402

SM90 = (9, 0)
BF16 = KeyFormat.parse("bf16")
GLUON = ScoresConfig(prefill_kernel="gluon")


@pytest.fixture
def compiled_not_interpreted(monkeypatch):
    """The choice as on a GPU machine (TRITON_INTERPRET unset)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_config_fields_are_checked():
    assert ScoresConfig().prefill_kernel == "triton" and ScoresConfig.for_device("cpu").prefill_kernel == "triton"
    for bad, match in ((dict(prefill_kernel="cuda"), "prefill_kernel"),
                       (dict(prefill_gluon_stages=2), "prefill_gluon_stages"),
                       (dict(prefill_gluon_stages=7), "prefill_gluon_stages"),
                       (dict(prefill_gluon_warps=2), "prefill_gluon_warps"),
                       (dict(prefill_gluon_warps=True), "prefill_gluon_warps"),
                       (dict(prefill_kernel="gluon", prefill_block_n=32), r"\(32, 8\)"),
                       (dict(prefill_kernel="gluon", prefill_block_n=256), r"\(256, 8\)"),
                       (dict(prefill_kernel="gluon", prefill_block_t=128), "prefill_block_t <= 64")):
        with pytest.raises(ValueError, match=match):
            ScoresConfig(**bad)
    for block_n, warps in GLUON_TILES:
        cfg = ScoresConfig(prefill_kernel="gluon", prefill_block_n=block_n, prefill_gluon_warps=warps,
                           prefill_gluon_stages=6)
        assert cfg.gluon_launch() == replace(cfg.gluon_launch(), block_n=block_n, warps=warps, stages=6)
    # the Triton kernel's own settings are untouched by the Gluon fields (4 warps at 64 x 128 tiles)
    assert GLUON.tile_launch("bf16", 64) == ScoresConfig().tile_launch("bf16", 64)


def test_choice_takes_gluon_only_where_it_can_run(compiled_not_interpreted):
    """"triton" is always the Triton kernel; "gluon" is the Gluon kernel on sm_90 with Gluon and bf16 keys,
    and a ValueError naming the reason everywhere else (no silent fallback)."""
    cuda = torch.device("cuda", 0)
    for capability in (SM90, (8, 0), (10, 0), None):
        for fmt in ("bf16", "fp8", "fp4", "fp8-centred"):
            assert choose_prefill_kernel(ScoresConfig(), KeyFormat.parse(fmt), cuda, capability=capability,
                                         importable=True) == "triton"
    assert choose_prefill_kernel(GLUON, BF16, cuda, 64, capability=SM90, importable=True) == "gluon"
    assert choose_prefill_kernel(GLUON, BF16, cuda, 16, capability=SM90, importable=True) == "gluon"
    for fmt, device, capability, importable, tile, match in (
            ("fp8", cuda, SM90, True, 64, "'fp8'"),
            ("fp4", cuda, SM90, True, 64, "bf16 keys only"),
            ("fp8-centred", cuda, SM90, True, 64, "bf16 keys only"),
            ("bf16", cuda, (8, 0), True, 64, "sm_80"),
            ("bf16", cuda, (10, 0), True, 64, "sm_100"),
            ("bf16", cuda, (12, 0), True, 64, "sm_120"),
            ("bf16", cuda, SM90, False, 64, "no Gluon"),
            ("bf16", torch.device("cpu"), None, True, 64, "not a CUDA GPU"),
            ("bf16", cuda, SM90, True, 128, "128-row query tiles")):
        with pytest.raises(ValueError, match=match):
            choose_prefill_kernel(GLUON, KeyFormat.parse(fmt), device, tile, capability=capability,
                                  importable=importable)
    with pytest.raises(ValueError, match="not a CUDA GPU"):  # detected: the CPU
        choose_prefill_kernel(GLUON, BF16, torch.device("cpu"))


def test_auto_takes_gluon_where_it_can_run_and_triton_elsewhere(compiled_not_interpreted):
    """"auto" (the value for a per-GPU table once the H200 has timed the kernel): Gluon for bf16 keys on sm_90
    with Gluon and <= 64-row tiles, the Triton kernel everywhere "gluon" would be refused, never an error."""
    auto = ScoresConfig(prefill_kernel="auto", prefill_block_t=128)  # larger tiles are allowed: Triton runs them
    cuda = torch.device("cuda", 0)
    assert choose_prefill_kernel(auto, BF16, cuda, 64, capability=SM90, importable=True) == "gluon"
    cpu = torch.device("cpu")
    for fmt, device, capability, importable, tile in (
            ("fp8", cuda, SM90, True, 64), ("fp4-centred", cuda, SM90, True, 64), ("bf16", cuda, (8, 0), True, 64),
            ("bf16", cuda, (10, 0), True, 64), ("bf16", cuda, SM90, False, 64), ("bf16", cpu, None, True, 64),
            ("bf16", cuda, SM90, True, 128)):
        assert choose_prefill_kernel(auto, KeyFormat.parse(fmt), device, tile, capability=capability,
                                     importable=importable) == "triton"
    with pytest.raises(ValueError, match="prefill_kernel='auto' takes"):
        ScoresConfig(prefill_kernel="auto", prefill_block_n=256)


def _cpu_case(t=40, heads=6, n=300, q_dtype=torch.bfloat16, seed=3):
    """One bf16 sequence of n entries (shuffled pages), t causal queries at its end."""
    gen = torch.Generator().manual_seed(seed)
    pages = -(-n // 64)
    pool = torch.randn(pages, 64 * 128, generator=gen).to(torch.bfloat16).view(torch.uint8)
    table = torch.randperm(pages, generator=gen).to(torch.int32).unsqueeze(0)
    counts = torch.tensor([n], dtype=torch.int32)
    positions = torch.arange(n - t, n, dtype=torch.int32)
    batch = PagedBatch.build(pool, BF16, table, counts, torch.zeros(t, dtype=torch.int32), positions)
    q = torch.randn(t, heads, 128, generator=gen).to(q_dtype)
    return q, torch.rand(t, heads, generator=gen), batch


def test_interpreter_refuses_gluon_and_keeps_triton(monkeypatch):
    """Under TRITON_INTERPRET=1 the Gluon kernel is refused (it has no interpreter), even on a forced sm_90, and
    before anything is launched; "triton" runs and agrees with the reference; decode plans ignore the switch."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        choose_prefill_kernel(GLUON, BF16, torch.device("cuda", 0), capability=SM90, importable=True)
    q, w, batch = _cpu_case()
    with pytest.raises(ValueError, match="prefill_kernel='gluon' cannot run here: the batch is on cpu"):
        scores_triton.index_scores_triton(q, w, batch, config=GLUON)
    from dsakit.ops.indexer.config import TopkConfig
    from dsakit.ops.indexer.triton import index_topk_triton

    with pytest.raises(ValueError, match="prefill_kernel='gluon'"):
        index_topk_triton(q, w, batch, 8, config=TopkConfig(scores=GLUON))
    auto = scores_triton.index_scores_triton(q, w, batch, config=ScoresConfig(kernel="tile", prefill_kernel="auto"))
    got = scores_triton.index_scores_triton(q, w, batch, config=ScoresConfig(kernel="tile"))
    torch.testing.assert_close(got, reference_scores(q, w, batch), rtol=1e-5, atol=1e-4)
    assert torch.equal(auto, got)  # "auto" in the interpreter: the Triton kernel
    # a decode (group) plan never asks for the prefill kernel
    decode_q, decode_w, decode_batch = _cpu_case(t=1, heads=16, n=200)
    scores_triton.index_scores_triton(decode_q, decode_w, decode_batch, config=GLUON)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the plan is built by the interpreter path")
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_gluon_launch_arguments(monkeypatch, q_dtype):
    """The launcher's Gluon launch (forced choice, launch recorded, not run): the arguments bind to the kernel's
    parameters in order, the grid is (query tiles x key tiles) as the Triton kernel's, q arrives as contiguous
    bf16 (fp8 widened exactly, fp32 rounded once; here from a non-contiguous view), the keys as the pool's bf16
    view, the launch settings come from ScoresConfig.gluon_launch."""
    if not gluon_importable():
        pytest.skip("this Triton has no Gluon")
    from dsakit.ops.indexer import gluon as gluon_launch

    recorder = RecordedLaunch(gluon_launch.index_scores_gluon_tile_kernel)
    monkeypatch.setattr(gluon_launch, "index_scores_gluon_tile_kernel", recorder)
    monkeypatch.setattr(scores_triton, "choose_prefill_kernel", lambda *a, **k: "gluon")
    q, w, batch = _cpu_case(t=70, heads=6, q_dtype=q_dtype)
    wide = torch.zeros(70, 12, 128).to(q_dtype)
    wide[:, ::2] = q
    q = wide[:, ::2]  # a strided view of the same values
    q_scale = torch.rand(70, 6) + 0.5
    config = ScoresConfig(prefill_kernel="gluon", prefill_block_n=64, prefill_gluon_warps=4, prefill_gluon_stages=5)
    scores_triton.index_scores_triton(q, w, batch, q_scale=q_scale, config=config)
    grid, bound = recorder.bound(4)
    assert grid == (2 * 5,)  # 70 rows = 2 tiles of <= 64, 300 entries = 5 tiles of 64
    assert bound["q_ptr"].dtype == torch.bfloat16
    assert torch.equal(bound["q_ptr"].float(), q.to(torch.bfloat16).float())
    assert bound["q_ptr"].is_contiguous() and bound["q_ptr"].data_ptr() % 16 == 0  # the kernel's q addressing
    assert bound["values_ptr"].dtype == torch.bfloat16 and bound["values_ptr"].data_ptr() == batch.pool.data_ptr()
    assert bound["q_scale_ptr"] is q_scale and bound["HAS_Q_SCALE"] and bound["HAS_POS"]
    assert (bound["H"], bound["BLOCK_N"], bound["STAGES"]) == (6, 64, 5)
    assert bound["width"] == 300 and bound["num_pages"] == 5


COMPILE_VARIANTS = {
    "h64-block128-warps8-stages4": dict(),
    "h64-block128-warps8-stages6": dict(stages=6),
    "h64-block128-warps4": dict(warps=4),
    "h64-block64-warps4-stages3": dict(block_n=64, warps=4, stages=3),
    "h64-block64-warps8": dict(block_n=64),
    "h7-qscale-bf16w-nopos": dict(heads=7, has_q_scale=True, weights_dtype="bf16", has_pos=False),
    "h32-fp16w": dict(heads=32, weights_dtype="fp16"),
}
# per variant: warps (the launch's; 8 unless given) and (block_n, heads) for the wgmma count
for _kw in COMPILE_VARIANTS.values():
    _kw.setdefault("warps", 8)

compiled_variants = compiled_variants_fixture("dsakit.ops.indexer.gluon:compile_gluon_scores_kernel", COMPILE_VARIANTS)


@pytest.mark.parametrize("name", sorted(COMPILE_VARIANTS))
def test_gluon_scores_kernel_compiles_for_sm90(compiled_variants, name):
    """Ahead-of-time compile for GPUTarget("cuda", 90, 32): a cubin; one async wgmma site per head of the
    two-head loop body, the prologue's and (even H) the tail's, 8 k-steps of 16 each; a wait that leaves one
    wgmma in flight (the overlap) which ptxas keeps asynchronous (no C7514); 16 B cp.async gathers; no register
    spills; shared memory (keys + q buffers) within the 227 KB of an SM."""
    variant = COMPILE_VARIANTS[name]
    got = compiled_variants[name]
    heads, block_n, stages = variant.get("heads", 64), variant.get("block_n", 128), variant.get("stages", 4)
    assert got["cubin"] > 0
    sites = 1 + 2 + (1 if heads % 2 == 0 else 0)
    assert got["wgmma"] == sites * 128 // 16
    assert got["wait1"] and got["cp_async_16"] > 0
    assert got["shared"] == (block_n + stages * 64) * 128 * 2 <= 227 * 1024
    assert_async_and_spill_free(got)


# ---------------------------------------------------------------------------------------------------------
# On the H200 (gpu marker): full size against the reference (sampled rows) and the Triton tile kernel
# ---------------------------------------------------------------------------------------------------------


def _gpu_case(lengths, queries, heads, *, seed, q_dtype=torch.bfloat16, causal=True):
    """bf16 pool on the GPU (shuffled pages), ``queries[b]`` queries of sequence b at its end (causal) or
    seeing every entry; weights fp32 [T, H] > 0."""
    from _common import make_queries, timing_pool  # benchmarks/ helpers (sys.path below)

    pool, table, counts = timing_pool(BF16, lengths, "cuda", seed)
    seq = torch.cat([torch.full((m,), b, dtype=torch.int32) for b, m in enumerate(queries)]).cuda()
    positions = None
    if causal:
        positions = torch.cat([torch.arange(n - m, n, dtype=torch.int32) for n, m in zip(lengths, queries)]).cuda()
    batch = PagedBatch.build(pool, BF16, table, counts, seq, positions)
    q, w, _ = make_queries("bf16", int(seq.numel()), heads, "cuda", seed + 1)
    return q.to(q_dtype), w, batch


@pytest.fixture
def benchmark_helpers(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _check_scores(q, w, batch, *, sample, q_scale=None, configs=(GLUON,)):
    """Gluon vs the Triton tile kernel on every row (same bf16 products, fp32 sums in another order: 1e-5 of
    the largest score), -inf masks identical, reruns bitwise; vs the reference on ``sample`` rows."""
    tile = ScoresConfig(kernel="tile")
    want = scores_triton.index_scores_triton(q, w, batch, q_scale=q_scale, config=tile)
    for config in configs:
        got = scores_triton.index_scores_triton(q, w, batch, q_scale=q_scale, config=replace(config, kernel="tile"))
        again = scores_triton.index_scores_triton(q, w, batch, q_scale=q_scale,
                                                  config=replace(config, kernel="tile"))
        torch.cuda.synchronize()
        assert torch.equal(got, again), "rerun differs"
        assert not torch.isnan(got).any()
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf masks differ"
        finite = torch.isfinite(want)
        scale = float(want[finite].abs().max()) if bool(finite.any()) else 1.0
        assert float((got[finite] - want[finite]).abs().max()) <= 1e-5 * scale
        rows = torch.linspace(0, q.shape[0] - 1, sample).long().unique()
        sub = PagedBatch.build(batch.pool.cpu(), batch.fmt, batch.block_table.cpu(), batch.entry_counts.cpu(),
                               batch.query_seq[rows.cuda()].cpu(),
                               None if batch.query_positions is None else batch.query_positions[rows.cuda()].cpu())
        operand_q = q.to(torch.bfloat16) if q.dtype == torch.float32 else q  # the kernels round fp32 q once
        ref = reference_scores(operand_q[rows.cuda()].cpu(), (w if q_scale is None else w * q_scale)[rows.cuda()].cpu(),
                               sub)
        mine = got[rows.cuda()].cpu()[:, : ref.shape[1]]
        assert torch.equal(torch.isneginf(mine), torch.isneginf(ref))
        fin = torch.isfinite(ref)
        assert float((mine[fin] - ref[fin]).abs().max()) <= 1e-5 * float(ref[fin].abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("config", [GLUON, replace(GLUON, prefill_gluon_stages=6),
                                    replace(GLUON, prefill_gluon_warps=4),
                                    replace(GLUON, prefill_block_n=64, prefill_gluon_warps=4, prefill_gluon_stages=3)],
                         ids=["block128-w8-s4", "block128-w8-s6", "block128-w4-s4", "block64-w4-s3"])
def test_gluon_scores_full_size(benchmark_helpers, config):
    """The benchmark's prefill shape: T 8192 queries x N 65536 entries, H 64, every query sees every entry."""
    needs_sm90()
    q, w, batch = _gpu_case([65536], [8192], 64, seed=31, causal=False)
    _check_scores(q, w, batch, sample=8, configs=(config,))


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
def test_gluon_scores_small_odd_shapes(benchmark_helpers, q_dtype):
    """Ragged causal batch (sequences of 1, 77, 1000 and 4099 entries with 1, 5, 70 and 131 queries: partial
    query and key tiles, a tile plan of 16..64-row tiles), odd H (7), q_scale, q in each dtype, every supported
    (block_n, warps) tile and 3..6 q buffers."""
    needs_sm90()
    q, w, batch = _gpu_case([1, 77, 1000, 4099], [1, 5, 70, 131], 7, seed=41, q_dtype=q_dtype)
    q_scale = torch.rand(q.shape[0], 7, device="cuda") + 0.5
    configs = [replace(GLUON, prefill_block_n=bn, prefill_gluon_warps=wp, prefill_gluon_stages=st)
               for (bn, wp), st in zip(GLUON_TILES, (3, 4, 5, 6))]
    _check_scores(q, w, batch, sample=12, q_scale=q_scale, configs=configs)


@pytest.mark.gpu
def test_gluon_prefill_topk_matches_triton(benchmark_helpers):
    """index_topk end to end with the Gluon scores: the same selection as with the Triton tile kernel (scores
    equal up to fp32 summation order, so only exact ties at the k-th value could differ: none with randn keys),
    at 8192 x 65536, K 2048, H 64."""
    needs_sm90()
    from dsakit.ops.indexer.config import TopkConfig
    from dsakit.ops.indexer.triton import index_topk_triton

    from _common import same_selection

    q, w, batch = _gpu_case([65536], [8192], 64, seed=51, causal=False)
    base = TopkConfig.for_device("cuda")
    gluon = replace(base, scores=replace(base.scores, prefill_kernel="gluon"))
    got = index_topk_triton(q, w, batch, 2048, config=gluon)
    scores = scores_triton.index_scores_triton(q, w, batch, config=gluon.scores)
    check = same_selection(got, scores, 2048)  # the exact top-k of the Gluon scores, by value
    assert check["values_equal"], check
    want = index_topk_triton(q, w, batch, 2048, config=base)
    torch.cuda.synchronize()
    # against the Triton kernel's selection: the same sets except where two scores within fp32 summation-order
    # error of each other straddle the k-th value
    differ = ~(torch.sort(got, 1).values == torch.sort(want, 1).values).all(1)
    assert float(differ.float().mean()) <= 0.05, f"{int(differ.sum())} of {got.shape[0]} rows select differently"
