"""Bad input against the public ops and the cache: refused alike by both backends, bounded, never corrupting."""

from __future__ import annotations

import math
import os

import pytest
import torch

from dsakit.ops.attention.reference import sparse_attention_dense, window_topk_indices
from dsakit.presets import KeyTransform


# -- bounds ----------------------------------------------------------------------------------------

def _naive_window(positions, topk, window, num_raw):
    rows = []
    for t, p in enumerate(positions.tolist()):
        raw = list(range(max(p - window + 1, 0), min(p, num_raw - 1) + 1))
        comp = sorted(j + num_raw for j in topk[t].tolist() if j >= 0)
        rows.append((raw, comp))
    return rows


@pytest.mark.parametrize("window", [3, 10, 11, 10 ** 9])
def test_window_longer_than_the_raw_kv_is_clamped_to_the_same_index_set(window):
    positions = torch.tensor([0, 4, 9, 12, -1])
    topk = torch.tensor([[-1, -1], [0, -1], [1, 0], [2, 1], [-1, -1]])
    got = window_topk_indices(positions, topk, window, 10)  # 10**9 used to allocate [T, 10**9] and die
    assert got.shape == (5, min(window, 10) + 2) and got.dtype == torch.int32
    for row, (raw, comp) in zip(got.tolist(), _naive_window(positions, topk, window, 10)):
        assert sorted(j for j in row[:-2] if j >= 0) == raw
        assert sorted(j for j in row[-2:] if j >= 0) == comp
    assert window_topk_indices(positions, topk, 10 ** 9, 0).shape == (5, 2)


# -- numerical edges -------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [math.nan, math.inf, -1.0, 0.0, "0.1", True])
def test_dense_attention_refuses_a_bad_softmax_scale(scale):
    q, kv = torch.randn(1, 2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="softmax_scale"):
        sparse_attention_dense(q, kv, torch.tensor([[0, 1]]), softmax_scale=scale)


@pytest.mark.parametrize("scale", [math.nan, math.inf, 0.0, "0.1"])
def test_paged_sparse_attention_refuses_a_bad_softmax_scale_on_every_backend(scale):
    from dsakit.formats import AttentionKVFormat
    from dsakit.ops.attention import sparse_attention

    fmt = AttentionKVFormat.parse("bf16")
    q, pool = torch.randn(1, 64, 512), torch.zeros(1, fmt.page_bytes, dtype=torch.uint8)
    indices = torch.tensor([[0, 1]], dtype=torch.int32)
    for backend in _backends():
        with pytest.raises(ValueError, match="softmax_scale"):  # NaN made every output zeros
            sparse_attention(q, pool, indices, kv_format=fmt, softmax_scale=scale, backend=backend)


@pytest.mark.parametrize("eps", [math.inf, math.nan, -1e-6, "1e-6", None, True])
def test_key_transform_refuses_a_bad_eps(eps):
    with pytest.raises(ValueError, match="eps"):
        KeyTransform(eps=eps)
    assert KeyTransform(eps=0).eps == 0 and KeyTransform(eps=1e-5).eps == 1e-5


# -- norms at the fp32 / bf16 maximum: finite rows stay finite, both backends store the same bytes ----

FP32_MAX = torch.finfo(torch.float32).max
BF16_MAX = torch.finfo(torch.bfloat16).max


def _extreme_rows(d: int) -> torch.Tensor:
    alternating = torch.tensor([FP32_MAX, -FP32_MAX]).repeat(d // 2)
    return torch.stack([alternating, torch.full((d,), BF16_MAX), -alternating.flip(0),
                        torch.linspace(-1.0, 1.0, d) * BF16_MAX, torch.randn(d)])


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_norms_of_rows_at_the_float_maximum_are_finite(norm):
    from dsakit.transforms import apply_norm

    x = _extreme_rows(128)
    out = apply_norm(x, norm, torch.ones(128), torch.zeros(128) if norm == "layernorm" else None, 1e-6)
    assert bool(torch.isfinite(out).all())
    assert torch.allclose(out[0], torch.tensor([1.0, -1.0]).repeat(64))  # +-m alternating: mean 0, rms m
    # the scaled computation is exact: a row that does not overflow gives the very bits of unscaled math
    y = torch.randn(64, 128) * 1e3
    if norm == "layernorm":
        centered = y - y.mean(-1, keepdim=True)
        want = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + 1e-6)
    else:
        want = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(apply_norm(y, norm, torch.ones(128), None, 1e-6), want)


def _store_both(store, rows, fmt, *args, **kwargs):
    """Store rows at slots 0..N-1 with both backends (Triton only where it can run: the CPU under
    TRITON_INTERPRET=1, else the GPU, its inputs moved there); -> {backend: CPU pool}."""
    from conftest import triton_runnable

    n = rows.shape[0]
    pools = {}
    for backend in ("reference", "triton") if triton_runnable()[0] else ("reference",):
        device = "cpu" if backend == "reference" or os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
        moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        pool = torch.zeros(1, fmt.page_bytes, dtype=torch.uint8, device=device)
        store(rows.to(device), torch.arange(n, device=device), torch.arange(n, device=device), pool, fmt, *moved,
              backend=backend, **kwargs)
        pools[backend] = pool.cpu()
    return pools


@pytest.mark.parametrize("norm,rope_dim", [("layernorm", 64), ("rmsnorm", 64), ("layernorm", 32)],
                         ids=["layernorm-fast", "rmsnorm-fast", "layernorm-generic"])
def test_index_keys_at_the_float_maximum_store_no_nan_and_backends_agree(norm, rope_dim):
    from dsakit.cache import dequantize_entries
    from dsakit.formats import KeyFormat
    from dsakit.ops.store import store_index_keys
    from dsakit.transforms import ROPE_V32, RopeConfig

    fmt = KeyFormat.parse("bf16")
    rows = _extreme_rows(128)
    table = RopeConfig(rope_dim, 10000.0).cos_sin_table(8)
    # no Hadamard: its butterfly sums in another order than the reference's matmul (documented last-bit
    # differences); without it the pipeline is the norm, the rope and the bf16 rounding, byte for byte
    transform = KeyTransform(norm, ROPE_V32, rope_dim, False, 1e-6)
    bias = torch.zeros(128) if norm == "layernorm" else None
    pools = _store_both(store_index_keys, rows, fmt, table, torch.ones(128), bias, transform)
    stored = dequantize_entries(pools["reference"], fmt, torch.arange(rows.shape[0]))
    assert bool(torch.isfinite(stored).all()), stored  # LayerNorm stored NaN for these rows
    if "triton" in pools:
        assert torch.equal(pools["triton"], pools["reference"])


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8-rope-bf16"])
def test_attention_kv_at_the_float_maximum_is_finite_and_backends_agree(fmt_name):
    from dsakit.formats import AttentionKVFormat
    from dsakit.ops.store import prepare_attention_kv, store_attention_kv
    from dsakit.transforms import RopeConfig

    fmt = AttentionKVFormat.parse(fmt_name)
    rows = _extreme_rows(512)
    table = RopeConfig(64, 10000.0).cos_sin_table(8)
    assert bool(torch.isfinite(prepare_attention_kv(rows, torch.arange(5), table, torch.ones(512))).all())
    pools = _store_both(store_attention_kv, rows, fmt, table, torch.ones(512))
    if "triton" in pools:
        assert torch.equal(pools["triton"], pools["reference"])


# -- the two backends accept and refuse alike (explicit cases; the property test draws random ones) ----

def _small_batch(fmt="bf16"):
    from dsakit import PagedCache

    cache = PagedCache(fmt, 4)
    seq = cache.add_sequence()
    cache.write(cache.append(seq, 70), torch.randn(70, 128))
    return cache, seq


def _backends():
    """The backends the argument checks below run on: they build CPU tensors, which the Triton backend takes
    under TRITON_INTERPRET=1 only (on a GPU machine without it, it would refuse them for their device first)."""
    from conftest import triton_runnable

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return ("reference", "triton") if triton_runnable()[0] and interpret else ("reference",)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.float64])
def test_integer_or_bool_weights_are_refused_by_every_backend(dtype):
    from dsakit.ops.indexer import index_scores
    from dsakit.ops.indexer.reference import index_scores_dense
    from dsakit.ops.indexer import index_topk

    cache, seq = _small_batch()
    batch = cache.batch([seq])
    q, w = torch.randn(1, 4, 128), torch.ones(1, 4, dtype=dtype)  # int ones used to select indices 0..k-1
    for backend in _backends():
        with pytest.raises(ValueError, match="weights must be one of"):
            index_scores(q, w, batch, backend=backend)
        with pytest.raises(ValueError, match="weights must be one of"):
            index_topk(q, w, batch, 8, backend=backend)
    with pytest.raises(ValueError, match="weights must be one of"):
        index_scores_dense(q, w, torch.randn(5, 128))


@pytest.mark.parametrize("k", [True, False, 0, 2.0, 16385])
def test_k_is_checked_alike(k):
    from dsakit.ops.indexer import index_topk, select_topk

    cache, seq = _small_batch()
    batch = cache.batch([seq])
    for backend in _backends():
        with pytest.raises(ValueError, match="k must be"):
            index_topk(torch.randn(1, 4, 128), torch.ones(1, 4), batch, k, backend=backend)
        with pytest.raises(ValueError, match="k must be"):
            select_topk(torch.randn(2, 10), k, backend=backend)


def test_attention_kv_rope_table_of_width_zero_is_refused_by_every_backend():
    from dsakit.formats import AttentionKVFormat
    from dsakit.ops.store import reference as store_reference
    from dsakit.ops.store import store_attention_kv

    fmt = AttentionKVFormat.parse("fp8-rope-bf16")
    pool = torch.zeros(1, fmt.page_bytes, dtype=torch.uint8)
    kv, table = torch.randn(2, 512), torch.zeros(16, 0)
    for backend in _backends():
        with pytest.raises(ValueError, match="rope"):
            store_attention_kv(kv, torch.arange(2), torch.arange(2), pool, fmt, table, torch.ones(512),
                               backend=backend)
    with pytest.raises(ValueError, match="rope_dim"):  # the reference module itself, not only the dispatcher
        store_reference.store_attention_kv(kv, torch.arange(2), torch.arange(2), pool, fmt, table, torch.ones(512))
    assert not bool(pool.any())
    with pytest.raises(ValueError, match="eps"):
        store_attention_kv(kv, torch.arange(2), torch.arange(2), pool, fmt, torch.zeros(16, 64), torch.ones(512),
                           eps=math.inf)


# -- block tables ------------------------------------------------------------------------------------

def test_a_block_table_row_listing_a_page_twice_is_refused_naming_row_and_page():
    from dsakit import PagedBatch
    from dsakit.ops.indexer import index_topk

    cache, seq = _small_batch()
    table = cache.block_table([seq])  # sequence 0 holds 70 entries on two pages
    table[0, 1] = table[0, 0]
    with pytest.raises(ValueError, match=r"block_table row 0 lists page 0 twice \(columns 0 and 1\)"):
        PagedBatch.build(cache.pool, cache.fmt, table, cache.entry_counts([seq]), torch.zeros(1, dtype=torch.int32))
    # a repeated page beyond the pages the entries need is never read: allowed
    wide = cache.block_table([seq], width=3)
    wide[0, 2] = wide[0, 0]
    batch = PagedBatch.build(cache.pool, cache.fmt, wide, cache.entry_counts([seq]), torch.zeros(1, dtype=torch.int32))
    assert index_topk(torch.randn(1, 4, 128), torch.ones(1, 4), batch, 4, backend="reference").shape == (1, 4)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "fp4"])
def test_a_pool_off_a_16_byte_boundary_is_refused_by_the_batch_and_the_store(fmt):
    """The kernels read multi-byte words and bulk-copy aligned boxes: a pool viewed at a byte offset (not a page
    boundary) is refused with a clear error, before anything is written; a page-boundary view is accepted."""
    from dsakit import PagedBatch
    from dsakit.ops.store import store_index_keys

    cache, seq = _small_batch(fmt)
    page_bytes = cache.fmt.page_bytes
    raw = torch.zeros(cache.pool.numel() + page_bytes + 4, dtype=torch.uint8)
    shifted = raw[4:4 + cache.pool.numel()].view(cache.pool.shape)
    shifted.copy_(cache.pool)
    args = (cache.fmt, cache.block_table([seq]), cache.entry_counts([seq]), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="16-byte boundary"):
        PagedBatch.build(shifted, *args)
    before = raw.clone()
    rope = torch.zeros(128, 64)
    with pytest.raises(ValueError, match="16-byte boundary"):
        store_index_keys(torch.randn(1, 128), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                         shifted, cache.fmt, rope, torch.ones(128))
    assert torch.equal(raw, before)
    at_page = raw[page_bytes:page_bytes + cache.pool.numel()].view(cache.pool.shape)  # a page-boundary view
    PagedBatch.build(at_page, *args)


@pytest.mark.parametrize("field", ["block_table", "entry_counts", "query_seq", "query_positions"])
def test_lists_for_batch_tensors_are_value_errors(field):
    from dsakit import PagedBatch

    cache, seq = _small_batch()
    args = dict(pool=cache.pool, fmt=cache.fmt, block_table=cache.block_table([seq]),
                entry_counts=cache.entry_counts([seq]), query_seq=torch.zeros(1, dtype=torch.int32),
                query_positions=torch.tensor([69]))
    args[field] = args[field].tolist()
    with pytest.raises(ValueError, match=field):
        PagedBatch.build(**args)


# -- sizes that cannot fit ---------------------------------------------------------------------------

def test_a_cache_or_decode_plan_that_cannot_fit_is_refused_naming_the_size():
    from dsakit import PagedCache

    with pytest.raises(ValueError, match=r"1,000,000,000,000 pages needs .* GiB .* more than"):
        PagedCache("fp8", 10 ** 12)
    with pytest.raises(ValueError, match="more than the 1.0 GiB of memory on cpu"):
        _check_with_memory(2 ** 31, 2 ** 30)
    from conftest import triton_runnable

    if triton_runnable()[0]:
        from dsakit.ops.indexer.plans import plan_decode_topk

        with pytest.raises(ValueError, match=r"max_entries 10,000,000,000,000 needs"):
            plan_decode_topk(1, 1, 10 ** 13, 64, "bf16", "cpu")
        with pytest.raises(ValueError, match="'gpu' is not a device"):
            plan_decode_topk(1, 1, 64, 8, "bf16", "gpu")


def _check_with_memory(nbytes: int, memory: int) -> None:
    from unittest import mock

    from dsakit import _memory

    with mock.patch.object(_memory, "device_memory_bytes", lambda device: memory):
        _memory.check_fits(nbytes, torch.device("cpu"), "a test buffer")


# -- cache arguments of the wrong type: ValueError naming them, never AttributeError / TypeError ----------

def test_cache_arguments_of_the_wrong_type_are_value_errors():
    from dsakit import PagedCache
    from dsakit.cache import bytes_per_token, tokens_that_fit
    from dsakit.formats import KeyFormat

    cache, seq = _small_batch("fp8")
    cases = [(lambda: cache.slots(seq, 0.5), "start"), (lambda: cache.slots(seq, 0, 2.0), "end"),
             (lambda: cache.block_table(3), "seq_ids"), (lambda: cache.entry_counts(seq), "seq_ids"),
             (lambda: cache.batch("0"), "seq_ids"), (lambda: cache.length([0]), "sequence id"),
             (lambda: PagedCache("fp8", 4, device="gpu"), "gpu"), (lambda: PagedCache("fp8", 4, device=3), "device"),
             (lambda: PagedCache("fp9", 4), "fp9"), (lambda: PagedCache(8, 4), "fmt"),
             (lambda: tokens_that_fit("fp8", 1.5), "nbytes"), (lambda: tokens_that_fit(None, 10), "fmt")]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()
    # format names are accepted where formats are
    assert bytes_per_token("fp8") == bytes_per_token(KeyFormat.FP8) == KeyFormat.FP8.page_bytes / 64
    three_pages = KeyFormat.FP8.page_bytes * 3
    assert tokens_that_fit("fp8", three_pages) == tokens_that_fit(KeyFormat.FP8, three_pages) == 64 * 3
