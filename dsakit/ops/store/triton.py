"""Fused Triton store kernels: norm -> rope -> (Hadamard) -> quantize -> paged write, one launch.

Per row n (pseudocode; the reference in ``reference.py`` is the spec)::

    x      = keys[n]                                 # fp32 [D], D = 128 (index keys) or 512 (attention KV)
    x      = x * rsqrt(mean(x^2) + eps) * w          # or (x - mean) * rsqrt(var + eps) * w + b
                                                     # (on x * 2^-k, eps * 2^-2k: transforms.norm_scale)
    x[a_i], x[b_i] = a c - b s, a s + b c            # rope pairs of the layout, c / s = table[pos[n]]
    x      = x @ H128 / sqrt(128)                    # index keys, optional: butterfly in registers
    pool[page(slot[n])] <- bytes of quantize(x)      # byte layout: dsakit.formats

Nothing but the cache entry is written to global memory. Kernels: ``_kernels.py`` (index keys are
encoded by the format codecs of :mod:`dsakit.formats.triton`); tuning: :class:`dsakit.ops.store.config.StoreConfig`.
Two kernel families, every option a compile-time constant:

* fast kernels for the preset geometry (rope_dim 64; attention rope on the trailing dims), shaped so that
  Triton keeps rows inside registers: ``_store_index_keys_kernel`` tiles [2, BLOCK_N, 8, 8] = (half, row,
  piece, e), so each lane holds one 64-dim half of a row and the row's two halves sit on two lanes (norm
  sums and Hadamard bit 6 are 2-lane shuffle reductions, everything else, including the rope pairs, the
  other 6 Hadamard stages and the fp4 blocks, is in-register); ``_store_attention_kv_kernel`` tiles
  [8, BLOCK_N, 8, 8] = (64-dim block, row, piece, e), one block per lane, so the per-block fp8 amax is
  in-register (fp8-rope-bf16 entries only: for plain bf16 entries the generic kernel measured faster).
  No shared memory, no gathers.
* generic kernels (``*_generic_kernel``) for any even rope width and placement: [BLOCK_N, D] tiles, the
  rope partner of each dim reloaded from global memory (an L1 hit).

Byte-exactness with the reference (CPU, fp32) is the goal, so the arithmetic mirrors it:

* every division the reference does is a correctly rounded ``div_rn``; ``rsqrt(v)`` is ``1 / sqrt_rn(v)``
  (what torch's CPU rsqrt computes); the launcher disables fp contraction so ``a * c - b * s`` is not fused
  into an FMA (the reference rounds each product);
* e2m1 codes and ue8m0 exponents are integer bit arithmetic; bf16 and e4m3 use the GPU's round-to-nearest-
  even conversions, and in the Triton interpreter (whose float casts truncate) an exact integer emulation;
* what cannot be identical is the order of the fp32 sums (mean of squares over 128 / 512 elements, the
  Hadamard butterfly versus the reference's matmul). Those differ in the last fp32 bits now and then, which
  changes a stored byte only when the reference value lies within that rounding of a code boundary (one
  code of fp8 / fp4; an fp32 fp8 scale by a few fp32 ulps). tests/test_store_triton.py states and checks
  the bound; inputs whose pipeline is exact in fp32 give identical bytes.

Safety without validation (CUDA-graph capture, torch.compile): rows whose slot is negative or
>= num_slots, or whose position is outside the rope table, are neither read nor written; no address
outside the pool, the inputs or the table is ever formed.

Page summaries (:class:`dsakit.pool.PageSummaries`, spec :func:`dsakit.pool.summarize_page`): with a table,
every page that gets a row is summarized over its entries 0..e (e its highest entry in the call), read back
from the pool and decoded bit for bit like the reference (``load_key_decoded``), so the bytes are the
reference's whatever order or chunking the entries came in. Two ways, picked by the launcher:

* in the store launch (``one_row_per_page``: a decode append, one row per sequence, or slots the record
  checked on the host): after storing its row, a program waits for its own stores (a CTA barrier) and sums
  entries 0..e of the row's page, entries 0..e-1 having been stored by earlier launches. No extra launch.
* otherwise one more launch after the store (``_summarize_pages_kernel``): the row that ends each page's run
  of rows summarizes the page, every row of the call being stored by then. Without host-checked slots the
  launcher cannot know that a call of N > 1 rows has one row per page, so such calls take this launch.

Both rely on the table's precondition (pages appended in order; a page's rows in one call consecutive, which
the record checks on the host when it checks values: :func:`dsakit.pool.check_summary_order`).

The launchers are registered as ``torch.library`` custom ops (``dsakit::store_index_keys``,
``dsakit::store_attention_kv``) that mutate ``pool`` and have fake (meta) implementations, so the public
functions work under ``torch.compile`` and CUDA graph capture.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from ...batch import check_pool_alignment
from ...formats import ATTENTION_FP8_BLOCK, ENTRIES_PER_PAGE, AttentionKVFormat, KeyFormat, key_codec
from ...pool import PageSummaries
from ._kernels import (PAGE_ENTRIES, PAGE_NONE, PAGE_ONE_LAUNCH, PAGE_SIDES, SUMMARY_IN_STORE, SUMMARY_NONE,
                       _store_attention_kv_generic_kernel, _store_attention_kv_kernel, _store_index_keys_generic_kernel,
                       _store_index_keys_kernel, _summarize_pages_kernel)
from .config import SUMMARY_ROWS_PER_PROGRAM, SUMMARY_WARPS, StoreConfig

# compile-time codes of the options
_NORMS = {"rmsnorm": 0, "layernorm": 1}
_PAIRINGS = {"interleaved": 0, "half-split": 1}
_PLACEMENTS = {"trailing": 0, "leading": 1}
# the attention-KV entries (not index keys): plain bf16 or fp8 + bf16 rope
_ATTENTION_KINDS = {"bf16": 0, "fp8-rope-bf16": 1}


# --------------------------------------------------------------------------------------------------
# Launchers (no validation: the public functions in __init__.py validate) and custom ops
# --------------------------------------------------------------------------------------------------


def _launch_options(device: torch.device) -> dict:
    # Keep a * c - b * s as two rounded products (the reference's arithmetic); the interpreter ignores it.
    return {"enable_fp_fusion": False} if device.type == "cuda" else {}


def _native_casts(pool: torch.Tensor) -> bool:
    """Hardware bf16 / e4m3 conversions on a GPU (both round to nearest even); bit-exact emulation in the
    interpreter, whose float casts truncate. The GPU benchmark checks the native path byte for byte."""
    return pool.device.type == "cuda"


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """Rows may be strided; the last dim must be dense (a copy of the input, never of the pool)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def launch_store_index_keys(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                            rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor, norm_bias: Optional[torch.Tensor],
                            fmt: KeyFormat, norm: str, pairing: str, placement: str, hadamard: bool,
                            eps: float, *, config: StoreConfig | None = None, summaries: PageSummaries | None = None,
                            one_row_per_page: bool = False) -> None:
    """Launch the index-key kernel on validated inputs (see ``dsakit.ops.store.store_index_keys``).

    ``config``: every launch setting (default: the measured table of the GPU), :class:`StoreConfig`.
    ``summaries``: the pool's page summaries, kept up to date; ``one_row_per_page``: the caller knows that no
    page gets two rows (a decode append, or slots it checked), so the store launch itself summarizes each
    row's page; otherwise one more launch does it after the store (module docstring, "Page summaries").
    """
    config = config or StoreConfig.for_device(pool.device)
    n = keys.shape[0]
    if n == 0:
        return
    keys = _rows_view(keys)
    positions, slots = positions.contiguous(), slots.contiguous()
    table = rope_cos_sin.contiguous()
    codec = key_codec(fmt)
    common = dict(NORM=_NORMS[norm], HAS_BIAS=norm_bias is not None, PAIRING=_PAIRINGS[pairing],
                  PLACEMENT=_PLACEMENTS[placement], HADAMARD=bool(hadamard), CODE=int(codec.code),
                  UE8M0=fmt.scale_fmt == "ue8m0", FP4_RNE=fmt.rounding == "rne", VALUE_BYTES=fmt.value_bytes,
                  SCALE_BYTES=fmt.scale_bytes, PAGE_BYTES=fmt.page_bytes, D=fmt.head_dim, PAGE=fmt.entries_per_page,
                  **_launch_options(pool.device))
    summary_rows = (pool, pool, pool) if summaries is None else (summaries.centre, summaries.lower, summaries.upper)
    in_store = summaries is not None and one_row_per_page
    args = (keys, positions, slots, pool, table, norm_weight, norm_weight if norm_bias is None else norm_bias,
            n, keys.stride(0), pool.shape[0] * ENTRIES_PER_PAGE, table.shape[0], float(eps), *summary_rows)
    common["SUMMARY"] = SUMMARY_IN_STORE if in_store else SUMMARY_NONE
    # A format with a per-page side value (page-centred: the centre) stores in one launch: rows at entry 0 of
    # a page write its side value, the others take it from entry 0's row of the same call or from the pool
    # (_kernels._page_sources), so no ordering between the programs of a launch is needed; or, from
    # config.page_term_two_launches_from rows on, in two (the side values, then the entries).
    if not codec.page_term:
        steps = (PAGE_NONE,)
    elif config.page_term_launches(n) == 1:
        steps = (PAGE_ONE_LAUNCH,)
    else:
        steps = (PAGE_SIDES, PAGE_ENTRIES)
    fast, block_n, warps = config.index_launch(table.shape[1], codec.page_term)
    for step in steps:
        if fast:
            _store_index_keys_kernel[(triton.cdiv(n, block_n),)](
                *args, NATIVE=_native_casts(pool), BLOCK_N=block_n, num_warps=warps, PAGE_STEP=step, **common)
        else:
            _store_index_keys_generic_kernel[(triton.cdiv(n, block_n),)](
                *args, ROPE_DIM=table.shape[1], BLOCK_N=block_n, num_warps=warps, PAGE_STEP=step, **common)
    if summaries is not None and not in_store:
        _summarize_pages_kernel[(triton.cdiv(n, SUMMARY_ROWS_PER_PROGRAM),)](
            slots, positions, pool, *summary_rows, n, pool.shape[0] * ENTRIES_PER_PAGE, table.shape[0],
            CODE=int(codec.code), D=fmt.head_dim, PAGE=fmt.entries_per_page, PAGE_BYTES=fmt.page_bytes,
            BLOCK_N=SUMMARY_ROWS_PER_PROGRAM, num_warps=SUMMARY_WARPS)


def launch_store_attention_kv(kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                              rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor, fmt: AttentionKVFormat,
                              pairing: str, placement: str, eps: float, *, config: StoreConfig | None = None) -> None:
    """Launch the attention-KV kernel on validated inputs (see ``dsakit.ops.store.store_attention_kv``).

    ``config``: every launch setting (default: the measured table of the GPU), :class:`StoreConfig`.
    """
    config = config or StoreConfig.for_device(pool.device)
    n = kv.shape[0]
    if n == 0:
        return
    kv = _rows_view(kv)
    positions, slots = positions.contiguous(), slots.contiguous()
    table = rope_cos_sin.contiguous()
    # the entry layout from the format object (dsakit.formats), as compile-time constants
    common = dict(PAIRING=_PAIRINGS[pairing], VALUE_BYTES=fmt.value_bytes, SCALE_BYTES=fmt.scale_bytes,
                  PAGE_BYTES=fmt.page_bytes, D=fmt.head_dim, NOPE=fmt.nope_dim, FP8_BLOCK=ATTENTION_FP8_BLOCK,
                  PAGE=fmt.entries_per_page, **_launch_options(pool.device))
    args = (kv, positions, slots, pool, table, norm_weight, n, kv.stride(0), pool.shape[0] * ENTRIES_PER_PAGE,
            table.shape[0], float(eps))
    if config.fast_attention_kernel(table.shape[1], placement, fmt.kind):
        _store_attention_kv_kernel[(triton.cdiv(n, config.attention_block_n),)](
            *args, NATIVE=_native_casts(pool), BLOCK_N=config.attention_block_n, num_warps=config.attention_warps,
            **common)
    else:
        _store_attention_kv_generic_kernel[(triton.cdiv(n, config.generic_attention_block_n),)](
            *args, KIND=_ATTENTION_KINDS[fmt.kind], ROPE_DIM=table.shape[1], PLACEMENT=_PLACEMENTS[placement],
            BLOCK_N=config.generic_attention_block_n, num_warps=config.generic_warps, **common)


@torch.library.custom_op("dsakit::store_index_keys",
                         mutates_args=("pool", "summary_centre", "summary_lower", "summary_upper"))
def store_index_keys_op(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                        rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor, norm_bias: Optional[torch.Tensor],
                        fmt: str, norm: str, rope_layout: str, hadamard: bool, eps: float,
                        summary_centre: Optional[torch.Tensor] = None, summary_lower: Optional[torch.Tensor] = None,
                        summary_upper: Optional[torch.Tensor] = None, one_row_per_page: bool = False) -> None:
    """Custom op around :func:`launch_store_index_keys`; ``fmt`` / ``rope_layout`` by name; the page summaries
    (optional) as their three tensors (all or none, checked by the caller's record)."""
    check_pool_alignment(pool)  # runs on the real pool also under torch.compile (check_pool cannot there)
    pairing, placement = rope_layout.rsplit("-", 1)
    summaries = None if summary_centre is None else PageSummaries(summary_centre, summary_lower, summary_upper)
    launch_store_index_keys(keys, positions, slots, pool, rope_cos_sin, norm_weight, norm_bias,
                            KeyFormat.parse(fmt), norm, pairing, placement, hadamard, eps, summaries=summaries,
                            one_row_per_page=one_row_per_page)


@store_index_keys_op.register_fake
def _store_index_keys_fake(keys, positions, slots, pool, rope_cos_sin, norm_weight, norm_bias, fmt, norm,
                           rope_layout, hadamard, eps, summary_centre=None, summary_lower=None, summary_upper=None,
                           one_row_per_page=False) -> None:
    return None


@torch.library.custom_op("dsakit::store_attention_kv", mutates_args=("pool",))
def store_attention_kv_op(kv: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                          rope_cos_sin: torch.Tensor, norm_weight: torch.Tensor, fmt: str, rope_layout: str,
                          eps: float) -> None:
    """Custom op around :func:`launch_store_attention_kv`; ``fmt`` / ``rope_layout`` by name."""
    check_pool_alignment(pool, "kv_cache")
    pairing, placement = rope_layout.rsplit("-", 1)
    launch_store_attention_kv(kv, positions, slots, pool, rope_cos_sin, norm_weight,
                              AttentionKVFormat.parse(fmt), pairing, placement, eps)


@store_attention_kv_op.register_fake
def _store_attention_kv_fake(kv, positions, slots, pool, rope_cos_sin, norm_weight, fmt, rope_layout, eps) -> None:
    return None
