"""The Gluon sm_90 sparse-attention kernel: which kernel runs (forced on the CPU), its ahead-of-time compile for
sm_90 (no GPU needed), and, with the ``gpu`` marker, its outputs at full size against the reference and the
portable Triton kernel (tolerance: the flash-attention rule of test_attention_triton.py)."""

from __future__ import annotations

import inspect
import math
import os

import pytest
from _sm90_compile import (RecordedLaunch, assert_async_and_spill_free,  # tests/ on sys.path
                           compiled_variants_fixture, needs_sm90)
import torch

from dsakit.formats import AttentionKVFormat
from dsakit.ops.attention import AttentionConfig
from dsakit.ops.attention import reference as ref
from dsakit.ops.attention.inputs import check_sparse_attention_inputs
from dsakit.ops.attention.reference import gather_entries

pytest.importorskip("triton")
from dsakit.ops.attention.triton import (choose_attention_kernel, gluon_importable,  # noqa: E402
                                         sparse_attention_triton)
from test_attention_triton import bf16_torch_attention, make_pool  # noqa: E402  (tests/ is on sys.path)

D = 512
BF16, FP8 = AttentionKVFormat.BF16, AttentionKVFormat.FP8_ROPE_BF16
SM90 = (9, 0)


def small_inputs(fmt=BF16, extra_fmt=None, heads=64):
    gen = torch.Generator().manual_seed(3)
    kw = {}
    if extra_fmt is not None:
        kw = dict(extra_kv_cache=make_pool(extra_fmt, 1, gen), extra_kv_format=extra_fmt,
                  extra_indices=torch.zeros(2, 4, dtype=torch.int32))
    return check_sparse_attention_inputs(torch.randn(2, heads, D), make_pool(fmt, 1, gen),
                                             torch.zeros(2, 8, dtype=torch.int32), kv_format=fmt, **kw)


@pytest.fixture
def compiled_not_interpreted(monkeypatch):
    """The choice as on a GPU machine (TRITON_INTERPRET unset)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_auto_picks_gluon_only_where_it_applies(compiled_not_interpreted):
    """kernel "auto": Gluon on sm_90 with Gluon importable and bf16 pools (with or without a bf16 extra pool,
    64 or 128 heads); the portable kernel for fp8 or mixed pools, other GPUs, no Gluon, or a CPU tensor."""
    auto = AttentionConfig()
    assert auto.kernel == "auto"
    for a in (small_inputs(), small_inputs(heads=128), small_inputs(extra_fmt=BF16)):
        assert choose_attention_kernel(a, auto, capability=SM90, importable=True) == "gluon"
    bf16 = small_inputs()
    for a, capability, importable in ((small_inputs(FP8), SM90, True), (small_inputs(FP8, heads=128), SM90, True),
                                      (small_inputs(FP8, FP8), SM90, True), (small_inputs(extra_fmt=FP8), SM90, True),
                                      (small_inputs(FP8, BF16), SM90, True), (bf16, (8, 0), True),
                                      (bf16, (10, 0), True), (bf16, (12, 0), True), (bf16, SM90, False),
                                      (bf16, None, True)):
        assert choose_attention_kernel(a, auto, capability=capability, importable=importable) == "triton"
    assert choose_attention_kernel(bf16, auto) == "triton"  # detected: q is on the CPU
    # "triton" always takes the portable kernel, also where Gluon applies
    assert choose_attention_kernel(bf16, auto.replace(kernel="triton"), capability=SM90, importable=True) == "triton"


def test_forced_gluon_names_why_it_cannot_run(compiled_not_interpreted):
    forced = AttentionConfig(kernel="gluon")
    assert choose_attention_kernel(small_inputs(), forced, capability=SM90, importable=True) == "gluon"
    for a, capability, importable, match in (
            (small_inputs(FP8), SM90, True, "bf16 pools only"),
            (small_inputs(FP8, FP8), SM90, True, "bf16 pools only"),
            (small_inputs(extra_fmt=FP8), SM90, True, "bf16 pools only"),
            (small_inputs(FP8, BF16), SM90, True, "bf16 pools only"),
            (small_inputs(FP8), (8, 0), True, "sm_80"),
            (small_inputs(), (8, 9), True, "sm_89"),
            (small_inputs(), SM90, False, "no Gluon"),
            (small_inputs(), None, True, "not a CUDA GPU")):
        with pytest.raises(ValueError, match=match):
            choose_attention_kernel(a, forced, capability=capability, importable=importable)


def test_interpreter_runs_the_portable_kernel(monkeypatch):
    """Under TRITON_INTERPRET=1 "auto" never picks Gluon (it has no interpreter), even on a forced sm_90, and
    the CPU launch of the default config runs the portable kernel (the reference agrees)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = small_inputs()
    assert choose_attention_kernel(a, AttentionConfig(), capability=SM90, importable=True) == "triton"
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        choose_attention_kernel(a, AttentionConfig(kernel="gluon"), capability=SM90, importable=True)
    with pytest.raises(ValueError, match="not a CUDA GPU"):
        sparse_attention_triton(a, kernel="gluon")
    out, lse = sparse_attention_triton(a)  # auto on the CPU: the portable kernel in the interpreter
    want_out, want_lse = ref.sparse_attention(a.q, a.kv_cache, a.indices, kv_format=BF16)
    assert torch.allclose(out.float(), want_out, atol=2e-2) and torch.allclose(lse, want_lse, atol=2e-2)


def test_gluon_config_fields_are_checked():
    for bad, match in ((dict(kernel="cuda"), "kernel"), (dict(gluon_block_n=128), "gluon_block_n"),
                       (dict(gluon_stages=1), "gluon_stages"), (dict(gluon_stages=3), "gluon_stages"),
                       (dict(gluon_block_n=32, gluon_stages=5), "gluon_stages"),
                       (dict(gluon_overlap=True), "gluon_overlap needs gluon_stages >= 3"),
                       (dict(gluon_overlap=1, gluon_block_n=32, gluon_stages=4), "gluon_overlap must be a bool")):
        with pytest.raises(ValueError, match=match):
            AttentionConfig(**bad)
    assert AttentionConfig(gluon_block_n=32, gluon_stages=4).gluon_stages == 4
    assert AttentionConfig(gluon_block_n=32, gluon_stages=3, gluon_overlap=True).gluon_overlap
    for removed in ("gluon_fp8", "gluon_fp8_stages", "dv_split"):  # lost variants: no such field
        with pytest.raises(TypeError):
            AttentionConfig(**{removed: 1})


class _RecordedLaunch(RecordedLaunch):
    """The Gluon attention kernel recorded (``RecordedLaunch``); each launch fills the outputs (the split
    partials the combine kernel then reads) with zeros."""

    def __init__(self, kernel):
        super().__init__(kernel)
        self.out_at = list(inspect.signature(kernel.fn).parameters).index("out_ptr")  # then lse_ptr

    def on_launch(self, args: tuple) -> None:
        args[self.out_at].zero_()  # the partial outputs
        args[self.out_at + 1].zero_()  # the partial LSEs

    @classmethod
    def install(cls, monkeypatch, name: str) -> "_RecordedLaunch":
        """Replace the Gluon kernel ``name`` in the launcher module by a recorder (skip without Gluon)."""
        if not gluon_importable():
            pytest.skip("this Triton has no Gluon")
        from dsakit.ops.attention import _gluon_kernels
        from dsakit.ops.attention import gluon as gluon_launch

        recorder = cls(getattr(_gluon_kernels, name))
        monkeypatch.setattr(gluon_launch, name, recorder)
        return recorder


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the split merge runs in the interpreter")
@pytest.mark.parametrize("extra", [False, True])
def test_gluon_launch_arguments(monkeypatch, extra):
    """The launcher's arguments (checked on the CPU with the launch recorded, not run): they bind to the
    kernel's parameters, the grid is (query, head block, split), the pools are read as bf16 views, the extra
    pool's offset is in 16 B units, every optional input sets its flag, the split partials are fp32."""
    recorder = _RecordedLaunch.install(monkeypatch, "sparse_attention_gluon_kernel")
    from dsakit.ops.attention import gluon as gluon_launch

    gen = torch.Generator().manual_seed(4)
    pool = make_pool(BF16, 3, gen)
    kw = dict(topk_length=torch.tensor([5, 0, 9], dtype=torch.int32), sink=torch.randn(128, generator=gen))
    if extra:
        kw.update(extra_kv_cache=make_pool(BF16, 2, gen), extra_kv_format="bf16",
                  extra_indices=torch.randint(-1, 128, (3, 40), generator=gen, dtype=torch.int32))
    a = check_sparse_attention_inputs(torch.randn(3, 128, D, generator=gen), pool,
                                          torch.randint(0, 192, (3, 200), generator=gen, dtype=torch.int32),
                                          kv_format=BF16, softmax_scale=0.05, **kw)
    out, lse = gluon_launch.sparse_attention_gluon(a, AttentionConfig(num_splits=2))
    assert out.shape == (3, 128, D) and out.dtype == torch.float32 and lse.shape == (3, 128)
    # two zero partials with LSE 0 (log2 units) each: merged out 0, lse ln 2 (the combine kernel ran on them)
    assert bool((out == 0).all()) and torch.allclose(lse, torch.full_like(lse, math.log(2)))
    grid, bound = recorder.bound(8)
    assert grid == (3 * 2 * 2,) and all(type(g) is int for g in grid)
    assert bound["pool_ptr"].dtype == torch.bfloat16 and bound["pool_ptr"].data_ptr() == pool.data_ptr()
    assert bound["PAGE_ELEMS"] == BF16.page_bytes // 2 and bound["NUM_SPLITS"] == 2
    assert bound["out_ptr"].shape == (2, 3, 128, D) and bound["out_ptr"].dtype == torch.float32
    assert bound["HAS_LEN"] and bound["HAS_SINK"] and bound["HAS_EXTRA"] == extra and not bound["HAS_XLEN"]
    assert bound["OVERLAP"] is False and bound["STAGES"] == 2 and bound["BLOCK_N"] == 64
    assert math.isclose(bound["scale_log2"], 0.05 * math.log2(math.e))
    assert bound["tiles_per_split"] == 2  # 200 indices = 4 tiles of 64, 2 per split
    if extra:
        offset = kw["extra_kv_cache"].data_ptr() - pool.data_ptr()
        assert bound["extra_offset"] * 16 == offset and bound["x_num_slots"] == 128 and bound["XK"] == 40
    else:
        assert bound["extra_offset"] == 0 and bound["XK"] == 0


COMPILE_VARIANTS = {
    "v4-prefill-h128-extra-sink": dict(),
    "decode-h64-splits-fp32q": dict(heads=64, num_splits=4, has_extra=False, has_sink=False, has_len=False,
                                    q_dtype="fp32"),
    "block32-stages4-fp16q": dict(block_n=32, stages=4, q_dtype="fp16"),
    "block32-stages3-overlap": dict(block_n=32, stages=3, overlap=True),
}


compiled_variants = compiled_variants_fixture("dsakit.ops.attention.gluon:compile_gluon_kernel", COMPILE_VARIANTS)


@pytest.mark.parametrize("name", sorted(COMPILE_VARIANTS))
def test_gluon_kernel_compiles_for_sm90(compiled_variants, name):
    """Ahead-of-time compile for GPUTarget("cuda", 90, 32) at the V4 shape (head dim 512): a cubin, async
    wgmma (QK: 512 / 16 k-steps; PV: BLOCK_N / 16 per site) that ptxas keeps asynchronous, 16 B cp.async gathers
    only, within the 227 KB of an SM, no register spills."""
    variant = COMPILE_VARIANTS[name]
    got = compiled_variants[name]
    block_n = variant.get("block_n", 64)
    assert got["cubin"] > 0
    # the FA3 order issues the last PV after the loop
    pv_sites = 2 if variant.get("overlap") else 1
    assert got["wgmma"] == D // 16 + pv_sites * block_n // 16
    assert got["wait0"] and got["cp_async_16"] > 0
    assert got["cp_async_8"] == 0
    assert got["shared"] <= 227 * 1024
    assert_async_and_spill_free(got)


# ---------------------------------------------------------------------------------------------------------
# On the H200 (gpu marker): full size against the reference (sampled queries) and the portable kernel
# ---------------------------------------------------------------------------------------------------------


def _case(t, hq, k, *, pages, gen, extra=False, q_dtype=torch.bfloat16, fmt=BF16):
    """Full-size inputs on the GPU: random slots (some -1, some past the pool), topk_length with empty rows,
    a sink; optionally a second pool of the same format ``fmt`` with its own indices and lengths."""
    pool = make_pool(fmt, pages, gen)
    idx = torch.randint(0, pages * 64, (t, k), generator=gen, dtype=torch.int32)
    idx[:, ::7] = -1
    idx[:, 5] = pages * 64 + 3  # outside the pool: skipped like padding
    length = torch.randint(0, k + 1, (t,), generator=gen, dtype=torch.int32)
    length[:4] = torch.tensor([0, 1, k, k - 1])
    kw = dict(topk_length=length, sink=torch.randn(hq, generator=gen))
    if extra:
        xpages = 4
        kw.update(extra_kv_cache=make_pool(fmt, xpages, gen), extra_kv_format=fmt,
                  extra_indices=torch.randint(-1, xpages * 64, (t, 128), generator=gen, dtype=torch.int32),
                  extra_topk_length=torch.randint(0, 129, (t,), generator=gen, dtype=torch.int32))
    q = (torch.randn(t, hq, D, generator=gen) * 2).to(q_dtype)
    kw["kv_format"] = fmt
    return q, pool, idx, kw


def _check_full_size(q, pool, idx, kw, *, sample: int, config: AttentionConfig | None = None):
    """Gluon vs the reference on ``sample`` queries (flash rule: error <= 2 x the bf16 PyTorch error + 1e-5),
    vs the portable kernel on every query (<= 3 x that bf16 error + 1e-5), empty rows exact, rerun bitwise."""
    kw = dict(kw)
    fmt = kw.pop("kv_format")
    cuda = {n: (v.cuda() if isinstance(v, torch.Tensor) else v) for n, v in kw.items()}
    a = check_sparse_attention_inputs(q.cuda(), pool.cuda(), idx.cuda(), kv_format=fmt, **cuda)
    config = config or AttentionConfig()
    assert choose_attention_kernel(a, config.replace(kernel="auto")) == "gluon"
    out, lse = sparse_attention_triton(a, config.replace(kernel="gluon"))
    again = sparse_attention_triton(a, config.replace(kernel="gluon"))
    assert torch.equal(again[0], out) and torch.equal(again[1], lse), "rerun differs"
    p_out, p_lse = sparse_attention_triton(a, config.replace(kernel="triton"))
    torch.cuda.synchronize()

    rows = torch.linspace(0, q.shape[0] - 1, sample).long().unique()
    sub = {n: (v[rows] if isinstance(v, torch.Tensor) and n in ("topk_length", "extra_indices",
                                                                 "extra_topk_length") else v)
           for n, v in kw.items()}
    want_out, want_lse = ref.sparse_attention(q[rows], pool, idx[rows], kv_format=fmt, **sub)
    kv, valid = gather_entries(pool, fmt, idx[rows], sub["topk_length"])
    if "extra_kv_cache" in kw:
        xkv, xvalid = gather_entries(kw["extra_kv_cache"], fmt, sub["extra_indices"], sub["extra_topk_length"])
        kv, valid = torch.cat([kv, xkv], 1), torch.cat([valid, xvalid], 1)
    base_out, base_lse = bf16_torch_attention(q[rows].float(), kv, valid, kw["sink"], D ** -0.5)
    g_out, g_lse = out[rows.cuda()].float().cpu(), lse[rows.cuda()].cpu()
    fin = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(g_lse), torch.isneginf(want_lse)), "empty-row mask differs"
    assert bool((g_out[~fin] == 0).all()), "rows with no valid index must be exactly 0"
    base_err = (base_out.float() - want_out).abs().max().item()
    base_lse_err = (base_lse.float()[fin] - want_lse[fin]).abs().max().item() if bool(fin.any()) else 0.0
    assert (g_out - want_out).abs().max().item() <= 2 * base_err + 1e-5
    assert (g_lse[fin] - want_lse[fin]).abs().max().item() <= 2 * base_lse_err + 1e-5 if bool(fin.any()) else True
    assert torch.equal(torch.isneginf(lse), torch.isneginf(p_lse))
    both = torch.isfinite(p_lse)
    assert (out.float() - p_out.float()).abs().max().item() <= 3 * base_err + 1e-5
    assert (lse[both] - p_lse[both]).abs().max().item() <= 3 * base_lse_err + 1e-5


# (KV format, config): the bf16 kernel's 64-row tile and its FA3-order form
FULL_SIZE_CONFIGS = {
    "bf16-block64x2": (BF16, AttentionConfig()),
    "bf16-block32x4-overlap": (BF16, AttentionConfig(gluon_block_n=32, gluon_stages=4, gluon_overlap=True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(FULL_SIZE_CONFIGS))
def test_gluon_prefill_full_size(config):
    """Prefill-like: T 4096, H 128, K 2048 (one split per query)."""
    needs_sm90()
    fmt, cfg = FULL_SIZE_CONFIGS[config]
    gen = torch.Generator().manual_seed(11)
    _check_full_size(*_case(4096, 128, 2048, pages=1024, gen=gen, fmt=fmt), sample=16, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("config", sorted(FULL_SIZE_CONFIGS))
@pytest.mark.parametrize("hq", [64, 128])
def test_gluon_decode_full_size(hq, config):
    """Decode-like: B 64 queries, K 2048, automatic splits (one at H 128, several at H 64)."""
    needs_sm90()
    fmt, cfg = FULL_SIZE_CONFIGS[config]
    gen = torch.Generator().manual_seed(12)
    _check_full_size(*_case(64, hq, 2048, pages=1024, gen=gen, fmt=fmt), sample=16, config=cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_gluon_extra_pool_splits_and_q_dtypes(q_dtype):
    """A second bf16 pool with its own lengths, few queries (several splits merged by the combine kernel),
    q in each float dtype, the 32-row / 4-stage tile and the FA3-order form."""
    needs_sm90()
    gen = torch.Generator().manual_seed(13)
    case = _case(6, 128, 600, pages=16, gen=gen, extra=True, q_dtype=q_dtype)
    for config in (AttentionConfig(), AttentionConfig(num_splits=1), AttentionConfig(gluon_block_n=32, gluon_stages=4),
                   AttentionConfig(gluon_block_n=32, gluon_stages=3, gluon_overlap=True)):
        _check_full_size(*case, sample=6, config=config)


@pytest.mark.gpu
def test_auto_on_gpu_keeps_fp8_portable():
    """fp8 KV on sm_90: "auto" runs the portable kernel (bitwise the same as asking for it); kernel "gluon"
    is refused (the Gluon kernel reads bf16 pools only)."""
    needs_sm90()
    gen = torch.Generator().manual_seed(14)
    pool = make_pool(FP8, 8, gen).cuda()
    q = torch.randn(4, 64, D, generator=gen).bfloat16().cuda()
    idx = torch.randint(0, 512, (4, 256), generator=gen, dtype=torch.int32).cuda()
    a = check_sparse_attention_inputs(q, pool, idx, kv_format=FP8)
    assert choose_attention_kernel(a, AttentionConfig()) == "triton"
    auto = sparse_attention_triton(a)
    portable = sparse_attention_triton(a, kernel="triton")
    assert torch.equal(auto[0], portable[0]) and torch.equal(auto[1], portable[1])
    with pytest.raises(ValueError, match="bf16 pools only"):
        sparse_attention_triton(a, kernel="gluon")
