"""Page summaries (dsakit.pool.PageSummaries): the side table of per-page centres and boxes that the store ops
keep for hierarchical selection. The reference store against the spec, the Triton store against the reference
byte for byte (under TRITON_INTERPRET=1 on the CPU, or on a GPU), appends in any chunking giving the same
bytes, the box bounding every entry, and the refusals that leave the pool and the table as they were."""

from __future__ import annotations

import os

import pytest
import torch

import dsakit.ops.store.triton as store_triton_module  # noqa: F401  (the launch counter patches it)
from dsakit.batch import PagedBatch
from dsakit.cache import PagedCache
from dsakit.formats import KeyFormat, is_centred
from dsakit.ops.store import IndexKeyStore, store_checked, store_index_keys
from dsakit.pool import (CANONICAL_BF16_NAN, PageSummaries, dequantize_entries, summarize_page, summarize_pages,
                         touched_pages)
from dsakit.presets import KeyTransform
from dsakit.transforms import ROPE_V4, RopeConfig

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TRITON = INTERPRET or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not TRITON, reason="Triton kernels need TRITON_INTERPRET=1 (CPU) or a GPU")
BACKENDS = ["reference"] + (["triton"] if TRITON else [])
FORMATS = ["bf16", "fp8", "fp8-ue8m0", "fp4", "fp4-rne", "fp8-centred", "fp4-centred"]
TABLE = RopeConfig(64, 160000.0).cos_sin_table(256)
FIELDS = ("centre", "lower", "upper")
PAGES = 3


def _keys(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random pre-norm keys [n, 128] with a spread of magnitudes, positions [n], a norm weight [128]."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n, 128, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    return keys, torch.randint(0, TABLE.shape[0], (n,), generator=g), torch.rand(128, generator=g) + 0.5


def _device(backend: str) -> str:
    return DEVICE if backend == "triton" else "cpu"


def _store(backend, fmt, keys, positions, slots, pool, summaries, weight, **kw):
    dev = _device(backend)
    store_index_keys(keys.to(dev), positions.to(dev), slots.to(dev), pool, fmt, TABLE.to(dev), weight.to(dev),
                     backend=backend, summaries=summaries, **kw)


def _bits(summaries: PageSummaries) -> dict[str, torch.Tensor]:
    return {f: getattr(summaries, f).cpu().view(torch.int16).clone() for f in FIELDS}


def _spec(pool: torch.Tensor, fmt: KeyFormat, slots: torch.Tensor) -> dict[str, torch.Tensor]:
    """The spec recomputed from the pool's bytes for every page the slots touch (others 0)."""
    table = PageSummaries.zeros(pool.shape[0])
    pages, counts = touched_pages(slots[slots >= 0].long())
    summarize_pages(pool.cpu(), fmt, pages, counts, table)
    return _bits(table)


def _append_slots(lengths: list[int], pages: list[int]) -> torch.Tensor:
    """Slots of an in-order append: entries 0..lengths[i]-1 of page pages[i], page after page."""
    return torch.cat([torch.arange(n) + p * 64 for n, p in zip(lengths, pages)])


def _fresh(fmt: KeyFormat, backend: str) -> tuple[torch.Tensor, PageSummaries]:
    dev = _device(backend)
    return torch.zeros(PAGES, fmt.page_bytes, dtype=torch.uint8, device=dev), PageSummaries.zeros(PAGES, dev)


# --------------------------------------------------------------------------------------------------
# the spec and the reference
# --------------------------------------------------------------------------------------------------


def test_summarize_page_rule():
    """Mean: fp32 sum in entry order, IEEE division, bf16 RNE; box: outward-rounded min / max, -0 as +0."""
    g = torch.Generator().manual_seed(0)
    decoded = torch.randn(37, 128, generator=g) * 3
    decoded[5, 0] = -0.0  # the only zero of dim 0 in a column of positives
    decoded[:, 0] = decoded[:, 0].abs() + 1
    decoded[5, 0] = -0.0
    centre, lower, upper = summarize_page(decoded)
    total = torch.zeros(128)
    for row in decoded:
        total = total + row
    assert torch.equal(centre.view(torch.int16), (total / 37).to(torch.bfloat16).view(torch.int16))
    assert bool((lower.float() <= decoded.amin(0)).all()) and bool((upper.float() >= decoded.amax(0)).all())
    # outward by at most one bf16 step: the next bf16 inward is on the wrong side of the extreme
    inward_lower = torch.nextafter(lower, torch.full_like(lower, float("inf"))).float()
    inward_upper = torch.nextafter(upper, torch.full_like(upper, -float("inf"))).float()
    assert bool((inward_lower > decoded.amin(0)).all()) and bool((inward_upper < decoded.amax(0)).all())
    assert int(lower.view(torch.int16)[0]) == 0  # the -0 counts as +0
    nan = decoded.clone()
    nan[3, 7] = float("nan")
    for row in summarize_page(nan):
        assert int(row.view(torch.int16)[7]) == CANONICAL_BF16_NAN


def test_summarize_pages_is_summarize_page_on_every_page():
    """The reference's all-pages-at-once recompute gives summarize_page's bytes page by page (partial pages,
    a NaN, signed zeros, an Inf)."""
    fmt = KeyFormat.parse("bf16")
    pool = torch.zeros(3, fmt.page_bytes, dtype=torch.uint8)
    x = torch.randn(64 + 5 + 1, 128, generator=torch.Generator().manual_seed(10))
    x[3, 1], x[4, 2], x[66, 3], x[67, 4] = float("nan"), -0.0, float("inf"), -0.0
    x[:, 2] = x[:, 2].abs()
    slots = torch.cat([torch.arange(64) + 128, torch.arange(5), torch.tensor([64])])
    from dsakit.pool import store_entries
    store_entries(pool, fmt, slots, x)
    table = PageSummaries.zeros(3)
    summarize_pages(pool, fmt, torch.tensor([2, 0, 1]), torch.tensor([64, 5, 1]), table)
    for page, count in ((2, 64), (0, 5), (1, 1)):
        rows = summarize_page(dequantize_entries(pool, fmt, torch.arange(count) + page * 64))
        for field, row in zip(FIELDS, rows):
            assert torch.equal(getattr(table, field)[page].view(torch.int16), row.view(torch.int16)), (field, page)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_store_matches_spec(fmt):
    """The reference store's table equals the spec applied to each page's decoded entries, partly filled pages
    included; pages not touched keep their bytes; the box holds every stored entry exactly."""
    fmt = KeyFormat.parse(fmt)
    slots = _append_slots([64, 23], [2, 0])
    keys, positions, weight = _keys(slots.numel(), 1)
    pool, summaries = _fresh(fmt, "reference")
    summaries.centre[1] = 7.0  # page 1 is never written: its row must stay
    _store("reference", fmt, keys, positions, slots, pool, summaries, weight)
    for page, count in ((2, 64), (0, 23)):
        decoded = dequantize_entries(pool, fmt, torch.arange(count) + page * 64)
        for field, row in zip(FIELDS, summarize_page(decoded)):
            assert torch.equal(getattr(summaries, field)[page].view(torch.int16), row.view(torch.int16)), field
        assert bool((summaries.lower[page].float() <= decoded).all())
        assert bool((decoded <= summaries.upper[page].float()).all())
    assert bool((summaries.centre[1] == 7.0).all()) and not bool(summaries.lower[1].any())


# --------------------------------------------------------------------------------------------------
# the Triton store against the reference
# --------------------------------------------------------------------------------------------------


def _exact_keys(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys whose store pipeline is exact in fp32 (rows of +-1 with eps 0 normalize to +-1, rope at position 0
    is the identity, no Hadamard: x = +-weight), so both backends store the same bytes."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.where(torch.rand(n, 128, generator=g) < 0.5, -1.0, 1.0)
    return signs, torch.zeros(n, dtype=torch.long), torch.rand(128, generator=g) * 4 + 0.25


EXACT = KeyTransform("rmsnorm", ROPE_V4, 64, False, 0.0)


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_bulk_store_matches_reference(fmt):
    """A bulk store (several rows per page, padding between pages): on keys both backends store alike, the
    Triton table is the reference's byte for byte; on random keys (whose stored bytes may differ in a last
    rounding, tests/test_store_triton.py) it is the spec of the Triton pool's own bytes. Untouched pages keep
    their rows."""
    fmt = KeyFormat.parse(fmt)
    slots = torch.cat([_append_slots([12], [1]), torch.tensor([-1]), _append_slots([5], [2])])
    keys, positions, weight = _exact_keys(slots.numel(), 2)
    results = {}
    for backend in BACKENDS:
        pool, summaries = _fresh(fmt, backend)
        summaries.upper[0] = -3.0  # untouched page
        _store(backend, fmt, keys, positions, slots, pool, summaries, weight, transform=EXACT)
        results[backend] = (pool.cpu(), _bits(summaries))
    assert torch.equal(results["triton"][0], results["reference"][0])
    for field in FIELDS:
        assert torch.equal(results["triton"][1][field], results["reference"][1][field]), field
    assert bool((results["triton"][1]["upper"][0] == torch.tensor(-3.0, dtype=torch.bfloat16).view(torch.int16)).all())
    keys, positions, weight = _keys(slots.numel(), 2)
    pool, summaries = _fresh(fmt, "triton")
    _store("triton", fmt, keys, positions, slots, pool, summaries, weight)
    spec, bits = _spec(pool, fmt, slots), _bits(summaries)
    for field in FIELDS:
        assert torch.equal(bits[field], spec[field]), field


@needs_triton
def test_triton_full_page_then_next_page():
    """A run that fills a page (entry 63) and goes on at entry 0 of another page in the next row: two runs,
    each summarized over its page's entries, byte for byte as the spec of the pool."""
    fmt = KeyFormat.parse("bf16")
    slots = _append_slots([64, 3], [2, 0])
    keys, positions, weight = _keys(slots.numel(), 9)
    pool, summaries = _fresh(fmt, "triton")
    _store("triton", fmt, keys, positions, slots, pool, summaries, weight)
    spec, bits = _spec(pool, fmt, slots), _bits(summaries)
    for field in FIELDS:
        assert torch.equal(bits[field], spec[field]), field
    assert bool(spec["centre"][2].any()) and bool(spec["centre"][0].any())


CHUNKING_CASES = [(backend, fmt) for backend in BACKENDS for fmt in ["bf16", "fp8", "fp4-rne", "fp8-centred",
                                                                    "fp4-centred"]
                  if backend == "reference" or fmt in ("fp8", "fp4-centred")]  # the interpreter is slow


@pytest.mark.parametrize("backend,fmt", CHUNKING_CASES)
def test_bulk_chunked_and_one_at_a_time_appends_identical(backend, fmt):
    """The same entries appended in one call, in chunks or one row per call give the same pool and the same
    table bytes (one row per call is the decode path: the store launch summarizes). Keys whose pipeline is
    exact, so that the stored bytes do not depend on the chunking either (the reference's fp32 reductions
    may round differently with the batch shape)."""
    fmt = KeyFormat.parse(fmt)
    slots = _append_slots([4, 3], [0, 2])
    keys, positions, weight = _exact_keys(slots.numel(), 3)
    splits = {"bulk": [slots.numel()], "chunks": [3, 3, 1], "single": [1] * slots.numel()}
    out = {}
    for name, sizes in splits.items():
        pool, summaries = _fresh(fmt, backend)
        start = 0
        for size in sizes:
            part = slice(start, start + size)
            _store(backend, fmt, keys[part], positions[part], slots[part], pool, summaries, weight,
                   transform=EXACT)
            start += size
        out[name] = (pool.cpu(), _bits(summaries))
    for name in ("chunks", "single"):
        assert torch.equal(out[name][0], out["bulk"][0]), name
        for field in FIELDS:
            assert torch.equal(out[name][1][field], out["bulk"][1][field]), (name, field)
    spec = _spec(out["bulk"][0], fmt, slots)
    for field in FIELDS:
        assert torch.equal(out["bulk"][1][field], spec[field]), field


@needs_triton
def test_triton_non_finite_and_zero_entries_match_spec():
    """bf16 keeps NaN keys (canonical NaN in all three rows) and zero rows (the box's -0 rule)."""
    fmt = KeyFormat.parse("bf16")
    slots = _append_slots([5], [1])
    keys, positions, weight = _keys(5, 4)
    keys[2, 9] = float("nan")
    keys[3] = 0.0  # a zero row normalizes to zeros (eps > 0)
    pool, summaries = _fresh(fmt, "triton")
    _store("triton", fmt, keys, positions, slots, pool, summaries, weight)
    bits, spec = _bits(summaries), _spec(pool, fmt, slots)
    for field in FIELDS:
        assert torch.equal(bits[field], spec[field]), field
        assert bool((bits[field][1] == CANONICAL_BF16_NAN).all())  # the NaN row: every dim NaN


# --------------------------------------------------------------------------------------------------
# launches
# --------------------------------------------------------------------------------------------------


class _LaunchCounter:
    """Wraps a Triton kernel object so that each ``kernel[grid](...)`` launch is counted."""

    def __init__(self, kernel, counts: dict, name: str):
        self.kernel, self.counts, self.name = kernel, counts, name

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.counts[self.name] = self.counts.get(self.name, 0) + 1
            return launch(*args, **kwargs)
        return run


@pytest.fixture
def launches(monkeypatch):
    counts: dict[str, int] = {}
    for name in ("_store_index_keys_kernel", "_store_index_keys_generic_kernel", "_summarize_pages_kernel"):
        monkeypatch.setattr(store_triton_module, name, _LaunchCounter(getattr(store_triton_module, name), counts,
                                                                       name))
    return counts


@needs_triton
@pytest.mark.parametrize("fmt", ["fp8", "fp4-centred"])
def test_decode_store_summarizes_in_its_own_launch(fmt, launches):
    """A decode append (one row per sequence, each on its own page) is one launch, table included; a call
    whose pages may get several rows adds the summary launch."""
    fmt = KeyFormat.parse(fmt)
    prefix = _append_slots([4, 2, 6], [0, 1, 2])  # three sequences' earlier entries
    keys, positions, weight = _keys(prefix.numel() + 3, 5)
    pool, summaries = _fresh(fmt, "triton")
    _store("triton", fmt, keys[:12], positions[:12], prefix, pool, summaries, weight)
    assert launches == {"_store_index_keys_kernel": 1, "_summarize_pages_kernel": 1}
    launches.clear()
    step = torch.tensor([4, 64 + 2, 128 + 6])  # the next entry of each sequence
    _store("triton", fmt, keys[12:], positions[12:], step, pool, summaries, weight)
    assert launches == {"_store_index_keys_kernel": 1}
    all_slots = torch.cat([prefix, step])
    spec = _spec(pool, fmt, all_slots)
    for field, bits in _bits(summaries).items():
        assert torch.equal(bits, spec[field]), field
    # the trusted path cannot see that 3 rows hit 3 pages: it adds the summary launch; 1 row never does
    launches.clear()
    dev = _device("triton")
    record = IndexKeyStore.check(keys[12:].to(dev), positions[12:].to(dev), step.to(dev), pool, fmt, TABLE.to(dev),
                                 weight.to(dev), check_values=False, summaries=summaries, backend="triton")
    store_checked(record)
    assert launches == {"_store_index_keys_kernel": 1, "_summarize_pages_kernel": 1}
    launches.clear()
    record = IndexKeyStore.check(keys[12:13].to(dev), positions[12:13].to(dev), step[:1].to(dev), pool, fmt,
                                 TABLE.to(dev), weight.to(dev), check_values=False, summaries=summaries,
                                 backend="triton")
    store_checked(record)
    assert launches == {"_store_index_keys_kernel": 1}
    for field, bits in _bits(summaries).items():
        assert torch.equal(bits, spec[field]), field


@needs_triton
@pytest.mark.parametrize("fmt", ["fp4", "fp8-centred"])
def test_generic_kernel_keeps_summaries(fmt):
    """The generic store kernel (any rope geometry) keeps the table too: a bulk store (summary launch), then a
    one-row append summarized in the store launch, byte for byte as the spec of the pool."""
    from dsakit.ops.store import StoreConfig
    from dsakit.ops.store.triton import launch_store_index_keys

    fmt = KeyFormat.parse(fmt)
    slots = _append_slots([6, 3], [1, 2])
    keys, positions, weight = _keys(slots.numel() + 1, 11)
    pool, summaries = _fresh(fmt, "triton")
    dev = _device("triton")
    config = StoreConfig(index_kernel="generic")
    for part, rows, one in ((slice(0, 9), slots, False), (slice(9, 10), torch.tensor([64 + 6]), True)):
        launch_store_index_keys(keys[part].to(dev), positions[part].to(dev), rows.to(dev), pool, TABLE.to(dev),
                                weight.to(dev), None, fmt, "rmsnorm", "interleaved", "trailing", True, 1e-6,
                                config=config, summaries=summaries, one_row_per_page=one)
    spec, bits = _spec(pool, fmt, torch.cat([slots, torch.tensor([64 + 6])])), _bits(summaries)
    for field in FIELDS:
        assert torch.equal(bits[field], spec[field]), field


# --------------------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case,match", [
    ("wrong_size", "page summaries of 4 pages"),
    ("not_a_table", "summaries must be a PageSummaries"),
    ("rows_out_of_order", "not one run of consecutive rows"),
    ("page_split_by_padding", "not one run of consecutive rows"),
    ("duplicate_slot", "duplicate"),
])
def test_refused_store_leaves_pool_and_table(backend, case, match):
    fmt = KeyFormat.parse("fp8")
    pool, summaries = _fresh(fmt, backend)
    keys, positions, weight = _keys(6, 6)
    _store(backend, fmt, keys[:2], positions[:2], torch.tensor([0, 1]), pool, summaries, weight)
    slots = torch.tensor([2, 3, 4, 64, 65, 66])
    if case == "wrong_size":
        summaries = PageSummaries.zeros(PAGES + 1, _device(backend))
    elif case == "not_a_table":
        summaries = summaries.centre
    elif case == "rows_out_of_order":
        slots = torch.tensor([2, 4, 3, 64, 65, 66])
    elif case == "page_split_by_padding":
        slots = torch.tensor([2, 3, -1, 4, 64, 65])
    elif case == "duplicate_slot":
        slots = torch.tensor([2, 3, 3, 64, 65, 66])
    before = pool.clone()
    table_before = _bits(summaries) if isinstance(summaries, PageSummaries) else None
    with pytest.raises(ValueError, match=match):
        _store(backend, fmt, keys, positions, slots, pool, summaries, weight)
    assert torch.equal(pool, before)
    if table_before is not None:
        for field, bits in _bits(summaries).items():
            assert torch.equal(bits, table_before[field]), field


def test_page_summaries_checks():
    with pytest.raises(ValueError, match="num_pages"):
        PageSummaries.zeros(0)
    with pytest.raises(ValueError, match="lower"):
        PageSummaries(torch.zeros(2, 128, dtype=torch.bfloat16), torch.zeros(3, 128, dtype=torch.bfloat16),
                      torch.zeros(2, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        PageSummaries(*(torch.zeros(2, 128) for _ in range(3)))


# --------------------------------------------------------------------------------------------------
# the cache and the batch
# --------------------------------------------------------------------------------------------------


def test_paged_cache_keeps_summaries_and_batch_carries_them():
    cache = PagedCache("fp4", num_pages=4, summaries=True)
    assert cache.summaries.num_pages == 4 and cache.summaries.centre.dtype == torch.bfloat16
    assert PagedCache("fp4", num_pages=4).summaries is None
    a, b = cache.add_sequence(), cache.add_sequence()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(70, 128, generator=g)
    slots_a = cache.append(a, 70)
    cache.write(slots_a[:50], x[:50])
    cache.write(slots_a[50:], x[50:])  # a second chunk: page 0 completed, page 1 started
    slots_b = cache.append(b, 3)
    for i in range(3):  # one entry per call
        cache.write(slots_b[i:i + 1], x[i:i + 1])
    expected = _spec(cache.pool, cache.fmt, torch.cat([slots_a, slots_b]))
    for field, bits in _bits(cache.summaries).items():
        assert torch.equal(bits, expected[field]), field
    batch = cache.batch([a, b])
    assert batch.summaries is cache.summaries
    # truncate inside a page: that page's row covers the entries kept
    cache.truncate(a, 66)
    expected = _spec(cache.pool, cache.fmt, cache.slots(a))
    assert torch.equal(_bits(cache.summaries)["centre"][int(slots_a[64]) // 64],
                       expected["centre"][int(slots_a[64]) // 64])
    # a page given back keeps its stale row until its next owner's first store recomputes it from entry 0
    cache.free_sequence(b)
    c = cache.add_sequence()
    slot = cache.append(c, 1)
    cache.write(slot, x[:1] * 2)
    page = int(slot[0]) // 64
    decoded = dequantize_entries(cache.pool, cache.fmt, slot)
    assert torch.equal(cache.summaries.centre[page].view(torch.int16),
                       summarize_page(decoded)[0].view(torch.int16))
    # refusals: attention-entry caches keep no summaries; a batch's table must belong to its pool
    with pytest.raises(ValueError, match="index-key pools"):
        PagedCache("fp8-rope-bf16", num_pages=2, summaries=True)
    with pytest.raises(ValueError, match="summaries"):
        PagedCache("fp8", num_pages=2, summaries=1)
    with pytest.raises(ValueError, match="do not belong"):
        PagedBatch.build(cache.pool, cache.fmt, cache.block_table([a]), cache.entry_counts([a]),
                         torch.zeros(1, dtype=torch.int32), summaries=PageSummaries.zeros(5))
    built = PagedBatch.build(cache.pool, cache.fmt, cache.block_table([a]), cache.entry_counts([a]),
                             torch.zeros(1, dtype=torch.int32), summaries=cache.summaries)
    assert built.summaries is cache.summaries


def test_centred_decoded_value_is_centre_plus_residual():
    """For page-centred formats the summarized value is the decoded key (centre + residual), not the residual."""
    fmt = KeyFormat.parse("fp8-centred")
    assert is_centred(fmt)
    cache = PagedCache(fmt, num_pages=1, summaries=True)
    seq = cache.add_sequence()
    x = torch.randn(10, 128, generator=torch.Generator().manual_seed(8)) + 5.0  # far from 0: residuals are not
    cache.write(cache.append(seq, 10), x)
    mean = cache.gather(seq).mean(dim=0)
    assert torch.allclose(cache.summaries.centre[0].float(), mean, rtol=2**-7, atol=1e-3)
    assert float(cache.summaries.centre[0].float().mean()) > 4.0
