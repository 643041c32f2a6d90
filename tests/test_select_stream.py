"""Streaming exact top-k (``select_topk_stream`` of dsakit.ops.indexer.select) against the reference ``select_topk``.

The select is exact, so on identical scores it must reproduce the reference bit for bit: same sets, same
order, same -1 padding. Tiny launch configurations (32-entry buffers and samples, 64-entry tiles) make rows
of a few hundred entries take every path: the candidate buffer, the tie lists (rows made mostly of exact
zeros), and the exact whole-row fallback when the sampled threshold misjudges a row; ``path_counts``
checks that each path really ran.
"""

from __future__ import annotations

import pytest
import torch

from dsakit.ops.indexer.reference import select_topk as reference_select

TINY = dict(cap=64, lanes=4, v=8, tie_cap=16, sample=32, num_warps=4, final_warps=4, order_warps=4, bins=32)


def _config(splits: int = 1):
    from dsakit.ops.indexer.config import StreamConfig

    return StreamConfig(splits=splits, **TINY)


def _run(scores, k, splits=1, **kw):
    from dsakit.ops.indexer.select import SelectBuffers, select_topk_stream

    buffers = SelectBuffers.allocate(scores.shape[0], scores.shape[1], k, scores.device,
                                     _config(splits))
    return select_topk_stream(scores, k, buffers=buffers, **kw), buffers.path_counts(scores.shape[0])


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _rows(n: int) -> torch.Tensor:
    """One row per rule: randn, ties at the k-th score, NaN / +-inf / -0.0, masked, shifted by +100, relu
    zeros (the top-k needs zeros: lowest indices win), only 3 candidates, rising (top entries at the end)."""
    s = torch.randn(8, n)
    s[0, 3: n // 2] = 1.25
    s[1, ::3] = float("-inf")
    s[1, 5], s[1, 7], s[1, 13] = float("nan"), float("inf"), float("nan")
    s[1, 9], s[1, 11] = -0.0, 0.0
    s[2] += 100.0
    s[3] = torch.relu(torch.randn(n) - 2.0)
    s[4] = 0.0
    s[5] = float("-inf")
    s[5, n - 3:] = torch.tensor([2.0, -1.0, 2.0])
    s[6] = torch.randn(n) + torch.linspace(0, 8, n)
    s[7] = torch.where(torch.rand(n) < 0.5, 0.0, -torch.rand(n))  # half zeros, rest negative
    return s


@pytest.mark.parametrize("splits", [1, 2])
def test_stream_select_equals_reference(triton_backend, splits):
    scores = _rows(256).to(_device())
    got, paths = _run(scores, 12, splits)
    assert torch.equal(got.cpu(), reference_select(scores.cpu(), 12))
    # every path ran: buffer (randn-like rows), tie lists (zeros), exact fallback (ties / few candidates)
    assert paths["buffer"] > 0 and paths["ties"] > 0 and paths["exact"] > 0, paths


def test_stream_select_counts_unsorted_and_deterministic(triton_backend):
    scores = _rows(200).to(_device())
    counts = torch.tensor([200, 150, 7, 0, 33, 200, 199, 64], dtype=torch.int32, device=scores.device)
    got, _ = _run(scores, 40, row_counts=counts)
    masked = scores.cpu().clone()
    for row, c in enumerate(counts.tolist()):
        masked[row, c:] = float("-inf")
    expected = reference_select(masked, 40)  # k > visible entries in several rows: -1 padding
    assert torch.equal(got.cpu(), expected)
    unsorted, _ = _run(scores, 40, row_counts=counts, sort=False)
    again, _ = _run(scores, 40, row_counts=counts, sort=False)
    assert torch.equal(unsorted, again)  # bitwise deterministic without the sort too
    assert torch.equal(torch.sort(unsorted.cpu(), dim=1).values, torch.sort(expected, dim=1).values)


def test_relu_zero_rows_same_set_on_every_backend(triton_backend):
    """Rows made mostly of exact zeros: every run and every backend selects the reference's set (the
    positive entries, then the lowest-index zeros), in the same order."""
    from dsakit.ops.indexer import select_topk
    from dsakit.ops.indexer.config import SelectConfig
    from dsakit.ops.indexer.select import select_topk_triton

    torch.manual_seed(3)
    scores = torch.relu(torch.randn(4, 300) - 1.8).to(_device())
    expected = reference_select(scores.cpu(), 48)
    first, paths = _run(scores, 48)
    second, _ = _run(scores, 48)
    assert paths["ties"] > 0
    assert torch.equal(first, second)
    assert torch.equal(first.cpu(), expected)
    multipass = SelectConfig(block=64, cap=32, bins=32, algorithm="multipass")
    assert torch.equal(select_topk_triton(scores, 48, config=multipass).cpu(), expected)
    assert torch.equal(select_topk(scores, 48, backend="triton").cpu(), expected)  # default: streaming select
    assert torch.equal(select_topk(scores.cpu(), 48, backend="reference"), expected)


def test_stream_select_rejects_bad_input(triton_backend):
    from dsakit.ops.indexer.config import STREAM_MAX_K, StreamConfig
    from dsakit.ops.indexer.select import select_topk_stream

    scores = torch.randn(2, 64, device=_device())
    with pytest.raises(ValueError, match="k must be"):
        select_topk_stream(scores, 0)
    with pytest.raises(ValueError, match="k must be"):
        select_topk_stream(scores, STREAM_MAX_K + 1)
    with pytest.raises(ValueError, match="fp32"):
        select_topk_stream(scores.double(), 4)
    with pytest.raises(ValueError, match="row_counts"):
        select_topk_stream(scores, 4, row_counts=torch.tensor([65, 1], device=scores.device))
    with pytest.raises(ValueError, match="power of two"):
        select_topk_stream(scores, 4, config=StreamConfig(splits=3, **TINY))


def test_default_config_tie_lists_reach_the_second_tile():
    """Every lane's tie list reaches its second tile (tie_cap >= 2 v), so a relu row of zeros is completed
    from the tie lists instead of the exact whole-row passes; every lane holds >= 64 candidates."""
    from dsakit.ops.indexer.config import SelectConfig

    for rows, width, k in [(64, 131072, 2048), (256, 131072, 2048), (64, 65536, 512), (8192, 65536, 2048)]:
        cfg = SelectConfig(stream_filter="warp").stream_for(rows, width, k)
        assert cfg.lane_cap >= 64 and cfg.tie_cap >= 2 * cfg.v, cfg


def test_cached_launch_in_row_slices(triton_backend):
    """A cached-buffer launch bounded to a few rows selects in consecutive row slices: same result."""
    from dsakit.ops.indexer.select import launch_stream_select_cached, release_select_buffers

    scores = _rows(96).to(_device())
    counts = torch.tensor([96, 50, 96, 96, 3, 96, 96, 96], dtype=torch.int32, device=scores.device)
    out = torch.empty((8, 5), dtype=torch.int32, device=scores.device)
    release_select_buffers()
    launch_stream_select_cached(scores, counts, out, 5, True, budget=1)  # one row per launch
    masked = scores.cpu().clone()
    for row, c in enumerate(counts.tolist()):
        masked[row, c:] = float("-inf")
    assert torch.equal(out.cpu(), reference_select(masked, 5))


def test_cached_launch_picks_its_launch_config_once(triton_backend, monkeypatch):
    """One cached-buffer launch asks SelectConfig.stream_for once (it used to ask twice: for the row budget
    and again for the buffers, with different shapes)."""
    from dsakit.ops.indexer.config import SelectConfig
    from dsakit.ops.indexer.select import launch_stream_select_cached, release_select_buffers

    calls = []
    real = SelectConfig.stream_for
    monkeypatch.setattr(SelectConfig, "stream_for", lambda self, *a: (calls.append(a), real(self, *a))[1])
    scores = _rows(96).to(_device())
    counts = torch.full((8,), 96, dtype=torch.int32, device=scores.device)
    out = torch.empty((8, 5), dtype=torch.int32, device=scores.device)
    release_select_buffers()
    launch_stream_select_cached(scores, counts, out, 5, True)
    assert len(calls) == 1
    assert torch.equal(out.cpu(), reference_select(scores.cpu(), 5))


def test_exact_row_stats_name_the_rows_and_why(triton_backend):
    """exact_row_stats lists the rows that took the exact passes, with each split's counters: the rows with
    fewer than k entries >= the threshold show it, and rows from the other paths are not listed."""
    from dsakit.ops.indexer.select import SelectBuffers, select_topk_stream

    scores = _rows(256).to(_device())
    buffers = SelectBuffers.allocate(8, 256, 12, scores.device, _config(2))
    select_topk_stream(scores, 12, buffers=buffers)
    paths = buffers.stats[:8, 0, 6].cpu()
    stats = buffers.exact_row_stats(8, most=8)
    assert sorted(stats) == [r for r in range(8) if paths[r] == 0] and stats
    for row, splits in stats.items():
        assert len(splits) == 2 and all(len(words) == 6 for words in splits)
        n_ge = sum(words[0] + words[1] for words in splits)
        overflow = max(words[5] for words in splits) > buffers.config.lane_cap
        assert overflow or n_ge < 12, (row, splits)  # the two reasons a row leaves the buffered path
    assert len(buffers.exact_row_stats(8, most=1)) == 1


@pytest.mark.parametrize("chunks", [2, 4, 64])
def test_chunked_order_equals_single_program_sort(triton_backend, chunks):
    """order_chunks > 1 (chunks sorted by separate programs, then each entry placed at its rank by binary
    searches) gives the one-program sort's output bitwise: every rule row, k not a power of two (padded
    chunks), rows with fewer candidates than k (-1 padding), ties, and the global slots of a paged batch."""
    from dataclasses import replace

    from dsakit.ops.indexer.select import SelectBuffers, launch_stream_select

    scores = _rows(256).to(_device())
    counts = torch.tensor([256, 200, 7, 0, 33, 256, 255, 64], dtype=torch.int32, device=scores.device)
    k = 40  # k_pad 64: chunks of 32 / 16 entries; 64 chunks are cut to 4 (chunks of >= 16 entries)
    table = torch.randperm(40, dtype=torch.int32).view(8, 5).to(scores.device)
    seq = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32, device=scores.device)
    results = []
    for order_chunks in (1, chunks):
        config = replace(_config(), order_chunks=order_chunks)
        buffers = SelectBuffers.allocate(8, 256, k, scores.device, config)
        out = torch.full((8, k), -5, dtype=torch.int32, device=scores.device)
        slots = torch.full((8, k), -5, dtype=torch.int32, device=scores.device)
        launch_stream_select(scores, counts, out, k, True, buffers, slots=slots, seq=seq, block_table=table)
        results.append((out.cpu(), slots.cpu()))
    masked = scores.cpu().clone()
    for row, c in enumerate(counts.tolist()):
        masked[row, c:] = float("-inf")
    assert torch.equal(results[0][0], reference_select(masked, k))
    assert torch.equal(results[1][0], results[0][0])
    assert torch.equal(results[1][1], results[0][1])
    with pytest.raises(ValueError, match="order_chunks"):
        replace(_config(), order_chunks=3)


def test_rows_that_fit_the_buffer_are_read_directly(triton_backend, monkeypatch):
    """Rows no wider than the candidate buffer skip the filter (the final kernel reads the scores): same
    result as the reference on every rule row, with counts, k above the candidates (-1 padding) and ties."""
    from dsakit.ops.indexer import select as _select_stream

    filters = []
    real_filter = _select_stream._launch_filter
    monkeypatch.setattr(_select_stream, "_launch_filter", lambda *a: (filters.append(1), real_filter(*a)))
    scores = _rows(64).to(_device())  # width 64 = TINY cap
    counts = torch.tensor([64, 50, 7, 0, 33, 64, 63, 64], dtype=torch.int32, device=scores.device)
    for k in (1, 5, 12, 40):
        got, paths = _run(scores, k, row_counts=counts)
        masked = scores.cpu().clone()
        for row, c in enumerate(counts.tolist()):
            masked[row, c:] = float("-inf")
        assert torch.equal(got.cpu(), reference_select(masked, k)), k
        assert paths == {"buffer": 8, "ties": 0, "exact": 0}
    assert not filters
    _run(_rows(65).to(_device()), 5)  # one entry wider than the buffer: the filter runs
    assert filters


def _launch_rule_before_the_move(rows: int, width: int, k: int) -> dict:
    """The streaming select's launch rule as it stood in ``_select_stream.StreamConfig.default`` (and its
    launcher's margin / sort-chunk rules) before it moved into ``SelectConfig.stream_for``: the move must
    not change one setting."""
    def pow2(x):
        return 1 << (max(1, x) - 1).bit_length()

    def pow2_floor(x):
        return 1 << (max(1, x).bit_length() - 1)

    splits = 1
    if rows < 512:
        splits = max(1, min(4, pow2_floor(2 * 512 // max(rows, 1)), pow2_floor(width // 8192)))
    cap = min(16384, max(4096, 4 * pow2(k)))
    sample = pow2(-(-128 * width // cap))
    if splits > 1:
        sample = max(sample, pow2(-(-64 * width // k)))
    sample = min(8192, max(256, sample))
    lanes = max(16, min(128, cap // (splits * 64)))
    v = max(8, 1024 // lanes)
    order_chunks = 4 if rows < 1024 else 1
    return dict(splits=splits, cap=cap, lanes=lanes, v=v, tie_cap=max(32, 2 * v), sample=sample, num_warps=8,
                final_warps=8, order_warps=2 if rows >= 512 else 4, bins=64, order_chunks=order_chunks,
                margin=5.0 if splits > 1 else 4.0, sort_chunks=min(order_chunks, max(1, pow2(k) // 16)))


def test_launch_settings_unchanged_by_the_move_into_select_config():
    from dsakit.ops.indexer.config import SelectConfig, TopkConfig

    select = SelectConfig()
    assert TopkConfig.for_device("cpu").select == select == SelectConfig.for_device(None)
    warp = SelectConfig(stream_filter="warp")  # the rule of the warp filter (the thread filter's: its own test)
    for rows in (1, 3, 8, 64, 100, 256, 300, 511, 512, 1000, 1024, 4096, 8192):
        for width in (64, 300, 4096, 8192, 65536, 131072, 262144, 1 << 20):
            for k in (1, 5, 16, 100, 512, 1024, 2048, 4096):
                cfg = warp.stream_for(rows, width, k)
                want = _launch_rule_before_the_move(rows, width, k)
                got = {name: getattr(cfg, name) for name in want if name not in ("margin", "sort_chunks")}
                got.update(margin=cfg.sample_margin, sort_chunks=cfg.sort_chunks(k))
                assert got == want, (rows, width, k)
    fixed = SelectConfig(stream=select.stream_for(64, 65536, 512))
    assert fixed.stream_for(8192, 300, 7) is fixed.stream  # a fixed launch overrides the rule
    assert select.uses_stream(4096) and not select.uses_stream(4097)
    assert SelectConfig(algorithm="stream").uses_stream(8192) and not SelectConfig(algorithm="multipass").uses_stream(1)
    for rows in (1, 511, 512, 8192):  # the chunking of index_topk_triton, as it was in its launcher
        for columns in (64, 65536, 262144, 1 << 20):
            config = TopkConfig(workspace_bytes=256 << 20)
            assert config.chunk_rows(rows, columns) == max(1, min(rows, (256 << 20) // (4 * columns)))
    assert select.stream_for(8, 4096, 16).reads_directly(4096)
    assert not select.stream_for(8, 65536, 16).reads_directly(65536)
    with pytest.raises(ValueError, match="stream must be"):
        SelectConfig(stream="fast")
    with pytest.raises(ValueError, match="visible_block"):
        SelectConfig(visible_block=0)


# --- the thread filter (StreamConfig.filter = "thread": one lane per thread, float compares) -----------------

THREAD = dict(TINY, v=1, unroll=4, filter="thread")


def _thread_run(scores, k, splits=1, **kw):
    from dsakit.ops.indexer.config import StreamConfig
    from dsakit.ops.indexer.select import SelectBuffers, select_topk_stream

    config = StreamConfig(splits=splits, **THREAD)
    buffers = SelectBuffers.allocate(scores.shape[0], scores.shape[1], k, scores.device, config)
    return select_topk_stream(scores, k, buffers=buffers, **kw), buffers.path_counts(scores.shape[0])


@pytest.mark.parametrize("splits", [1, 2, 4])
def test_thread_filter_equals_reference(triton_backend, splits):
    """Every rule row (ties at the k-th score, NaN / +-inf / -0.0, -inf, +100 shift, relu zeros, 3 candidates,
    rising, half zeros) bit for bit as the reference, with one threshold per row shared by 2 / 4 split
    programs; the buffer, tie-list and exact paths all ran."""
    scores = _rows(256).to(_device())
    got, paths = _thread_run(scores, 12, splits)
    assert torch.equal(got.cpu(), reference_select(scores.cpu(), 12))
    assert paths["buffer"] > 0 and paths["ties"] > 0 and paths["exact"] > 0, paths


@pytest.mark.parametrize("splits", [1, 2])
def test_thread_filter_counts_unsorted_deterministic(triton_backend, splits):
    """Rows shorter than k (-1 padding), empty rows, unsorted sets: as the reference and the warp filter,
    twice bitwise the same."""
    scores = _rows(200).to(_device())
    counts = torch.tensor([200, 150, 7, 0, 33, 200, 199, 64], dtype=torch.int32, device=scores.device)
    masked = scores.cpu().clone()
    for row, c in enumerate(counts.tolist()):
        masked[row, c:] = float("-inf")
    expected = reference_select(masked, 40)
    got, _ = _thread_run(scores, 40, splits, row_counts=counts)
    assert torch.equal(got.cpu(), expected)
    unsorted, _ = _thread_run(scores, 40, splits, row_counts=counts, sort=False)
    again, _ = _thread_run(scores, 40, splits, row_counts=counts, sort=False)
    assert torch.equal(unsorted, again)
    assert torch.equal(torch.sort(unsorted.cpu(), dim=1).values, torch.sort(expected, dim=1).values)
    warp, _ = _run(scores, 40, splits, row_counts=counts, sort=False)
    assert torch.equal(torch.sort(unsorted.cpu(), dim=1).values, torch.sort(warp.cpu(), dim=1).values)


def test_thread_filter_relu_zero_rows_and_nan_threshold(triton_backend):
    """Relu rows made mostly of exact zeros (and -0.0) take the tie lists and select the lowest-index zeros;
    a row whose threshold sample is NaN-flooded (threshold key = NaN) takes the exact passes."""
    torch.manual_seed(5)
    scores = torch.relu(torch.randn(6, 320) - 1.8)
    scores[1, 1::7] = -0.0
    scores[5] = float("nan")
    scores[5, 100:] = torch.randn(220)
    scores = scores.to(_device())
    for splits in (1, 2):
        got, paths = _thread_run(scores, 48, splits)
        assert torch.equal(got.cpu(), reference_select(scores.cpu(), 48)), splits
        assert paths["ties"] >= 4 and paths["exact"] >= 1, paths


def test_thread_filter_launch_rule():
    """stream_filter="thread" keeps the warp rule's buffer and lanes per row, one lane per thread, v = 1, tie
    lists >= 32 that together hold >= 2 k; the default is the warp filter for >= 512 rows and the thread filter
    for fewer (the H200's measurement), a pair picks per row count, and the configs validate."""
    from dataclasses import replace

    from dsakit.ops.indexer.config import SelectConfig, StreamConfig

    assert SelectConfig().stream_for(64, 131072, 2048).filter == "thread"
    assert SelectConfig().stream_for(511, 131072, 2048).filter == "thread"
    assert SelectConfig().stream_for(512, 65536, 2048).filter == "warp"
    assert SelectConfig(stream_filter=("thread", "warp")).stream_for(8192, 65536, 2048).filter == "thread"
    assert SelectConfig(stream_filter=("thread", "warp")).stream_for(64, 65536, 2048).filter == "warp"
    thread = SelectConfig(stream_filter="thread")
    for rows, width, k in [(64, 131072, 2048), (64, 65536, 2048), (256, 131072, 2048), (8192, 65536, 2048),
                           (8192, 65536, 512), (16, 262144, 4096)]:
        cfg, warp = thread.stream_for(rows, width, k), SelectConfig(stream_filter="warp").stream_for(rows, width, k)
        assert cfg.filter == "thread" and cfg.v == 1 and cfg.lanes == 32 * cfg.num_warps, cfg
        assert (cfg.splits, cfg.cap, cfg.sample) == (warp.splits, warp.cap, warp.sample)
        assert cfg.lane_cap >= 32 and cfg.tie_cap >= 32 and cfg.splits * cfg.lanes * cfg.tie_cap >= 2 * k, cfg
        assert cfg.unroll == (8 if rows >= 512 else 32) and cfg.block == cfg.lanes * cfg.unroll
    with pytest.raises(ValueError, match="v must be 1"):
        StreamConfig(splits=1, **dict(THREAD, v=2))
    with pytest.raises(ValueError, match="unroll"):
        StreamConfig(splits=1, **dict(TINY, unroll=2))
    with pytest.raises(ValueError, match="filter"):
        replace(StreamConfig(splits=1, **THREAD), filter="block")
    for bad in ("block", ("warp",), ("warp", "thread", "warp"), ("warp", "block"), ["warp", "thread"]):
        with pytest.raises(ValueError, match="stream_filter"):
            SelectConfig(stream_filter=bad)


def test_thread_filter_through_select_config(triton_backend):
    """A SelectConfig carrying a thread-filter launch reaches it through the public launcher (cached buffers,
    consecutive row slices under a small budget): the reference's result."""
    from dsakit.ops.indexer.config import SelectConfig, StreamConfig
    from dsakit.ops.indexer.select import select_topk_triton

    scores = _rows(160).to(_device())
    select = SelectConfig(algorithm="stream", stream=StreamConfig(splits=2, **THREAD), cached_bytes=1)
    assert torch.equal(select_topk_triton(scores, 9, config=select).cpu(), reference_select(scores.cpu(), 9))


def test_register_sort_equals_the_plain_sort(triton_backend):
    """register_sort (the winners loaded as a [rows, regs] tile, sorted as its flat sequence) gives the plain
    one-program sort's output bitwise: 4 registers a row (k 300, 1 warp: a 128 x 4 tile), ties, rows with fewer
    candidates than k (-1 padding), the global slots of a paged batch; and k = 40 (one register a row). Rows
    of 512 = cap entries: the final kernel reads them directly (the filters are tested above)."""
    from dataclasses import replace

    from dsakit.ops.indexer.config import StreamConfig
    from dsakit.ops.indexer.select import SelectBuffers, launch_stream_select

    scores = _rows(512).to(_device())
    scores[0, 3:400] = 1.25  # ties at the k-th score
    counts = torch.tensor([512, 500, 7, 0, 333, 512, 511, 320], dtype=torch.int32, device=scores.device)
    table = torch.randperm(8 * 8, dtype=torch.int32).view(8, 8).to(scores.device)
    seq = torch.arange(8, dtype=torch.int32, device=scores.device)
    masked = scores.cpu().clone()
    for row, c in enumerate(counts.tolist()):
        masked[row, c:] = float("-inf")
    for k in (300, 40):
        results = []
        for register_sort in (False, True):
            config = StreamConfig(splits=1, **dict(THREAD, cap=512, lanes=4, order_warps=1, register_sort=register_sort))
            buffers = SelectBuffers.allocate(8, 512, k, scores.device, config)
            out = torch.full((8, k), -5, dtype=torch.int32, device=scores.device)
            slots = torch.full((8, k), -5, dtype=torch.int32, device=scores.device)
            launch_stream_select(scores, counts, out, k, True, buffers, slots=slots, seq=seq, block_table=table)
            results.append((out.cpu(), slots.cpu()))
        assert torch.equal(results[0][0], reference_select(masked, k)), k
        assert torch.equal(results[1][0], results[0][0]) and torch.equal(results[1][1], results[0][1]), k
    with pytest.raises(ValueError, match="register_sort"):
        replace(_config(), register_sort=1)


def test_sample_groups_keep_page_clustered_rows_off_the_exact_path(triton_backend):
    """Rows whose 64-entry pages carry offsets of 3 standard deviations of the rest (the centred formats' page
    term, neighbouring tokens alike): the default sample (groups of 8 at offsets that walk through the row's
    slices) sends none of these 8 rows to the exact whole-row passes, where groups of 32 sent 4 (the layout
    before: with the sample's entries correlated in runs of 32, its 5-sigma margin covers about one). Both give
    the exact top-k; the decode launch rule of 64 rows (4 split programs, thread filter) at 32768 x k 1024."""
    import dataclasses

    from dsakit.ops.indexer.config import SelectConfig
    from dsakit.ops.indexer.select import SelectBuffers, launch_stream_select

    n, k = 32768, 1024
    gen = torch.Generator().manual_seed(1)
    page = torch.randn(8, n // 64, generator=gen) * 3.0
    scores = (page.repeat_interleave(64, dim=1) + torch.randn(8, n, generator=gen)).to(_device())
    counts = torch.full((8,), n, dtype=torch.int32, device=scores.device)
    default = SelectConfig().stream_for(64, n, k)
    assert default.sample_group == 8 and default.splits == 4
    exact_rows = {}
    for group in (8, 32):
        cfg = dataclasses.replace(default, sample_group=group)
        buffers = SelectBuffers.allocate(8, n, k, scores.device, cfg)
        out = torch.empty((8, k), dtype=torch.int32, device=scores.device)
        launch_stream_select(scores, counts, out, k, True, buffers)
        assert torch.equal(out.cpu(), reference_select(scores.cpu(), k))
        exact_rows[group] = buffers.path_counts(8)["exact"]
    assert exact_rows[8] == 0 and exact_rows[32] >= 2, exact_rows


def test_sample_group_is_validated():
    from dsakit.ops.indexer.config import SelectConfig, StreamConfig

    for bad in (0, 3, 64):
        with pytest.raises(ValueError, match="sample_group"):
            StreamConfig(splits=1, **dict(TINY, sample_group=bad))
        with pytest.raises(ValueError, match="stream_sample_group"):
            SelectConfig(stream_sample_group=bad)
