"""Hierarchical top-k on the device: page representatives first, exact scores inside the pages kept.

The spec is :func:`dsakit.ops.indexer.reference.hierarchical_topk`; this module computes the same selection with
the flat kernels of ``index_topk`` run on two small *derived batches*, so every key format, both query
layouts (prefill and decode) and every tuning of the flat path carry over unchanged:

* stage 1: the representatives (bf16 [P, 128]: a centred pool's stored centres, a plain pool's
  :class:`dsakit.pool.PageSummaries` centres) of each sequence's pages are gathered into a bf16 key pool of
  ceil(pages / 64) pages per sequence, and ``index_topk`` over it with ratio * 64 (a query sees the pages
  whose 64 entries it all sees) keeps the best m pages of each query: [T, Pmax] scores, never [T, N];
* the kept pages, the first and the last pages (:func:`dsakit.ops.indexer.reference.forced_pages`) are merged
  in ascending page order and deduplicated: [T, M] page columns, M = m + first + recent;
* stage 2: each query becomes a sequence of its own whose block table lists its kept pages (ascending, so
  entry order and the tie rule are the flat top-k's); its visible count is all of its kept pages but the
  last, which is its own partial page; ``index_topk`` over that batch returns the exact top-k, mapped back
  to entry indices (and slots) through the page columns.

No [T, N] tensor and no device->host sync in the approximate mode (the derived batches are built with
``validate=False`` from widths known on the host). The exact mode adds the page bounds
(:func:`~dsakit.ops.indexer.reference.page_score_bounds`, fp32 torch, chunked), one sync for the widest page
set, and a second stage 2 over the pages whose bound reaches the k-th score: each sequence keeps the union of
its queries' pages and every query its own row and position (:func:`_stage2_per_sequence`), so the flat
kernels run with the original query layout and score every entry with the flat top-k's own arithmetic.
"""

from __future__ import annotations

import dataclasses

import torch

from ...batch import PagedBatch, visible_counts
from ...formats import ENTRIES_PER_PAGE, KeyFormat, is_centred
from ...pool import PageSummaries
from .config import HierarchyConfig
from .reference import page_score_bounds

_SENTINEL = 2**30  # a page column past every real one: sorts last, marks "no page"
# Elements of the [rows, Pmax, 128] bound gathers per chunk (bf16): 2^26 = 128 MiB each.
_BOUND_CHUNK_ELEMENTS = 1 << 26


def _with_layout(batch: PagedBatch, query_lens, rows_sorted: bool) -> PagedBatch:
    """A derived batch with the host query layout it was built for (its pages are columns of a checked block
    table): the tile plans then need no sync, as for the flat top-k of a checked batch."""
    return dataclasses.replace(batch, query_lens=query_lens, rows_sorted=rows_sorted,
                               checked_tensors=batch._tensor_ids())


def representatives(batch: PagedBatch, summaries: PageSummaries | None) -> torch.Tensor:
    """bf16 [P, 128] (a view, rows may be strided): the representative of every page of the pool."""
    if is_centred(batch.fmt):
        offset = batch.fmt.centre_offset_in_page
        return batch.pool[:, offset:offset + 256].view(torch.bfloat16)
    return summaries.centre


def _stage1_batch(batch: PagedBatch, reps: torch.Tensor) -> tuple[PagedBatch, int]:
    """The representatives of each sequence's pages as a bf16 key batch (entry i of sequence b = the
    representative of its page i) and the widest page count."""
    num_seqs, width = batch.block_table.shape
    pages_max = min(width, -(-batch.max_entries // ENTRIES_PER_PAGE))
    rep_pages = max(1, -(-pages_max // ENTRIES_PER_PAGE))  # bf16 pages of 64 representatives per sequence
    columns = rep_pages * ENTRIES_PER_PAGE
    # one gather straight into the derived pool: columns past a sequence's pages repeat a valid row (never
    # visible: the entry counts stop before them)
    table = torch.zeros(num_seqs, columns, dtype=torch.int64, device=batch.device)
    table[:, :pages_max] = batch.block_table[:, :pages_max].clamp(0, reps.shape[0] - 1)
    gathered = torch.empty(num_seqs, columns, 128, dtype=torch.bfloat16, device=batch.device)
    torch.index_select(reps, 0, table.view(-1), out=gathered.view(-1, 128))
    pool = gathered.view(num_seqs * rep_pages, KeyFormat.BF16.page_bytes // 2).view(torch.uint8)
    rep_table = torch.arange(num_seqs * rep_pages, device=batch.device, dtype=torch.int32).view(num_seqs, rep_pages)
    page_counts = (batch.entry_counts.long() + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
    derived = PagedBatch.build(pool, KeyFormat.BF16, rep_table, page_counts.clamp(max=pages_max), batch.query_seq,
                               batch.query_positions, batch.ratio * ENTRIES_PER_PAGE, validate=False,
                               max_entries=pages_max)
    # the original batch's query layout (host metadata): the tile plans need no sync
    derived = _with_layout(derived, batch.query_lens, batch.rows_sorted)
    return derived, pages_max


def _merge_columns(parts: list[torch.Tensor]) -> torch.Tensor:
    """int64 [T, M]: the distinct page columns >= 0 of the parts (each int [T, x], < 0 = none), ascending,
    then _SENTINEL."""
    cols = torch.cat([torch.where(p >= 0, p.long(), torch.full_like(p.long(), _SENTINEL)) for p in parts], dim=1)
    cols = cols.sort(dim=1).values
    t, width = cols.shape
    first = torch.ones_like(cols, dtype=torch.bool)  # the first of each run of equal columns
    first[:, 1:] = cols[:, 1:] != cols[:, :-1]
    # compact the distinct columns to the front, in order (a scan and a scatter instead of a second sort);
    # repeats go to a spare column that is dropped
    place = torch.where(first, first.cumsum(dim=1) - 1, torch.full_like(cols, width))
    out = torch.full((t, width + 1), _SENTINEL, dtype=torch.long, device=cols.device)
    out.scatter_(1, place, cols)
    return out[:, :width]


def _forced_columns(visible: torch.Tensor, config: HierarchyConfig) -> torch.Tensor:
    """int64 [T, first + recent]: the first pages and the last visible pages of each query (-1 = none)."""
    used = (visible + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
    first = torch.arange(config.first_pages, device=visible.device).unsqueeze(0).expand(visible.shape[0], -1)
    first = torch.where(first < used.unsqueeze(1), first, torch.full_like(first, -1))
    recent = used.unsqueeze(1) - 1 - torch.arange(config.recent_pages, device=visible.device).unsqueeze(0)
    return torch.cat([first, recent.clamp(min=-1)], dim=1)


def _stage2(q, weights, batch: PagedBatch, k: int, cols: torch.Tensor, visible: torch.Tensor, *, topk,
            return_slots: bool):
    """Exact top-k of each query over the pages at its columns cols [T, M] (ascending, _SENTINEL = none)."""
    t, width = cols.shape
    valid = cols < _SENTINEL
    kept = valid.sum(dim=1)
    rows = batch.block_table.long()[batch.query_seq.long()]  # [T, W]
    safe = cols.clamp(max=rows.shape[1] - 1)
    pages = torch.where(valid, rows.gather(1, safe), torch.zeros_like(safe))
    used = (visible + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
    last = visible - (used - 1) * ENTRIES_PER_PAGE  # visible entries of the query's last page
    counts = torch.where(kept > 0, (kept - 1) * ENTRIES_PER_PAGE + last, torch.zeros_like(kept))
    derived = PagedBatch.build(batch.pool, batch.fmt, pages.to(torch.int32), counts,
                               torch.arange(t, device=batch.device, dtype=torch.int32), None, 1,
                               validate=False, max_entries=width * ENTRIES_PER_PAGE)
    derived = _with_layout(derived, (1,) * t, True)  # one query per sequence
    chosen = topk(q, weights, derived, k).long()
    column = (chosen.clamp(min=0) // ENTRIES_PER_PAGE)
    within = chosen.clamp(min=0) % ENTRIES_PER_PAGE
    none = torch.full_like(chosen, -1)
    indices = torch.where(chosen >= 0, cols.gather(1, column) * ENTRIES_PER_PAGE + within, none).to(torch.int32)
    slots = None
    if return_slots:
        slots = torch.where(chosen >= 0, pages.gather(1, column) * ENTRIES_PER_PAGE + within, none).to(torch.int32)
    return indices, slots, derived, chosen


def _kth_scores(q, weights, derived: PagedBatch, chosen: torch.Tensor, cols: torch.Tensor, k: int, *,
                scores) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [T], int64 [T]): the score of each query's k-th selected entry of stage 2 (-inf where fewer than
    k), scored by the flat kernel on a one-page batch (the page holding that entry), and that page's column in
    the query's sequence (0 where none)."""
    kth = chosen[:, k - 1]
    column = kth.clamp(min=0) // ENTRIES_PER_PAGE
    page = derived.block_table.long().gather(1, column.unsqueeze(1))
    one = PagedBatch.build(derived.pool, derived.fmt, page.to(torch.int32),
                           torch.full_like(kth, ENTRIES_PER_PAGE), derived.query_seq, None, 1, validate=False,
                           max_entries=ENTRIES_PER_PAGE)
    one = _with_layout(one, derived.query_lens, True)
    page_scores = scores(q, weights, one)
    value = page_scores.gather(1, (kth.clamp(min=0) % ENTRIES_PER_PAGE).unsqueeze(1)).squeeze(1)
    value = torch.where(kth >= 0, value, torch.full_like(value, float("-inf")))
    return value, cols.gather(1, column.unsqueeze(1)).squeeze(1).clamp(max=_SENTINEL - 1) * (kth >= 0)


def _reachable_pages(q, weights, batch: PagedBatch, summaries: PageSummaries, theta: torch.Tensor,
                     theta_page: torch.Tensor, visible: torch.Tensor, pages_max: int) -> torch.Tensor:
    """bool [T, pages_max]: the visible pages whose score bound is not below theta [T], lowered by the slack
    of theta's own page (column theta_page [T]): what no kernel rounding can separate from the flat k-th."""
    from .reference import BOUND_SLACK

    t, h, _ = q.shape
    rows_table = batch.block_table[:, :pages_max].long()[batch.query_seq.long()]  # [T, Pmax]
    rows_table = rows_table.clamp(0, summaries.num_pages - 1)
    out = torch.empty(t, pages_max, dtype=torch.bool, device=q.device)
    step = max(1, _BOUND_CHUNK_ELEMENTS // max(1, pages_max * 128 * max(1, h // 8)))
    for start in range(0, t, step):
        sl = slice(start, min(t, start + step))
        lower = summaries.lower[rows_table[sl]]  # [rows, Pmax, 128]
        upper = summaries.upper[rows_table[sl]]
        bound, scale = page_score_bounds(q[sl], weights[sl], lower, upper, with_scale=True)
        low = theta[sl] - BOUND_SLACK * scale.gather(1, theta_page[sl].clamp(max=pages_max - 1).unsqueeze(1)).squeeze(1)
        out[sl] = ~(bound < low.unsqueeze(1))
    used = (visible + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
    return out & (torch.arange(pages_max, device=q.device).unsqueeze(0) < used.unsqueeze(1))


def _stage2_per_sequence(q, weights, batch: PagedBatch, k: int, kept: torch.Tensor, visible: torch.Tensor, *,
                         topk, return_slots: bool):
    """Exact mode's stage 2: each sequence keeps the union of its queries' kept pages (kept bool [T, Pmax]), in
    ascending order, and every query its original row: the flat kernels run with the original query layout
    (the same tile plan and arithmetic as the flat top-k), each query seeing the union's pages up to its own
    last page (a position per query, ratio 1). One sync (the widest union)."""
    t, pages_max = kept.shape
    device = batch.device
    seq = batch.query_seq.long()
    num_seqs = batch.block_table.shape[0]
    union = torch.zeros(num_seqs, pages_max, dtype=torch.int32, device=device)
    union.index_add_(0, seq, kept.to(torch.int32))
    union = union > 0
    widest = max(1, int(union.sum(dim=1).max()))  # the sync
    order = torch.where(union, torch.arange(pages_max, device=device).unsqueeze(0),
                        torch.full_like(union, _SENTINEL, dtype=torch.long))
    ucols = order.sort(dim=1).values[:, :widest]  # [S, U] ascending page columns, _SENTINEL = none
    valid = ucols < _SENTINEL
    rows = batch.block_table.long()
    table = torch.where(valid, rows.gather(1, ucols.clamp(max=rows.shape[1] - 1)), torch.zeros_like(ucols))
    counts_all = batch.entry_counts.long()
    last_fill = counts_all - ((counts_all + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE - 1) * ENTRIES_PER_PAGE
    last_col = (counts_all + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE - 1
    size = valid.sum(dim=1)
    has_last = (ucols == last_col.unsqueeze(1)).any(dim=1)
    counts = size * ENTRIES_PER_PAGE - torch.where(has_last, ENTRIES_PER_PAGE - last_fill, torch.zeros_like(size))
    # query t sees the union's pages before its last page, then its last page's visible entries
    used = (visible + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
    before = torch.cumsum(union.to(torch.int64), dim=1)  # [S, Pmax]: union pages at or before each column
    own_last = (used - 1).clamp(min=0)
    pages_before = before[seq, own_last.clamp(max=pages_max - 1)] - 1
    derived_visible = torch.where(visible > 0, pages_before * ENTRIES_PER_PAGE + visible - own_last * ENTRIES_PER_PAGE,
                                  torch.zeros_like(visible))
    derived = PagedBatch.build(batch.pool, batch.fmt, table.to(torch.int32), counts, batch.query_seq,
                               (derived_visible - 1).clamp(min=0), 1, validate=False,
                               max_entries=widest * ENTRIES_PER_PAGE)
    derived = _with_layout(derived, batch.query_lens, batch.rows_sorted)
    chosen = topk(q, weights, derived, k).long()
    chosen = torch.where((visible > 0).unsqueeze(1), chosen, torch.full_like(chosen, -1))
    column = chosen.clamp(min=0) // ENTRIES_PER_PAGE
    within = chosen.clamp(min=0) % ENTRIES_PER_PAGE
    none = torch.full_like(chosen, -1)
    indices = torch.where(chosen >= 0, ucols[seq].gather(1, column) * ENTRIES_PER_PAGE + within, none)
    slots = None
    if return_slots:
        slots = torch.where(chosen >= 0, table[seq].gather(1, column) * ENTRIES_PER_PAGE + within, none).to(torch.int32)
    return indices.to(torch.int32), slots, union[seq].sum(dim=1)


def hierarchical_topk_triton(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int,
                             config: HierarchyConfig, summaries: PageSummaries | None, *,
                             q_scale: torch.Tensor | None = None, return_slots: bool = False,
                             topk_config=None):
    """Hierarchical top-k on the flat Triton kernels (inputs checked by the caller; ``q_scale`` fp32 [T, H]
    as in ``index_topk_triton``, ``topk_config`` its TopkConfig) -> (indices int32 [T, k], slots int32 [T, k]
    or None, pages scored int64 [T])."""
    from .scores import index_scores_triton
    from .triton import index_topk_triton

    from .inputs import check_q_scale_values

    if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):  # its check syncs: once, never in a graph
        check_q_scale_values(q_scale)

    def topk(q_, w_, b_, k_):
        return index_topk_triton(q_, w_, b_, k_, q_scale=q_scale, config=topk_config, check_q_scale=False)

    def scores(q_, w_, b_):
        return index_scores_triton(q_, w_, b_, q_scale=q_scale, check_q_scale=False)

    t = q.shape[0]
    device = batch.device
    if t == 0 or batch.max_entries == 0:
        empty = torch.full((t, k), -1, dtype=torch.int32, device=device)
        return empty, (empty.clone() if return_slots else None), torch.zeros(t, dtype=torch.int64, device=device)
    stage1, pages_max = _stage1_batch(batch, representatives(batch, summaries))
    m = min(config.pages_for(k), pages_max)
    best = topk(q, weights, stage1, m)  # [T, m] page columns, -1 padded
    visible = visible_counts(batch.entry_counts[batch.query_seq.long()], batch.query_positions, batch.ratio)
    visible = visible.clamp(max=batch.max_entries)
    cols = _merge_columns([best, _forced_columns(visible, config)])
    indices, slots, derived, chosen = _stage2(q, weights, batch, k, cols, visible, topk=topk,
                                              return_slots=return_slots)
    if config.exact:
        theta, theta_page = _kth_scores(q, weights, derived, chosen, cols, k, scores=scores)
        q_value = q.float() if q_scale is None else q.float() * q_scale.unsqueeze(-1)
        reach = _reachable_pages(q_value, weights, batch, summaries, theta, theta_page, visible, pages_max)
        kept = torch.zeros(t, pages_max + 1, dtype=torch.bool, device=device)
        kept.scatter_(1, cols.clamp(max=pages_max), True)
        kept = kept[:, :pages_max] | reach
        indices, slots, _ = _stage2_per_sequence(q, weights, batch, k, kept, visible, topk=topk,
                                                 return_slots=return_slots)
        return indices, slots, kept.sum(dim=1)
    return indices, slots, (cols < _SENTINEL).sum(dim=1)
