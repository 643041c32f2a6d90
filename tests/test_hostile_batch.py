"""Hostile batch metadata (issue 24 items 2, 4 and 8): an unchecked batch never reads next to its block
table, int64 values are checked before they are narrowed, sizes no machine holds are ValueErrors."""

from __future__ import annotations

import os

import pytest
import torch

from dsakit.batch import PagedBatch
from dsakit.cache import PagedCache
from dsakit.formats import KeyFormat
from dsakit.ops.indexer import index_topk, index_topk_reference
from dsakit.ops.indexer.config import TopkConfig

#: the Triton top-k runs on a GPU, or on the CPU under the interpreter
TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _two_sequences(fmt: str = "bf16", device: str = "cpu"):
    """Two sequences of 70 and 20 entries in a 4-page pool; block table [2, 2]."""
    cache = PagedCache(fmt, num_pages=4, device=device)
    g = torch.Generator().manual_seed(5)
    for n in (70, 20):
        seq = cache.add_sequence()
        cache.write(cache.append(seq, n), torch.randn(n, 128, generator=g))
    return cache


def _unchecked(cache, query_seq):
    return PagedBatch.build(cache.pool, cache.fmt, cache.block_table(), cache.entry_counts(),
                            torch.tensor(query_seq, device=cache.pool.device), validate=False, max_entries=100)


def test_unchecked_query_seq_is_clamped_into_the_batch():
    """query_seq [0, 40, 1] with B = 2 and validate=False: the batch clamps 40 to 1 (no sync), so the slot
    mapping gathers block-table row 1, not the memory 38 rows past the table."""
    cache = _two_sequences()
    batch = _unchecked(cache, [0, 40, 1])
    assert batch.query_seq.tolist() == [0, 1, 1]
    negative = _unchecked(cache, [-7, 0, 1])
    assert negative.query_seq.tolist() == [0, 0, 1]


@pytest.mark.skipif(not TRITON, reason="the Triton top-k needs a GPU or TRITON_INTERPRET=1")
def test_unchecked_batch_slots_come_from_the_block_table():
    """index_topk(return_slots=True) with a small workspace on the unchecked batch: every slot it returns is
    a slot of the block table's pages (row 1 = sequence 1), the same as a checked batch of query_seq [0, 1, 1]."""
    cache = _two_sequences(device=DEVICE)
    g = torch.Generator().manual_seed(6)
    q, w = torch.randn(3, 4, 128, generator=g).to(DEVICE), torch.randn(3, 4, generator=g).to(DEVICE)
    config = TopkConfig(workspace_bytes=4 * 128)  # one row per chunk
    indices, slots = index_topk(q, w, _unchecked(cache, [0, 40, 1]), 8, backend="triton", return_slots=True,
                                config=config)
    checked = PagedBatch.build(cache.pool, cache.fmt, cache.block_table(), cache.entry_counts(),
                               torch.tensor([0, 1, 1], device=DEVICE))
    want_idx, want_slots = index_topk(q, w, checked, 8, backend="triton", return_slots=True, config=config)
    assert torch.equal(indices, want_idx) and torch.equal(slots, want_slots)
    pages = set(cache.block_table().flatten().tolist()) - {-1}
    assert all(s // 64 in pages for s in slots[slots >= 0].tolist())


@pytest.mark.skipif(not TRITON, reason="the Triton top-k needs a GPU or TRITON_INTERPRET=1")
def test_unchecked_batch_decode_plan_slots_come_from_the_block_table():
    """index_topk_decode with a return-slots plan on an unchecked batch of query_seq [0, 40] (B = 2)."""
    from dsakit.ops.indexer import index_topk_decode, plan_decode_topk

    cache = _two_sequences(device=DEVICE)
    g = torch.Generator().manual_seed(7)
    q, w = torch.randn(2, 1, 16, 128, generator=g).to(DEVICE), torch.randn(2, 1, 16, generator=g).to(DEVICE)
    plan = plan_decode_topk(2, 1, 100, 8, cache.fmt, DEVICE, num_heads=16, return_slots=True)
    _, slots = index_topk_decode(q, w, _unchecked(cache, [0, 40]), 8, plan=plan)
    pages = set(cache.block_table()[1].tolist()) - {-1}
    assert slots[1][slots[1] >= 0].numel() and all(s // 64 in pages for s in slots[1][slots[1] >= 0].tolist())


def test_unchecked_batch_without_sequences_refuses_queries():
    cache = _two_sequences()
    with pytest.raises(ValueError, match="no sequences"):
        PagedBatch.build(cache.pool, cache.fmt, torch.zeros(0, 2, dtype=torch.int32),
                         torch.zeros(0, dtype=torch.int32), torch.tensor([0]), validate=False, max_entries=4)


@pytest.mark.parametrize("field,value,match", [
    ("table", 2**32, r"block_table\[0, 0\] = 4294967296"),
    ("table", -2**32 + 1, r"block_table\[0, 0\] = -4294967295"),
    ("counts", 2**32 + 64, "4294967360"),
    ("seq", 2**32, "4294967296"),
])
def test_int64_values_are_checked_before_narrowing(field, value, match):
    """An int64 2**32 must not become page 0 (or a count of 64, or sequence 0) on its way to int32."""
    cache = _two_sequences()
    table, counts, seq = cache.block_table().long(), cache.entry_counts().long(), torch.tensor([0, 1])
    {"table": table, "counts": counts, "seq": seq}[field].view(-1)[0] = value
    with pytest.raises(ValueError, match=match):
        PagedBatch.build(cache.pool, cache.fmt, table, counts, seq)


def test_int64_batch_that_fits_is_accepted_and_narrowed():
    cache = _two_sequences()
    batch = PagedBatch.build(cache.pool, cache.fmt, cache.block_table().long(), cache.entry_counts().long(),
                             torch.tensor([0, 1, 1]))
    assert batch.block_table.dtype == batch.entry_counts.dtype == batch.query_seq.dtype == torch.int32
    q, w = torch.randn(3, 2, 128), torch.randn(3, 2)
    assert index_topk_reference(q, w, batch, 4).shape == (3, 4)


def test_sizes_no_machine_holds_are_value_errors():
    cache = _two_sequences()
    with pytest.raises(ValueError, match="queries"):
        cache.batch(query_lens=[10**12, 1])
    with pytest.raises(ValueError, match="block table"):
        cache.block_table(width=2**40)
    with pytest.raises(ValueError, match="block table"):
        PagedBatch.from_host(cache.pool, KeyFormat.BF16, [[0]], [10], width=2**40)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_cuda_device_without_cuda_is_a_value_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        PagedCache("fp8", 4, device="cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_a_layer_cache_on_cuda_without_cuda_is_a_value_error():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_layers_attention import random_layer

    layer = random_layer("csa", "reference", "cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        layer.new_cache(16, device="cuda")


# -- issue 35 item 5: clear errors at the batch / pool / tensor boundaries ---------------------------------


def test_negative_query_positions_are_refused():
    cache = _two_sequences()
    batch = cache.batch()
    with pytest.raises(ValueError, match="query_positions must be token positions >= 0.*-5"):
        PagedBatch.build(cache.pool, cache.fmt, batch.block_table, batch.entry_counts, batch.query_seq,
                         torch.tensor([-5, 3]))


def test_meta_tensors_are_a_value_error():
    cache = _two_sequences()
    with pytest.raises(ValueError, match="meta tensor"):
        cache.batch(query_lens=[1, 1], query_positions=torch.empty(2, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match="meta tensor"):
        index_topk(torch.empty(2, 4, 128, device="meta"), torch.rand(2, 4), cache.batch(), 4, backend="reference")


def test_pool_functions_refuse_a_format_name():
    from dsakit import pool

    cache = _two_sequences("fp8")
    for call in (lambda: pool.read_entries(cache.pool, "fp8", torch.tensor([0])),
                 lambda: pool.dequantize_entries(cache.pool, "fp8", torch.tensor([0])),
                 lambda: pool.store_entries(cache.pool, "fp8", torch.tensor([0]), torch.randn(1, 128)),
                 lambda: pool.check_pool(cache.pool, "fp8")):
        with pytest.raises(ValueError, match="fmt must be a dsakit.formats.EntryFormat.*KeyFormat.parse"):
            call()


@pytest.mark.parametrize("replaced", ["pool", "block_table"])
def test_a_checked_batch_with_a_replaced_pool_or_table_is_checked_again(replaced):
    """dataclasses.replace on a checked batch: the reference ops check its slots (ValueError, not IndexError)."""
    import dataclasses

    cache = _two_sequences()
    batch = cache.batch(query_lens=[1, 1])
    q, w = torch.randn(2, 4, 128), torch.rand(2, 4)
    swap = {"pool": torch.zeros(1, cache.pool.shape[1], dtype=torch.uint8),
            "block_table": torch.tensor([[99, 98], [97, 96]], dtype=torch.int32)}[replaced]
    bad = dataclasses.replace(batch, **{replaced: swap})
    assert bad.query_lens is None and batch.query_lens == (1, 1)
    with pytest.raises(ValueError, match="slots out of range"):
        index_topk(q, w, bad, 4, backend="reference")
    # the same batch rebuilt with its own tensors stays checked
    assert dataclasses.replace(batch).query_lens == (1, 1)
