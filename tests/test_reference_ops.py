"""Reference ops (dsakit.ops.*.reference) against INDEPENDENT naive formulations.

Every naive function below is written from docs/spec.md with plain python loops and floats (or a different torch
formulation); none calls the code under test. The format codecs (quantize / dequantize) are tested on their
own in test_formats.py and are used here only to encode the naive pipeline's result.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dsakit.cache import PagedCache, read_entries
from dsakit.formats import AttentionKVFormat, KeyFormat
from dsakit.ops.attention.reference import sparse_attention_dense, window_topk_indices
from dsakit.ops.compress.reference import compress, compress_projected
from dsakit import PagedBatch
from dsakit.ops.indexer.reference import index_scores, index_scores_dense
from dsakit.ops.store.reference import prepare_index_keys, store_attention_kv, store_index_keys
from dsakit.ops.indexer.reference import index_topk, select_topk, topk_to_slots
from dsakit.presets import KeyTransform
from dsakit.transforms import RopeConfig, RopeLayout

NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------------
# Naive building blocks (python floats)
# --------------------------------------------------------------------------------------------------


def naive_norm(x: list[float], norm: str, w: list[float], b: list[float] | None, eps: float = 1e-6) -> list[float]:
    n = len(x)
    if norm == "rmsnorm":
        r = 1.0 / math.sqrt(sum(v * v for v in x) / n + eps)
        return [v * r * w[i] for i, v in enumerate(x)]
    mean = sum(x) / n
    var = sum((v - mean) ** 2 for v in x) / n
    r = 1.0 / math.sqrt(var + eps)
    return [(v - mean) * r * w[i] + b[i] for i, v in enumerate(x)]


def naive_rope(x: list[float], position: int, inv_freq: list[float], layout: str, rope_dim: int = 64) -> list[float]:
    """Multiply each rotated pair, read as a complex number a + ib, by exp(i * position * f)."""
    x = list(x)
    start = len(x) - rope_dim if layout.endswith("trailing") else 0
    half = rope_dim // 2
    for i in range(half):
        a, b = (start + 2 * i, start + 2 * i + 1) if layout.startswith("interleaved") else (start + i, start + i + half)
        z = complex(x[a], x[b]) * complex(math.cos(position * inv_freq[i]), math.sin(position * inv_freq[i]))
        x[a], x[b] = z.real, z.imag
    return x


def naive_hadamard(x: list[float]) -> list[float]:
    """In-place butterfly Walsh-Hadamard transform (Sylvester order) scaled by n^-0.5."""
    x = list(x)
    n, h = len(x), 1
    while h < n:
        for s in range(0, n, 2 * h):
            for j in range(s, s + h):
                x[j], x[j + h] = x[j] + x[j + h], x[j] - x[j + h]
        h *= 2
    return [v / math.sqrt(n) for v in x]


def naive_prepare(keys, positions, inv_freq, w, b, transform: KeyTransform) -> torch.Tensor:
    rows = []
    for n in range(keys.shape[0]):
        x = naive_norm(keys[n].tolist(), transform.norm, w.tolist(), None if b is None else b.tolist(), transform.eps)
        x = naive_rope(x, int(positions[n]), inv_freq, transform.rope_layout.name, transform.rope_dim)
        rows.append(naive_hadamard(x) if transform.hadamard else x)
    return torch.tensor(rows, dtype=torch.float64)


def element_codes(fmt, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sign, magnitude code) per element, magnitude codes ordered like the magnitudes they encode."""
    if fmt.kind == "bf16":
        bits = values.contiguous().view(torch.int16).long() & 0xFFFF
        return bits >> 15, bits & 0x7FFF
    if fmt.kind == "fp8":
        return values.long() >> 7, values.long() & 0x7F
    nibbles = torch.stack([values & 0xF, values >> 4], dim=-1).reshape(values.shape[0], -1).long()
    return nibbles >> 3, nibbles & 0x7


def assert_bytes_match_up_to_rounding_flips(fmt, got_values, got_scales, want_values, want_scales):
    """Bytes equal, except rare elements sitting on a rounding boundary where the reference's fp32 and the
    naive fp64 pipelines land on the two sides (measured: 3 of 30720 bf16 bytes over all store cases).
    Those must be adjacent codes of the same sign, under 0.5% of the elements. An fp8 scale may differ in
    its last bit (amax / 448 of an amax one ulp apart)."""
    got_sign, got_mag = element_codes(fmt, got_values)
    want_sign, want_mag = element_codes(fmt, want_values)
    differ = (got_sign != want_sign) | (got_mag != want_mag)
    assert int(differ.sum()) <= max(2, int(0.005 * differ.numel())), f"{int(differ.sum())} elements differ"
    adjacent = (got_mag - want_mag).abs() <= 1
    same_sign = (got_sign == want_sign) | ((got_mag == 0) & (want_mag == 0))
    assert bool((adjacent & same_sign)[differ].all()), "a differing element is more than one code away"
    if fmt.kind == "fp8":
        a, b = got_scales.contiguous().view(torch.float32), want_scales.contiguous().view(torch.float32)
        assert torch.allclose(a, b, rtol=1e-6, atol=0)
    else:
        assert torch.equal(got_scales, want_scales)


# --------------------------------------------------------------------------------------------------
# store
# --------------------------------------------------------------------------------------------------

STORE_CASES = list(itertools.product(["bf16", "fp8", "fp8-ue8m0", "fp4", "fp4-rne"],
                                     ["interleaved-trailing", "half-split-leading"], ["rmsnorm", "layernorm"],
                                     [True, False]))


@pytest.mark.parametrize("fmt_name,layout,norm,hadamard", STORE_CASES,
                         ids=[f"{f}-{lay}-{n}-{'had' if h else 'nohad'}" for f, lay, n, h in STORE_CASES])
def test_store_index_keys_vs_naive(fmt_name, layout, norm, hadamard):
    fmt = KeyFormat.parse(fmt_name)
    rope = RopeConfig(rope_dim=64, theta=160000.0)
    table = rope.cos_sin_table(300)
    transform = KeyTransform(norm, RopeLayout.parse(layout), 64, hadamard, 1e-6)
    n = 4
    keys = torch.randn(n, 128) * 3
    positions = torch.tensor([0, 1, 123, 299])
    weight = torch.randn(128)
    bias = torch.randn(128) if norm == "layernorm" else None
    pool = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8)
    slots = torch.tensor([70, -1, 3, 64])  # crosses pages; -1 is padding and must not be written
    store_index_keys(keys, positions, slots, pool, fmt, table, weight, bias, transform)

    want = naive_prepare(keys, positions, rope.inv_freq().tolist(), weight, bias, transform)
    got = prepare_index_keys(keys, positions, table, weight, bias, transform)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)

    real = slots >= 0
    got_v, got_s = read_entries(pool, fmt, slots[real])
    want_v, want_s = fmt.quantize(want.float()[real])
    assert_bytes_match_up_to_rounding_flips(fmt, got_v, got_s, want_v, want_s)
    # the store writes exactly quantize(prepare_index_keys(...)), and nothing else
    exact_v, exact_s = fmt.quantize(got[real])
    assert torch.equal(got_v, exact_v) and torch.equal(got_s, exact_s)
    untouched = torch.ones(128, dtype=torch.bool)
    untouched[slots[real]] = False
    rest_v, rest_s = read_entries(pool, fmt, torch.arange(128)[untouched])
    assert bool((rest_v == 0).all()) and bool((rest_s == 0).all())


def test_store_attention_kv_vs_naive():
    fmt = AttentionKVFormat.FP8_ROPE_BF16
    rope = RopeConfig(rope_dim=64, theta=160000.0)
    table = rope.cos_sin_table(64)
    kv = torch.randn(3, 512) * 2
    positions = torch.tensor([5, 0, 63])
    weight = torch.randn(512)
    pool = torch.zeros(1, fmt.page_bytes, dtype=torch.uint8)
    slots = torch.tensor([2, 9, 63])
    store_attention_kv(kv, positions, slots, pool, fmt, table, weight)
    inv_freq = rope.inv_freq().tolist()
    want = torch.tensor([naive_rope(naive_norm(kv[i].tolist(), "rmsnorm", weight.tolist(), None), int(positions[i]),
                                    inv_freq, "interleaved-trailing") for i in range(3)], dtype=torch.float64)
    got_v, got_s = read_entries(pool, fmt, slots)
    want_v, want_s = fmt.quantize(want.float())
    # rope part (bf16) and the 7 ue8m0 scales + pad must agree; fp8 codes up to rounding flips
    assert torch.equal(got_s, want_s)
    got = fmt.dequantize(got_v, got_s)
    assert torch.allclose(got[:, 448:].double(), want[:, 448:], rtol=2 ** -8, atol=1e-6)
    rel = (got[:, :448].double() - want[:, :448]).norm(dim=1) / want[:, :448].norm(dim=1)
    assert float(rel.max()) < 0.05
    assert int((got_v != want_v).sum()) <= 2


def test_store_bad_input_leaves_pool_unchanged():
    fmt = KeyFormat.FP8
    table = RopeConfig().cos_sin_table(16)
    pool = torch.randint(0, 256, (1, fmt.page_bytes), dtype=torch.uint8)
    before = pool.clone()
    keys, w = torch.randn(2, 128), torch.ones(128)
    with pytest.raises(ValueError, match="position 16"):
        store_index_keys(keys, torch.tensor([0, 16]), torch.tensor([0, 1]), pool, fmt, table, w)
    with pytest.raises(ValueError, match="slot 64"):
        store_index_keys(keys, torch.tensor([0, 1]), torch.tensor([0, 64]), pool, fmt, table, w)
    with pytest.raises(ValueError, match="duplicate slot 5"):
        store_index_keys(keys, torch.tensor([0, 1]), torch.tensor([5, 5]), pool, fmt, table, w)
    with pytest.raises(ValueError, match="norm_weight"):
        store_index_keys(keys, torch.tensor([0, 1]), torch.tensor([0, 1]), pool, fmt, table, torch.ones(64))
    with pytest.raises(ValueError, match="8448"):
        store_index_keys(keys, torch.tensor([0, 1]), torch.tensor([0, 1]), pool, KeyFormat.FP4, table, w)
    # regression: non-tensor slots / transform raised AttributeError instead of a ValueError naming them
    with pytest.raises(ValueError, match="slots must be an int tensor"):
        store_index_keys(keys, torch.tensor([0, 1]), [0, 1], pool, fmt, table, w)
    with pytest.raises(ValueError, match="transform must be a KeyTransform"):
        store_index_keys(keys, torch.tensor([0, 1]), torch.tensor([0, 1]), pool, fmt, table, w, transform="v4")
    attn_pool = torch.zeros(1, AttentionKVFormat.BF16.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="slots must be an int tensor"):
        store_attention_kv(torch.randn(2, 512), torch.tensor([0, 1]), (0, 1), attn_pool, "bf16", table,
                           torch.ones(512))
    assert torch.equal(pool, before) and not attn_pool.any()


# --------------------------------------------------------------------------------------------------
# index_scores
# --------------------------------------------------------------------------------------------------


def naive_score(q_t, w_t, k_j) -> float:
    """sum_h w[h] * relu(q[h] . k), with python floats."""
    total = 0.0
    for h in range(len(q_t)):
        dot = sum(a * b for a, b in zip(q_t[h], k_j))
        total += w_t[h] * max(dot, 0.0)
    return total


def naive_batch_scores(q, w, keys_by_seq, query_seq, positions, ratio) -> list[list[float]]:
    width = max((len(k) for k in keys_by_seq), default=0)
    out = []
    for t in range(q.shape[0]):
        keys = keys_by_seq[int(query_seq[t])]
        row = [NEG_INF] * width
        for j in range(len(keys)):
            # visible once all `ratio` tokens of entry j (tokens j*ratio .. j*ratio + ratio - 1) are <= pos
            if positions is None or j * ratio + ratio - 1 <= int(positions[t]):
                row[j] = naive_score(q[t].tolist(), w[t].tolist(), keys[j])
        out.append(row)
    return out


def build_batch(fmt, counts, num_pages=6, seed=0):
    """A PagedCache whose sequences get shuffled, non-contiguous pages; returns the cache and the keys as
    the format decodes them (python lists, one list of keys per sequence)."""
    gen = torch.Generator().manual_seed(seed)
    cache = PagedCache(fmt, num_pages=num_pages)
    # take pages out of order: a throwaway sequence grabs one page first, then is freed
    filler = cache.add_sequence()
    cache.append(filler, 64)
    seqs = [cache.add_sequence() for _ in counts]
    cache.free_sequence(filler)
    keys_by_seq = []
    for seq, n in zip(seqs, counts):
        x = torch.randn(n, 128, generator=gen)
        slots = cache.append(seq, n)
        cache.write(slots, x)
        keys_by_seq.append(fmt.dequantize(*fmt.quantize(x)).tolist())
    return cache, seqs, keys_by_seq


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("ratio,use_positions", [(4, True), (1, True), (4, False)],
                         ids=["ratio4-causal", "ratio1-causal", "no-positions"])
def test_index_scores_ragged_batch_vs_naive(fmt_name, ratio, use_positions):
    fmt = KeyFormat.parse(fmt_name)
    counts = [70, 0, 5]  # a sequence crossing a page, an empty one, a short one
    cache, seqs, keys_by_seq = build_batch(fmt, counts)
    h = 3
    query_seq = torch.tensor([0, 0, 0, 0, 1, 2, 2, 0])
    # positions: fully masked (2 < 3 for ratio 4), the 4-token boundary (3 sees entry 0, 6 does not see
    # entry 1, 7 does), far beyond the cache (sees everything), an empty sequence, ...
    positions = torch.tensor([2, 3, 6, 7, 50, 1000, 9, 200])
    q = torch.randn(len(query_seq), h, 128)
    w = torch.randn(len(query_seq), h)
    block_table = cache.block_table(seqs, width=3)
    entry_counts = cache.entry_counts(seqs)
    pos = positions if use_positions else None
    got = index_scores(q, w, PagedBatch.build(cache.pool, fmt, block_table, entry_counts, query_seq, pos, ratio))
    want = torch.tensor(naive_batch_scores(q, w, keys_by_seq, query_seq, pos, ratio))
    assert got.shape == (8, 70) and got.dtype == torch.float32
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "the -inf mask must match exactly"
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-4, atol=1e-3)
    if use_positions and ratio == 4:
        assert bool(torch.isinf(got[0]).all())  # position 2: no complete entry yet
        assert torch.isfinite(got[1]).tolist()[:2] == [True, False]
        assert torch.isfinite(got[3]).tolist()[:3] == [True, True, False]
    assert bool(torch.isinf(got[4]).all())  # empty sequence


def test_index_scores_dense_matches_naive_and_checks_input():
    q, w, keys = torch.randn(5, 2, 128), torch.rand(5, 2), torch.randn(9, 128)
    positions = torch.tensor([0, 3, 4, 11, 40])
    got = index_scores_dense(q, w, keys, positions, ratio=4)
    want = torch.tensor(naive_batch_scores(q, w, [keys.tolist()], torch.zeros(5, dtype=torch.long), positions, 4))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    assert torch.allclose(got[finite], want[finite], rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="weights"):
        index_scores_dense(q, torch.rand(5, 3), keys)
    with pytest.raises(ValueError, match="query_positions"):
        index_scores_dense(q, w, keys, torch.arange(4), ratio=4)


def test_index_scores_rejects_bad_batches():
    fmt = KeyFormat.BF16
    cache, seqs, _ = build_batch(fmt, [10])
    q, w = torch.randn(2, 2, 128), torch.rand(2, 2)
    table, counts = cache.block_table(seqs), cache.entry_counts(seqs)
    build = PagedBatch.build
    with pytest.raises(ValueError, match="query_seq values"):
        build(cache.pool, fmt, table, counts, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="entry_counts"):
        build(cache.pool, fmt, table, torch.tensor([65]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="16384"):
        build(cache.pool, KeyFormat.FP8, table, counts, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="ratio"):
        build(cache.pool, fmt, table, counts, torch.tensor([0, 0]), torch.tensor([1, 2]), ratio=0)
    with pytest.raises(ValueError, match="query_positions"):
        build(cache.pool, fmt, table, counts, torch.tensor([0, 0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="max_entries"):
        build(cache.pool, fmt, table, counts, torch.tensor([0, 0]), validate=False)
    batch = build(cache.pool, fmt, table, counts, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="q has 3 rows but the batch has 2"):
        index_scores(torch.randn(3, 2, 128), torch.rand(3, 2), batch)
    with pytest.raises(ValueError, match="PagedBatch"):
        index_scores(q, w, cache.pool)
    # a validated batch knows its shape on the host: widest sequence, queries per sequence, row order
    assert (batch.max_entries, batch.num_queries, batch.query_lens, batch.rows_sorted) == (10, 2, (2,), True)
    assert batch.next_n == 2 and batch.block_table.dtype == torch.int32 and batch.query_seq.dtype == torch.int32


# --------------------------------------------------------------------------------------------------
# select_topk / index_topk / topk_to_slots
# --------------------------------------------------------------------------------------------------


def naive_select(row: list[float], k: int) -> list[int]:
    """Candidates = NaN or > -inf. Order: NaN first (by index), then by score descending, ties by index."""
    cands = [j for j, s in enumerate(row) if math.isnan(s) or s > NEG_INF]
    cands.sort(key=lambda j: (0, 0.0, j) if math.isnan(row[j]) else (1, -row[j], j))
    chosen = cands[:k]
    return chosen + [-1] * (k - len(chosen))


SCORE_VALUES = st.sampled_from([NEG_INF, float("nan"), float("inf"), -2.0, -0.5, 0.0, 0.5, 1.0, 3.0])


@given(rows=st.lists(st.lists(SCORE_VALUES, min_size=6, max_size=6), min_size=1, max_size=4),
       k=st.integers(1, 9))
def test_select_topk_rules_vs_naive(rows, k):
    scores = torch.tensor(rows, dtype=torch.float32)
    got = select_topk(scores, k)
    assert got.dtype == torch.int32 and got.shape == (len(rows), k)
    assert got.tolist() == [naive_select(r, k) for r in rows]


def test_select_topk_literal_cases():
    s = torch.tensor([[1.0, 5.0, 5.0, NEG_INF, 2.0],
                      [NEG_INF] * 5,
                      [0.0, float("nan"), float("inf"), 0.0, -1.0]])
    assert select_topk(s, 3).tolist() == [[1, 2, 4], [-1, -1, -1], [1, 2, 0]]
    # k larger than the visible entries and larger than N: -1 padding
    assert select_topk(s, 7).tolist()[0] == [1, 2, 4, 0, -1, -1, -1]
    assert select_topk(torch.zeros(2, 0), 3).tolist() == [[-1] * 3] * 2
    with pytest.raises(ValueError, match="0"):
        select_topk(s, 0)


def assert_topk_sets_equal_up_to_ties(got: torch.Tensor, scores: torch.Tensor, k: int, eps: float):
    """Same selected set, except entries whose score is within eps of the k-th best; -1 count must match."""
    for t in range(scores.shape[0]):
        row = scores[t]
        valid = torch.isfinite(row)
        n_valid = int(valid.sum())
        chosen = [j for j in got[t].tolist() if j >= 0]
        assert len(chosen) == min(k, n_valid) and len(set(chosen)) == len(chosen)
        if not chosen:
            continue
        kth = torch.sort(row[valid], descending=True).values[len(chosen) - 1]
        for j in chosen:
            assert bool(row[j] >= kth - eps), f"row {t}: entry {j} ({float(row[j])}) below k-th score {float(kth)}"
        strictly_better = torch.nonzero(valid & (row > kth + eps)).flatten().tolist()
        assert set(strictly_better) <= set(chosen)


@pytest.mark.parametrize("fmt_name", ["bf16", "fp4"])
def test_index_topk_vs_naive(fmt_name):
    fmt = KeyFormat.parse(fmt_name)
    cache, seqs, keys_by_seq = build_batch(fmt, [70, 6], seed=3)
    query_seq = torch.tensor([0, 0, 0, 1, 1])
    positions = torch.tensor([1, 30, 400, 11, 23])
    q, w = torch.randn(5, 2, 128), torch.rand(5, 2)
    k = 8
    got = index_topk(q, w, PagedBatch.build(cache.pool, fmt, cache.block_table(seqs), cache.entry_counts(seqs),
                                            query_seq, positions, 4), k)
    naive = torch.tensor(naive_batch_scores(q, w, keys_by_seq, query_seq, positions, 4))
    assert got.shape == (5, 8) and got.dtype == torch.int32
    assert got[0].tolist() == [-1] * 8          # position 1: nothing visible
    assert sum(1 for j in got[1].tolist() if j >= 0) == 7   # position 30: entries 0..6
    assert sum(1 for j in got[3].tolist() if j >= 0) == 3   # position 11: entries 0..2
    assert_topk_sets_equal_up_to_ties(got, naive, k, eps=1e-3)


def test_topk_to_slots_vs_naive():
    block_table = torch.tensor([[5, 2, -1], [0, 3, 4]], dtype=torch.int32)
    indices = torch.tensor([[0, 63, 64, -1], [130, 1, -1, 65]], dtype=torch.int32)
    query_seq = torch.tensor([0, 1])
    want = [[block_table[int(query_seq[t]), i // 64].item() * 64 + i % 64 if i >= 0 else -1
             for i in indices[t].tolist()] for t in range(2)]
    assert want == [[320, 383, 128, -1], [258, 1, -1, 193]]
    assert topk_to_slots(indices, block_table, query_seq).tolist() == want


# --------------------------------------------------------------------------------------------------
# compress
# --------------------------------------------------------------------------------------------------


def naive_compress(x, wkv, wgate, ape, ratio) -> torch.Tensor:
    """Loop formulation of the V4 compressor: per entry j, per feature f, softmax over the window rows."""
    s_len, hidden = x.shape
    cd = wkv.shape[0]
    overlap = ratio == 4
    d = cd // 2 if overlap else cd

    def proj(w, s, f):
        return sum(float(w[f, i]) * float(x[s, i]) for i in range(hidden))

    out = []
    for j in range(s_len // ratio):
        entry = []
        for f in range(d):
            rows = []  # (gate, kv)
            if overlap and j > 0:  # previous block, first half of the features (Ca)
                for s in range(ratio * (j - 1), ratio * j):
                    rows.append((proj(wgate, s, f) + float(ape[s % ratio, f]), proj(wkv, s, f)))
            own = d + f if overlap else f  # own block: second half (Cb) with overlap, all features without
            for s in range(ratio * j, ratio * (j + 1)):
                rows.append((proj(wgate, s, own) + float(ape[s % ratio, own]), proj(wkv, s, own)))
            top = max(g for g, _ in rows)
            weights = [math.exp(g - top) for g, _ in rows]
            entry.append(sum(wt * v for wt, (_, v) in zip(weights, rows)) / sum(weights))
        out.append(entry)
    return torch.tensor(out, dtype=torch.float64).reshape(len(out), d)


@pytest.mark.parametrize("ratio,seq_len,d", [(4, 23, 5), (128, 300, 2), (2, 9, 3)])
def test_compress_vs_loop_formulation(ratio, seq_len, d):
    hidden = 6
    c = 2 if ratio == 4 else 1
    x = torch.randn(seq_len, hidden)
    wkv, wgate = torch.randn(c * d, hidden), torch.randn(c * d, hidden)
    ape = torch.randn(ratio, c * d)
    got = compress(x, wkv, wgate, ape, ratio)
    assert got.shape == (seq_len // ratio, d)  # incomplete trailing block: no entry
    assert torch.allclose(got.double(), naive_compress(x, wkv, wgate, ape, ratio), atol=1e-5, rtol=1e-5)
    # compress = compress_projected of the projections
    assert torch.allclose(compress_projected(x @ wkv.T, x @ wgate.T, ape, ratio), got, atol=1e-6)


def test_compress_first_entry_ignores_previous_block_and_checks_shapes():
    # ratio 4, entry 0 has no previous block: it depends only on tokens 0..3
    x = torch.randn(8, 4)
    wkv, wgate, ape = torch.randn(6, 4), torch.randn(6, 4), torch.randn(4, 6)
    first = compress(x, wkv, wgate, ape, 4)[0]
    x2 = x.clone()
    x2[4:] = torch.randn(4, 4)
    assert torch.equal(compress(x2, wkv, wgate, ape, 4)[0], first)
    with pytest.raises(ValueError, match="ape"):
        compress(x, wkv, wgate, torch.randn(3, 6), 4)
    with pytest.raises(ValueError, match="divisible"):
        compress_projected(torch.randn(8, 5), torch.randn(8, 5), torch.randn(4, 5), 4)
    with pytest.raises(ValueError, match="ratio"):
        compress_projected(torch.randn(8, 4), torch.randn(8, 4), torch.randn(0, 4), 0)


# --------------------------------------------------------------------------------------------------
# sparse attention
# --------------------------------------------------------------------------------------------------


def naive_sparse_attention(q, kv, indices, sink, scale):
    t_len, hq, dh = q.shape
    out = torch.zeros(t_len, hq, dh, dtype=torch.float64)
    lse = torch.full((t_len, hq), NEG_INF, dtype=torch.float64)
    for t in range(t_len):
        idx = [i for i in indices[t].tolist() if i >= 0]
        for h in range(hq):
            logits = [scale * sum(float(a) * float(b) for a, b in zip(q[t, h], kv[i])) for i in idx]
            if not logits:
                continue  # empty row: out 0, lse -inf (the sink alone gets all the mass)
            m = max(logits)
            exps = [math.exp(v - m) for v in logits]
            lse[t, h] = m + math.log(sum(exps))
            denom = sum(exps) + (math.exp(float(sink[h]) - m) if sink is not None else 0.0)
            for p, i in zip(exps, idx):
                out[t, h] += (p / denom) * kv[i].double()
    return out, lse


@pytest.mark.parametrize("with_sink", [True, False])
def test_sparse_attention_vs_naive(with_sink):
    t_len, hq, dh, n = 4, 3, 16, 10
    q, kv = torch.randn(t_len, hq, dh), torch.randn(n, dh)
    indices = torch.tensor([[0, 5, 9, -1], [-1, -1, -1, -1], [3, 3, 1, 2], [7, -1, 0, 8]])  # empty row, duplicate
    sink = torch.randn(hq) if with_sink else None
    out, lse = sparse_attention_dense(q, kv, indices, sink, softmax_scale=0.3)
    want_out, want_lse = naive_sparse_attention(q, kv, indices, sink, 0.3)
    assert torch.allclose(out.double(), want_out, atol=1e-5)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.allclose(lse[~torch.isinf(lse)].double(), want_lse[~torch.isinf(want_lse)], atol=1e-5)
    assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())
    # default scale is Dh^-0.5
    out_default, _ = sparse_attention_dense(q, kv, indices, sink)
    assert torch.allclose(out_default.double(), naive_sparse_attention(q, kv, indices, sink, dh ** -0.5)[0], atol=1e-5)


def test_sparse_attention_rejects_bad_indices():
    q, kv = torch.randn(1, 1, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="index 4"):
        sparse_attention_dense(q, kv, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="index -2"):
        sparse_attention_dense(q, kv, torch.tensor([[-2, 0]]))
    with pytest.raises(ValueError, match="sink"):
        sparse_attention_dense(q, kv, torch.tensor([[0]]), sink=torch.zeros(2))


def test_window_topk_indices_vs_naive():
    positions = torch.tensor([0, 2, 9])
    topk = torch.tensor([[-1, -1], [0, -1], [1, 0]])
    window, num_raw = 4, 10
    got = window_topk_indices(positions, topk, window, num_raw)
    want = []
    for t in range(3):
        p = int(positions[t])
        raw = [s if 0 <= s < num_raw else -1 for s in range(p - window + 1, p + 1)]
        want.append(raw + [j + num_raw if j >= 0 else -1 for j in topk[t].tolist()])
    assert got.tolist() == want
    assert got.dtype == torch.int32


def test_window_topk_indices_and_sparse_attention_validate_inputs():
    """Regression: window_topk_indices had no checks (a negative window gave an empty window, an index of -5
    became the raw token num_raw - 5, T mismatches broadcast or crashed); sparse_attention crashed with a
    TypeError on an integer q."""
    pos, topk = torch.tensor([3, 7]), torch.tensor([[0, -1], [1, 0]])
    cases = [((pos.float(), topk, 4, 10), "query_positions"), ((pos, topk[:1], 4, 10), "topk_indices"),
             ((pos, topk.float(), 4, 10), "topk_indices"), ((pos, topk, -1, 10), "window"),
             ((pos, topk, 4, -3), "num_raw"), ((pos, topk, 2.5, 10), "window"),
             ((pos, torch.tensor([[0, -5], [1, 0]]), 4, 10), "-5")]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            window_topk_indices(*args)
    with pytest.raises(ValueError, match="q must be a floating"):
        sparse_attention_dense(torch.ones(1, 2, 4, dtype=torch.long), torch.randn(3, 4), torch.tensor([[0]]))
    with pytest.raises(ValueError, match="kv must be"):
        sparse_attention_dense(torch.randn(1, 2, 4), [[0.0] * 4], torch.tensor([[0]]))


# --------------------------------------------------------------------------------------------------
# dsakit.layers.DSAIndexer: the V4 indexer wired from the ops above
# --------------------------------------------------------------------------------------------------


def small_indexer(seed: int = 0):
    from dsakit.layers import DSAIndexer

    return DSAIndexer.random(hidden_size=24, q_lora_rank=12, heads=3, generator=torch.Generator().manual_seed(seed))


def test_indexer_queries_and_weights_vs_naive():
    ix = small_indexer()
    q_latent, hidden = torch.randn(5, 12), torch.randn(5, 24)
    positions = torch.tensor([0, 3, 17, 100, 4095])
    got = ix.queries(q_latent, positions)
    inv_freq = ix.rope.inv_freq().tolist()
    for t in range(5):
        for h in range(3):
            row = [sum(float(ix.wq_b[h * 128 + d, i]) * float(q_latent[t, i]) for i in range(12)) for d in range(128)]
            want = naive_hadamard(naive_rope(row, int(positions[t]), inv_freq, "interleaved-trailing"))
            assert torch.allclose(got[t, h].double(), torch.tensor(want, dtype=torch.float64), atol=1e-4)
    w = ix.weights(hidden)
    want_w = (hidden.double() @ ix.weights_proj.double().T) * 128 ** -0.5 * 3 ** -0.5
    assert torch.allclose(w.double(), want_w, atol=1e-6)
    # fp4 query simulation changes q, and only up to fp4 precision
    q4 = ix.queries(q_latent, positions, query_format="fp4-rne")
    assert not torch.equal(q4, got)
    assert float(((q4 - got).norm(dim=-1) / got.norm(dim=-1)).max()) < 0.2


def test_indexer_store_keys_appends_only_new_entries():
    ix = small_indexer(1)
    hidden = torch.randn(41, 24)
    cache = PagedCache("bf16", num_pages=1)
    seq = cache.add_sequence()
    assert ix.store_keys(hidden[:22], cache, seq, backend="reference").shape == (5,)  # 22 tokens -> 5 entries
    assert ix.store_keys(hidden, cache, seq, backend="reference").shape == (5,)       # 41 -> 10 entries, 5 new
    assert cache.length(seq) == 10
    # the first 5 entries came from a 22-token projection, so fp32 last bits may differ (bf16 flips)
    assert torch.allclose(cache.gather(seq), ix.keys(hidden), rtol=2 ** -8, atol=1e-6)
    with pytest.raises(ValueError, match="already holds 10"):
        ix.store_keys(hidden[:20], cache, seq)


def test_indexer_store_keys_failed_store_leaves_cache_unchanged():
    """Regression: a store that raised (here: unknown backend) used to keep the appended, unwritten entries."""
    ix = small_indexer(1)
    hidden = torch.randn(300, 24)  # 75 entries: two pages
    cache = PagedCache("bf16", num_pages=3)
    seq = cache.add_sequence()
    ix.store_keys(hidden[:40], cache, seq, backend="reference")  # 10 entries, one page
    pool_before = cache.pool.clone()
    with pytest.raises(ValueError, match="unknown backend"):
        ix.store_keys(hidden, cache, seq, backend="bogus")
    assert cache.length(seq) == 10 and cache.free_pages == 2
    assert torch.equal(cache.pool, pool_before)
    assert ix.store_keys(hidden, cache, seq, backend="reference").shape == (65,)


@pytest.mark.parametrize("key_format", ["bf16", "fp8", "fp4"])
def test_indexer_topk_is_select_topk_of_its_scores(key_format):
    ix = small_indexer(2)
    hidden, q_latent = torch.randn(50, 24), torch.randn(50, 12)
    got = ix.topk(hidden, q_latent, key_format=key_format, k=5, backend="reference")
    assert got.shape == (50, 5) and got.dtype == torch.int32
    # entries are visible once complete: token t sees (t + 1) // 4 of them
    assert ((got >= 0).sum(dim=1)).tolist() == [min(5, (t + 1) // 4) for t in range(50)]
    exact = ix.scores(hidden, q_latent)
    if key_format == "bf16":
        # bf16 keys: same sets as the exact scores except near-ties
        assert_topk_sets_equal_up_to_ties(got, exact, 5, eps=0.02 * float(exact[torch.isfinite(exact)].abs().max()))
    # the same sets as selecting on the scores of the decoded cache keys
    fmt = KeyFormat.parse(key_format)
    keys = fmt.dequantize(*fmt.quantize(ix.keys(hidden)))
    scores = index_scores_dense(ix.queries(q_latent, torch.arange(50)), ix.weights(hidden), keys, torch.arange(50), 4)
    assert_topk_sets_equal_up_to_ties(got, scores, 5, eps=1e-4)


def test_indexer_rejects_bad_input():
    from dsakit.layers import DSAIndexer
    ix = small_indexer()
    with pytest.raises(ValueError, match="deepseek-v3.2"):
        DSAIndexer.random(8, 8, preset="deepseek-v3.2")
    with pytest.raises(ValueError, match=r"wkv must have shape \[256, 24\]"):
        DSAIndexer(ix.wq_b, ix.weights_proj, ix.wkv[:, :23], ix.wgate, ix.ape, ix.norm_weight)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        ix.queries(torch.randn(2, 12), torch.tensor([0, -1]))
    with pytest.raises(ValueError, match=r"q_latent must be a \[rows, 12\]"):
        ix.queries(torch.randn(2, 11), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="8 rows but there are 7 queries"):
        ix.topk(torch.randn(8, 24), torch.randn(7, 12))
    with pytest.raises(ValueError, match="k must be a positive int"):
        ix.topk(torch.randn(8, 24), torch.randn(8, 12), k=0)
    with pytest.raises(ValueError, match="unknown backend"):
        ix.topk(torch.randn(8, 24), torch.randn(8, 12), backend="cuda")


def test_indexer_topk_triton_backend_matches_reference(triton_backend, device):
    """The wiring passes backend= through to store_index_keys / index_topk (interpreter: one small case)."""
    ix = small_indexer(2)
    hidden, q_latent = torch.randn(50, 24), torch.randn(50, 12)
    fast = ix.topk(hidden.to(device), q_latent.to(device), key_format="fp4", k=5, backend=triton_backend)
    ref = ix.topk(hidden, q_latent, key_format="fp4", k=5, backend="reference")
    assert [set(r) for r in fast.cpu().tolist()] == [set(r) for r in ref.tolist()]


@pytest.mark.gpu
@pytest.mark.parametrize("key_format", ["bf16", "fp8", "fp8-ue8m0", "fp4", "fp4-rne"])
def test_indexer_topk_cuda_matches_reference(key_format):
    from dsakit.layers import DSAIndexer

    ix = DSAIndexer.random(hidden_size=256, q_lora_rank=64, heads=64, generator=torch.Generator().manual_seed(5))
    hidden, q_latent = torch.randn(2048, 256), torch.randn(2048, 64)
    fast = ix.topk(hidden.cuda(), q_latent.cuda(), key_format=key_format, k=64, backend="auto")
    assert fast.is_cuda
    ref = ix.topk(hidden, q_latent, key_format=key_format, k=64, backend="reference")
    fmt = KeyFormat.parse(key_format)
    keys = fmt.dequantize(*fmt.quantize(ix.keys(hidden)))
    positions = torch.arange(2048)
    q, w = ix.queries(q_latent, positions), ix.weights(hidden)
    scores = index_scores_dense(q, w, keys, positions, 4)
    assert_topk_sets_equal_up_to_ties(ref, scores, 64, eps=1e-5 * float(scores[torch.isfinite(scores)].abs().max()))
    # the Triton scores kernel rounds fp32 queries to bf16 for the tensor-core dot (dsakit/ops/indexer/scores.py):
    # compare it with the reference run on those rounded queries, tightly
    scores_q16 = index_scores_dense(q.bfloat16().float(), w, keys, positions, 4)
    eps = 1e-4 * float(scores_q16[torch.isfinite(scores_q16)].abs().max())
    assert_topk_sets_equal_up_to_ties(fast.cpu(), scores_q16, 64, eps=eps)


def test_topk_to_slots_rejects_indices_outside_assigned_pages():
    """Regression: an index in an unassigned (-1) page mapped to a bogus negative slot (-28 here) instead of
    an error; an index beyond the table width raised a RuntimeError from gather."""
    table = torch.tensor([[3, -1]], dtype=torch.int32)
    seq = torch.tensor([0])
    with pytest.raises(ValueError, match="entry index 100 falls in an unassigned page"):
        topk_to_slots(torch.tensor([[100, 5]], dtype=torch.int32), table, seq)
    with pytest.raises(ValueError, match="entry index 130 is beyond the block table width"):
        topk_to_slots(torch.tensor([[130]], dtype=torch.int32), table, seq)
    with pytest.raises(ValueError, match="query_seq values"):
        topk_to_slots(torch.tensor([[1]], dtype=torch.int32), table, torch.tensor([1]))
    empty = torch.zeros(1, 0, dtype=torch.int32)
    assert topk_to_slots(torch.tensor([[-1, -1]], dtype=torch.int32), empty, seq).tolist() == [[-1, -1]]


def test_dense_scores_and_compress_validate_inputs():
    """Regression: index_scores_dense took a float ratio or float positions (floor-divided silently) and
    raised AttributeError for non-tensor keys; compress raised AttributeError / einsum errors."""
    q, w, keys = torch.randn(3, 2, 8), torch.rand(3, 2), torch.randn(5, 8)
    for kwargs, match in [(dict(ratio=2.5), "ratio"), (dict(ratio=0), "ratio"),
                          (dict(query_positions=torch.tensor([0.0, 1.0, 2.0])), "query_positions"),
                          (dict(query_positions=torch.tensor([0, 1])), "query_positions")]:
        with pytest.raises(ValueError, match=match):
            index_scores_dense(q, w, keys, **kwargs)
    with pytest.raises(ValueError, match="keys must be a floating"):
        index_scores_dense(q, w, keys.tolist())
    with pytest.raises(ValueError, match="keys must be a floating"):
        index_scores_dense(q, w, keys.long())
    kv = torch.randn(8, 16)
    with pytest.raises(ValueError, match="gate must be a floating"):
        compress_projected(kv, kv.long(), torch.zeros(4, 16), 4)
    with pytest.raises(ValueError, match="ratio"):
        compress_projected(kv, kv, torch.zeros(1, 16), True)
    with pytest.raises(ValueError, match="wkv must be a floating"):
        compress(torch.randn(8, 4), None, torch.randn(16, 4), torch.zeros(4, 16), 4)


def test_explicit_triton_backend_on_cpu_without_interpreter_is_refused(monkeypatch):
    """Regression: backend='triton' on CPU tensors without TRITON_INTERPRET=1 crashed inside Triton's launcher
    ("0 active drivers") after validation; it is now a ValueError naming the device, and the pool is untouched."""
    from dsakit.ops._backend import resolve_backend
    from dsakit.ops.store import store_index_keys as public_store_index_keys

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.zeros(2)
    assert resolve_backend("auto", cpu) == "reference"
    assert resolve_backend("reference", cpu) == "reference"
    if not torch.cuda.is_available():
        pytest.importorskip("triton")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1 .* cpu"):
            resolve_backend("triton", cpu)
        pool = torch.zeros(1, KeyFormat.FP8.page_bytes, dtype=torch.uint8)
        with pytest.raises(ValueError, match="TRITON_INTERPRET"):
            public_store_index_keys(torch.randn(2, 128), torch.tensor([0, 1]), torch.tensor([0, 1]), pool, "fp8",
                                    RopeConfig().cos_sin_table(4), torch.ones(128), backend="triton")
        assert not pool.any()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("triton", cpu) == "triton"
