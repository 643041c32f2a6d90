"""Drop-in replacement for DeepGEMM's paged fp8 MQA logits (the V3.2 indexer's decode logits).

DeepGEMM convention (read from its tests/test_attention.py; restated, not copied):

    q            fp8 e4m3fn [B, next_n, H, D]      (D = 128 here; no q scale: fold it into the weights)
    kv_cache     uint8 [pages, 64, 1, D + 4]        page = 64 x D e4m3 bytes, then 64 fp32 scales: exactly
                                                    dsakit's ``KeyFormat.FP8`` page (8448 bytes)
    weights      fp32 [B * next_n, H]
    context_lens int32 [B]  or  [B, next_n]
    block_table  int32 [B, max_pages]               logical page -> physical page
    -> logits    fp32 [B * next_n, max_context_len], row b * next_n + i = query i of sequence b

    logits[b * next_n + i, j] = sum_h weights[row, h] * relu(q[b, i, h] . k_j) * scale_j   for visible j
                              = -inf                                                      otherwise
    visible j, context_lens [B]:          j <= context_lens[b] - next_n + i   (query i sits at that position;
                                          the last query sees all context_lens[b] entries)
    visible j, context_lens [B, next_n]:  j <  context_lens[b, i]

Non-paged variant (``fp8_mqa_logits``, DeepGEMM's prefill logits):

    q       fp8 e4m3fn [T, H, D];  kv = (fp8 e4m3fn [N, D], fp32 scales [N]);  weights fp32 [T, H]
    ks, ke  int32 [T]: row t sees kv[ks[t] : ke[t]]         -> logits fp32 [T, N], -inf outside [ks, ke)

The masked value is -inf. DeepGEMM writes it only with ``clean_logits=True`` (otherwise masked columns hold
unspecified values); dsakit always writes -inf, so ``clean_logits=False`` is accepted and gives the same,
fully defined output. DeepGEMM's schedule metadata (``get_paged_mqa_logits_metadata``) has no counterpart:
the Triton launcher schedules by itself, so the argument is accepted and ignored.

Page-centred pools (``centred_paged_mqa_logits``, ``deepgemm_centred_paged_mqa_logits``): the same arguments
and output with a kv_cache of page-centred pages (docs/formats-centred.md), viewed as DeepGEMM views its fp8
pages, [pages, 64, 1, bytes per entry]:

    fp8-centred  uint8 [pages, 64, 1, 136]   page = 64 x 128 e4m3 residuals, 64 fp32 scales, bf16 centre [128]
    fp4-centred  uint8 [pages, 64, 1, 72]    page = 64 x 64 e2m1 pairs, 64 x 4 ue8m0 scales, bf16 centre [128]

    logits[row, j] = sum_h weights[row, h] * relu(q[b, i, h] . (c[page(j)] + r_j))   for visible j

(the format follows from the last dimension; q fp8 e4m3, or bf16 for either format).
"""

from __future__ import annotations

import torch

from ..._memory import INDEX_DTYPES, check_int, check_tensor
from ...batch import PagedBatch
from ...formats import ENTRIES_PER_PAGE, INDEX_HEAD_DIM, KeyFormat
from .plans import plan_decode_tiles
from .scores import index_scores_triton

_FP8 = KeyFormat.FP8
# page-centred formats by the last dimension of their [pages, 64, 1, bytes per entry] view
_CENTRED_BY_ENTRY_BYTES = {KeyFormat.FP8_CENTRED.page_bytes // ENTRIES_PER_PAGE: KeyFormat.FP8_CENTRED,
                           KeyFormat.FP4_CENTRED.page_bytes // ENTRIES_PER_PAGE: KeyFormat.FP4_CENTRED}


def _as_pool(kv_cache: torch.Tensor, entry_bytes: tuple[int, ...] = (INDEX_HEAD_DIM + 4,)) -> torch.Tensor:
    """uint8 [pages, 64, 1, E] (or any 1-byte dtype), E one of ``entry_bytes`` -> uint8 [pages, 64 E] view,
    never a copy."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4 \
            or tuple(kv_cache.shape[1:3]) != (ENTRIES_PER_PAGE, 1) or kv_cache.shape[3] not in entry_bytes:
        wanted = " or ".join(f"[pages, 64, 1, {e}]" for e in entry_bytes)
        raise ValueError(f"kv_cache must be {wanted}, got "
                         f"{list(kv_cache.shape) if isinstance(kv_cache, torch.Tensor) else type(kv_cache).__name__}")
    if kv_cache.element_size() != 1:
        raise ValueError(f"kv_cache must hold bytes (uint8 or fp8 view), got {kv_cache.dtype}")
    check_tensor("kv_cache", kv_cache, contiguous=True)  # its pages are read through the page layout
    return kv_cache.view(torch.uint8).view(kv_cache.shape[0], ENTRIES_PER_PAGE * kv_cache.shape[3])


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                         clean_logits: bool = True, *, schedule_metadata: torch.Tensor | None = None,
                         out: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """DeepGEMM-compatible paged fp8 logits -> fp32 [B * next_n, max_context_len] (module docstring).

    ``out`` (optional, fp32 [B * next_n, max_context_len]) is written in place and returned.
    ``validate=False`` skips the value checks (context_lens >= 0, page ids, lengths <= max_context_len), which
    cost a device->host sync; the kernel still never reads or writes out of bounds (see index_scores_triton).
    """
    _check_q(q, (torch.float8_e4m3fn,), "float8_e4m3fn (DeepGEMM's paged logits take fp8 queries)")
    return _paged_logits(q, _as_pool(kv_cache), _FP8, weights, context_lens, block_table, max_context_len, out,
                         validate)


def centred_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                             context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                             clean_logits: bool = True, *, schedule_metadata: torch.Tensor | None = None,
                             out: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """:func:`fp8_paged_mqa_logits` for a pool of page-centred pages -> fp32 [B * next_n, max_context_len].

    kv_cache: uint8 [pages, 64, 1, 136] (fp8-centred) or [pages, 64, 1, 72] (fp4-centred), i.e. a
    ``PagedCache(KeyFormat.FP8_CENTRED / FP4_CENTRED).pool`` viewed as ``pool.view(-1, 64, 1, 136)`` (or 72);
    q fp8 e4m3 or bf16 [B, next_n, H, 128]; everything else as DeepGEMM's paged logits (module docstring).
    """
    _check_q(q, (torch.float8_e4m3fn, torch.bfloat16), "float8_e4m3fn or bfloat16")
    pool = _as_pool(kv_cache, tuple(_CENTRED_BY_ENTRY_BYTES))
    return _paged_logits(q, pool, _CENTRED_BY_ENTRY_BYTES[kv_cache.shape[3]], weights, context_lens, block_table,
                         max_context_len, out, validate)


def _check_q(q: torch.Tensor, dtypes: tuple, wanted: str) -> None:
    """q [B, next_n >= 1, H, 128] of one of ``dtypes``."""
    check_tensor("q", q, shape=(None, None, None, INDEX_HEAD_DIM), message=f"q must be [B, next_n, H, {INDEX_HEAD_DIM}]")
    check_tensor("q", q, dtypes=dtypes, message=f"q must be {wanted}")
    if q.shape[1] < 1:
        raise ValueError(f"q must have next_n >= 1 queries per sequence, got q of shape {list(q.shape)}")


def _paged_logits(q: torch.Tensor, pool: torch.Tensor, fmt: KeyFormat, weights: torch.Tensor,
                  context_lens: torch.Tensor, block_table: torch.Tensor, max_context_len: int,
                  out: torch.Tensor | None, validate: bool) -> torch.Tensor:
    """The paged logits of q (checked by :func:`_check_q`) against pool uint8 [pages, fmt.page_bytes]."""
    b, next_n, h, _ = q.shape
    rows = b * next_n
    check_tensor("weights", weights, shape=(rows, h), dtypes=torch.float32,
                 message=f"weights must be fp32 [B * next_n, H] = [{rows}, {h}]")
    if not isinstance(context_lens, torch.Tensor) or context_lens.dtype not in (torch.int32, torch.int64) \
            or context_lens.shape not in ((b,), (b, next_n)):
        raise ValueError(f"context_lens must be int [B] = [{b}] or [B, next_n] = [{b}, {next_n}], got "
                         f"{getattr(context_lens, 'dtype', None)} {list(getattr(context_lens, 'shape', []))}")
    check_int("max_context_len", max_context_len, 0, message="max_context_len must be a non-negative int")
    if validate and rows and bool((context_lens < 0).any()):
        raise ValueError(f"context_lens must be >= 0, got minimum {int(context_lens.min())}")

    offsets = torch.arange(next_n, device=q.device, dtype=torch.int64)
    if context_lens.dim() == 1:
        entry_counts = context_lens.to(torch.int32)
        positions = context_lens.long()[:, None] - next_n + offsets[None, :]  # [B, next_n]
    else:
        entry_counts = context_lens.max(dim=1).values.to(torch.int32)
        positions = context_lens.long() - 1
    if out is None:
        out = torch.empty(rows, max_context_len, dtype=torch.float32, device=q.device)
    else:
        check_tensor("out", out, shape=(rows, max_context_len), message=f"out must be [{rows}, {max_context_len}]")
    query_seq = torch.arange(b, device=q.device, dtype=torch.int32).repeat_interleave(next_n)
    # validate=True: one sync checks the batch (and lengths <= max_context_len through out's width)
    batch = PagedBatch.build(pool, fmt, block_table, entry_counts, query_seq, positions.reshape(rows), 1,
                             validate=validate, max_entries=None if validate else max_context_len)
    return index_scores_triton(q.reshape(rows, h, INDEX_HEAD_DIM), weights, batch, out=out,
                               tiles=plan_decode_tiles(b, next_n, h, q.device))


def deepgemm_fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                                  context_lens: torch.Tensor, block_table: torch.Tensor,
                                  schedule_metadata: torch.Tensor | None, max_context_len: int,
                                  clean_logits: bool = True) -> torch.Tensor:
    """Same as :func:`fp8_paged_mqa_logits` with DeepGEMM's positional order (schedule metadata ignored)."""
    return fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len, clean_logits,
                                schedule_metadata=schedule_metadata)


def deepgemm_centred_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                                      context_lens: torch.Tensor, block_table: torch.Tensor,
                                      schedule_metadata: torch.Tensor | None, max_context_len: int,
                                      clean_logits: bool = True) -> torch.Tensor:
    """:func:`centred_paged_mqa_logits` with DeepGEMM's positional order (``deep_gemm.fp8_paged_mqa_logits``):
    an engine switches by importing this under that name. Schedule metadata ignored."""
    return centred_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len, clean_logits,
                                    schedule_metadata=schedule_metadata)


def fp8_mqa_logits(q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor,
                   ks: torch.Tensor, ke: torch.Tensor, clean_logits: bool = True) -> torch.Tensor:
    """DeepGEMM-compatible non-paged fp8 logits -> fp32 [T, N], -inf outside each row's [ks, ke).

    The keys are copied once into an fp8 page pool (N x 132 bytes, the layout the kernels read) and scored
    with the paged kernel: row t sees the prefix [0, ke[t]) through the causal rule (position ke[t] - 1,
    ratio 1); the lower bound ks is then applied with one masked fill of the (materialized) output.
    """
    check_tensor("q", q, shape=(None, None, INDEX_HEAD_DIM), dtypes=torch.float8_e4m3fn,
                 message=f"q must be float8_e4m3fn [T, H, {INDEX_HEAD_DIM}]")
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise ValueError("kv must be a pair (fp8 values [N, D], fp32 scales [N])")
    values, scales = kv
    check_tensor("kv values", values, shape=(None, INDEX_HEAD_DIM), dtypes=torch.float8_e4m3fn,
                 message=f"kv values must be float8_e4m3fn [N, {INDEX_HEAD_DIM}]")
    n = values.shape[0]
    check_tensor("kv scales", scales, shape=(n,), dtypes=torch.float32, message=f"kv scales must be fp32 [N] = [{n}]")
    t, h, _ = q.shape
    for name, bound in (("ks", ks), ("ke", ke)):
        check_tensor(name, bound, shape=(t,), dtypes=INDEX_DTYPES, message=f"{name} must be int [T] = [{t}]")
    device = q.device
    pages = max(1, (n + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE)
    padded_values = torch.zeros(pages * ENTRIES_PER_PAGE, INDEX_HEAD_DIM, dtype=torch.uint8, device=device)
    padded_values[:n] = values.view(torch.uint8)
    padded_scales = torch.ones(pages * ENTRIES_PER_PAGE, dtype=torch.float32, device=device)
    padded_scales[:n] = scales
    pool = torch.empty(pages, _FP8.page_bytes, dtype=torch.uint8, device=device)
    pool[:, : _FP8.scale_offset_in_page] = padded_values.reshape(pages, -1)
    pool[:, _FP8.scale_offset_in_page:] = padded_scales.view(torch.uint8).reshape(pages, -1)
    block_table = torch.arange(pages, device=device, dtype=torch.int32)[None, :]
    entry_counts = torch.tensor([n], device=device, dtype=torch.int32)
    query_seq = torch.zeros(t, device=device, dtype=torch.int32)
    positions = ke.to(torch.int32) - 1  # visible = min(N, ke)
    logits = torch.empty(t, n, dtype=torch.float32, device=device)
    batch = PagedBatch.build(pool, _FP8, block_table, entry_counts, query_seq, positions, 1,
                             validate=False, max_entries=n)  # built here, valid by construction: no sync
    index_scores_triton(q, weights, batch, out=logits)
    below = torch.arange(n, device=device)[None, :] < ks.to(device).long()[:, None]
    return logits.masked_fill_(below, float("-inf"))


__all__ = ["fp8_paged_mqa_logits", "deepgemm_fp8_paged_mqa_logits", "centred_paged_mqa_logits",
           "deepgemm_centred_paged_mqa_logits", "fp8_mqa_logits"]
