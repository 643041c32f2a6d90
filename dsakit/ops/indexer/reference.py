"""Reference (fp32, CPU) of the lightning indexer: the scores and the top-k selected from them. It is the
spec every kernel of :mod:`dsakit.ops.indexer` is tested against, and imports none of them.

Scores::

    S[t, j] = sum_h weights[t, h] * relu(q[t, h, :] . k[j, :])          (fp32 accumulation)
    entry j is visible to query t iff j < entry_count[seq(t)] and j < (position[t] + 1) // ratio
    invisible entries score -inf

Page-centred key formats (``fp8-centred``, ``fp4-centred``) store k[j] = c[page(j)] + r[j]; their logit is
computed as q . r[j] + q . c[page(j)], the second term once per (query, head, page) and exact in fp32 (the
centre is bf16), then the relu.

``ratio`` is the compression ratio of the entries (1 = one key per token, plain causal s <= t; 4 = V4 CSA
entries of 4 tokens, visible once all 4 tokens are <= t). ``query_positions = None`` makes every cached
entry of the sequence visible (decode without a causal cut).

Batches are ragged: queries [T] belong to sequences through ``query_seq`` [T]; sequence b has
``entry_counts[b]`` entries addressed by ``block_table[b]`` (page ids, see dsakit.cache).

Top-k rules (every kernel follows them):

* Candidates of a row are its entries with score > -inf (masked / invisible entries are never selected).
  NaN counts as a candidate ranking above every number, +inf included (the order ``torch.topk`` and a
  radix select over float bits give): a NaN-producing bug is visible as selected garbage, not hidden.
* The row's output holds the indices of its min(k, candidates) best entries in descending score order;
  equal scores go to the lower index first. The remaining columns are -1.
* Output int32 [T, k]; entry indices are within the query's sequence (0..entry_count-1).
"""

from __future__ import annotations

import torch

from ..._memory import INDEX_DTYPES, check_tensor
from ...batch import PagedBatch, check_batch_queries, check_k, check_queries, check_ratio, visible_counts
from ...pool import (PageSummaries, check_slots, dequantize_entries, num_slots, read_centres, read_checked_entries,
                     read_entries, sequence_slots)
from ...formats import ENTRIES_PER_PAGE, KeyFormat, is_centred
from .config import MAX_K, HierarchyConfig

# Queries processed per chunk so that [chunk, H, N] stays small on the CPU.
_CHUNK_ELEMENTS = 1 << 24


def index_scores_dense(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                       query_positions: torch.Tensor | None = None, ratio: int = 1, *,
                       centres: torch.Tensor | None = None) -> torch.Tensor:
    """Scores of queries q [T, H, D] with weights [T, H] against one sequence's keys [N, D] -> fp32 [T, N].

    Page-centred keys: ``keys`` are the residuals and ``centres`` [ceil(N / 64), D] the centres of the
    sequence's pages; the logit of entry j is q . keys[j] + q . centres[j // 64], the second term computed
    once per (query, head, page) and added before the relu.
    """
    check_queries(q, weights, q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() == 3 else 128)
    check_tensor("keys", keys, shape=(None, q.shape[2]), floating=True,
                 message=f"keys must be a floating [N, {q.shape[2]}] tensor")
    check_ratio(ratio)
    t, h, _ = q.shape
    n = keys.shape[0]
    qf, wf, kf = q.detach().cpu().float(), weights.detach().cpu().float(), keys.detach().cpu().float()
    page_of = None
    if centres is not None:
        pages = (n + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
        check_tensor("centres", centres, shape=(pages, q.shape[2]), floating=True,
                     message=f"centres must be a floating [{pages}, {q.shape[2]}] tensor (one per page of the N = "
                             f"{n} keys)")
        cf = centres.detach().cpu().float()
        page_of = torch.arange(n) // ENTRIES_PER_PAGE
    out = torch.empty(t, n)
    chunk = max(1, _CHUNK_ELEMENTS // max(1, h * n))
    for start in range(0, t, chunk):
        logits = torch.einsum("thd,nd->thn", qf[start:start + chunk], kf)
        if page_of is not None:  # + q . c: once per (query, head, page), broadcast to the page's entries
            logits += torch.einsum("thd,pd->thp", qf[start:start + chunk], cf)[:, :, page_of]
        out[start:start + chunk] = (logits.relu() * wf[start:start + chunk].unsqueeze(-1)).sum(dim=1)
    counts = torch.full((t,), n, dtype=torch.long)
    if query_positions is not None:
        check_tensor("query_positions", query_positions, shape=(t,), dtypes=INDEX_DTYPES,
                     message=f"query_positions must be int [T] = [{t}] or None")
        counts = visible_counts(counts, query_positions.cpu(), ratio)
    masked = torch.arange(n).unsqueeze(0) >= counts.unsqueeze(1)
    return out.masked_fill_(masked, float("-inf"))


def gather_sequence_keys(pool: torch.Tensor, fmt: "KeyFormat | str", block_table_row: torch.Tensor,
                         length: int) -> torch.Tensor:
    """fp32 [length, 128]: one sequence's dequantized keys."""
    fmt = KeyFormat.parse(fmt)
    return dequantize_entries(pool, fmt, sequence_slots(block_table_row, length))


def gather_sequence_residuals(pool: torch.Tensor, fmt: "KeyFormat | str", block_table_row: torch.Tensor,
                              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page-centred formats: one sequence's (residuals fp32 [length, 128], page centres fp32 [pages, 128])."""
    fmt = KeyFormat.parse(fmt)
    slots = sequence_slots(block_table_row, length)
    values, scales = read_entries(pool, fmt, slots)
    first_slots = slots[::ENTRIES_PER_PAGE]
    return fmt.dequantize_residual(values, scales), read_centres(pool, fmt, first_slots)


def _batch_sequence_keys(batch: PagedBatch, row: torch.Tensor, length: int
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One sequence's keys fp32 [length, 128] (residuals for centred formats) and page centres (or None) read
    from the batch's pool. A validated batch guarantees its pages, so its slots are read as they are; an
    unchecked one (validate=False) has its slots checked against the pool here, so bad pages are a ValueError."""
    slots = sequence_slots(row, length)
    if batch.query_lens is None:
        slots = check_slots(slots, num_slots(batch.pool), allow_padding=False)
    values, scales = read_checked_entries(batch.pool, batch.fmt, slots)
    if is_centred(batch.fmt):
        return batch.fmt.dequantize_residual(values, scales), read_centres(batch.pool, batch.fmt,
                                                                           slots[::ENTRIES_PER_PAGE])
    return batch.fmt.dequantize(values, scales), None


def index_scores(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
    """Scores of a ragged batch against paged keys -> fp32 [T, batch.max_entries] (CPU), -inf where invisible.

    q [T, H, 128], weights [T, H], batch: a :class:`dsakit.PagedBatch` (already validated: nothing of it is
    checked again here).
    """
    check_batch_queries(q, weights, batch)
    t = q.shape[0]
    out = torch.full((t, batch.max_entries), float("-inf"))
    counts = batch.entry_counts.cpu().long()
    seq_of = batch.query_seq.cpu().long()
    positions = None if batch.query_positions is None else batch.query_positions.cpu()
    table = batch.block_table.cpu()
    for b in range(batch.num_seqs):
        rows = torch.nonzero(seq_of == b).flatten()
        if rows.numel() == 0 or counts[b] == 0:
            continue
        length = min(int(counts[b]), batch.max_entries)
        pos = None if positions is None else positions[rows]
        keys, centres = _batch_sequence_keys(batch, table[b], length)
        out[rows, : keys.shape[0]] = index_scores_dense(q[rows], weights[rows], keys, pos, batch.ratio,
                                                        centres=centres)
    return out


def select_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores fp32 [T, N] -> int32 [T, k] indices (rules above)."""
    check_tensor("scores", scores, dims=2, message="scores must be a [T, N] tensor")
    check_k(k, MAX_K)
    s = scores.detach().cpu().float()
    t, n = s.shape
    out = torch.full((t, k), -1, dtype=torch.int32)
    if n == 0 or t == 0:
        return out
    is_nan = torch.isnan(s)
    # Two stable passes: by score (NaN as +inf), then NaN first. Stability keeps lower indices first on ties.
    key = torch.where(is_nan, torch.full_like(s, float("inf")), s)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    nan_first = torch.sort(is_nan.gather(1, order).to(torch.int8), dim=1, descending=True, stable=True).indices
    order = order.gather(1, nan_first)
    candidates = (is_nan | (s > float("-inf"))).sum(dim=1)
    take = min(k, n)
    chosen = order[:, :take].to(torch.int32)
    keep = torch.arange(take).unsqueeze(0) < candidates.unsqueeze(1)
    out[:, :take] = torch.where(keep, chosen, torch.full_like(chosen, -1))
    return out


def index_topk(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int) -> torch.Tensor:
    """Top-k entries per query of a ragged batch against paged keys -> int32 [T, k] (-1 padded).

    Arguments as :func:`dsakit.ops.indexer.reference.index_scores`. Materializes [T, N] (the reference may).
    """
    check_k(k, MAX_K)
    return select_topk(index_scores(q, weights, batch), k)


def topk_to_slots(indices: torch.Tensor, block_table: torch.Tensor, query_seq: torch.Tensor) -> torch.Tensor:
    """Entry indices int32 [T, K] (-1 padded) -> global slot ids int32 [T, K] (-1 kept) via the block table.

    An index >= 0 must fall in an assigned page of its query's block-table row (else ValueError: it would
    map to a bogus slot).
    """
    for what, t, dims in (("indices", indices, 2), ("block_table", block_table, 2), ("query_seq", query_seq, 1)):
        check_tensor(what, t, dims=dims, dtypes=INDEX_DTYPES, message=f"{what} must be a {dims}-D int32/int64 tensor")
    if query_seq.shape[0] != indices.shape[0]:
        raise ValueError(f"query_seq must be [T] = [{indices.shape[0]}], got {list(query_seq.shape)}")
    if query_seq.numel() and (int(query_seq.min()) < 0 or int(query_seq.max()) >= block_table.shape[0]):
        raise ValueError(f"query_seq values must be in 0..{block_table.shape[0] - 1}, got "
                         f"{int(query_seq.min())}..{int(query_seq.max())}")
    idx = indices.long()
    pages = block_table.long()[query_seq.long()]  # [T, max_pages]
    safe = idx.clamp(min=0)
    page_index = torch.div(safe, 64, rounding_mode="floor")
    beyond = (idx >= 0) & (page_index >= pages.shape[1])
    if bool(beyond.any()):
        raise ValueError(f"entry index {int(idx[beyond][0])} is beyond the block table width "
                         f"({pages.shape[1]} pages = {pages.shape[1] * 64} entries)")
    if pages.shape[1] == 0:  # no pages at all: every index is padding (checked above)
        return torch.full_like(idx, -1).to(torch.int32)
    page = pages.gather(1, page_index.clamp(max=pages.shape[1] - 1))
    unassigned = (idx >= 0) & (page < 0)
    if bool(unassigned.any()):
        raise ValueError(f"entry index {int(idx[unassigned][0])} falls in an unassigned page (-1) of its "
                         f"sequence's block table")
    slots = page * 64 + safe % 64
    return torch.where(idx >= 0, slots, torch.full_like(slots, -1)).to(torch.int32)


# --------------------------------------------------------------------------------------------------
# Hierarchical top-k (docs/hierarchy.md)
# --------------------------------------------------------------------------------------------------

#: Relative slack of the exact mode's per-head bound: covers the kernels' rounding of q to bf16 (2^-9 of
#: sum_d |q_d k_d|), Hopper's fp8 accumulation and fp32 reordering, each far below 2^-7 of that sum.
BOUND_SLACK = 2.0 ** -7


def page_score_bounds(q: torch.Tensor, weights: torch.Tensor, lower: torch.Tensor, upper: torch.Tensor, *,
                      with_scale: bool = False):
    """Upper bound of S[t, j] = sum_h w[t, h] relu(q[t, h] . k_j) over every key k_j of a page whose
    per-dimension box is [lower_p, upper_p]: q [T, H, D], weights [T, H], lower / upper [P, D] (pages shared by
    every query) or [T, P, D] (each query's own pages) -> fp32 [T, P], on q's device.

    Per head, q . k ranges over [lo_h, hi_h] with hi_h = q+ . upper + q- . lower and lo_h = q+ . lower +
    q- . upper (q+ / q- the positive / negative parts); relu is monotone, so w relu(q . k) <= w relu(hi_h)
    where w > 0 and <= w relu(lo_h) where w <= 0. Both ends are widened by BOUND_SLACK * m_h with
    m_h = |q| . max(|lower|, |upper|) >= sum_d |q_d k_d|, which covers the rounding of every kernel's score.
    NaN anywhere makes the bound NaN, which never compares below a threshold: such pages are kept.
    ``with_scale=True`` also returns scale [T, P] = sum_h |w_h| m_h, the size of the scores the page can
    produce: a kernel's rounding of any of its scores is far below BOUND_SLACK * scale.
    """
    qf, wf = q.float(), weights.float()
    lo, hi = lower.float(), upper.float()
    pos, neg = qf.clamp(min=0), qf.clamp(max=0)
    spec = "thd,pd->thp" if lo.dim() == 2 else "thd,tpd->thp"
    hi_h = torch.einsum(spec, pos, hi) + torch.einsum(spec, neg, lo)
    lo_h = torch.einsum(spec, pos, lo) + torch.einsum(spec, neg, hi)
    m_h = torch.einsum(spec, qf.abs(), torch.maximum(lo.abs(), hi.abs()))
    w = wf.unsqueeze(-1)
    term = torch.where(w > 0, w * (hi_h + BOUND_SLACK * m_h).relu(), w * (lo_h - BOUND_SLACK * m_h).relu())
    if with_scale:
        return term.sum(dim=1), (w.abs() * m_h).sum(dim=1)
    return term.sum(dim=1)


def forced_pages(visible: torch.Tensor, num_pages: int, config: HierarchyConfig) -> torch.Tensor:
    """bool [T, num_pages]: the pages every query keeps whatever their score: its first ``first_pages``
    and its last ``recent_pages`` pages that hold a visible entry (visible int64 [T] entries)."""
    page = torch.arange(num_pages, device=visible.device).unsqueeze(0)
    used = (visible.unsqueeze(1) + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE  # pages holding a visible entry
    return (page < used) & ((page < config.first_pages) | (page >= used - config.recent_pages))


def _kth_scores(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 [T], int64 [T]): the k-th best candidate score of each row of scores [T, W] (-inf where fewer
    than k) and the page it is in (0 where none)."""
    chosen = select_topk(scores, k)[:, k - 1].long()
    kth = scores.gather(1, chosen.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(chosen >= 0, kth, torch.full_like(kth, float("-inf"))), chosen.clamp(min=0) // ENTRIES_PER_PAGE


def hierarchical_topk(q: torch.Tensor, weights: torch.Tensor, batch: PagedBatch, k: int,
                      config: HierarchyConfig, summaries: PageSummaries | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec of hierarchical top-k -> (int32 [T, k] entry indices, -1 padded; int64 [T] pages scored).

    1. Representatives: the stored centre of each page for centred formats, ``summaries.centre`` otherwise.
    2. Stage 1: coarse[t, p] = sum_h w[t, h] relu(q[t, h] . rep_p) over the query's fully visible pages;
       its best m = ``config.pages_for(k)`` (select_topk's rules) are kept, plus :func:`forced_pages`.
    3. Exact mode: theta = the k-th best exact score among the kept pages' entries, lowered by
       BOUND_SLACK times the scale of its page (so that a kernel's rounding of it cannot lift it above the
       flat k-th score); every page whose :func:`page_score_bounds` is not below theta is kept too (no entry
       of a skipped page can reach the flat top-k, nor tie with its k-th score).
    4. Stage 2: the exact scores (:func:`index_scores`) of the kept pages' visible entries, selected by
       :func:`select_topk`'s rules: the same order and tie rule as the flat top-k over those entries.

    Materializes [T, N] (the reference may); arguments as :func:`index_topk`, already checked.
    """
    check_k(k, MAX_K)
    scores = index_scores(q, weights, batch)  # [T, N] fp32, -inf where invisible
    t, n = scores.shape
    num_pages = -(-n // ENTRIES_PER_PAGE)
    seq_of = batch.query_seq.cpu().long()
    counts = batch.entry_counts.cpu().long()
    positions = None if batch.query_positions is None else batch.query_positions.cpu()
    visible = visible_counts(counts[seq_of], positions, batch.ratio).clamp(max=n)
    keep = forced_pages(visible, num_pages, config)
    qf, wf = q.detach().cpu().float(), weights.detach().cpu().float()
    table = batch.block_table.cpu().long()
    bounds = None
    if config.exact:
        bounds = torch.full((t, num_pages), float("nan"))
        scale = torch.zeros(t, num_pages)
    m = config.pages_for(k)
    for b in range(batch.num_seqs):
        rows = torch.nonzero(seq_of == b).flatten()
        pages_b = min(-(-int(counts[b]) // ENTRIES_PER_PAGE), num_pages)
        if rows.numel() == 0 or pages_b == 0:
            continue
        page_ids = table[b, :pages_b]
        if is_centred(batch.fmt):
            reps = read_centres(batch.pool, batch.fmt, page_ids * ENTRIES_PER_PAGE)
        else:
            reps = summaries.centre[page_ids.to(summaries.centre.device)].cpu().float()
        coarse = (torch.einsum("thd,pd->thp", qf[rows], reps).relu() * wf[rows].unsqueeze(-1)).sum(dim=1)
        full = (visible[rows] // ENTRIES_PER_PAGE).unsqueeze(1)
        coarse = coarse.masked_fill(torch.arange(pages_b).unsqueeze(0) >= full, float("-inf"))
        best = select_topk(coarse, min(m, pages_b)).long()
        hit = torch.zeros(rows.numel(), num_pages, dtype=torch.bool)
        hit.scatter_(1, best.clamp(min=0), best >= 0)
        keep[rows] |= hit
        if bounds is not None:
            device = summaries.lower.device
            lower = summaries.lower[page_ids.to(device)].cpu()
            upper = summaries.upper[page_ids.to(device)].cpu()
            bounds[rows, :pages_b], scale[rows, :pages_b] = page_score_bounds(qf[rows], wf[rows], lower, upper,
                                                                               with_scale=True)
    entry_page = torch.arange(n) // ENTRIES_PER_PAGE
    if bounds is not None:
        theta, kth_page = _kth_scores(scores.masked_fill(~keep[:, entry_page], float("-inf")), k)
        theta = theta - BOUND_SLACK * scale.gather(1, kth_page.unsqueeze(1)).squeeze(1)
        reachable = ~(bounds < theta.unsqueeze(1))  # NaN bounds or theta: kept
        used = (visible.unsqueeze(1) + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
        keep |= reachable & (torch.arange(num_pages).unsqueeze(0) < used)
    chosen = select_topk(scores.masked_fill(~keep[:, entry_page], float("-inf")), k)
    return chosen, keep.sum(dim=1)
