"""Paged cache (dsakit.cache): allocator state machine, raw pool access, bad input leaves the pool unchanged."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from dsakit.cache import (
    PagedCache,
    bytes_per_token,
    check_slots,
    dequantize_entries,
    read_entries,
    sequence_slots,
    tokens_that_fit,
    write_entries,
)
from dsakit.formats import AttentionKVFormat, KeyFormat

# --------------------------------------------------------------------------------------------------
# Allocator state machine
# --------------------------------------------------------------------------------------------------


class PagedCacheMachine(RuleBasedStateMachine):
    """Random add / append / write / free sequences against a model of what each sequence holds.

    The cache uses bf16 (lossless for bf16-representable data), so ``gather`` must return exactly the
    values written. Page counts are not powers of two.
    """

    sequences = Bundle("sequences")

    def __init__(self):
        super().__init__()
        self.num_pages = 7
        self.cache = PagedCache(KeyFormat.BF16, num_pages=self.num_pages)
        self.model: dict[int, torch.Tensor] = {}  # seq -> rows written so far (bf16-exact fp32), NaN = unwritten
        self.counter = 0

    def _rows(self, n: int) -> torch.Tensor:
        # distinct, bf16-representable rows so a misplaced entry is caught
        self.counter += n
        base = torch.arange(self.counter - n, self.counter, dtype=torch.float32).unsqueeze(1)
        return (base + torch.arange(128) / 256.0).bfloat16().float()

    @rule(target=sequences)
    def add(self):
        seq = self.cache.add_sequence()
        self.model[seq] = torch.zeros(0, 128)
        return seq

    @rule(seq=sequences, n=st.integers(0, 150))
    def append_and_write(self, seq, n):
        if seq not in self.model:
            return
        free_before, pool_before = self.cache.free_pages, self.cache.pool.clone()
        old_len = self.cache.length(seq)
        have = (old_len + 63) // 64
        need = (old_len + n + 63) // 64 - have
        if need > free_before:
            with pytest.raises(ValueError, match="exhausted"):
                self.cache.append(seq, n)
            # all or nothing: no page taken, length unchanged, no byte changed
            assert self.cache.free_pages == free_before and self.cache.length(seq) == old_len
            assert torch.equal(self.cache.pool, pool_before)
            return
        slots = self.cache.append(seq, n)
        assert slots.shape == (n,) and self.cache.free_pages == free_before - need
        rows = self._rows(n)
        self.cache.write(slots, rows)
        self.model[seq] = torch.cat([self.model[seq], rows])

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if seq not in self.model:
            return
        pages = (self.cache.length(seq) + 63) // 64
        before = self.cache.free_pages
        self.cache.free_sequence(seq)
        del self.model[seq]
        assert self.cache.free_pages == before + pages
        with pytest.raises(ValueError, match=str(seq)):
            self.cache.length(seq)

    @invariant()
    def pages_are_owned_once_and_conserved(self):
        owned = []
        table = self.cache.block_table()
        for row, seq in enumerate(self.cache.sequences):
            pages = (self.cache.length(seq) + 63) // 64
            assert bool((table[row, :pages] >= 0).all()) and bool((table[row, pages:] == -1).all())
            owned += table[row, :pages].tolist()
        assert len(owned) == len(set(owned)), "a page is owned twice"
        assert len(owned) + self.cache.free_pages == self.num_pages
        assert all(0 <= p < self.num_pages for p in owned)

    @invariant()
    def slots_follow_block_table_and_gather_returns_writes(self):
        for row, seq in enumerate(self.cache.sequences):
            length = self.cache.length(seq)
            slots = self.cache.slots(seq)
            table = self.cache.block_table([seq])[0]
            expected = [int(table[i // 64]) * 64 + i % 64 for i in range(length)]
            assert slots.tolist() == expected
            assert torch.equal(self.cache.gather(seq), self.model[seq])
        assert self.cache.entry_counts().tolist() == [self.cache.length(s) for s in self.cache.sequences]


TestPagedCacheMachine = PagedCacheMachine.TestCase
TestPagedCacheMachine.settings = settings(max_examples=15, stateful_step_count=12, deadline=None)


# --------------------------------------------------------------------------------------------------
# Properties of the raw pool functions
# --------------------------------------------------------------------------------------------------


@given(num_pages=st.integers(1, 5), data=st.data())
@settings(max_examples=20)
def test_write_then_read_any_slots(num_pages, data):
    fmt = KeyFormat.FP8
    pool = torch.zeros(num_pages, fmt.page_bytes, dtype=torch.uint8)
    slot_list = data.draw(st.lists(st.integers(0, num_pages * 64 - 1), min_size=1, max_size=20, unique=True))
    slots = torch.tensor(slot_list)
    x = torch.randn(len(slot_list), 128)
    values, scales = fmt.quantize(x)
    write_entries(pool, fmt, slots, values, scales)
    got_v, got_s = read_entries(pool, fmt, slots)
    assert torch.equal(got_v, values) and torch.equal(got_s, scales)
    assert torch.equal(dequantize_entries(pool, fmt, slots), fmt.dequantize(values, scales))
    # bytes outside the written entries are still zero
    touched = torch.zeros_like(pool.view(-1), dtype=torch.bool)
    vo, so = fmt.byte_offsets(slots)
    for v0, s0 in zip(vo.tolist(), so.tolist()):
        touched[v0: v0 + fmt.value_bytes] = True
        touched[s0: s0 + fmt.scale_bytes] = True
    assert bool((pool.view(-1)[~touched] == 0).all())


def test_padding_slots_are_skipped():
    fmt = KeyFormat.FP4
    pool = torch.zeros(1, fmt.page_bytes, dtype=torch.uint8)
    values, scales = fmt.quantize(torch.randn(3, 128))
    write_entries(pool, fmt, torch.tensor([-1, 5, -7]), values, scales)
    got_v, got_s = read_entries(pool, fmt, torch.tensor([5]))
    assert torch.equal(got_v[0], values[1]) and torch.equal(got_s[0], scales[1])
    rest = torch.ones(64, dtype=torch.bool)
    rest[5] = False
    assert bool((read_entries(pool, fmt, torch.arange(64)[rest])[0] == 0).all())


def test_sequence_slots_and_block_table_padding():
    row = torch.tensor([4, 0, 2, -1], dtype=torch.int32)
    slots = sequence_slots(row, 130)
    assert slots[:64].tolist() == list(range(256, 320))
    assert slots[64:128].tolist() == list(range(0, 64))
    assert slots[128:].tolist() == [128, 129]
    with pytest.raises(ValueError, match="unassigned page"):
        sequence_slots(row, 193)
    with pytest.raises(ValueError, match="needs 5 pages"):
        sequence_slots(row, 257)


def test_pages_come_back_after_free_and_non_power_of_two_pool():
    cache = PagedCache("fp8", num_pages=3)
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append(a, 65)   # 2 pages
    cache.append(b, 64)   # 1 page
    assert cache.free_pages == 0
    with pytest.raises(ValueError, match="exhausted"):
        cache.append(b, 1)
    cache.free_sequence(a)
    assert cache.free_pages == 2
    slots = cache.append(b, 100)  # 64 + 100 = 164 entries -> 3 pages
    assert cache.length(b) == 164 and cache.free_pages == 0 and slots.shape == (100,)
    assert sorted(cache.block_table([b])[0].tolist()) == [0, 1, 2]


def test_bytes_per_token_and_tokens_that_fit():
    assert bytes_per_token(KeyFormat.FP8, 4) == 8448 / 64 / 4 == 33.0
    assert bytes_per_token(AttentionKVFormat.FP8_ROPE_BF16) == 37440 / 64
    assert tokens_that_fit(KeyFormat.FP4, 3 * 4352 + 100, compress_ratio=4) == 3 * 64 * 4
    assert PagedCache("bf16", 2).bytes_per_token(1) == 256
    with pytest.raises(ValueError, match="compress_ratio"):
        bytes_per_token(KeyFormat.FP8, 0)
    # regression: tokens_that_fit took any compress_ratio (a negative one gave a negative token count)
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="compress_ratio"):
            tokens_that_fit(KeyFormat.FP8, 10 ** 6, compress_ratio=bad)


# --------------------------------------------------------------------------------------------------
# Bad input: ValueError naming the value, pool unchanged byte for byte
# --------------------------------------------------------------------------------------------------


def filled_pool(fmt=KeyFormat.FP8, pages: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (pages, fmt.page_bytes), dtype=torch.uint8)


def encoded(n: int, fmt=KeyFormat.FP8):
    return fmt.quantize(torch.randn(n, 128))


@pytest.mark.parametrize("case,match", [
    ("slot_too_large", "slot 192"),
    ("duplicate_slot", "duplicate slot 7"),
    ("float_slots", "float32"),
    ("2d_slots", r"\[2, 1\]"),
    ("float_values", "float32"),
    ("wrong_value_shape", r"\[2, 127\]"),
    ("wrong_scale_shape", r"\[2, 3\]"),
])
def test_write_entries_bad_input_leaves_pool_unchanged(case, match):
    fmt = KeyFormat.FP8
    pool = filled_pool(fmt)
    before = pool.clone()
    values, scales = encoded(2, fmt)
    slots = torch.tensor([3, 7])
    if case == "slot_too_large":
        slots = torch.tensor([3, 192])  # pool of 3 pages holds slots 0..191
    elif case == "duplicate_slot":
        slots = torch.tensor([7, 7])
    elif case == "float_slots":
        slots = torch.tensor([3.0, 7.0])
    elif case == "2d_slots":
        slots = torch.tensor([[3], [7]])
    elif case == "float_values":
        values = values.float()
    elif case == "wrong_value_shape":
        values = values[:, :127]
    elif case == "wrong_scale_shape":
        scales = scales[:, :3]
    with pytest.raises(ValueError, match=match):
        write_entries(pool, fmt, slots, values, scales)
    assert torch.equal(pool, before)


def test_pool_shape_and_contiguity_are_checked():
    fmt = KeyFormat.FP4
    values, scales = encoded(1, fmt)
    with pytest.raises(ValueError, match="4352"):
        write_entries(torch.zeros(2, 4351, dtype=torch.uint8), fmt, torch.tensor([0]), values, scales)
    with pytest.raises(ValueError, match="int8"):
        write_entries(torch.zeros(2, 4352, dtype=torch.int8), fmt, torch.tensor([0]), values, scales)
    strided = torch.zeros(2, 2 * 4352, dtype=torch.uint8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        write_entries(strided, fmt, torch.tensor([0]), values, scales)
    assert bool((strided == 0).all())


@pytest.mark.parametrize("case,match", [
    ("out_of_range", "slot 640"), ("duplicate", "duplicate slot 1"), ("int_rows", "int64"),
    ("wrong_dim", r"\[2, 64\]"), ("count_mismatch", r"N = 3"), ("list_slots", "list")])
def test_paged_cache_write_bad_input(case, match):
    cache = PagedCache(KeyFormat.FP8, num_pages=10)
    seq = cache.add_sequence()
    cache.write(cache.append(seq, 2), torch.randn(2, 128))
    before = cache.pool.clone()
    slots, x = torch.tensor([0, 1]), torch.randn(2, 128)
    if case == "out_of_range":
        slots = torch.tensor([0, 640])
    elif case == "duplicate":
        slots = torch.tensor([1, 1])
    elif case == "int_rows":
        x = torch.ones(2, 128, dtype=torch.int64)
    elif case == "wrong_dim":
        x = torch.randn(2, 64)
    elif case == "count_mismatch":
        x = torch.randn(3, 128)
    elif case == "list_slots":  # regression: was an AttributeError
        slots = [0, 1]
    with pytest.raises(ValueError, match=match):
        cache.write(slots, x)
    assert torch.equal(cache.pool, before)


def test_paged_cache_argument_errors():
    with pytest.raises(ValueError, match="num_pages"):
        PagedCache("fp8", num_pages=0)
    with pytest.raises(ValueError, match="fp7"):
        PagedCache("fp7", num_pages=1)
    cache = PagedCache("fp8", num_pages=2)
    seq = cache.add_sequence()
    with pytest.raises(ValueError, match="-3"):
        cache.append(seq, -3)
    with pytest.raises(ValueError, match="unknown sequence id 42"):
        cache.append(42, 1)
    cache.append(seq, 10)
    with pytest.raises(ValueError, match="5..11"):
        cache.slots(seq, 5, 11)
    with pytest.raises(ValueError, match="width 0"):
        cache.block_table(width=0)
    assert cache.block_table(width=3).tolist() == [[0, -1, -1]]
    with pytest.raises(ValueError, match="width must be an int"):
        cache.block_table(width=2.0)
    with pytest.raises(ValueError, match="True"):
        cache.append(seq, True)
    with pytest.raises(ValueError, match="num_pages"):
        PagedCache("fp8", num_pages=True)


def test_check_slots_rejects_negative_when_padding_is_not_allowed():
    with pytest.raises(ValueError, match="slot -1"):
        check_slots(torch.tensor([0, -1]), 64, allow_padding=False)
    pool = filled_pool(KeyFormat.FP8, 1)
    with pytest.raises(ValueError, match="slot -1"):
        read_entries(pool, KeyFormat.FP8, torch.tensor([-1]))


def test_truncate_returns_pages_and_validates():
    cache = PagedCache(KeyFormat.FP8, num_pages=4)
    seq = cache.add_sequence()
    cache.append(seq, 150)  # 3 pages
    first = cache.slots(seq, 0, 64)
    cache.truncate(seq, 64)
    assert cache.length(seq) == 64 and cache.free_pages == 3
    assert torch.equal(cache.slots(seq), first)
    assert cache.block_table([seq]).shape == (1, 1)
    cache.truncate(seq, 0)
    assert cache.free_pages == 4
    for bad in (-1, 1, 0.5, True):
        with pytest.raises(ValueError, match="truncate length"):
            cache.truncate(seq, bad)
    with pytest.raises(ValueError, match="unknown sequence"):
        cache.truncate(99, 0)


def test_read_and_sequence_slots_validate_their_inputs():
    """Regression: empty slots skipped validation in read_entries (any dtype / shape passed), byte_offsets
    turned slot -1 into a negative offset, sequence_slots accepted a negative length or a 2-D row."""
    fmt = KeyFormat.FP4
    pool = torch.zeros(2, fmt.page_bytes, dtype=torch.uint8)
    for bad in (torch.zeros(0), torch.zeros(0, 3, dtype=torch.long), [0, 1]):
        with pytest.raises(ValueError, match="slots"):
            read_entries(pool, fmt, bad)
    values, scales = read_entries(pool, fmt, torch.zeros(0, dtype=torch.long))
    assert values.shape == (0, fmt.value_bytes) and scales.shape == (0, fmt.scale_bytes)
    with pytest.raises(ValueError, match=r"slots must be >= 0 .* -1"):
        fmt.byte_offsets(torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="int32/int64"):
        fmt.byte_offsets(torch.tensor([1.0]))
    row = torch.tensor([1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-negative int, got -1"):
        sequence_slots(row, -1)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        sequence_slots(row.reshape(1, 2), 5)
    assert sequence_slots(row, 0).shape == (0,)


def test_paged_cache_batch_equals_the_validated_batch():
    """PagedCache.batch (host metadata, no sync) gives the same PagedBatch the explicit constructor validates."""
    from dsakit import PagedBatch

    cache = PagedCache(KeyFormat.FP4, 8)
    a, b, c = (cache.add_sequence() for _ in range(3))
    cache.append(a, 70)
    cache.append(c, 5)
    cache.append(a, 64)  # a's pages are not contiguous
    positions = torch.tensor([3, 100, 7, 0, 4])
    got = cache.batch([a, b, c], query_lens=[2, 1, 2], query_positions=positions, ratio=4)
    want = PagedBatch.build(cache.pool, cache.fmt, cache.block_table([a, b, c]), cache.entry_counts([a, b, c]),
                            torch.tensor([0, 0, 1, 2, 2]), positions, 4)
    for name in ("block_table", "entry_counts", "query_seq", "query_positions"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == getattr(want, name).dtype and getattr(got, name).is_contiguous()
    for name in ("num_queries", "max_entries", "query_lens", "rows_sorted", "ratio", "fmt", "next_n"):
        assert getattr(got, name) == getattr(want, name), name
    assert got.max_entries == 134 and got.query_lens == (2, 1, 2) and got.next_n is None
    decode = cache.batch([c, a])  # default: one query per sequence, every entry visible
    assert decode.next_n == 1 and decode.query_positions is None and decode.query_seq.tolist() == [0, 1]
    with pytest.raises(ValueError, match="unknown sequence id"):
        cache.batch([a, 99])
    with pytest.raises(ValueError, match="query_lens"):
        cache.batch([a, b], query_lens=[1])
    with pytest.raises(ValueError, match="query_positions"):
        cache.batch([a, b], query_positions=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="ratio"):
        cache.batch([a], ratio=0)
    with pytest.raises(ValueError, match="attention entries"):
        PagedCache(AttentionKVFormat.BF16, 1).batch([])


@pytest.mark.parametrize("how", ["free", "truncate"])
def test_a_reused_centred_page_must_be_started_again(how):
    """A page-centred page freed by one sequence and handed to the next loses its start mark: writing its
    entries 1.. before entry 0 is refused, as on a fresh page (it was coded against the old owner's centre)."""
    cache = PagedCache(KeyFormat.FP8_CENTRED, num_pages=1)
    first = cache.add_sequence()
    cache.write(cache.append(first, 64), torch.randn(64, 128))
    if how == "free":
        cache.free_sequence(first)
        seq = cache.add_sequence()
    else:
        cache.truncate(first, 0)
        seq = first
    slots = cache.append(seq, 3)
    before = cache.pool.clone()
    with pytest.raises(ValueError, match="entry 0"):
        cache.write(slots[1:], torch.randn(2, 128))
    assert torch.equal(cache.pool, before)
    cache.write(slots, torch.randn(3, 128))  # entry 0 first (in the same call): the page starts again
    # a plain format keeps its bytes: nothing to restart
    plain = PagedCache(KeyFormat.FP8, num_pages=1)
    s = plain.add_sequence()
    plain.write(plain.append(s, 2), torch.randn(2, 128))
    kept = plain.pool.clone()
    plain.free_sequence(s)
    assert torch.equal(plain.pool, kept)
