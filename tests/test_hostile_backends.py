"""Property: the reference and the Triton backend accept and refuse the same inputs.

Hypothesis draws one or two faults (a wrong dtype, shape, value, k, rope table, slot ...) into an otherwise
valid small call, runs it on both backends (Triton under TRITON_INTERPRET=1 on the CPU) and checks that both
succeed or both raise ValueError (never another exception type), that a refused store leaves the pool
unchanged, and that accepted score calls agree on which entries are masked (-inf) and which are NaN.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsakit import PagedBatch, PagedCache
from dsakit.formats import AttentionKVFormat, KeyFormat
from dsakit.ops.indexer import index_scores
from dsakit.ops.store import store_attention_kv, store_index_keys
from dsakit.ops.indexer import index_topk
from dsakit.ops.indexer.config import MAX_K
from dsakit.presets import KeyTransform
from dsakit.transforms import ROPE_V4, RopeConfig

pytestmark = pytest.mark.usefixtures("triton_backend")

H = 4
LENGTHS = (5, 70)  # entries of the two sequences (the second spans two pages)
QUERY_LENS = (1, 2)
T = sum(QUERY_LENS)

# -- index_scores / index_topk -----------------------------------------------------------------------

QUERY_FAULTS = {
    "q_dtype": [torch.float64, torch.int32, torch.bool, torch.float8_e5m2, torch.bfloat16, torch.float16,
                torch.float8_e4m3fn],
    "w_dtype": [torch.float64, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.bfloat16,
                torch.float16],
    "q_shape": ["rows", "dim", "flat", "list"],
    "w_shape": ["rows", "heads", "list"],
    "k": [0, -3, True, False, 2.0, "4", None, MAX_K + 1, 1, 200, MAX_K],
    "q_values": [math.nan, math.inf, -math.inf, 3e38],
    "block_table": ["repeated-page", "page-out-of-pool", "unassigned", "list"],
    "entry_counts": [129, -1, "list"],
    "query_seq": [2, -1, "list"],
    "positions": ["negative", "float", "short", "list", "valid"],
    "ratio": [0, True, 2.5, 4],
}


@st.composite
def query_faults(draw):
    names = draw(st.lists(st.sampled_from(sorted(QUERY_FAULTS)), min_size=1, max_size=2, unique=True))
    return {name: draw(st.sampled_from(QUERY_FAULTS[name])) for name in names}


def _valid_query_inputs(fmt: str):
    g = torch.Generator().manual_seed(7)
    cache = PagedCache(fmt, 5)
    seqs = [cache.add_sequence() for _ in LENGTHS]
    for s, n in zip(seqs, LENGTHS):
        cache.write(cache.append(s, n), torch.randn(n, 128, generator=g))
    q = torch.randn(T, H, 128, generator=g)
    w = torch.rand(T, H, generator=g)
    return cache, seqs, q, w


def _apply_query_faults(faults: dict, fmt: str):
    """-> (q, weights, k, thunk building the batch): the valid inputs with the faults written in."""
    cache, seqs, q, w = _valid_query_inputs(fmt)
    k = 8
    table, counts = cache.block_table(seqs), cache.entry_counts(seqs)
    query_seq = torch.tensor([0, 1, 1], dtype=torch.int32)
    positions, ratio = None, 1
    for name, value in faults.items():
        if name == "q_dtype":
            q = q.to(value)
        elif name == "w_dtype":
            w = w.to(value)
        elif name == "q_shape":
            q = {"rows": q[:2], "dim": q[..., :64], "flat": q[:, 0], "list": q.tolist()}[value]
        elif name == "w_shape":
            w = {"rows": w[:2], "heads": w[:, :2], "list": w.tolist()}[value]
        elif name == "k":
            k = value
        elif name == "q_values":
            q = q.clone()
            q[1, 2, 5] = value
        elif name == "block_table":
            table = table.clone()
            if value == "repeated-page":
                table[1, 1] = table[1, 0]
            elif value == "page-out-of-pool":
                table[1, 1] = 99
            elif value == "unassigned":
                table[1, 1] = -1
            else:
                table = table.tolist()
        elif name == "entry_counts":
            counts = counts.tolist() if value == "list" else torch.tensor([LENGTHS[0], value], dtype=torch.int32)
        elif name == "query_seq":
            query_seq = query_seq.tolist() if value == "list" else torch.tensor([0, 1, value], dtype=torch.int32)
        elif name == "positions":
            positions = {"negative": torch.tensor([3, -5, 60]), "float": torch.tensor([3.0, 5.0, 60.0]),
                         "short": torch.tensor([3, 5]), "list": [3, 5, 60],
                         "valid": torch.tensor([3, 5, 60])}[value]
        elif name == "ratio":
            ratio = value

    def batch():
        return PagedBatch.build(cache.pool, cache.fmt, table, counts, query_seq, positions, ratio)

    return q, w, k, batch


def _outcome(fn):
    """('ok', result) or ('refused', message); any exception but ValueError fails the test."""
    try:
        return "ok", fn()
    except ValueError as exc:
        return "refused", str(exc)


@settings(max_examples=30)
@given(fmt=st.sampled_from(["bf16", "fp8", "fp4", "fp8-centred"]), faults=query_faults())
def test_index_scores_and_topk_accept_and_refuse_alike(fmt, faults):
    q, w, k, batch = _apply_query_faults(faults, fmt)
    built = _outcome(batch)
    if built[0] == "refused":  # one validated batch for both backends: nothing backend-specific left
        return
    batch = built[1]
    scores = {b: _outcome(lambda b=b: index_scores(q, w, batch, backend=b)) for b in ("reference", "triton")}
    topk = {b: _outcome(lambda b=b: index_topk(q, w, batch, k, backend=b)) for b in ("reference", "triton")}
    for what, got in (("index_scores", scores), ("index_topk", topk)):
        assert got["reference"][0] == got["triton"][0], f"{what} {faults}: {got['reference']} vs {got['triton']}"
    if scores["reference"][0] == "ok":
        ref, tri = scores["reference"][1].cpu(), scores["triton"][1].cpu()
        assert ref.shape == tri.shape
        assert torch.equal(ref == -math.inf, tri == -math.inf) and torch.equal(ref.isnan(), tri.isnan())
    if topk["reference"][0] == "ok":
        assert topk["reference"][1].shape == topk["triton"][1].shape == (T, k)


# -- store_index_keys / store_attention_kv ------------------------------------------------------------

STORE_FAULTS = {
    "rows_dtype": [torch.float64, torch.int32, torch.bool, torch.bfloat16, torch.float16],
    "rows_shape": ["dim", "flat", "list"],
    "rope_width": [0, 30, 64, 65, 130],
    "table_dtype": [torch.float64, torch.bfloat16],
    "positions": ["beyond-table", "negative", "float", "short", "list"],
    "slots": ["duplicate", "beyond-pool", "padding", "float", "list"],
    "weight": ["int", "short", "list", "bool"],
    "eps": [math.inf, math.nan, -1e-6, "1e-6", 0.0],
}


@st.composite
def store_faults(draw):
    names = draw(st.lists(st.sampled_from(sorted(STORE_FAULTS)), min_size=1, max_size=2, unique=True))
    return {name: draw(st.sampled_from(STORE_FAULTS[name])) for name in names}


def _store_call(kind: str, fmt_name: str, faults: dict):
    """-> (store function, pool factory, kwargs with the faults written in)."""
    d = 128 if kind == "index" else 512
    fmt = KeyFormat.parse(fmt_name) if kind == "index" else AttentionKVFormat.parse(fmt_name)
    n = 3
    rows = torch.randn(n, d, generator=torch.Generator().manual_seed(3))
    width = 64
    positions = torch.tensor([0, 4, 9])
    slots = torch.tensor([0, 65, 7])
    weight = torch.rand(d) + 0.5
    eps = 1e-6
    table_dtype = torch.float32
    for name, value in faults.items():
        if name == "rows_dtype":
            rows = rows.to(value)
        elif name == "rows_shape":
            rows = {"dim": rows[:, :64], "flat": rows[0], "list": rows.tolist()}[value]
        elif name == "rope_width":
            width = value
        elif name == "table_dtype":
            table_dtype = value
        elif name == "positions":
            positions = {"beyond-table": torch.tensor([0, 4, 16]), "negative": torch.tensor([0, -1, 9]),
                         "float": torch.tensor([0.0, 4.0, 9.0]), "short": torch.tensor([0, 4]),
                         "list": [0, 4, 9]}[value]
        elif name == "slots":
            slots = {"duplicate": torch.tensor([0, 7, 7]), "beyond-pool": torch.tensor([0, 128, 7]),
                     "padding": torch.tensor([0, -1, 7]), "float": torch.tensor([0.0, 65.0, 7.0]),
                     "list": [0, 65, 7]}[value]
        elif name == "weight":
            weight = {"int": torch.ones(d, dtype=torch.int32), "short": weight[:64], "list": weight.tolist(),
                      "bool": torch.ones(d, dtype=torch.bool)}[value]
        elif name == "eps":
            eps = value
    table = RopeConfig(max(width + width % 2, 2), 10000.0).cos_sin_table(16)[:, :width].to(table_dtype)

    def pool():
        return torch.randint(0, 256, (2, fmt.page_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))

    if kind == "index":
        def call(p, backend):
            transform = KeyTransform("rmsnorm", ROPE_V4, width, True, eps)  # a bad eps or width: refused here
            store_index_keys(rows, positions, slots, p, fmt, table, weight, None, transform, backend=backend)
    else:
        def call(p, backend):
            store_attention_kv(rows, positions, slots, p, fmt, table, weight, ROPE_V4, eps, backend=backend)
    return call, pool


@settings(max_examples=30)
@given(target=st.sampled_from([("index", "bf16"), ("index", "fp8"), ("index", "fp4"), ("index", "fp4-centred"),
                               ("attention", "bf16"), ("attention", "fp8-rope-bf16")]), faults=store_faults())
def test_store_ops_accept_and_refuse_alike_and_refusals_leave_the_pool(target, faults):
    call, make_pool = _store_call(*target, faults)
    outcomes, pools = {}, {}
    for backend in ("reference", "triton"):
        pools[backend] = make_pool()
        outcomes[backend] = _outcome(lambda b=backend: call(pools[b], b))
    assert outcomes["reference"][0] == outcomes["triton"][0], f"{target} {faults}: {outcomes}"
    if outcomes["reference"][0] == "refused":
        assert torch.equal(pools["reference"], make_pool()) and torch.equal(pools["triton"], make_pool())
