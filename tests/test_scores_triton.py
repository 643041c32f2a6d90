"""Triton index-scores kernels against the reference (CPU under TRITON_INTERPRET=1, or CUDA).

Two bounds per case (DeepGEMM's method): a tight one against the reference run on the same operands the
kernel multiplies (q rounded to bf16 when it is fp32, keys dequantized from the cache), which isolates kernel
error; and a loose one per format against fp32 scores of the unquantized keys, which documents what the
storage format costs. -inf masks must match exactly; outputs are NaN-poisoned before the kernel writes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsakit import PagedBatch
from dsakit.cache import PagedCache
from dsakit.formats import KeyFormat, key_codec
from dsakit.ops.indexer import ScoresConfig, index_scores
from dsakit.ops.indexer.reference import index_scores as _reference_scores
from dsakit.ops.indexer.reference import index_scores_dense

pytestmark = pytest.mark.usefixtures("triton_backend")

FORMATS = ["bf16", "fp8", "fp8-ue8m0", "fp4", "fp4-rne"]
# Relative L2 error of scores from quantized keys against fp32 scores of the original keys (loose bound).
# Measured on randn keys and queries: bf16 ~3e-3, fp8 ~3e-2, fp4 ~0.15; the bounds leave about 2x margin.
LOOSE_REL_L2 = {"bf16": 1e-2, "fp8": 6e-2, "fp8-ue8m0": 8e-2, "fp4": 0.3, "fp4-rne": 0.3}
# Tight bound: same operands, only fp32 accumulation order differs. On a GPU, fp8 x fp8 products go through
# Hopper's fp8 wgmma, which accumulates with fewer than fp32 mantissa bits (measured ~6e-5 relative on H200).
TIGHT_RTOL = 1e-5
TIGHT_RTOL_FP8_DOT_GPU = 5e-4


def tight_rtol(fmt_name: str, q_dtype: torch.dtype, device: str) -> float:
    # fp4 keys with fp8 q go through fp8 tensor cores in the decode kernel (ScoresConfig.decode_fp4 "blocks")
    fp8_dot = fmt_name.startswith(("fp8", "fp4")) and q_dtype == torch.float8_e4m3fn
    return TIGHT_RTOL_FP8_DOT_GPU if fp8_dot and device == "cuda" else TIGHT_RTOL


def _triton():
    from dsakit.ops.indexer import scores as scores_triton

    return scores_triton


def _plans():
    from dsakit.ops.indexer import plans

    return plans


def make_cache(fmt: str, lengths: list[int], device: str, pages_extra: int = 2):
    """Cache with sequences of ``lengths`` random entries (pages interleaved between sequences)."""
    fmt = KeyFormat.parse(fmt)
    pages = sum((n + 63) // 64 for n in lengths) + pages_extra
    cache = PagedCache(fmt, pages)
    seqs = [cache.add_sequence() for _ in lengths]
    keys = {}
    # append in rounds of one page so that sequences get interleaved, non-contiguous pages
    remaining = dict(zip(seqs, lengths))
    while any(remaining.values()):
        for s in seqs:
            n = min(64, remaining[s])
            if n:
                slots = cache.append(s, n)
                x = torch.randn(n, 128)
                cache.write(slots, x)
                keys.setdefault(s, []).append(x)
                remaining[s] -= n
    originals = [torch.cat(keys[s]) if s in keys else torch.zeros(0, 128) for s in seqs]
    pool = cache.pool.to(device)
    return fmt, pool, cache.block_table().to(device), cache.entry_counts().to(device), originals


def assert_scores_match(out: torch.Tensor, ref: torch.Tensor, rtol: float = TIGHT_RTOL) -> None:
    out, ref = out.cpu(), ref.cpu()
    assert out.shape == ref.shape
    assert not torch.isnan(out).any(), "kernel left an element unwritten (NaN poison) or produced NaN"
    assert torch.equal(torch.isneginf(out), torch.isneginf(ref)), "-inf masks differ"
    finite = torch.isfinite(ref)
    if finite.any():
        scale = ref[finite].abs().max()
        torch.testing.assert_close(out[finite], ref[finite], rtol=rtol, atol=rtol * float(scale))


def batch_of(pool, fmt, table, counts, query_seq, positions=None, ratio=1, *, validate=True, max_entries=None):
    return PagedBatch.build(pool, fmt, table, counts, query_seq, positions, ratio, validate=validate,
                            max_entries=max_entries)


def reference_scores(q, w, pool, fmt, table, counts, query_seq, positions=None, ratio=1):
    """The reference on a batch of these (CPU) tensors."""
    batch = batch_of(pool.cpu(), fmt, table.cpu(), counts.cpu(), query_seq.cpu(),
                     None if positions is None else positions.cpu(), ratio)
    return _reference_scores(q.cpu(), w.cpu(), batch)


def scores_kernel(q, w, pool, fmt, table, counts, query_seq, positions=None, ratio=1, *, out=None, q_scale=None,
                  tiles=None, validate=True, kernel="auto", **tuning):
    """index_scores_triton on a batch of these tensors (validate=False: an unchecked batch as wide as out)."""
    batch = batch_of(pool, fmt, table, counts, query_seq, positions, ratio, validate=validate,
                     max_entries=None if validate else out.shape[1])
    return _triton().index_scores_triton(q, w, batch, out=out, q_scale=q_scale, tiles=tiles,
                                         config=ScoresConfig(kernel=kernel, **tuning))


def decode_kernel(q, w, pool, fmt, table, counts, positions=None, *, out=None, validate=True):
    """index_scores_decode on the decode batch of these tensors (row b * next_n + i = query i of sequence b)."""
    b, next_n = q.shape[:2]
    query_seq = torch.arange(b, dtype=torch.int32, device=q.device).repeat_interleave(next_n)
    batch = batch_of(pool, fmt, table, counts, query_seq, None if positions is None else positions.reshape(-1), 1,
                     validate=validate, max_entries=None if validate else out.shape[1])
    return _triton().index_scores_decode(q, w, batch, out=out)


def run_kernel(q, w, pool, fmt, table, counts, query_seq, positions, ratio, **kw):
    t = q.shape[0]
    width = int(counts.max()) if counts.numel() else 0
    out = torch.full((t, width), float("nan"), device=q.device)
    return scores_kernel(q, w, pool, fmt, table, counts, query_seq, positions, ratio, out=out, **kw)


def operand_queries(q: torch.Tensor) -> torch.Tensor:
    """The fp32 values the kernel multiplies: fp32 / fp16 queries are rounded to bf16 first."""
    if q.dtype in (torch.float32, torch.float16):
        return q.to(torch.bfloat16).float()
    return q.float()


# --------------------------------------------------------------------------------------------------
# Correctness: formats x query dtypes x kernels, ragged causal batches
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", ["tile", "group"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn],
                         ids=["q-bf16", "q-fp32", "q-fp8"])
@pytest.mark.parametrize("fmt_name", FORMATS)
def test_matches_reference(fmt_name, q_dtype, kernel, device):
    lengths = [130, 0, 67, 1]  # non-powers of two, an empty sequence, a one-entry sequence
    fmt, pool, table, counts, _ = make_cache(fmt_name, lengths, device)
    h = 16
    if kernel == "tile":  # ragged, unsorted: several queries per sequence, causal with ratio 4
        query_seq = torch.tensor([0] * 9 + [2] * 5 + [1] * 2 + [3] + [0] * 3, dtype=torch.int32)
        query_seq = query_seq[torch.randperm(query_seq.numel())]
        positions = torch.randint(-2, 4 * 140, (query_seq.numel(),), dtype=torch.int32)
        ratio = 4
    else:  # decode: <= 2 queries per sequence, plain causal
        query_seq = torch.tensor([0, 0, 1, 2, 2, 3], dtype=torch.int32)
        positions = torch.tensor([128, 129, 5, 30, 66, 0], dtype=torch.int32)
        ratio = 1
    t = query_seq.numel()
    q = torch.randn(t, h, 128).to(q_dtype)
    w = torch.rand(t, h) - 0.25
    q_scale = torch.rand(t, h) + 0.5 if q_dtype == torch.float8_e4m3fn else None
    out = run_kernel(q.to(device), w.to(device), pool, fmt, table, counts, query_seq.to(device), positions.to(device),
                     ratio, q_scale=None if q_scale is None else q_scale.to(device), kernel=kernel)
    w_eff = w if q_scale is None else w * q_scale
    ref = reference_scores(operand_queries(q), w_eff, pool.cpu(), fmt, table.cpu(), counts.cpu(), query_seq,
                           positions, ratio)
    assert_scores_match(out, ref, tight_rtol(fmt_name, q_dtype, device))
    again = run_kernel(q.to(device), w.to(device), pool, fmt, table, counts, query_seq.to(device),
                       positions.to(device), ratio, q_scale=None if q_scale is None else q_scale.to(device),
                       kernel=kernel)
    assert torch.equal(out.cpu(), again.cpu()), "two runs on the same input differ (must be bitwise deterministic)"


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["q-bf16", "q-fp8"])
@pytest.mark.parametrize("fmt_name", ["fp4", "fp4-rne"])
def test_decode_fp4_paths(fmt_name, q_dtype, device):
    """Both fp4 paths of the decode kernel (per-block e4m3 dots, bf16 dequantization) match the reference,
    on keys whose four block scales within an entry differ by up to 2^20 (one block scaled 1e-6, one 1e3)."""
    fmt = KeyFormat.parse(fmt_name)
    cache = PagedCache(fmt, 8)
    lengths = [150, 70, 3]
    seqs = [cache.add_sequence() for _ in lengths]
    gen = torch.Generator().manual_seed(5)
    for s, n in zip(seqs, lengths):
        x = torch.randn(n, 128, generator=gen)
        x[:, 32:64] *= 1e-6
        x[:, 96:] *= 1e3
        x[::7, :32] = 0.0  # an all-zero block (scale at the 1e-4 floor)
        cache.write(cache.append(s, n), x)
    pool, table, counts = cache.pool.to(device), cache.block_table().to(device), cache.entry_counts().to(device)
    query_seq = torch.tensor([0, 0, 1, 2], dtype=torch.int32)
    positions = torch.tensor([149, 100, 69, 2], dtype=torch.int32)
    t, h = 4, 16
    q = torch.randn(t, h, 128, generator=gen).to(q_dtype)
    w = torch.rand(t, h, generator=gen) - 0.25
    ref = reference_scores(q.float(), w, pool.cpu(), fmt, table.cpu(), counts.cpu(), query_seq, positions, 1)
    outs = {}
    for mode in ("blocks", "dequant"):
        outs[mode] = run_kernel(q.to(device), w.to(device), pool, fmt, table, counts, query_seq.to(device),
                                positions.to(device), 1, kernel="group", decode_fp4=mode)
        assert_scores_match(outs[mode], ref, tight_rtol(fmt_name, q_dtype, device))
    if device == "cpu" or q_dtype != torch.float8_e4m3fn:  # the same fp32 products, summed in another order
        assert_scores_match(outs["blocks"], outs["dequant"])
    with pytest.raises(ValueError, match="decode_fp4"):
        ScoresConfig(decode_fp4="fp16")


@pytest.mark.parametrize("fmt_name", ["bf16", "fp8", "fp4"])
def test_loose_bound_against_unquantized_keys(fmt_name, device):
    """Scores from the stored format versus fp32 scores of the original keys: the format's documented cost."""
    lengths = [200]
    fmt, pool, table, counts, originals = make_cache(fmt_name, lengths, device)
    t, h = 24, 16
    q = torch.randn(t, h, 128, dtype=torch.bfloat16)
    w = torch.rand(t, h)
    query_seq = torch.zeros(t, dtype=torch.int32)
    out = run_kernel(q.to(device), w.to(device), pool, fmt, table, counts, query_seq.to(device), None, 1).cpu()
    exact = index_scores_dense(q.float(), w, originals[0])
    rel = float((out - exact).norm() / exact.norm())
    assert rel < LOOSE_REL_L2[fmt_name], f"{fmt_name}: relative L2 error {rel:.3g} above {LOOSE_REL_L2[fmt_name]}"


def test_public_dispatcher_backends(device):
    fmt, pool, table, counts, _ = make_cache("fp8", [70, 20], device)
    q = torch.randn(5, 16, 128, dtype=torch.bfloat16, device=device)
    w = torch.rand(5, 16, device=device)
    query_seq = torch.tensor([1, 0, 0, 1, 0], dtype=torch.int32, device=device)
    positions = torch.tensor([3, 69, 0, 40, 10], dtype=torch.int32, device=device)
    batch = batch_of(pool, fmt, table, counts, query_seq, positions, 1)
    tri = index_scores(q, w, batch, backend="triton")
    ref = index_scores(q, w, batch, backend="reference")
    assert_scores_match(tri, ref)
    with pytest.raises(ValueError, match="unknown backend"):
        index_scores(q, w, batch, backend="cuda")
    with pytest.raises(ValueError, match="PagedBatch"):
        index_scores(q, w, pool, backend="reference")


# --------------------------------------------------------------------------------------------------
# Corner cases
# --------------------------------------------------------------------------------------------------


def test_empty_batch_and_empty_sequences(device):
    fmt, pool, table, counts, _ = make_cache("bf16", [0, 0], device)
    kernel = scores_kernel
    q = torch.randn(3, 16, 128, device=device)
    w = torch.rand(3, 16, device=device)
    out = kernel(q, w, pool, fmt, table, counts, torch.tensor([0, 1, 1], dtype=torch.int32, device=device))
    assert out.shape == (3, 0)
    out = kernel(q[:0], w[:0], pool, fmt, table, counts, torch.zeros(0, dtype=torch.int32, device=device))
    assert out.shape == (0, 0)


def test_rows_that_see_nothing_are_all_neg_inf(device):
    fmt, pool, table, counts, _ = make_cache("fp8", [100, 0], device)
    q = torch.randn(4, 16, 128, device=device)
    w = torch.rand(4, 16, device=device)
    query_seq = torch.tensor([0, 0, 1, 0], dtype=torch.int32, device=device)
    positions = torch.tensor([2, 0, 50, 3], dtype=torch.int32, device=device)  # ratio 4: 0, 0, 0, 1 visible
    out = run_kernel(q, w, pool, fmt, table, counts, query_seq, positions, 4).cpu()
    assert torch.isneginf(out[:3]).all()
    assert torch.isfinite(out[3, :1]).all() and torch.isneginf(out[3, 1:]).all()


def test_workspace_out_slice_is_bounded(device):
    """out wider than needed and taller than T: only out[:T, :W'] is written, rows beyond stay untouched."""
    fmt, pool, table, counts, _ = make_cache("fp4", [90, 33], device)
    t, h = 6, 16
    q = torch.randn(t, h, 128, dtype=torch.bfloat16, device=device)
    w = torch.rand(t, h, device=device)
    query_seq = torch.tensor([0, 1, 0, 1, 0, 0], dtype=torch.int32, device=device)
    positions = torch.tensor([10, 32, 89, 5, 50, 200], dtype=torch.int32, device=device)
    ws = torch.full((t + 3, 128), float("nan"), device=device)
    result = scores_kernel(q, w, pool, fmt, table, counts, query_seq, positions, 1, out=ws[:, :100])
    assert result.shape == (t, 100) and result.data_ptr() == ws.data_ptr()
    ref = reference_scores(q.float(), w.cpu(), pool.cpu(), fmt, table.cpu(), counts.cpu(), query_seq.cpu(),
                           positions.cpu(), 1)
    expect = torch.full((t, 100), float("-inf"))
    expect[:, :90] = ref
    assert_scores_match(result, expect)
    assert torch.isnan(ws[t:]).all() and torch.isnan(ws[:, 100:]).all(), "kernel wrote outside out[:T, :W']"
    # rows that share memory (an expanded tensor) would overwrite each other's scores: refused
    with pytest.raises(ValueError, match="overlap"):
        scores_kernel(q, w, pool, fmt, table, counts, query_seq, positions, 1,
                                      out=torch.full((1, 100), float("nan"), device=device).expand(t, 100))
    # W' smaller than a row's visible count would silently drop entries: refused
    with pytest.raises(ValueError, match="visible count"):
        scores_kernel(q, w, pool, fmt, table, counts, query_seq, positions, 1, out=ws[:, :60])


def test_non_contiguous_inputs(device):
    fmt, pool, table, counts, _ = make_cache("bf16", [75], device)
    t, h = 5, 16
    big_q = torch.randn(t, 2 * h, 256, dtype=torch.bfloat16, device=device)
    q = big_q[:, ::2, 64:192]  # strided heads, offset dims (last-dim stride 1 kept)
    w = torch.rand(h, t, device=device).t()  # transposed weights
    query_seq = torch.zeros(t, dtype=torch.int32, device=device)
    out = run_kernel(q, w, pool, fmt, table, counts, query_seq, None, 1)
    ref = reference_scores(q.float().cpu(), w.cpu(), pool.cpu(), fmt, table.cpu(), counts.cpu(), query_seq.cpu())
    assert_scores_match(out, ref)


def test_strided_metadata(device):
    """A column-strided block table and strided counts / positions give the same scores as contiguous ones."""
    fmt, pool, table, counts, _ = make_cache("fp8", [130, 70], device)
    t, h = 6, 16
    q = torch.randn(t, h, 128, dtype=torch.bfloat16, device=device)
    w = torch.rand(t, h, device=device)
    query_seq = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.int32, device=device)
    positions = torch.tensor([100, 300, 519, 50, 200, 279], device=device)
    wide = torch.full((table.shape[0], 2 * table.shape[1]), -7, dtype=table.dtype, device=device)
    wide[:, ::2] = table
    strided_counts = torch.stack([counts, counts], dim=1)[:, 0]
    strided_positions = torch.stack([positions, positions], dim=1)[:, 0]
    assert wide[:, ::2].stride(1) == 2 and strided_counts.stride(0) == 2 and strided_positions.stride(0) == 2
    out = run_kernel(q, w, pool, fmt, wide[:, ::2], strided_counts, query_seq, strided_positions, 4)
    ref = run_kernel(q, w, pool, fmt, table, counts, query_seq, positions, 4)
    assert torch.equal(out.cpu(), ref.cpu())


def test_nan_key_propagates_like_reference(device):
    """A NaN stored in a bf16 key gives NaN scores (as torch.relu does), never a silently finite value."""
    fmt = KeyFormat.BF16
    cache = PagedCache(fmt, 2)
    s = cache.add_sequence()
    slots = cache.append(s, 10)
    x = torch.randn(10, 128)
    x[3, 7] = float("nan")
    cache.write(slots, x)
    q = torch.randn(2, 16, 128, device=device)
    w = torch.rand(2, 16, device=device)
    query_seq = torch.zeros(2, dtype=torch.int32, device=device)
    out = scores_kernel(q, w, cache.pool.to(device), fmt, cache.block_table().to(device),
                                        cache.entry_counts().to(device), query_seq).cpu()
    assert torch.isnan(out[:, 3]).all()
    assert torch.isfinite(out[:, [0, 1, 2, 4, 5]]).all()


@settings(max_examples=8)
@given(lengths=st.lists(st.integers(0, 150), min_size=1, max_size=3),
       queries=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 700)), min_size=1, max_size=12),
       ratio=st.sampled_from([1, 4]), fmt_name=st.sampled_from(["fp8", "fp4", "bf16"]))
def test_random_ragged_batches(lengths, queries, ratio, fmt_name):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fmt, pool, table, counts, _ = make_cache(fmt_name, lengths, device)
    query_seq = torch.tensor([s % len(lengths) for s, _ in queries], dtype=torch.int32)
    positions = torch.tensor([p for _, p in queries], dtype=torch.int32)
    t = len(queries)
    q = torch.randn(t, 16, 128, dtype=torch.bfloat16)
    w = torch.rand(t, 16)
    out = run_kernel(q.to(device), w.to(device), pool, fmt, table, counts, query_seq.to(device),
                     positions.to(device), ratio)
    ref = reference_scores(q.float(), w, pool.cpu(), fmt, table.cpu(), counts.cpu(), query_seq, positions, ratio)
    assert_scores_match(out, ref)


# --------------------------------------------------------------------------------------------------
# Decode wrapper and the DeepGEMM-compatible function
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("next_n", [1, 2])
def test_decode_wrapper(next_n, device):
    lengths = [65, 1, 130]
    fmt, pool, table, counts, _ = make_cache("fp8", lengths, device)
    b, h = len(lengths), 16
    q = torch.randn(b, next_n, h, 128, device=device).to(torch.float8_e4m3fn)
    w = torch.rand(b * next_n, h, device=device)
    # positions >= 0 (a batch refuses negative ones): the 1-entry sequence's first query sees its entry too
    positions = (counts.long()[:, None] - next_n + torch.arange(next_n, device=device)[None, :]).clamp(min=0)
    positions = positions.to(torch.int32)
    out = decode_kernel(q, w, pool, fmt, table, counts, positions)
    query_seq = torch.arange(b, dtype=torch.int32).repeat_interleave(next_n)
    ref = reference_scores(q.float().reshape(b * next_n, h, 128).cpu(), w.cpu(), pool.cpu(), fmt, table.cpu(),
                           counts.cpu(), query_seq, positions.reshape(-1).cpu(), 1)
    assert_scores_match(out, ref, tight_rtol("fp8", q.dtype, device))
    # the last query of each sequence sees every entry
    last = out.cpu().reshape(b, next_n, -1)[:, -1]
    for i, n in enumerate(lengths):
        assert torch.isfinite(last[i, :n]).all() and torch.isneginf(last[i, n:]).all()
    # non-tensor arguments are named (they used to escape as AttributeError)
    with pytest.raises(ValueError, match="weights must be a torch.Tensor"):
        decode_kernel(q, w.tolist(), pool, fmt, table, counts, positions)
    with pytest.raises(ValueError, match="block_table must be"):
        decode_kernel(q, w, pool, fmt, table.tolist(), counts, positions)


def deepgemm_semantics(q, kv_cache, weights, context_lens, block_table, max_len):
    """Independent torch statement of DeepGEMM's paged logits rule (module docstring of deepgemm_compat)."""
    b, next_n, h, d = q.shape
    pages = kv_cache.view(kv_cache.shape[0], -1).cpu()
    keys = KeyFormat.FP8.dequantize_pages(pages)  # [P * 64, 128] slot order
    out = torch.full((b * next_n, max_len), float("-inf"))
    for i in range(b):
        for j in range(next_n):
            n = int(context_lens[i, j]) if context_lens.dim() == 2 else int(context_lens[i]) - next_n + j + 1
            n = max(n, 0)
            idx = torch.arange(n)
            slots = block_table[i].cpu().long()[idx // 64] * 64 + idx % 64
            logits = q[i, j].float().cpu() @ keys[slots].T  # [H, n]
            out[i * next_n + j, :n] = (logits.relu() * weights[i * next_n + j].cpu()[:, None]).sum(0)
    return out


@pytest.mark.parametrize("lens_2d", [False, True], ids=["context_lens-B", "context_lens-B-next_n"])
def test_deepgemm_paged_logits(lens_2d, device):
    from dsakit.ops.indexer.deepgemm_compat import deepgemm_fp8_paged_mqa_logits, fp8_paged_mqa_logits

    lengths = [3, 64, 150]
    fmt, pool, table, counts, _ = make_cache("fp8", lengths, device)
    b, next_n, h, max_len = len(lengths), 2, 16, 160
    q = torch.randn(b, next_n, h, 128, device=device).to(torch.float8_e4m3fn)
    w = torch.randn(b * next_n, h, device=device)
    kv_cache = pool.view(-1, 64, 1, 132)
    if lens_2d:
        context_lens = torch.stack([counts - 1, counts], dim=1).clamp(min=0).to(torch.int32)
    else:
        context_lens = counts
    logits = fp8_paged_mqa_logits(q, kv_cache, w, context_lens, table, max_len)
    expect = deepgemm_semantics(q, kv_cache, w, context_lens, table, max_len)
    assert_scores_match(logits, expect, tight_rtol("fp8", q.dtype, device))
    same = deepgemm_fp8_paged_mqa_logits(q, kv_cache, w, context_lens, table, None, max_len, True)
    assert torch.equal(same.cpu(), logits.cpu())
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_paged_mqa_logits(q.float(), kv_cache, w, context_lens, table, max_len)
    with pytest.raises(ValueError, match="kv_cache"):
        fp8_paged_mqa_logits(q, pool, w, context_lens, table, max_len)
    # next_n = 0 is named (used to escape as IndexError on the empty context_lens [B, 0])
    with pytest.raises(ValueError, match="next_n >= 1"):
        fp8_paged_mqa_logits(q[:, :0], kv_cache, w[:0], context_lens[:, :0] if lens_2d else context_lens,
                             table, max_len)


# --------------------------------------------------------------------------------------------------
# Validation: bad input raises ValueError naming the value, before any kernel runs
# --------------------------------------------------------------------------------------------------


def test_validation_errors(device):
    fmt, pool, table, counts, _ = make_cache("fp8", [70, 10], device)
    kernel = scores_kernel
    q = torch.randn(3, 16, 128, device=device)
    w = torch.rand(3, 16, device=device)
    query_seq = torch.tensor([0, 1, 0], dtype=torch.int32, device=device)
    bad_table = table.clone()
    bad_table[0, 1] = pool.shape[0] + 5
    with pytest.raises(ValueError, match=r"block_table\[0, 1\]"):
        kernel(q, w, pool, fmt, bad_table, counts, query_seq)
    with pytest.raises(ValueError, match="q_scale must be > 0"):
        kernel(q, w, pool, fmt, table, counts, query_seq, q_scale=-torch.ones(3, 16, device=device))
    with pytest.raises(ValueError, match="q_scale must be fp32"):
        kernel(q, w, pool, fmt, table, counts, query_seq, q_scale=torch.ones(3, 8, device=device))
    with pytest.raises(ValueError, match="q dtype"):
        kernel(q.double(), w, pool, fmt, table, counts, query_seq)
    with pytest.raises(ValueError, match="pool must be uint8"):
        kernel(q, w, pool, "bf16", table, counts, query_seq)
    with pytest.raises(ValueError, match="query_seq values"):
        kernel(q, w, pool, fmt, table, counts, torch.tensor([0, 2, 0], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="power-of-two head count"):
        kernel(q[:, :12], w[:, :12], pool, fmt, table, counts, query_seq, kernel="group")
    with pytest.raises(ValueError, match="at most 4 queries"):
        kernel(torch.randn(6, 16, 128, device=device), torch.rand(6, 16, device=device), pool, fmt, table, counts,
               torch.zeros(6, dtype=torch.int32, device=device), kernel="group")
    with pytest.raises(ValueError, match="out must be fp32"):
        kernel(q, w, pool, fmt, table, counts, query_seq, out=torch.empty(3, 70, dtype=torch.float16, device=device))


# --------------------------------------------------------------------------------------------------
# Plans (tiles=) and the sync-free path (validate=False)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("next_n,h", [(1, 16), (3, 64), (4, 12), (70, 16), (130, 64)])
def test_decode_tile_plan_equals_general_plan_without_sync(next_n, h, device, monkeypatch):
    """plan_decode_tiles builds, from the shape alone, the plan plan_query_tiles builds with a host sync, also
    when a sequence needs several tiles (next_n > 64: it used to fall back to plan_query_tiles and sync)."""
    b = 3
    query_seq = torch.arange(b, dtype=torch.int32, device=device).repeat_interleave(next_n)
    general = _plans().plan_query_tiles(query_seq, b, h)

    def no_sync(*args, **kwargs):
        raise AssertionError("plan_decode_tiles called plan_query_tiles (a host sync)")

    monkeypatch.setattr(_plans(), "plan_query_tiles", no_sync)
    decode = _plans().plan_decode_tiles(b, next_n, h, device)
    assert (decode.kernel, decode.size, decode.num_tiles) == (general.kernel, general.size, general.num_tiles)
    for name in ("rows", "tile_seq", "tile_start", "tile_len"):
        got, want = getattr(decode, name), getattr(general, name)
        assert got.dtype == torch.int32 and torch.equal(got.cpu(), want.cpu()), name
    with pytest.raises(ValueError, match="next_n must be an int >= 1"):
        _plans().plan_decode_tiles(b, 0, h, device)


def test_reused_tile_plan_and_decode_plan(device):
    scores_triton = _triton()
    lengths = [70, 129, 5]
    fmt, pool, table, counts, _ = make_cache("fp8", lengths, device)
    b, next_n, h = len(lengths), 2, 16
    q = torch.randn(b * next_n, h, 128, dtype=torch.bfloat16, device=device)
    w = torch.rand(b * next_n, h, device=device)
    query_seq = torch.arange(b, dtype=torch.int32, device=device).repeat_interleave(next_n)
    positions = (counts.long().repeat_interleave(next_n) - 1).to(torch.int32)
    general = _plans().plan_query_tiles(query_seq, b, h)
    decode = _plans().plan_decode_tiles(b, next_n, h, device)
    assert general.kernel == decode.kernel == "group" and general.size == decode.size == 2
    for name in ("rows", "tile_seq", "tile_start", "tile_len"):
        assert torch.equal(getattr(general, name).cpu(), getattr(decode, name).cpu()), name
    first = run_kernel(q, w, pool, fmt, table, counts, query_seq, positions, 1, tiles=general)
    second = run_kernel(q, w, pool, fmt, table, counts, query_seq, positions, 1, tiles=general, validate=False)
    assert torch.equal(first.cpu(), second.cpu())
    ref = reference_scores(q.float().cpu(), w.cpu(), pool.cpu(), fmt, table.cpu(), counts.cpu(), query_seq.cpu(),
                           positions.cpu(), 1)
    assert_scores_match(first, ref)
    # a tile-kernel plan for the same queries gives the same scores
    tile_plan = _plans().plan_query_tiles(query_seq, b, h, kernel="tile")
    assert tile_plan.kernel == "tile" and tile_plan.size == 16
    assert_scores_match(run_kernel(q, w, pool, fmt, table, counts, query_seq, positions, 1, tiles=tile_plan), ref)
    with pytest.raises(ValueError, match="QueryTiles plan"):
        run_kernel(q[:3], w[:3], pool, fmt, table, counts, query_seq[:3], positions[:3], 1, tiles=general)
    with pytest.raises(ValueError, match="block_t"):
        _plans().plan_query_tiles(query_seq, b, h, kernel="tile", block_t=24)
    # out-of-range sequence ids are named (a negative one used to escape as bincount's RuntimeError)
    for bad_value in (-1, b):
        bad_seq = query_seq.clone()
        bad_seq[1] = bad_value
        with pytest.raises(ValueError, match="query_seq values must be in"):
            _plans().plan_query_tiles(bad_seq, b, h)
    with pytest.raises(ValueError, match="query_seq values must be in"):
        _plans().plan_query_tiles(query_seq, 0, h)
    empty = _plans().plan_query_tiles(query_seq[:0], 0, h)
    assert empty.num_tiles == 0 and empty.num_queries == 0


def test_unvalidated_bad_input_stays_in_bounds(device):
    """validate=False with page ids outside the pool and counts past the block table: no out-of-bounds access
    (the kernels clamp), and nothing is written outside out[:T, :W']."""
    fmt, pool, table, counts, _ = make_cache("fp4", [100, 40], device, pages_extra=0)
    scores_triton = _triton()
    t, h = 4, 16
    q = torch.randn(t, h, 128, dtype=torch.bfloat16, device=device)
    w = torch.rand(t, h, device=device)
    query_seq = torch.tensor([0, 1, 0, 1], dtype=torch.int32, device=device)
    bad_table = table.clone()
    bad_table[0, 1] = 10_000  # not a page of the pool
    bad_table[1, 0] = -7
    bad_counts = torch.tensor([100, 500], dtype=torch.int32, device=device)  # 500 > block table width x 64
    ws = torch.full((t + 2, 600), float("nan"), device=device)
    for kernel in ("tile", "group"):
        plan = _plans().plan_query_tiles(query_seq, 2, h, kernel=kernel)
        ws.fill_(float("nan"))
        out = scores_kernel(q, w, pool, fmt, bad_table, bad_counts, query_seq, None, 1,
                                                out=ws[:, :512], tiles=plan, validate=False)
        assert out.shape == (t, 512)
        assert not torch.isnan(out).any(), f"{kernel}: unwritten element inside out[:T, :W']"
        assert torch.isnan(ws[t:]).all() and torch.isnan(ws[:, 512:]).all(), f"{kernel}: wrote outside out[:T, :W']"
    with pytest.raises(ValueError, match="entry_counts"):
        scores_kernel(q, w, pool, fmt, table, bad_counts, query_seq, None, 1, out=ws[:, :512])


def test_decode_wrapper_unvalidated_matches(device):
    lengths = [65, 3]
    fmt, pool, table, counts, _ = make_cache("bf16", lengths, device)
    q = torch.randn(2, 1, 16, 128, dtype=torch.bfloat16, device=device)
    w = torch.rand(2, 16, device=device)
    out = torch.full((2, 65), float("nan"), device=device)
    fast = decode_kernel(q, w, pool, fmt, table, counts, out=out, validate=False)
    slow = decode_kernel(q, w, pool, fmt, table, counts)
    assert torch.equal(fast.cpu(), slow.cpu())


def test_deepgemm_non_paged_logits(device):
    from dsakit.ops.indexer.deepgemm_compat import fp8_mqa_logits

    t, h, n = 7, 16, 150
    q = torch.randn(t, h, 128).to(torch.float8_e4m3fn)
    keys = torch.randn(n, 128)
    scale = keys.abs().amax(dim=1).clamp(min=1e-4) / 448
    values = (keys / scale[:, None]).to(torch.float8_e4m3fn)
    w = torch.randn(t, h)
    ks = torch.tensor([0, 0, 5, 10, 149, 30, 0], dtype=torch.int32)
    ke = torch.tensor([1, 150, 80, 10, 150, 20, 64], dtype=torch.int32)  # row 3: empty, row 5: ke < ks
    logits = fp8_mqa_logits(q.to(device), (values.to(device), scale.to(device)), w.to(device), ks.to(device),
                            ke.to(device)).cpu()
    k32 = values.float() * scale[:, None]
    expect = (torch.einsum("thd,nd->thn", q.float(), k32).relu() * w[:, :, None]).sum(1)
    j = torch.arange(n)[None, :]
    expect = expect.masked_fill((j < ks[:, None].long()) | (j >= ke[:, None].long()), float("-inf"))
    assert_scores_match(logits, expect, tight_rtol("fp8", q.dtype, device))
    with pytest.raises(ValueError, match="kv scales"):
        fp8_mqa_logits(q.to(device), (values.to(device), scale[:-1].to(device)), w.to(device), ks.to(device),
                       ke.to(device))


def test_largest_int32_position_sees_every_entry(device):
    """query_positions = INT32_MAX (an "everything visible" sentinel) must not overflow pos + 1 in int32."""
    fmt, pool, table, counts, _ = make_cache("bf16", [70, 5], device)
    scores_triton = _triton()
    t, h = 4, 16
    q = torch.randn(t, h, 128, dtype=torch.bfloat16, device=device)
    w = torch.rand(t, h, device=device)
    query_seq = torch.tensor([0, 1, 0, 1], dtype=torch.int32, device=device)
    positions = torch.full((t,), 2**31 - 1, dtype=torch.int32, device=device)
    ref = reference_scores(q.float().cpu(), w.cpu(), pool.cpu(), fmt, table.cpu(), counts.cpu(), query_seq.cpu(),
                           positions.cpu(), 1)
    assert torch.isfinite(ref[0]).all()
    for kernel in ("tile", "group"):
        plan = _plans().plan_query_tiles(query_seq, 2, h, kernel=kernel)
        out = run_kernel(q, w, pool, fmt, table, counts, query_seq, positions, 1, tiles=plan)
        assert_scores_match(out, ref)


def test_unvalidated_counts_without_pages_stay_in_bounds(device):
    """validate=False with entries but an empty pool or a zero-width block table: no page can be read, so
    every score is -inf (the kernels would otherwise address page -1 / block-table column -1)."""
    fmt = KeyFormat.FP8
    scores_triton = _triton()
    t, h = 3, 16
    q = torch.randn(t, h, 128, dtype=torch.bfloat16, device=device)
    w = torch.rand(t, h, device=device)
    query_seq = torch.zeros(t, dtype=torch.int32, device=device)
    counts = torch.tensor([40], dtype=torch.int32, device=device)
    cases = {"empty pool": (torch.zeros(0, fmt.page_bytes, dtype=torch.uint8, device=device),
                            torch.zeros(1, 1, dtype=torch.int32, device=device)),
             "zero-width block table": (torch.zeros(2, fmt.page_bytes, dtype=torch.uint8, device=device),
                                        torch.zeros(1, 0, dtype=torch.int32, device=device))}
    for name, (pool, table) in cases.items():
        for kernel in ("tile", "group"):
            plan = _plans().plan_query_tiles(query_seq, 1, h, kernel=kernel)
            out = torch.full((t + 1, 48), float("nan"), device=device)
            result = scores_kernel(q, w, pool, fmt, table, counts, query_seq, None, 1,
                                                       out=out[:, :40], tiles=plan, validate=False)
            assert torch.isneginf(result).all(), f"{name}, {kernel}: scores from pages that do not exist"
            assert torch.isnan(out[t:]).all() and torch.isnan(out[:, 40:]).all(), f"{name}: wrote outside out"
        with pytest.raises(ValueError):
            scores_kernel(q, w, pool, fmt, table, counts, query_seq, None, 1)


def test_maxnreg_validated_and_result_unchanged(triton_backend):
    """A register cap changes only how many programs share an SM, never the scores."""
    from dsakit.ops.indexer.config import ScoresConfig

    for bad in (20, 65, 256, True, 64.0):
        with pytest.raises(ValueError, match="decode_maxnreg.*got"):
            ScoresConfig(decode_maxnreg=bad)
        with pytest.raises(ValueError, match="prefill_maxnreg.*got"):
            ScoresConfig(prefill_maxnreg=bad)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fmt, pool, table, counts, _ = make_cache("fp8", [130, 97], device)
    gen = torch.Generator().manual_seed(5)
    query_seq = torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(2, 64, 128, generator=gen).to(torch.bfloat16)
    w = torch.rand(2, 64, generator=gen)
    outs = [run_kernel(q.to(device), w.to(device), pool, fmt, table, counts, query_seq.to(device), None, 1,
                       kernel="group", decode_maxnreg=reg) for reg in (None, 64)]
    outs += [run_kernel(q.to(device), w.to(device), pool, fmt, table, counts, query_seq.to(device), None, 1,
                        kernel="tile", prefill_block_t=16, prefill_maxnreg=reg) for reg in (None, 168)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[2], outs[3])
    ref = reference_scores(q.float(), w, pool, fmt, table, counts, query_seq)
    for out in (outs[0], outs[2]):
        assert_scores_match(out, ref, tight_rtol("fp8", torch.bfloat16, device))


@pytest.mark.parametrize("fmt_name,next_n,expected", [
    ("fp8", 1, (128, 16, 5)),    # <= 64 query-head columns: the format's measured tile, tiles and stages
    ("bf16", 1, (64, 16, 5)),
    ("fp4", 1, (64, 16, 5)),     # "blocks" path: its own 64-entry tile
    ("fp8", 2, (64, 8, 3)),      # 128 columns: 64-entry tiles (a 128-entry one spills on sm_90), 8 tiles, 3 stages
    ("fp8-centred", 1, (128, 16, 5)),  # the residuals' work is plain fp8's (page terms from a pass)
])
def test_decode_launch_defaults(monkeypatch, fmt_name, next_n, expected):
    """The decode kernel's launch choices follow the documented per-format defaults (a launch recorder stands
    in for the kernel, so this checks the policy without running it)."""
    from dsakit.ops.indexer import scores as scores_triton

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((grid, kw))

    class Skip:  # the page-term pass of the centred formats: not launched (the pool is a CPU tensor here)
        def __getitem__(self, grid):
            return lambda *args, **kw: None

    monkeypatch.setattr(scores_triton, "_index_scores_group_kernel", Recorder())
    monkeypatch.setattr(scores_triton, "_page_term_group_kernel", Skip())
    b, width = 2, 128 * 64  # wide enough that the tiles per program are not cut to four programs per row
    fmt, pool, table, counts, _ = make_cache(fmt_name, [width] * b, "cpu")
    q = torch.randn(b, next_n, 64, 128).to(torch.bfloat16)
    w = torch.rand(b, next_n, 64)
    query_seq = torch.arange(b, dtype=torch.int32).repeat_interleave(next_n)
    batch = batch_of(pool, fmt, table, counts, query_seq)
    # the gather kernel's policy (fp4 keys take the page copies by default: test_decode_tma_launch_defaults)
    scores_triton.index_scores_decode(q, w, batch, out=torch.empty(b * next_n, width),
                                      config=ScoresConfig(decode_loads="gather"))
    (grid, kw), = launches
    block_n, tiles, stages = expected
    assert (kw["BLOCK_N"], kw["TILES_PER_PROGRAM"], kw["num_stages"]) == (block_n, tiles, stages)
    assert grid == (b, -(-width // (block_n * tiles)))
    assert "maxnreg" not in kw  # no register cap unless asked


@pytest.mark.parametrize("fmt_name,config,stages", [
    ("bf16", {}, 2),            # the codec's prefill stages
    ("fp8", {}, 3),
    ("fp4", {}, 3),
    ("bf16", {"prefill_stages": 4}, 4),  # an explicit choice wins
])
def test_prefill_launch_stages(monkeypatch, fmt_name, config, stages):
    """The tile kernel's pipeline stages: ScoresConfig.prefill_stages, or the key format's measured default."""
    from dsakit.ops.indexer import scores as scores_triton

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw)

    monkeypatch.setattr(scores_triton, "_index_scores_tile_kernel", Recorder())
    fmt, pool, table, counts, _ = make_cache(fmt_name, [300], "cpu")
    query_seq = torch.zeros(40, dtype=torch.int32)
    batch = batch_of(pool, fmt, table, counts, query_seq)
    q = torch.randn(40, 16, 128).to(torch.bfloat16)
    scores_triton.index_scores_triton(q, torch.rand(40, 16), batch, config=ScoresConfig(kernel="tile", **config))
    (kw,) = launches
    assert kw["num_stages"] == stages


@pytest.mark.parametrize("next_n", [1, 2, 4])
def test_decode_tma_launch_defaults(monkeypatch, next_n, device):
    """fp8 keys with e4m3 queries take the page-copy kernel by default (32 pages per program, 5 stages at every
    next_n); decode_loads="gather" and bf16 queries take the gather kernel."""
    from dsakit.ops.indexer import scores as scores_triton

    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk tensor copies need sm_90+")

    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, grid, kw))

    monkeypatch.setattr(scores_triton, "_index_scores_group_kernel", Recorder("gather"))
    monkeypatch.setattr(scores_triton, "_index_scores_group_tma_kernel", Recorder("tma"))
    b, width = 2, 128 * 64
    fmt, pool, table, counts, _ = make_cache("fp8", [width] * b, device)  # the pool's device picks the path
    w = torch.rand(b, next_n, 64, device=device)
    query_seq = torch.arange(b, dtype=torch.int32, device=device).repeat_interleave(next_n)
    batch = batch_of(pool, fmt, table, counts, query_seq)
    q = torch.randn(b, next_n, 64, 128, device=device)
    for q_dtype, loads in ((torch.float8_e4m3fn, "tma"), (torch.float8_e4m3fn, "gather"), (torch.bfloat16, "tma")):
        scores_triton.index_scores_decode(q.to(q_dtype), w, batch, out=torch.empty(b * next_n, width, device=device),
                                          config=ScoresConfig(decode_loads=loads))
    (tma, grid, kw), gather_fp8, gather_bf16 = launches
    assert tma == "tma" and (kw["PAGES_PER_PROGRAM"], kw["num_stages"], kw["PAGE_ROWS"]) == (32, 5, 66)
    assert grid == (b, width // (64 * 32))
    assert gather_fp8[0] == "gather" and gather_bf16[0] == "gather"

    # fp4 keys: the page copies for any query dtype (rows of 64 packed bytes, 68 per page), 8 warps from 128
    # query-head columns per program on; decode_fp4="dequant" gathers
    launches.clear()
    fmt, pool, table, counts, _ = make_cache("fp4", [width] * b, device)
    batch = batch_of(pool, fmt, table, counts, query_seq)
    for q_dtype, fp4_mode in ((torch.float8_e4m3fn, "blocks"), (torch.bfloat16, "blocks"),
                              (torch.float8_e4m3fn, "dequant")):
        scores_triton.index_scores_decode(q.to(q_dtype), w, batch, out=torch.empty(b * next_n, width, device=device),
                                          config=ScoresConfig(decode_fp4=fp4_mode))
    (fp8_q, _, kw), (bf16_q, _, _), (dequant, _, _) = launches
    assert (fp8_q, bf16_q, dequant) == ("tma", "tma", "gather")
    assert (kw["PAGE_ROWS"], kw["num_warps"]) == (68, 8 if next_n * 64 >= 128 else 4)
    assert kw["num_stages"] == (3 if next_n * 64 >= 256 else 5)
    # the 128-register cap (four programs per SM) at <= 64 columns; the interpreter takes no register options
    assert kw.get("maxnreg") == (128 if next_n == 1 and device != "cpu" else None)

    # the page copies need a pool on a 16-byte boundary: the batch refuses one viewed at a byte offset
    shifted = torch.zeros(pool.numel() + 8, dtype=torch.uint8, device=device)[8:].view(pool.shape)
    with pytest.raises(ValueError, match="16-byte boundary"):
        batch_of(shifted, fmt, table, counts, query_seq)
    assert scores_triton._tma_pages(key_codec(fmt), False, pool, ScoresConfig())


@pytest.mark.parametrize("fmt_name", ["fp8", "fp8-ue8m0", "fp4", "fp4-rne"])
def test_decode_tma_page_loads(fmt_name, device):
    """decode_loads="tma" (bulk copies per page) gives the gather path's scores bitwise for fp8 keys with e4m3
    queries and fp4 keys, with positions, a partial last page, several queries per sequence and a q_scale;
    fp8 keys with other query dtypes fall back to the gather path (same result), fp4 keys take the copies
    with bf16 queries too; bad page ids of an unchecked batch stay in the pool and nothing is written outside
    out."""
    if device == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("bulk tensor copies need sm_90+")
    fmt, pool, table, counts, _ = make_cache(fmt_name, [150, 64, 3], device)
    gen = torch.Generator().manual_seed(11)
    query_seq = torch.tensor([0, 0, 1, 2, 2], dtype=torch.int32)
    positions = torch.tensor([149, 90, 63, 0, 2], dtype=torch.int32)
    t, h = 5, 16
    q = torch.randn(t, h, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.rand(t, h, generator=gen) - 0.25
    q_scale = torch.rand(t, h, generator=gen) + 0.5
    ref = reference_scores(q.float(), w * q_scale, pool, fmt, table, counts, query_seq, positions)
    args = (q.to(device), w.to(device), pool, fmt, table, counts, query_seq.to(device), positions.to(device), 1)
    outs = [run_kernel(*args, kernel="group", q_scale=q_scale.to(device), decode_loads=mode,
                       decode_tiles_per_program=2) for mode in ("gather", "tma")]
    assert_scores_match(outs[1], ref, tight_rtol(fmt_name, q.dtype, device))
    if device == "cpu" and fmt_name.startswith("fp8"):
        assert torch.equal(outs[0], outs[1])
    else:  # the same e4m3 products: one 64-entry tile per dot instead of 128 (fp8), summed in nibble order (fp4)
        assert_scores_match(outs[1], outs[0], TIGHT_RTOL_FP8_DOT_GPU if device != "cpu" else TIGHT_RTOL)
    q_bf16 = q.float().to(torch.bfloat16).to(device)  # not e4m3: fp8 keys gather, fp4 keys copy; same scores
    bf16_outs = [run_kernel(q_bf16, *args[1:], kernel="group", decode_loads=mode) for mode in ("gather", "tma")]
    assert_scores_match(bf16_outs[1], reference_scores(q.float(), w, pool, fmt, table, counts, query_seq, positions))
    assert_scores_match(bf16_outs[1], bf16_outs[0])  # the same exact products (fp4: summed in nibble order)

    bad_table = table.clone()
    bad_table[0, 1] = 10_000  # not a page of the pool
    bad_table[1, 0] = -7
    bad_counts = torch.tensor([150, 500, 3], dtype=torch.int32, device=device)
    ws = torch.full((t + 2, 600), float("nan"), device=device)
    out = scores_kernel(q.to(device), w.to(device), pool, fmt, bad_table, bad_counts, query_seq.to(device), None,
                        1, out=ws[:, :512], validate=False, kernel="group", decode_loads="tma")
    assert not torch.isnan(out).any() and torch.isnan(ws[t:]).all() and torch.isnan(ws[:, 512:]).all()
    with pytest.raises(ValueError, match="decode_loads"):
        ScoresConfig(decode_loads="bulk")


# The launch settings the launcher derived itself before they moved into ScoresConfig (05bb4b1), restated
# here as the oracle: every plain format keeps exactly these (so its speed cannot change).
_BEFORE_FORMATS = {"bf16": (64, 64, 16, 5, 2), "fp8": (128, 64, 16, 5, 3), "fp4": (128, 64, 16, 5, 3)}


def _settings_before(config, fmt_name, kind, size, columns, width):
    decode_block_n, blocks_block_n, decode_tiles, decode_stages, prefill_stages = _BEFORE_FORMATS[fmt_name]
    if kind == "tile":
        bn = config.prefill_block_n
        warps = config.prefill_warps or (4 if size * bn <= 64 * 128 else 8)
        return bn, 1, warps, config.prefill_stages or prefill_stages, config.prefill_maxnreg
    if kind == "tma":
        per_program = config.decode_tiles_per_program or max(1, min(32, -(-width // (64 * 4))))
        warps, stages, regs = config.decode_warps, config.decode_stages or 5, config.decode_maxnreg
        if fmt_name == "fp4":
            if columns >= 128:
                warps = max(warps, 8)
            if columns >= 256 and config.decode_stages is None:
                stages = 3
            if columns <= 64 and warps == 4 and regs is None:
                regs = 128
        return 64, per_program, warps, stages, regs
    fp4_blocks = fmt_name == "fp4" and config.decode_fp4 == "blocks"
    bn = config.decode_block_n or (blocks_block_n if fp4_blocks else decode_block_n)
    if config.decode_block_n is None and bn > 64 and columns > 64:
        bn = 64
    tiles_default, stages_default = (decode_tiles, decode_stages) if columns <= 64 else (8, 3)
    per_program = config.decode_tiles_per_program or max(1, min(tiles_default, -(-width // (bn * 4))))
    warps = config.decode_warps
    if fp4_blocks and columns >= 128:
        warps = max(warps, 8)
    return bn, per_program, warps, config.decode_stages or stages_default, config.decode_maxnreg


@pytest.mark.parametrize("overrides", [
    {}, {"decode_block_n": 64}, {"decode_block_n": 128, "decode_tiles_per_program": 4}, {"decode_stages": 2},
    {"decode_warps": 8}, {"decode_maxnreg": 96}, {"decode_fp4": "dequant"}, {"prefill_warps": 8},
    {"prefill_stages": 4, "prefill_block_n": 64}, {"prefill_maxnreg": 168}, {"prefill_block_n": 256}])
def test_resolved_launch_settings_equal_the_launcher_before(overrides):
    """ScoresConfig.tile_launch / group_launch / tma_launch resolve, for every plain format, query tile and
    width, the same block, tiles per program, warps, stages and register cap as the launcher derived before the
    settings moved into the config object (the H200 table and explicit overrides)."""
    from dsakit.ops.indexer.config import ScoresConfig

    config = ScoresConfig(**overrides)
    for fmt_name in ("bf16", "fp8", "fp4"):
        for block_t in (16, 32, 64, 128):
            got = config.tile_launch(fmt_name, block_t)
            assert (got.block_n, got.per_program, got.warps, got.stages, got.maxnreg) == \
                _settings_before(config, fmt_name, "tile", block_t, 0, 0), (fmt_name, block_t)
        for columns in (16, 32, 64, 128, 256):
            for width in (100, 4096, 65536, 131072):
                fp4_blocks = fmt_name == "fp4" and config.decode_fp4 == "blocks"
                got = config.group_launch(fmt_name, columns, width, fp4_blocks)
                assert (got.block_n, got.per_program, got.warps, got.stages, got.maxnreg) == \
                    _settings_before(config, fmt_name, "group", 0, columns, width), (fmt_name, columns, width)
                if fmt_name != "bf16":
                    got = config.tma_launch(fmt_name == "fp4", columns, width)
                    assert (got.block_n, got.per_program, got.warps, got.stages, got.maxnreg) == \
                        _settings_before(config, fmt_name, "tma", 0, columns, width), (fmt_name, columns, width)


def test_centred_page_copy_register_caps():
    """The page copies of page-centred keys at <= 64 query-head columns (the settings measured fastest on the
    H200): fp8-centred capped at 96 registers with its page terms loaded in the page's own iteration,
    fp4-centred at 168 with them one page ahead; an explicit cap wins; wider programs and plain fp8 stay
    uncapped."""
    from dsakit.ops.indexer.config import ScoresConfig

    config = ScoresConfig()
    assert config.tma_launch(False, 64, 1 << 16, page_term=True).maxnreg == 96
    assert config.tma_launch(True, 64, 1 << 16, page_term=True).maxnreg == 168
    assert config.tma_launch(True, 64, 1 << 16).maxnreg == 128
    assert config.tma_launch(False, 64, 1 << 16).maxnreg is None
    assert config.tma_launch(False, 128, 1 << 16, page_term=True).maxnreg is None
    assert ScoresConfig(decode_maxnreg=248).tma_launch(False, 64, 1 << 16, page_term=True).maxnreg == 248
    assert config.tma_launch(False, 64, 1 << 16, page_term=True).lookahead == 0
    assert config.tma_launch(True, 64, 1 << 16, page_term=True).lookahead == 1
