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

from ...cache import check_pool, dequantize_entries, read_entries, sequence_slots
from ...formats import ENTRIES_PER_PAGE, KeyFormat, is_centred

# Queries processed per chunk so that [chunk, H, N] stays small on the CPU.
_CHUNK_ELEMENTS = 1 << 24


def check_queries(q: torch.Tensor, weights: torch.Tensor, d: int = 128) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[2] != d:
        raise ValueError(f"q must be [T, H, {d}], got {list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    if not q.is_floating_point():
        raise ValueError(f"q must be a floating tensor, got {q.dtype}")
    if not isinstance(weights, torch.Tensor) or weights.shape != q.shape[:2]:
        raise ValueError(f"weights must be [T, H] = {list(q.shape[:2])}, got "
                         f"{list(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__}")


def visible_counts(entry_counts: torch.Tensor, query_positions: torch.Tensor | None, ratio: int) -> torch.Tensor:
    """int64 [T]: how many leading entries each query sees (entry_counts already gathered per query)."""
    counts = entry_counts.long()
    if query_positions is None:
        return counts
    return torch.minimum(counts, torch.div(query_positions.long() + 1, ratio, rounding_mode="floor").clamp(min=0))


def index_scores_dense(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                       query_positions: torch.Tensor | None = None, ratio: int = 1, *,
                       centres: torch.Tensor | None = None) -> torch.Tensor:
    """Scores of queries q [T, H, D] with weights [T, H] against one sequence's keys [N, D] -> fp32 [T, N].

    Page-centred keys: ``keys`` are the residuals and ``centres`` [ceil(N / 64), D] the centres of the
    sequence's pages; the logit of entry j is q . keys[j] + q . centres[j // 64], the second term computed
    once per (query, head, page) and added before the relu.
    """
    check_queries(q, weights, q.shape[-1] if isinstance(q, torch.Tensor) and q.dim() == 3 else 128)
    if not isinstance(keys, torch.Tensor) or keys.dim() != 2 or keys.shape[1] != q.shape[2] \
            or not keys.is_floating_point():
        raise ValueError(f"keys must be a floating [N, {q.shape[2]}] tensor, got "
                         f"{(keys.dtype, list(keys.shape)) if isinstance(keys, torch.Tensor) else type(keys).__name__}")
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio < 1:
        raise ValueError(f"ratio must be a positive int, got {ratio!r}")
    t, h, _ = q.shape
    n = keys.shape[0]
    qf, wf, kf = q.detach().cpu().float(), weights.detach().cpu().float(), keys.detach().cpu().float()
    page_of = None
    if centres is not None:
        pages = (n + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE
        if not isinstance(centres, torch.Tensor) or centres.shape != (pages, q.shape[2]) \
                or not centres.is_floating_point():
            raise ValueError(f"centres must be a floating [{pages}, {q.shape[2]}] tensor (one per page of the N = "
                             f"{n} keys), got {(centres.dtype, list(centres.shape)) if isinstance(centres, torch.Tensor) else centres!r}")
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
        if not isinstance(query_positions, torch.Tensor) or query_positions.shape != (t,) \
                or query_positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"query_positions must be int [T] = [{t}] or None, got "
                             f"{(query_positions.dtype, list(query_positions.shape)) if isinstance(query_positions, torch.Tensor) else query_positions!r}")
        counts = visible_counts(counts, query_positions.cpu(), ratio)
    masked = torch.arange(n).unsqueeze(0) >= counts.unsqueeze(1)
    return out.masked_fill_(masked, float("-inf"))


def check_batch(block_table: torch.Tensor, entry_counts: torch.Tensor, query_seq: torch.Tensor, t: int,
                query_positions: torch.Tensor | None, ratio: int) -> None:
    if block_table.dim() != 2 or block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int [B, max_pages], got {block_table.dtype} {list(block_table.shape)}")
    b = block_table.shape[0]
    if entry_counts.shape != (b,) or entry_counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"entry_counts must be int [B] = [{b}], got {entry_counts.dtype} {list(entry_counts.shape)}")
    if bool((entry_counts < 0).any()) or bool((entry_counts > block_table.shape[1] * 64).any()):
        raise ValueError(f"entry_counts must be in 0..{block_table.shape[1] * 64} (block table width x 64), "
                         f"got {entry_counts.tolist()}")
    if query_seq.shape != (t,) or query_seq.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"query_seq must be int [T] = [{t}], got {query_seq.dtype} {list(query_seq.shape)}")
    if t and (bool((query_seq < 0).any()) or bool((query_seq >= b).any())):
        raise ValueError(f"query_seq values must be in 0..{b - 1}, got range "
                         f"{int(query_seq.min())}..{int(query_seq.max())}")
    if query_positions is not None and (query_positions.shape != (t,) or query_positions.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"query_positions must be int [T] = [{t}] or None, got {list(query_positions.shape)}")
    if not isinstance(ratio, int) or ratio < 1:
        raise ValueError(f"ratio must be a positive int, got {ratio!r}")


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
    return fmt.dequantize_residual(values, scales), fmt.read_centres(pool, first_slots)


def index_scores(q: torch.Tensor, weights: torch.Tensor, pool: torch.Tensor, fmt: "KeyFormat | str",
                 block_table: torch.Tensor, entry_counts: torch.Tensor, query_seq: torch.Tensor,
                 query_positions: torch.Tensor | None = None, ratio: int = 1) -> torch.Tensor:
    """Scores of a ragged batch against paged keys -> fp32 [T, max(entry_counts)], -inf where invisible.

    q [T, H, 128], weights [T, H], pool uint8 [P, page_bytes], block_table int [B, max_pages],
    entry_counts int [B], query_seq int [T] (sequence of each query), query_positions int [T] or None.
    """
    fmt = KeyFormat.parse(fmt)
    check_queries(q, weights)
    check_pool(pool, fmt)
    t = q.shape[0]
    check_batch(block_table, entry_counts, query_seq, t, query_positions, ratio)
    counts = entry_counts.cpu().long()
    width = int(counts.max()) if counts.numel() else 0
    out = torch.full((t, width), float("-inf"))
    seq_of = query_seq.cpu().long()
    for b in range(block_table.shape[0]):
        rows = torch.nonzero(seq_of == b).flatten()
        if rows.numel() == 0 or counts[b] == 0:
            continue
        pos = None if query_positions is None else query_positions.cpu()[rows]
        if is_centred(fmt):
            keys, centres = gather_sequence_residuals(pool, fmt, block_table[b], int(counts[b]))
        else:
            keys, centres = gather_sequence_keys(pool, fmt, block_table[b], int(counts[b])), None
        out[rows, : keys.shape[0]] = index_scores_dense(q[rows], weights[rows], keys, pos, ratio, centres=centres)
    return out
