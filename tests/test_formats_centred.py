"""Page-centred key formats (fp8-centred, fp4-centred): page layout byte for byte, the centre rule, bulk
store = one-at-a-time appends, scores q . r + q . c, and the recall they buy on keys with a shared part.

The centre bytes are computed here independently of torch (fp32 bits -> bf16 with round-to-nearest-even in
integer arithmetic); the residual codes are the plain format's codec, whose bytes tests/test_formats.py and
tests/test_formats_engine_bytes.py pin down.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import struct

import pytest
import torch

from dsakit import PagedBatch
from dsakit.cache import PagedCache
from dsakit.formats import CENTRED_KEY_FORMATS, KeyFormat, centre_of, decode_centres, is_centred
from dsakit.ops import indexer as indexer_ops
from dsakit.ops import store as store_ops
from dsakit.ops.store import StoreConfig
from dsakit.ops.indexer.reference import index_scores_dense
from dsakit.presets import KeyTransform, get_preset

CENTRED = sorted(CENTRED_KEY_FORMATS)
TRITON_OK = importlib.util.find_spec("triton") is not None and (
    os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available())
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def bf16_bits(value: float) -> int:
    """fp32 value -> bf16 bit pattern, round to nearest even on the fp32 bits (finite inputs)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def independent_centre(row: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """(256 little-endian bytes, fp32 [128] values) of a row's centre, without torch's casts."""
    raw, values = [], []
    for v in row.tolist():
        b = bf16_bits(v)
        if (b & 0x7F80) == 0x7F80:  # Inf / NaN after rounding: the centre keeps 0 there
            b = 0
        raw += [b & 0xFF, b >> 8]
        values.append(bf16_value(b))
    return raw, torch.tensor(values, dtype=torch.float32)


def shared_keys(n: int, ratio: float, seed: int = 0) -> torch.Tensor:
    """Keys mu + z with |mu| / |z| = ratio (the recall lab's model of pooled keys)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(128, generator=g)
    z = torch.randn(n, 128, generator=g)
    return mu * ratio * z.norm(dim=1).mean() / mu.norm() + z


# --------------------------------------------------------------------------------------------------
# Sizes and layout
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name,value_bytes,page_bytes,per_entry,centre_offset", [
    ("fp8-centred", 128, 8704, 136, 8448), ("fp4-centred", 64, 4608, 72, 4352)])
def test_sizes(name, value_bytes, page_bytes, per_entry, centre_offset):
    fmt = KeyFormat.parse(name)
    assert is_centred(fmt) and isinstance(fmt, KeyFormat) and KeyFormat.parse(name.upper()) is fmt
    assert (fmt.value_bytes, fmt.scale_bytes, fmt.page_bytes) == (value_bytes, 4, page_bytes)
    assert fmt.bytes_per_entry == per_entry and fmt.page_bytes == 64 * per_entry
    assert fmt.centre_offset_in_page == centre_offset and fmt.scale_offset_in_page == 64 * value_bytes
    assert not is_centred(KeyFormat.FP8) and not is_centred(KeyFormat.parse(fmt.kind))


@pytest.mark.parametrize("name", CENTRED)
def test_page_bytes_literal_layout(name):
    """Two pages written by quantize_pages: [64 residual values][64 scales][bf16 centre of entry 0]."""
    fmt = KeyFormat.parse(name)
    plain = KeyFormat.parse(fmt.kind)
    x = shared_keys(128, 30.0, seed=1)
    x[64, :3] = torch.tensor([float("nan"), float("inf"), 3.5e38])  # entry 0 of page 1: non-finite centre parts
    pages = fmt.quantize_pages(x)
    v, s = fmt.value_bytes, fmt.scale_bytes
    for p in range(2):
        raw, centre = independent_centre(x[64 * p])
        if p == 1:
            assert raw[:6] == [0, 0, 0, 0, 0, 0]  # NaN, Inf and a value beyond bf16's range: 0 in the centre
        values, scales = plain.quantize(x[64 * p: 64 * p + 64] - centre)
        assert pages[p, : 64 * v].tolist() == values.reshape(-1).tolist()
        assert pages[p, 64 * v: 64 * (v + s)].tolist() == scales.reshape(-1).tolist()
        assert pages[p, 64 * (v + s):].tolist() == raw
    assert torch.equal(centre_of(x[::64])[0], pages[:, fmt.centre_offset_in_page:])
    assert torch.equal(decode_centres(pages[:, fmt.centre_offset_in_page:]), fmt.page_centres(pages))


@pytest.mark.parametrize("name", CENTRED)
def test_round_trip_is_centre_plus_residual(name):
    fmt = KeyFormat.parse(name)
    x = shared_keys(64, 50.0, seed=2)
    pages = fmt.quantize_pages(x)
    centre = fmt.page_centres(pages)
    values, scales = fmt.split_pages(pages)
    residual = KeyFormat.parse(fmt.kind).dequantize(values, scales)
    assert torch.equal(fmt.dequantize_pages(pages), centre + residual)
    assert torch.equal(fmt.dequantize_residual(values, scales), residual)
    # entry 0 is its own centre up to bf16 rounding, so its residual (and error) is tiny
    err = (fmt.dequantize_pages(pages) - x).abs()
    assert float(err[0].max()) < 1e-3 * float(x[0].abs().max())


def test_centred_error_is_set_by_the_spread_not_the_shared_part():
    """With |mu| / |z| = 100 the plain formats' error scales with |mu|; the centred ones' with |z|."""
    x = shared_keys(256, 100.0, seed=3)
    spread = float((x - x.mean(dim=0)).norm(dim=1).mean())
    for name in CENTRED:
        fmt = KeyFormat.parse(name)
        plain = KeyFormat.parse(fmt.kind)
        err_c = float((fmt.dequantize_pages(fmt.quantize_pages(x)) - x).norm(dim=1).mean())
        err_p = float((plain.dequantize(*plain.quantize(x)) - x).norm(dim=1).mean())
        assert err_c < err_p / 20, (name, err_c, err_p)
        assert err_c < 0.5 * spread, (name, err_c, spread)


def test_codec_needs_centres():
    fmt = KeyFormat.FP8_CENTRED
    x = torch.randn(3, 128)
    with pytest.raises(ValueError, match="needs centres"):
        fmt.quantize(x)
    with pytest.raises(ValueError, match="needs centres"):
        fmt.quantize(x, torch.zeros(2, 128))
    values, scales = fmt.quantize(x, torch.zeros(3, 128))
    with pytest.raises(ValueError, match="needs centres"):
        fmt.dequantize(values, scales)
    with pytest.raises(ValueError, match="centre bytes"):
        decode_centres(torch.zeros(3, 255, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 64"):
        fmt.quantize_pages(torch.zeros(65, 128))


# --------------------------------------------------------------------------------------------------
# The centre rule through the store op (reference)
# --------------------------------------------------------------------------------------------------


def _store(fmt, pool, keys, slots, positions, table, transform):
    store_ops.store_index_keys(keys, positions, slots, pool, fmt, table, torch.ones(128), None, transform,
                               backend="reference")


@pytest.fixture(scope="module")
def v4():
    preset = get_preset("deepseek-v4-flash")
    return preset.rope.cos_sin_table(512), preset.key_transform


@pytest.mark.parametrize("name", CENTRED)
def test_bulk_store_equals_one_at_a_time_appends(name, v4):
    """Two interleaved sequences, pages out of order: a bulk store, chunked stores and one-entry appends (with
    padding rows) write the same pool, byte for byte; the bytes are the quantize_pages rule on the
    transformed keys.

    Without the Hadamard rotation: the reference rotates with a matmul, whose fp32 summation order may
    depend on the number of rows, so its transformed keys (for every format, centred or not) can differ in
    the last bit between a bulk store and appends. The centre rule adds no such dependence (PagedCache.write
    of transformed keys below, and the Triton store, whose rotation is a per-row butterfly)."""
    table, transform = v4
    transform = dataclasses.replace(transform, hadamard=False)
    fmt = KeyFormat.parse(name)
    n = 150
    keys = shared_keys(2 * n, 40.0, seed=4) * 0.3
    positions = torch.arange(n)

    def new_cache():
        cache = PagedCache(fmt, 8)
        a, b = cache.add_sequence(), cache.add_sequence()
        sa, sb = cache.append(a, 64), cache.append(b, 64)  # pages interleave: a0 b0 a1 b1 ...
        sa = torch.cat([sa, cache.append(a, n - 64)])
        sb = torch.cat([sb, cache.append(b, n - 64)])
        return cache, sa, sb

    bulk, sa, sb = new_cache()
    _store(fmt, bulk.pool, keys, torch.cat([sa, sb]), torch.cat([positions, positions]), table, transform)
    chunked, _, _ = new_cache()
    for lo, hi in ((0, 10), (10, 64), (64, 65), (65, 150)):
        _store(fmt, chunked.pool, keys[n + lo: n + hi], sb[lo:hi], positions[lo:hi], table, transform)
        _store(fmt, chunked.pool, keys[lo:hi], sa[lo:hi], positions[lo:hi], table, transform)
    appended, _, _ = new_cache()
    for i in range(n):
        rows = torch.stack([keys[i], keys[n + i], keys[0]])
        slots = torch.stack([sa[i], sb[i], torch.tensor(-1)])  # a padding row is skipped
        _store(fmt, appended.pool, rows, slots, torch.stack([positions[i]] * 3), table, transform)
    assert torch.equal(bulk.pool, chunked.pool) and torch.equal(bulk.pool, appended.pool)

    x = store_ops.prepare_index_keys(keys[:n], positions, table, torch.ones(128), None, transform)
    full = fmt.quantize_pages(torch.cat([x, torch.zeros(192 - n, 128)]))  # the last page is partly filled
    pages = bulk.block_table([0])[0, :3].long()
    assert torch.equal(bulk.pool[pages[:2]], full[:2])
    used = 64 - (192 - n)
    last = bulk.pool[pages[2]]
    assert torch.equal(last[: used * fmt.value_bytes], full[2, : used * fmt.value_bytes])
    assert torch.equal(last[fmt.centre_offset_in_page:], full[2, fmt.centre_offset_in_page:])


@pytest.mark.parametrize("name", CENTRED)
def test_centre_is_never_rewritten_by_later_entries(name, v4):
    table, transform = v4
    fmt = KeyFormat.parse(name)
    pool = torch.zeros(1, fmt.page_bytes, dtype=torch.uint8)
    keys = shared_keys(64, 20.0, seed=5)
    _store(fmt, pool, keys[:1], torch.tensor([0]), torch.tensor([0]), table, transform)
    centre = pool[0, fmt.centre_offset_in_page:].clone()
    assert centre.any()
    entry0 = pool[0, : fmt.value_bytes].clone()
    for i in range(1, 64):
        _store(fmt, pool, keys[i:i + 1], torch.tensor([i]), torch.tensor([i]), table, transform)
        assert torch.equal(pool[0, fmt.centre_offset_in_page:], centre)
    assert torch.equal(pool[0, : fmt.value_bytes], entry0)
    # PagedCache.write (already transformed keys) follows the same rule, one entry at a time or in bulk
    cache = PagedCache(fmt, 1)
    seq = cache.add_sequence()
    cache.write(cache.append(seq, 1), keys[:1])
    cache.write(cache.append(seq, 40), keys[1:41])
    for i in range(41, 64):
        cache.write(cache.append(seq, 1), keys[i:i + 1])
    assert torch.equal(cache.pool, fmt.quantize_pages(keys))


def test_store_validates_before_writing(v4):
    table, transform = v4
    fmt = KeyFormat.FP8_CENTRED
    pool = torch.zeros(1, fmt.page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="duplicate"):
        _store(fmt, pool, torch.randn(2, 128), torch.tensor([0, 0]), torch.tensor([0, 1]), table, transform)
    with pytest.raises(ValueError, match="out of range"):
        _store(fmt, pool, torch.randn(2, 128), torch.tensor([0, 64]), torch.tensor([0, 1]), table, transform)
    assert not pool.any()
    with pytest.raises(ValueError, match="8704"):
        _store(fmt, torch.zeros(1, 8448, dtype=torch.uint8), torch.randn(1, 128), torch.tensor([0]),
               torch.tensor([0]), table, transform)


def test_non_finite_entry_zero_keeps_the_page_finite():
    fmt = KeyFormat.FP8_CENTRED
    x = shared_keys(64, 30.0, seed=6)
    x[0, 5], x[0, 6] = float("nan"), float("-inf")
    out = fmt.dequantize_pages(fmt.quantize_pages(x))
    assert bool(torch.isfinite(out[1:]).all())
    # the other entries carry those dims in their residual: errors of fp8 at their own residual scale
    assert float((out[1:] - x[1:]).abs().max()) < 0.05 * float(x[1:].abs().max())


# --------------------------------------------------------------------------------------------------
# Scores and top-k (reference): q . k = q . r + q . c
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CENTRED)
def test_scores_add_q_dot_centre_before_the_relu(name):
    fmt = KeyFormat.parse(name)
    g = torch.Generator().manual_seed(7)
    keys = shared_keys(3 * 64, 30.0, seed=7)
    cache = PagedCache(fmt, 4)
    seq = cache.add_sequence()
    cache.write(cache.append(seq, 150), keys[:150])
    q = torch.randn(5, 4, 128, generator=g)
    w = torch.rand(5, 4, generator=g)
    positions = torch.tensor([10, 63, 64, 100, 149])
    causal = cache.batch([seq], query_lens=[5], query_positions=positions)
    everything = cache.batch([seq], query_lens=[5])
    prefill = indexer_ops.index_scores(q, w, causal, backend="reference")
    decode = indexer_ops.index_scores(q, w, everything, backend="reference")

    # by hand: residuals and centres from the page bytes
    pages = cache.pool[cache.block_table([seq])[0].long()]
    values, scales = fmt.split_pages(pages)
    residual = KeyFormat.parse(fmt.kind).dequantize(values, scales)[:150]
    centre = fmt.page_centres(pages)
    logits = torch.einsum("thd,nd->thn", q, residual) + torch.einsum("thd,pd->thp", q, centre)[:, :, torch.arange(150) // 64]
    expected = (logits.relu() * w[:, :, None]).sum(dim=1)
    assert torch.allclose(decode, expected, rtol=1e-5, atol=1e-4)
    visible = torch.arange(150)[None, :] < (positions + 1)[:, None]
    assert torch.equal(torch.isinf(prefill), ~visible)
    assert torch.allclose(prefill[visible], expected[visible], rtol=1e-5, atol=1e-4)
    # and the dense scores of the dequantized keys agree up to fp32 rounding
    assert torch.allclose(decode, index_scores_dense(q, w, cache.gather(seq)), rtol=1e-4, atol=1e-3)
    for k in (1, 16, 200):
        top = indexer_ops.index_topk(q, w, causal, k, backend="reference")
        assert torch.equal(top, indexer_ops.select_topk(prefill, k, backend="reference"))


def test_centred_keeps_a_needle_that_fp8_loses():
    """|mu| / |z| = 100, 4096 entries, a needle 4 spreads above the rest along the query: fp8 scores bury
    it (rank in the hundreds), fp8-centred keeps it at rank 0 like the exact scores."""
    g = torch.Generator().manual_seed(8)
    n = 4096
    keys = shared_keys(n, 100.0, seed=8)
    mu = keys.mean(dim=0)
    u = torch.randn(128, generator=g)
    u -= (u @ mu) / (mu @ mu) * mu
    u /= u.norm()
    needle = 1234
    keys[needle] += 4.0 * u  # the individual part has ~1 per dim along any unit direction
    q = (u + 0.02 * mu / mu.norm()).reshape(1, 1, 128)
    w = torch.ones(1, 1)
    ranks = {}
    for name in ("fp8", "fp8-centred", "bf16"):
        fmt = KeyFormat.parse(name)
        cache = PagedCache(fmt, n // 64)
        seq = cache.add_sequence()
        cache.write(cache.append(seq, n), keys)
        s = indexer_ops.index_scores(q, w, cache.batch([seq]), backend="reference")[0]
        ranks[name] = int((s > s[needle]).sum())
    assert ranks["bf16"] == 0 and ranks["fp8-centred"] == 0, ranks
    assert ranks["fp8"] > 50, ranks


@pytest.mark.skipif(not TRITON_OK, reason="Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
@pytest.mark.parametrize("name", CENTRED)
def test_triton_store_matches_reference_bulk_and_appends(name):
    """Inputs whose pipeline is exact in fp32 (rows of +-1 under RMSNorm with eps 0, rope at position 0, no
    Hadamard: the transformed row is +-weight): the two-launch Triton store writes the reference's bytes,
    centres included, in one bulk call and in appends that start, fill and cross pages."""
    fmt = KeyFormat.parse(name)
    g = torch.Generator().manual_seed(9)
    n = 70
    keys = torch.where(torch.rand(n, 128, generator=g) < 0.1, -1.0, 1.0)
    weight = torch.randn(128, generator=g) * 3
    table = get_preset("deepseek-v4-flash").rope.cos_sin_table(4)
    transform = KeyTransform(hadamard=False, eps=0.0)
    slots = torch.cat([torch.arange(128, 192), torch.arange(64, 70)])  # pages 2 then 1
    positions = torch.zeros(n, dtype=torch.long)
    ref = torch.zeros(3, fmt.page_bytes, dtype=torch.uint8)
    store_ops.store_index_keys(keys, positions, slots, ref, fmt, table, weight, None, transform, backend="reference")
    dev = lambda t: t.to(DEVICE)  # noqa: E731
    bulk = torch.zeros(3, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    store_ops.store_index_keys(dev(keys), dev(positions), dev(slots), bulk, fmt, dev(table), dev(weight), None,
                               transform, backend="triton")
    appended = torch.zeros(3, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    for lo, hi in ((0, 1), (1, 66), (66, 70)):
        store_ops.store_index_keys(dev(keys[lo:hi]), dev(positions[lo:hi]), dev(slots[lo:hi]), appended, fmt,
                                   dev(table), dev(weight), None, transform, backend="triton")
    assert torch.equal(bulk.cpu(), ref) and torch.equal(appended.cpu(), ref)
    assert ref[2, fmt.centre_offset_in_page:].any()


class _LaunchCounter:
    """Stands in for a Triton kernel object: counts the launches (``kernel[grid](...)``), then runs them."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _store_calls(fmt, pool, calls, transform, table, weight, launcher=False, config=None):
    """Run the Triton store (the public op, or the launcher without any check, with ``config``) for each
    (keys, positions, slots)."""
    from dsakit.ops.store.triton import launch_store_index_keys

    dev = lambda t: t.to(DEVICE)  # noqa: E731
    for keys, positions, slots in calls:
        if launcher:
            pairing, placement = transform.rope_layout.name.rsplit("-", 1)
            launch_store_index_keys(dev(keys), dev(positions), dev(slots), pool, dev(table), dev(weight), None, fmt,
                                    transform.norm, pairing, placement, transform.hadamard, transform.eps,
                                    config=config)
        else:
            store_ops.store_index_keys(dev(keys), dev(positions), dev(slots), pool, fmt, dev(table), dev(weight),
                                       None, transform, backend="triton")


@pytest.mark.skipif(not TRITON_OK, reason="Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
@pytest.mark.parametrize("name", CENTRED)
@pytest.mark.parametrize("rope_dim", [64, 32], ids=["fast-kernel", "generic-kernel"])
def test_triton_store_one_launch_decode_appends_equal_bulk(name, rope_dim, monkeypatch):
    """Random keys, Hadamard on: three sequences (one resuming mid-page) stored token by token, all three
    sequences in each call as a decode step does, take one launch per call, and write the bytes of one bulk
    store, of chunked stores and of the reference's centres (the centres are bf16 of the same fp32 rows)."""
    from dsakit.ops.store import triton as store_triton

    fmt = KeyFormat.parse(name)
    g = torch.Generator().manual_seed(30 + rope_dim)
    table = get_preset("deepseek-v4-flash").rope.cos_sin_table(160)[:, :rope_dim].contiguous() if rope_dim == 64 \
        else torch.cat([torch.cos(torch.outer(torch.arange(160.0), torch.rand(16, generator=g))),
                        torch.sin(torch.outer(torch.arange(160.0), torch.rand(16, generator=g)))], dim=1)
    transform = KeyTransform(rope_dim=rope_dim, hadamard=True)
    weight = torch.rand(128, generator=g) + 0.5
    lengths, start = [70, 40, 66], [0, 0, 10]  # sequence 2 resumes at entry 10 of its first page
    keys = [shared_keys(n, 20.0, seed=40 + i) * 3 for i, n in enumerate(lengths)]
    pages = [[4, 1], [0], [3, 5]]  # pages out of order
    slots = [torch.tensor([pages[i][(start[i] + j) // 64] * 64 + (start[i] + j) % 64 for j in range(n)])
             for i, n in enumerate(lengths)]
    positions = [torch.arange(n) + start[i] for i, n in enumerate(lengths)]
    # sequence 2's first 10 entries, stored beforehand (entry 0 of page 3 included)
    head = (shared_keys(10, 20.0, seed=49), torch.arange(10), torch.arange(3 * 64, 3 * 64 + 10))

    def fresh():
        pool = torch.zeros(6, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
        _store_calls(fmt, pool, [head], transform, table, weight)
        return pool

    bulk = fresh()
    _store_calls(fmt, bulk, [(torch.cat(keys), torch.cat(positions), torch.cat(slots))], transform, table, weight)
    two_launches = fresh()  # the other launch setting: the pages' centres first, then the entries
    _store_calls(fmt, two_launches, [(torch.cat(keys), torch.cat(positions), torch.cat(slots))], transform, table,
                 weight, launcher=True, config=StoreConfig(page_term_two_launches_from=1))
    assert torch.equal(bulk.cpu(), two_launches.cpu())
    chunked = fresh()
    for i in range(3):
        for lo, hi in ((0, 1), (1, 30), (30, lengths[i])):
            _store_calls(fmt, chunked, [(keys[i][lo:hi], positions[i][lo:hi], slots[i][lo:hi])], transform, table,
                         weight)
    assert torch.equal(chunked.cpu(), bulk.cpu())
    appended = fresh()
    counter = _LaunchCounter(store_triton._store_index_keys_kernel if rope_dim == 64
                             else store_triton._store_index_keys_generic_kernel)
    monkeypatch.setattr(store_triton, "_store_index_keys_kernel" if rope_dim == 64
                        else "_store_index_keys_generic_kernel", counter)
    steps = max(lengths)
    for t in range(steps):
        live = [i for i in range(3) if t < lengths[i]]
        pad = torch.tensor([-1])  # a padding row, as a decode batch with a finished sequence has
        _store_calls(fmt, appended, [(torch.stack([keys[i][t] for i in live] + [keys[0][0]]),
                                      torch.stack([positions[i][t] for i in live] + [positions[0][0]]),
                                      torch.cat([slots[i][t:t + 1] for i in live] + [pad]))], transform, table,
                     weight)
    assert counter.launches == steps, "a decode step of a centred format must be one launch"
    assert torch.equal(bulk.cpu(), chunked.cpu()) and torch.equal(bulk.cpu(), appended.cpu())
    # the centres are those of entry 0's transformed key
    x = store_ops.prepare_index_keys(keys[0], positions[0], table, weight, None, transform)
    for p, first in ((4, 0), (1, 64)):
        assert torch.equal(bulk[p, fmt.centre_offset_in_page:].cpu(), centre_of(x[first:first + 1])[0][0])


@pytest.mark.skipif(not TRITON_OK, reason="Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
@pytest.mark.parametrize("name", CENTRED)
def test_entries_before_their_page_entry_zero_are_refused(name, v4):
    """Issue 24: a page whose entry 0 was never stored has no centre. Storing its other entries is a ValueError
    before anything is written (reference and Triton store, PagedCache.write); the store op also refuses a
    page's rows out of order in one call (its kernel takes the centre from entry 0's row); the launcher, which
    checks nothing (CUDA-graph capture), drops such rows instead of coding them against a zero centre."""
    table, transform = v4
    fmt = KeyFormat.parse(name)
    keys = shared_keys(8, 20.0, seed=7)
    for backend in ("reference", "triton"):
        pool = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8, device=DEVICE if backend == "triton" else "cpu")
        dev = lambda t: t.to(pool.device)  # noqa: E731
        with pytest.raises(ValueError, match="slot 3 is entry 3 of page 0, whose entry 0 was never stored"):
            store_ops.store_index_keys(dev(keys[:3]), dev(torch.arange(3)), dev(torch.tensor([67, 68, 3])), pool, fmt,
                                       dev(table), dev(torch.ones(128)), None, transform, backend=backend)
        with pytest.raises(ValueError, match="entry 1 of page 0, whose entry 0 is in the same call but not 1 rows"):
            store_ops.store_index_keys(dev(keys[:2]), dev(torch.arange(2)), dev(torch.tensor([1, 0])), pool, fmt,
                                       dev(table), dev(torch.ones(128)), None, transform, backend=backend)
        with pytest.raises(ValueError, match="without padding rows"):
            store_ops.store_index_keys(dev(keys[:3]), dev(torch.arange(3)), dev(torch.tensor([0, -1, 1])), pool, fmt,
                                       dev(table), dev(torch.ones(128)), None, transform, backend=backend)
        assert not bool(pool.any())
        # entry 0 first (in the same call, in order, or in an earlier call): accepted
        store_ops.store_index_keys(dev(keys[:2]), dev(torch.arange(2)), dev(torch.tensor([64, 65])), pool, fmt,
                                   dev(table), dev(torch.ones(128)), None, transform, backend=backend)
        store_ops.store_index_keys(dev(keys[2:4]), dev(torch.arange(2)), dev(torch.tensor([67, 66])), pool, fmt,
                                   dev(table), dev(torch.ones(128)), None, transform, backend=backend)
        assert bool(pool[1].any()) and not bool(pool[0].any())
    cache = PagedCache(fmt, 2)
    seq = cache.add_sequence()
    slots = cache.append(seq, 8)
    with pytest.raises(ValueError, match="never stored"):
        cache.write(slots[1:], keys[1:])
    assert not bool(cache.pool.any())
    cache.write(slots.flip(0), keys.flip(0))  # PagedCache.write takes a call's rows in any order
    assert torch.equal(cache.gather(seq), fmt.dequantize_pages(fmt.quantize_pages(
        torch.cat([keys, torch.zeros(56, 128)])))[:8])
    # no checks (the launcher, as under CUDA-graph capture): rows of a page never started are not written
    pool = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    _store_calls(fmt, pool, [(keys[:3], torch.arange(3), torch.tensor([67, 68, 0]))], transform, table,
                 torch.ones(128), launcher=True)
    assert not bool(pool[1].any()) and bool(pool[0].any())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs a CUDA device (graph capture)")
@pytest.mark.parametrize("name", CENTRED)
def test_gpu_decode_append_captured_in_a_cuda_graph(name, v4):
    """A decode step of a centred cache (one sequence mid-page, one starting a page) captured in a CUDA graph
    (the store's host checks are skipped under capture) writes what the eager store writes."""
    table, transform = (t.cuda() if isinstance(t, torch.Tensor) else t for t in v4)
    fmt = KeyFormat.parse(name)
    keys = shared_keys(130, 20.0, seed=8).cuda()
    weight = torch.ones(128, device="cuda")
    pools = [torch.zeros(3, fmt.page_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for pool in pools:  # the sequences so far: entries 0..99 (pages 0 and 1)
        store_ops.store_index_keys(keys[:100], torch.arange(100, device="cuda"), torch.arange(100, device="cuda"),
                                   pool, fmt, table, weight, None, transform)
    step = (keys[100:102], torch.tensor([100, 0], device="cuda"), torch.tensor([100, 128], device="cuda"))
    eager, captured = pools
    store_ops.store_index_keys(*step, eager, fmt, table, weight, None, transform)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store_ops.store_index_keys(*step, captured, fmt, table, weight, None, transform)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.skipif(not TRITON_OK, reason="Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
@pytest.mark.parametrize("name", CENTRED)
def test_triton_scores_and_topk_match_reference(name):
    """Prefill (tile kernel) and decode (group kernel) scores of centred pages against the reference on the
    same bf16-rounded queries, and the top-k built on them."""
    fmt = KeyFormat.parse(name)
    g = torch.Generator().manual_seed(10)
    cache = PagedCache(fmt, 4)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.write(cache.append(a, 150), shared_keys(150, 30.0, seed=11))
    cache.write(cache.append(b, 40), shared_keys(40, 30.0, seed=12))
    q = torch.randn(4, 16, 128, generator=g).bfloat16().float()
    w = torch.rand(4, 16, generator=g)
    query_seq = torch.tensor([0, 0, 1, 0], dtype=torch.int32)
    positions = torch.tensor([149, 100, 39, 64])
    batch = PagedBatch.build(cache.pool.to(DEVICE), fmt, cache.block_table([a, b]).to(DEVICE),
                             cache.entry_counts([a, b]).to(DEVICE), query_seq.to(DEVICE), positions.to(DEVICE))
    ref = indexer_ops.index_scores(q, w, batch, backend="reference")
    from dsakit.ops.indexer.config import ScoresConfig
    from dsakit.ops.indexer.scores import index_scores_triton

    for kernel in ("tile", "group"):
        out = index_scores_triton(q.to(DEVICE), w.to(DEVICE), batch, config=ScoresConfig(kernel=kernel)).cpu()
        assert torch.equal(torch.isinf(out), torch.isinf(ref)), kernel
        finite = torch.isfinite(ref)
        assert float((out - ref).abs()[finite].max()) <= 1e-5 * float(ref[finite].abs().max()), kernel
    top = indexer_ops.index_topk(q.to(DEVICE), w.to(DEVICE), batch, 32, backend="triton").cpu()
    assert torch.equal(top, indexer_ops.select_topk(ref, 32, backend="reference"))


@pytest.mark.skipif(not TRITON_OK, reason="Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
@pytest.mark.parametrize("name", CENTRED)
def test_triton_decode_scores_wide_groups_and_fp8_queries(name):
    """Decode (group kernel) at 4 queries x 32 heads per program, where the centred formats' key tile is one
    page by default, and with an explicit two-page tile; bf16 and fp8 queries, against the reference."""
    from dsakit.ops.indexer.config import ScoresConfig
    from dsakit.ops.indexer.scores import index_scores_triton

    fmt = KeyFormat.parse(name)
    g = torch.Generator().manual_seed(20)
    cache = PagedCache(fmt, 4)
    a = cache.add_sequence()
    cache.write(cache.append(a, 200), shared_keys(200, 30.0, seed=21))
    q = torch.randn(4, 32, 128, generator=g)
    w = torch.rand(4, 32, generator=g)
    batch = PagedBatch.build(cache.pool.to(DEVICE), fmt, cache.block_table([a]).to(DEVICE),
                             cache.entry_counts([a]).to(DEVICE), torch.zeros(4, dtype=torch.int32, device=DEVICE),
                             torch.tensor([199, 150, 70, 3], device=DEVICE))
    for q_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        qd = q.to(q_dtype)
        ref = indexer_ops.index_scores(qd.float(), w, batch, backend="reference")
        finite = torch.isfinite(ref)
        for block_n in (None, 128):
            config = ScoresConfig(kernel="group", decode_block_n=block_n)
            out = index_scores_triton(qd.to(DEVICE), w.to(DEVICE), batch, config=config).cpu()
            assert torch.equal(torch.isinf(out), torch.isinf(ref)), (q_dtype, block_n)
            assert float((out - ref).abs()[finite].max()) <= 1e-5 * float(ref[finite].abs().max()), (q_dtype, block_n)


# --------------------------------------------------------------------------------------------------
# Recall lab: the needle of a centred format is stored with its whole page(s)
# --------------------------------------------------------------------------------------------------


def test_lab_needle_rows_cover_whole_pages():
    from dsakit.recall.haystack import needle_rows, with_needle

    entries = torch.tensor([63, 64])
    assert torch.equal(needle_rows(KeyFormat.FP8, entries, 100), entries)
    rows = needle_rows(KeyFormat.FP8_CENTRED, entries, 100)
    assert torch.equal(rows, torch.arange(100))  # page 0 whole, page 1 up to the last entry
    keys = torch.zeros(100, 128)
    out = with_needle(keys, rows, entries, torch.ones(2, 128))
    assert out[63:65].eq(1).all() and out[:63].eq(0).all() and out[65:].eq(0).all()


def test_lab_horizon_patch_equals_storing_the_haystack_with_the_needle():
    """The horizon patches each trial's needle pages from a store of their own; the scores must equal those
    of the whole haystack stored with the needle in place (a needle at entry 0 of a page moves its centre)."""
    from dsakit.recall import horizon, settings as lab_settings
    from dsakit.recall.synthetic import (SyntheticConfig, make_haystack, make_queries, model_weights,
                                         place_needles, prepare_queries, query_positions)

    config = SyntheticConfig(query_tokens=1)
    gen = torch.Generator().manual_seed(0)
    norm_weight, ape = model_weights(config, gen)
    hay = make_haystack(config, 200, gen, norm_weight, ape)
    table = config.geometry.rope.cos_sin_table(801)
    probe = horizon.HorizonHaystack(hay, table, "reference", torch.device("cpu"), seed=0)
    n = 150
    sub = horizon.haystack_prefix(hay, n)
    directions = torch.randn(3, 128, generator=gen)
    directions[:, :64] = 0  # orthogonal to mu is not needed here: any needle moves the page centre
    directions /= directions.norm(dim=1, keepdim=True)
    needles = place_needles(sub, [64, 10, 127], directions)  # entry 0 of page 1; inside page 0; across pages
    qpos = query_positions(config, n * 4, 1)
    tr = config.geometry.key_transform
    q_pre, w = zip(*(make_queries(sub, nd, qpos, gen) for nd in needles))
    q = prepare_queries(torch.cat(q_pre), qpos.expand(3), table, tr.rope_layout, tr.rope_dim, tr.hadamard)
    w = torch.cat(w)
    fmt = KeyFormat.FP8_CENTRED
    scores = indexer_ops.index_scores_dense(q, w, probe.keys(fmt)[:n])
    probe._patch_pages(fmt, scores, q, w, needles, n)
    for i, nd in enumerate(needles):
        keys = sub.keys.clone()
        keys[nd.entries] = nd.keys
        truth = indexer_ops.index_scores_dense(q[i:i + 1], w[i:i + 1], probe._stored(fmt, keys, torch.arange(n) * 4))
        torch.testing.assert_close(scores[i:i + 1], truth, rtol=1e-5, atol=1e-5)
    assert lab_settings.ALL_FORMATS[-2:] == ("fp8-centred", "fp4-centred")


def test_lab_missing_centre_fault_row():
    from dsakit.recall import RecallSettings, run_faults
    from dsakit.recall.faults import FAULTS
    from dsakit.recall.sweep import fault_carriers
    from dsakit.recall.synthetic import SyntheticConfig

    settings = RecallSettings(config=SyntheticConfig(query_tokens=2), formats=("bf16",), topks=(64,),
                              contexts=(1024,), depths=(0.5,), horizon=False,
                              faults=("missing-centre", "missing-key-scale"), fault_contexts=(1024,),
                              fault_depths=(0.5,), seed=1)
    pairs = {(f.name, fmt.name) for f, fmt in fault_carriers(settings)}
    assert pairs == {("none", "fp8-centred"), ("missing-centre", "fp8-centred"), ("none", "fp8"),
                     ("missing-key-scale", "fp8")}
    assert not FAULTS["missing-centre"].applies_to(KeyFormat.FP8)
    assert FAULTS["missing-centre"].applies_to(KeyFormat.FP4_CENTRED)
    rows = {(r["fault"], r["format"]): r for r in run_faults(settings)}
    base, fault = rows[("none", "fp8-centred")], rows[("missing-centre", "fp8-centred")]
    assert base["needle_score_ratio"] == pytest.approx(1.0, abs=0.05)
    assert abs(fault["needle_score_ratio"] - 1.0) > 0.3  # the q . c term is most of every score


@pytest.mark.skipif(not TRITON_OK, reason="Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
@pytest.mark.parametrize("name", CENTRED)
def test_triton_scores_when_the_page_term_dominates(name):
    """A large centre and small residuals (|mu| / |z| = 1000): q . c is ~1000x the residual's logit, so a page
    term added after the relu, scaled with the residual, dropped or rounded below fp32 shows at once, and the
    order within a page (set by the residuals alone) must survive it. Every kernel path: prefill tile (one- and
    two-page key tiles), decode gather (fp4 blocks and dequantized), decode page copies; bf16 and fp8 q."""
    from dsakit.ops.indexer.config import ScoresConfig
    from dsakit.ops.indexer.scores import index_scores_triton

    fmt = KeyFormat.parse(name)
    g = torch.Generator().manual_seed(30)
    cache = PagedCache(fmt, 6)
    cache._free = [4, 1, 5, 0, 3, 2]  # pages out of order
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.write(cache.append(a, 200), shared_keys(200, 1000.0, seed=31))
    cache.write(cache.append(b, 70), shared_keys(70, 1000.0, seed=32))
    batch = PagedBatch.build(cache.pool.to(DEVICE), fmt, cache.block_table([a, b]).to(DEVICE),
                             cache.entry_counts([a, b]).to(DEVICE),
                             torch.tensor([0, 1, 0, 1], dtype=torch.int32, device=DEVICE),
                             torch.tensor([199, 69, 130, 63], device=DEVICE))
    q = torch.randn(4, 16, 128, generator=g)
    w = torch.rand(4, 16, generator=g)
    configs = [ScoresConfig(kernel="tile"), ScoresConfig(kernel="tile", prefill_block_n=64, prefill_block_t=16),
               ScoresConfig(kernel="group", decode_loads="gather"),
               ScoresConfig(kernel="group", decode_loads="gather", decode_fp4="dequant"),
               ScoresConfig(kernel="group")]  # page copies where the format and q allow them
    for q_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        qd = q.to(q_dtype)
        ref = indexer_ops.index_scores(qd.float(), w, batch, backend="reference")
        finite = torch.isfinite(ref)
        expected = indexer_ops.select_topk(ref, 48, backend="reference").sort(dim=1).values
        for config in configs:
            out = index_scores_triton(qd.to(DEVICE), w.to(DEVICE), batch, config=config).cpu()
            assert torch.equal(torch.isinf(out), torch.isinf(ref)), (q_dtype, config)
            assert float((out - ref).abs()[finite].max()) <= 1e-5 * float(ref[finite].abs().max()), (q_dtype, config)
            top = indexer_ops.select_topk(out, 48, backend="reference").sort(dim=1).values
            assert torch.equal(top, expected), (q_dtype, config)  # the same set: the residuals' order survives


@pytest.mark.skipif(not TRITON_OK, reason="Triton kernels need TRITON_INTERPRET=1 (CPU) or a CUDA device")
@pytest.mark.parametrize("name", CENTRED)
def test_deepgemm_style_paged_logits_of_centred_pools(name):
    """dsakit.ops.indexer.centred_paged_mqa_logits takes DeepGEMM's paged-logits arguments with a centred pool
    viewed as [pages, 64, 1, bytes per entry]: the logits of the decoded keys (centre + residual) under
    DeepGEMM's visibility rule (context_lens [B]: query i of sequence b sees context_lens[b] - next_n + i + 1
    entries), -inf elsewhere; the positional DeepGEMM-order variant gives the same."""
    fmt = KeyFormat.parse(name)
    g = torch.Generator().manual_seed(40)
    cache = PagedCache(fmt, 5)
    seqs = [cache.add_sequence() for _ in range(2)]
    lengths = [150, 66]
    for i, (seq, n) in enumerate(zip(seqs, lengths)):
        cache.write(cache.append(seq, n), shared_keys(n, 30.0, seed=41 + i))
    b, next_n, h, max_len = 2, 2, 16, 160
    q = torch.randn(b, next_n, h, 128, generator=g).to(torch.float8_e4m3fn)
    w = torch.rand(b * next_n, h, generator=g)
    table = cache.block_table(seqs)
    context_lens = cache.entry_counts(seqs)
    entry_bytes = fmt.page_bytes // 64
    kv_cache = cache.pool.view(-1, 64, 1, entry_bytes)
    logits = indexer_ops.centred_paged_mqa_logits(q.to(DEVICE), kv_cache.to(DEVICE), w.to(DEVICE),
                                                 context_lens.to(DEVICE), table.to(DEVICE), max_len).cpu()
    keys = fmt.dequantize_pages(cache.pool)  # [pages * 64, 128]: centre + residual per slot
    expect = torch.full((b * next_n, max_len), float("-inf"))
    for i in range(b):
        for j in range(next_n):
            n = int(context_lens[i]) - next_n + j + 1
            idx = torch.arange(n)
            slots = table[i].long()[idx // 64] * 64 + idx % 64
            expect[i * next_n + j, :n] = ((q[i, j].float() @ keys[slots].T).relu() * w[i * next_n + j][:, None]).sum(0)
    assert torch.equal(torch.isinf(logits), torch.isinf(expect))
    finite = torch.isfinite(expect)
    assert float((logits - expect).abs()[finite].max()) <= 1e-5 * float(expect[finite].abs().max())
    same = indexer_ops.deepgemm_centred_paged_mqa_logits(q.to(DEVICE), kv_cache.to(DEVICE), w.to(DEVICE),
                                                       context_lens.to(DEVICE), table.to(DEVICE), None, max_len)
    assert torch.equal(same.cpu(), logits)
    with pytest.raises(ValueError, match=r"kv_cache must be \[pages, 64, 1, 136\] or \[pages, 64, 1, 72\]"):
        indexer_ops.centred_paged_mqa_logits(q, cache.pool.view(-1, 64, 1, 8, entry_bytes // 8)[..., 0],
                                            w, context_lens, table, max_len)
    with pytest.raises(ValueError, match="float8_e4m3fn or bfloat16"):
        indexer_ops.centred_paged_mqa_logits(q.float(), kv_cache, w, context_lens, table, max_len)
