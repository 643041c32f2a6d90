"""Reference (fp32, CPU) of the lightning-indexer scores.

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
"""

from __future__ import annotations

import torch

from ..._memory import INDEX_DTYPES, check_tensor
from ...batch import PagedBatch, check_batch_queries, check_queries, check_ratio, visible_counts
from ...pool import (check_slots, dequantize_entries, num_slots, read_centres, read_checked_entries, read_entries,
                     sequence_slots)
from ...formats import ENTRIES_PER_PAGE, KeyFormat, is_centred

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
