"""Sparse attention on paged pools: the reference contract, and the Triton kernel under TRITON_INTERPRET=1.

Tolerance (flash-attention rule): against the fp32 reference on the dequantized entries, the kernel's max
error must be at most twice that of a same-precision PyTorch implementation (bf16 operands, bf16 logits,
bf16 softmax, bf16 output) plus 1e-5; the same for the LSE; empty rows (out 0, lse -inf) must match exactly.
Shapes are small (few queries, at most a few tiles of 64 indices) because the interpreter is slow.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsakit.formats import AttentionKVFormat
from dsakit.ops.attention import sparse_attention, sparse_attention_dense
from dsakit.ops.attention import reference as ref
from dsakit.ops.attention.inputs import check_sparse_attention_inputs
from dsakit.ops.attention.reference import gather_entries

triton = pytest.importorskip("triton")
from dsakit.ops._backend import triton_interpreted  # noqa: E402

needs_interpreter = pytest.mark.skipif(not triton_interpreted(), reason="needs TRITON_INTERPRET=1 on the CPU")

FORMATS = {"bf16": AttentionKVFormat.BF16, "fp8": AttentionKVFormat.FP8_ROPE_BF16}
D = 512


def make_pool(fmt: AttentionKVFormat, pages: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [pages, page_bytes] holding random entries (rope dims larger, as after rope in the model)."""
    x = torch.randn(pages * 64, D, generator=gen)
    x[:, 448:] *= 2.0
    return fmt.quantize_pages(x)


def bf16_torch_attention(q, kv, valid, sink, scale):
    """Same-precision PyTorch implementation: every tensor op in bf16 -> (out bf16, lse bf16)."""
    qb, kvb = q.bfloat16(), kv.bfloat16()
    logits = torch.einsum("thd,tid->thi", qb, kvb) * torch.tensor(scale, dtype=torch.bfloat16)
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    if sink is not None:
        col = sink.bfloat16().view(1, -1, 1).expand(logits.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([logits, col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.nan_to_num(torch.softmax(logits, dim=-1), nan=0.0)
    return torch.einsum("thi,tid->thd", probs, kvb), lse


def assert_flash_close(out, lse, want_out, want_lse, base_out, base_lse):
    """Kernel error <= 2 x the bf16 PyTorch error + 1e-5 (out and lse); -inf lse and empty rows exact."""
    out, lse = out.float().cpu(), lse.float().cpu()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)), "empty-row mask differs"
    fin = torch.isfinite(want_lse)
    assert bool(torch.isfinite(lse[fin]).all()) and bool(torch.isfinite(out).all())
    assert bool((out[~fin] == 0).all()), "rows with no valid index must be exactly 0"
    err_out = (out - want_out).abs().max().item()
    base_err_out = (base_out.float() - want_out).abs().max().item()
    assert err_out <= 2 * base_err_out + 1e-5, (err_out, base_err_out)
    if bool(fin.any()):
        err_lse = (lse[fin] - want_lse[fin]).abs().max().item()
        base_err_lse = (base_lse.float()[fin] - want_lse[fin]).abs().max().item()
        assert err_lse <= 2 * base_err_lse + 1e-5, (err_lse, base_err_lse)


def run_both(q, pool, indices, fmt, *, num_splits=None, **kw):
    """-> kernel (out, lse), reference (out, lse), bf16 torch (out, lse)."""
    from dsakit.ops.attention.triton import sparse_attention_triton

    a = check_sparse_attention_inputs(q, pool, indices, kv_format=fmt, **kw)
    got = sparse_attention_triton(a, num_splits=num_splits)
    want = ref.sparse_attention(q, pool, indices, kv_format=fmt, **kw)
    kv, valid = gather_entries(pool, a.kv_format, indices, a.topk_length)
    if a.extra_kv_cache is not None:
        xkv, xvalid = gather_entries(a.extra_kv_cache, a.extra_kv_format, a.extra_indices, a.extra_topk_length)
        kv, valid = torch.cat([kv, xkv], 1), torch.cat([valid, xvalid], 1)
    base = bf16_torch_attention(q.float(), kv, valid, a.sink, a.softmax_scale)
    return got, want, base


# --------------------------------------------------------------------------------------------------
# reference contract (no kernel)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_reference_paged_matches_dense(fmt_name):
    """Paged reference = dense reference on the dequantized pool, with the concatenated index sets."""
    gen = torch.Generator().manual_seed(0)
    fmt = FORMATS[fmt_name]
    pool, xpool = make_pool(fmt, 2, gen), make_pool(fmt, 1, gen)
    q = torch.randn(3, 4, D, generator=gen)
    idx = torch.tensor([[5, 127, -1, 64], [-1, -1, -1, -1], [3, 200, 0, 9]], dtype=torch.int32)  # 200: out of pool
    xidx = torch.tensor([[1, 2], [63, -1], [0, 70]], dtype=torch.int32)  # 70: out of the extra pool
    length = torch.tensor([4, 4, 3], dtype=torch.int32)  # row 2 drops its 4th index
    sink = torch.randn(4, generator=gen)
    out, lse = ref.sparse_attention(q, pool, idx, kv_format=fmt, topk_length=length, extra_kv_cache=xpool,
                                    extra_indices=xidx, sink=sink, softmax_scale=0.05)
    dense = torch.cat([fmt.dequantize_pages(pool), fmt.dequantize_pages(xpool)])
    didx = torch.tensor([[5, 127, -1, 64, 129, 130], [-1, -1, -1, -1, 191, -1], [3, -1, 0, -1, 128, -1]])
    want_out, want_lse = sparse_attention_dense(q, dense, didx, sink, softmax_scale=0.05)
    assert torch.allclose(out, want_out, atol=1e-5) and torch.allclose(lse, want_lse, atol=1e-5)
    # public dispatcher on CPU data = the reference, in q's dtype
    out2, lse2 = sparse_attention(q.bfloat16(), pool, idx, kv_format=fmt.name, topk_length=length,
                                  extra_kv_cache=xpool, extra_indices=xidx, sink=sink, softmax_scale=0.05)
    assert out2.dtype == torch.bfloat16 and lse2.dtype == torch.float32


def test_reference_empty_rows_and_sink():
    gen = torch.Generator().manual_seed(1)
    fmt = AttentionKVFormat.BF16
    pool = make_pool(fmt, 1, gen)
    q = torch.randn(2, 2, D, generator=gen)
    idx = torch.tensor([[-1, -1], [7, 7]], dtype=torch.int32)
    length = torch.tensor([2, 0], dtype=torch.int32)  # row 1 has indices but a length of 0
    out, lse = ref.sparse_attention(q, pool, idx, kv_format=fmt, topk_length=length, sink=torch.zeros(2))
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    # one entry twice, sink 0: weight of the entry = 2 e^s / (2 e^s + 1)
    out, lse = ref.sparse_attention(q[1:], pool, idx[1:], kv_format=fmt, sink=torch.zeros(2))
    kv = fmt.dequantize_pages(pool)[7]
    s = (q[1] @ kv) * D ** -0.5
    assert torch.allclose(lse[0], s + math.log(2), atol=1e-5)
    w = 2 * torch.exp(s) / (2 * torch.exp(s) + 1)
    assert torch.allclose(out[0], w[:, None] * kv, atol=1e-5)


FP32_MAX = torch.finfo(torch.float32).max
NAN, INF = float("nan"), float("inf")


def non_finite_case(name: str):
    """-> (q fp32 [3, 64, 512], sink [64] | None, idx int32 [3, 4], (out NaN, lse NaN) expected per [query, head 0]).

    Query 0 and 1 have valid entries, query 2 none (its q is poisoned too: an empty row stays out 0, lse -inf).
    The pool is make_pool(BF16, 1, seed 7); entries 0, 5, 9 have dim 3 of mixed signs."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(3, 64, D, generator=gen)
    sink = None
    if name == "nan_q":
        q[0, 0, 3] = q[2, 0, 3] = NAN
        want = [(True, True), (False, False), (False, False)]
    elif name == "inf_q":
        q[0, 0, 3] = INF  # +inf * kv of both signs: a +inf score -> NaN
        q[1, 0, :] = -INF
        q[2, 0, 3] = INF
        want = [(True, True), (True, True), (False, False)]
    elif name == "fp32_max_q":
        q[0, 0] = FP32_MAX  # products overflow fp32
        q[1, 0, 3] = FP32_MAX  # one value: finite in fp32, +inf in bf16 (the kernel's precision)
        q[2, 0] = FP32_MAX
        want = [(True, True), (True, True), (False, False)]
    else:  # nan_sink: out NaN, lse (sink excluded) as without it; the empty row's out too
        sink = torch.randn(64, generator=gen)
        sink[0] = NAN
        want = [(True, False), (True, False), (True, False)]
    idx = torch.tensor([[0, 5, 9, -1], [0, 5, 9, 1], [-1, -1, -1, -1]], dtype=torch.int32)
    return q, sink, idx, want


NON_FINITE_CASES = ["nan_q", "inf_q", "fp32_max_q", "nan_sink"]


def assert_non_finite_as_specified(out, lse, want):
    """Head 0 of each query NaN (out, lse) as ``want`` says; finite elsewhere; the empty row exactly empty."""
    for t, (out_nan, lse_nan) in enumerate(want):
        assert bool(out[t, 0].isnan().all()) == out_nan and bool(out[t, 0].isnan().any()) == out_nan, t
        assert bool(lse[t, 0].isnan()) == lse_nan, (t, lse[t, 0])
    assert bool(torch.isfinite(out[:2, 1:]).all()) and bool(torch.isfinite(lse[:2, 1:]).all())
    assert bool(torch.isneginf(lse[2, 1:]).all()) and bool((out[2, 1:] == 0).all())


@pytest.mark.parametrize("name", NON_FINITE_CASES)
def test_reference_propagates_non_finite_inputs(name):
    """NaN / Inf in q, q at the fp32 maximum, a NaN sink: NaN out (and lse, sink excluded), never a silent 0."""
    pool = make_pool(AttentionKVFormat.BF16, 1, torch.Generator().manual_seed(7))
    q, sink, idx, want = non_finite_case(name)
    out, lse = ref.sparse_attention(q, pool, idx, kv_format="bf16", sink=sink)
    assert_non_finite_as_specified(out, lse, want)


def test_validation_names_the_bad_value():
    fmt = AttentionKVFormat.FP8_ROPE_BF16
    pool = torch.zeros(1, fmt.page_bytes, dtype=torch.uint8)
    q = torch.zeros(2, 4, D)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    cases = [
        (dict(q=torch.zeros(2, 4, 256)), "head dim"),
        (dict(q=torch.zeros(2, 4, D, dtype=torch.int32)), "q must be"),
        (dict(kv_cache=torch.zeros(1, 1024, dtype=torch.uint8)), "kv_cache must be uint8"),
        (dict(indices=idx.long()), "indices must be int32"),
        (dict(indices=torch.zeros(3, 3, dtype=torch.int32)), "indices must have shape"),
        (dict(topk_length=torch.zeros(3, dtype=torch.int32)), "topk_length"),
        (dict(sink=torch.zeros(3)), "sink"),
        (dict(softmax_scale=float("nan")), "softmax_scale"),
        (dict(softmax_scale=float("inf")), "softmax_scale"),
        (dict(softmax_scale=0.0), "softmax_scale"),
        (dict(softmax_scale=-1.0), "softmax_scale"),
        (dict(softmax_scale=True), "softmax_scale"),
        (dict(kv_format="fp9"), "attention KV format"),
        (dict(extra_indices=idx), "together"),
        (dict(extra_topk_length=torch.zeros(2, dtype=torch.int32)), "without extra"),
        (dict(extra_kv_cache=pool, extra_indices=idx[:, :1].repeat(1, 2)[:1]), "extra_indices"),
        (dict(backend="cuda"), "backend"),
    ]
    base = dict(q=q, kv_cache=pool, indices=idx, kv_format=fmt)
    for change, match in cases:
        kw = {**base, **change}
        with pytest.raises(ValueError, match=match):
            sparse_attention(kw.pop("q"), kw.pop("kv_cache"), kw.pop("indices"), **kw)


# --------------------------------------------------------------------------------------------------
# Triton kernel (interpreter)
# --------------------------------------------------------------------------------------------------


@needs_interpreter
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("hq", [64, 128])
def test_kernel_prefill_cases(fmt_name, hq):
    """One split: a full row over two tiles, a window shorter than 128 (-1 padded), K larger than the
    entries available (mostly -1), an all -1 row, an out-of-pool slot (skipped), a per-head sink."""
    gen = torch.Generator().manual_seed(2 + hq)
    fmt = FORMATS[fmt_name]
    pool = make_pool(fmt, 3, gen)  # 192 slots
    k = 80
    idx = torch.full((4, k), -1, dtype=torch.int32)
    idx[0] = torch.randperm(192, generator=gen)[:k].to(torch.int32)
    idx[1, :37] = torch.arange(100, 137, dtype=torch.int32)  # a window of 37 tokens
    idx[2, 70:73] = torch.tensor([5, 191, 9000], dtype=torch.int32)  # 3 of 80 set, 9000 outside the pool
    q = (torch.randn(4, hq, D, generator=gen) * 2).bfloat16()
    sink = torch.randn(hq, generator=gen)
    (out, lse), want, base = run_both(q, pool, idx, fmt, sink=sink)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == (4, hq, D)
    assert_flash_close(out, lse, *want, *base)
    assert bool(torch.isneginf(lse[3]).all()) and bool((out[3] == 0).all())
    if hq == 64 and fmt_name == "bf16":
        from dsakit.ops.attention.triton import sparse_attention_triton

        a = check_sparse_attention_inputs(q, pool, idx, kv_format=fmt, sink=sink)
        out2, lse2 = sparse_attention_triton(a)  # determinism: a rerun is bitwise equal
        assert torch.equal(out, out2) and torch.equal(lse, lse2)


@needs_interpreter
@pytest.mark.parametrize("fmt_name", ["bf16", "fp8"])
def test_kernel_decode_splits_extra_pool_topk_length(fmt_name):
    """Three splits merged by the combine kernel; main window + extra (compressed) pool in the other
    format, both with a per-row valid length; fp32 q gives an fp32 output."""
    gen = torch.Generator().manual_seed(3)
    fmt = FORMATS[fmt_name]
    xfmt = FORMATS["fp8" if fmt_name == "bf16" else "bf16"]
    pool, xpool = make_pool(fmt, 2, gen), make_pool(xfmt, 2, gen)
    t, hq, k, xk = 3, 64, 70, 100
    idx = torch.randint(0, 128, (t, k), generator=gen, dtype=torch.int32)
    xidx = torch.randperm(128, generator=gen)[:xk].to(torch.int32).repeat(t, 1)
    xidx[1, 50:] = -1
    length = torch.tensor([70, 10, 0], dtype=torch.int32)
    xlength = torch.tensor([100, 90, 0], dtype=torch.int32)  # row 2: nothing at all
    q = torch.randn(t, hq, D, generator=gen) * 2
    sink = torch.randn(hq, generator=gen)
    kw = dict(topk_length=length, extra_kv_cache=xpool, extra_kv_format=xfmt, extra_indices=xidx,
              extra_topk_length=xlength, sink=sink, softmax_scale=0.06)
    (out, lse), want, base = run_both(q, pool, idx, fmt, num_splits=3, **kw)
    assert out.dtype == torch.float32
    assert_flash_close(out, lse, *want, *base)
    assert bool(torch.isneginf(lse[2]).all()) and bool((out[2] == 0).all())


@needs_interpreter
def test_kernel_no_sink_and_public_dispatch():
    gen = torch.Generator().manual_seed(4)
    fmt = AttentionKVFormat.BF16
    pool = make_pool(fmt, 1, gen)
    idx = torch.tensor([[0, 1, 2, 63], [-1, -1, -1, -1]], dtype=torch.int32)
    q = torch.randn(2, 64, D, generator=gen).bfloat16()
    out, lse = sparse_attention(q, pool, idx, kv_format="bf16", backend="triton")
    want_out, want_lse = ref.sparse_attention(q, pool, idx, kv_format="bf16")
    kv, valid = gather_entries(pool, fmt, idx, None)
    assert_flash_close(out, lse, want_out, want_lse, *bf16_torch_attention(q.float(), kv, valid, None, D ** -0.5))
    with pytest.raises(ValueError, match="Hq in"):
        sparse_attention(q[:, :32], pool, idx, kv_format="bf16", backend="triton")


def check_kernel_non_finite(name: str, device: str, kernel: str = "triton") -> None:
    """The kernel (one split; two merged by the combine kernel; two output halves) has NaN exactly where the
    reference has, -inf lse where it has, and agrees with it on the other heads within 2e-2 (bf16 operands).
    ``kernel``: AttentionConfig.kernel ("gluon": the sm_90 kernel)."""
    from dsakit.ops.attention.triton import sparse_attention_triton

    pool = make_pool(AttentionKVFormat.BF16, 1, torch.Generator().manual_seed(7))
    q, sink, idx, want = non_finite_case(name)
    want_out, want_lse = ref.sparse_attention(q, pool, idx, kv_format="bf16", sink=sink)
    on = [None if x is None else x.to(device) for x in (q, pool, idx, sink)]
    a = check_sparse_attention_inputs(on[0], on[1], on[2], kv_format="bf16", sink=on[3])
    for num_splits in (1, 2):
        out, lse = (x.cpu() for x in sparse_attention_triton(a, num_splits=num_splits, kernel=kernel))
        assert_non_finite_as_specified(out, lse, want)
        assert torch.equal(out.isnan(), want_out.isnan()) and torch.equal(lse.isnan(), want_lse.isnan())
        assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
        assert torch.allclose(out[:, 1:], want_out[:, 1:], atol=2e-2)
        assert torch.allclose(lse[:2, 1:], want_lse[:2, 1:], atol=2e-2)


@needs_interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy reports the NaN it makes
@pytest.mark.parametrize("name", NON_FINITE_CASES)
def test_kernel_matches_reference_on_non_finite_inputs(name):
    check_kernel_non_finite(name, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "gluon"])
@pytest.mark.parametrize("name", NON_FINITE_CASES)
def test_kernel_on_gpu_matches_reference_on_non_finite_inputs(name, kernel):
    """Compiled: bf16 rounding, max and exp2 of the hardware (NaN handling of max differs from numpy's);
    the portable kernel and the Gluon one (sm_90 only)."""
    if kernel == "gluon":
        pytest.importorskip("triton.experimental.gluon")
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("the Gluon kernel runs on sm_90 only")
    check_kernel_non_finite(name, "cuda", kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
@pytest.mark.parametrize("hq", [64, 128])
def test_kernel_on_gpu(fmt_name, hq):
    """Compiled kernel (every default stage count) vs the reference: one split, automatic decode splits,
    an extra pool and a topk_length; rerun bitwise equal."""
    gen = torch.Generator().manual_seed(5)
    fmt = FORMATS[fmt_name]
    pool, xpool = make_pool(fmt, 8, gen), make_pool(AttentionKVFormat.BF16, 2, gen)
    t, k, xk = 6, 300, 100
    idx = torch.stack([torch.randperm(512, generator=gen)[:k] for _ in range(t)]).to(torch.int32)
    idx[1, 50:] = -1
    xidx = torch.randint(-1, 128, (t, xk), generator=gen, dtype=torch.int32)
    length = torch.tensor([300, 300, 0, 17, 299, 1], dtype=torch.int32)
    q = (torch.randn(t, hq, D, generator=gen) * 2).bfloat16()
    sink = torch.randn(hq, generator=gen)
    kw = dict(topk_length=length, extra_kv_cache=xpool, extra_kv_format="bf16", extra_indices=xidx, sink=sink)
    want = ref.sparse_attention(q, pool, idx, kv_format=fmt, **kw)
    a = check_sparse_attention_inputs(q, pool, idx, kv_format=fmt, **kw)
    kv, valid = gather_entries(pool, a.kv_format, idx, length)
    xkv, xvalid = gather_entries(xpool, a.extra_kv_format, xidx, None)
    base = bf16_torch_attention(q.float(), torch.cat([kv, xkv], 1), torch.cat([valid, xvalid], 1), sink,
                                D ** -0.5)
    cuda = {name: (v.cuda() if isinstance(v, torch.Tensor) else v) for name, v in kw.items()}
    from dsakit.ops.attention.triton import sparse_attention_triton

    ga = check_sparse_attention_inputs(q.cuda(), pool.cuda(), idx.cuda(), kv_format=fmt, **cuda)
    # num_splits None: automatic, several splits for these few queries
    # kernel "triton": the portable kernel also on sm_90, where "auto" would take the Gluon one
    for cfg in (dict(num_splits=1), dict(), dict(num_warps=4, block_n=32)):
        cfg["kernel"] = "triton"
        out, lse = sparse_attention_triton(ga, **cfg)
        assert_flash_close(out, lse, *want, *base)
        again = sparse_attention_triton(ga, **cfg)
        assert torch.equal(again[0], out) and torch.equal(again[1], lse), cfg


def test_attention_config_is_checked_and_is_what_the_launcher_reads():
    """Every launch setting of the launcher comes from an AttentionConfig (per-GPU table; the CPU takes the
    "default" entry): its fields are checked when it is made, the split rule is its method, and a config
    passed in runs exactly as the same settings given as overrides."""
    from dsakit.ops.attention import ATTENTION_DEFAULTS, AttentionConfig
    from dsakit.ops.attention.triton import sparse_attention_triton

    for bad, match in ((dict(block_n=48), "block_n"),
                       (dict(num_stages=0), "num_stages"), (dict(stages={("bf16", 64): 1}), "stages"),
                       (dict(combine_block_h=128), "combine_block_h"), (dict(num_splits=True), "num_splits")):
        with pytest.raises(ValueError, match=match):
            AttentionConfig(**bad)
    config = AttentionConfig.for_device("cpu")
    assert config is ATTENTION_DEFAULTS["default"] and config.stages_for("bf16", 128) == 2
    assert config.replace(num_stages=3).stages_for("fp8-rope-bf16", 64) == 3
    assert config.splits_for(2, 64, 100, sm_count=None) == 1  # not a GPU: one split
    assert config.splits_for(2, 64, 100, sm_count=132) == 66 and config.splits_for(2, 128, 10, sm_count=132) == 10
    assert config.splits_for(200, 64, 100, sm_count=132) == 1  # the queries fill the SMs
    assert config.replace(num_splits=3).splits_for(2, 64, 100, sm_count=132) == 3
    with pytest.raises(ValueError, match="config must be an AttentionConfig"):
        sparse_attention_triton(None, {"num_splits": 2})
    if not triton_interpreted():
        return
    gen = torch.Generator().manual_seed(21)
    fmt = FORMATS["bf16"]
    pool = make_pool(fmt, 3, gen)
    q = torch.randn(2, 64, D, generator=gen)
    indices = torch.randint(0, 3 * 64, (2, 70), generator=gen, dtype=torch.int32)
    a = check_sparse_attention_inputs(q, pool, indices, kv_format=fmt)
    by_config = sparse_attention_triton(a, AttentionConfig(num_splits=2))
    by_override = sparse_attention_triton(a, num_splits=2)
    assert torch.equal(by_config[0], by_override[0]) and torch.equal(by_config[1], by_override[1])
