"""Reference (fp32, CPU) of the DeepSeek-V4 compressor (docs/spec.md §3): pooled, pre-norm entries.

With c = 2 when ``ratio == 4`` (overlapping windows) and c = 1 otherwise, and d the entry dim::

    kv   = x @ wkv.T                    [S, c*d]
    gate = x @ wgate.T + ape[s % ratio] [S, c*d]
    entry j (for complete blocks only, j < S // ratio):
      ratio 4:  rows = tokens 4(j-1)..4j-1 with features [:d]   (previous block; for j = 0 kv = 0, gate = -inf)
                     ++ tokens 4j..4j+3 with features [d:]        (own block)      -> 8 rows
      else:     rows = tokens ratio*j .. ratio*(j+1)-1, all d features               -> ratio rows
      out[j, f] = sum_r softmax_r(gate[r, f]) * kv[r, f]       (per feature channel)

The result is *before* the compressor's RMSNorm; :func:`dsakit.ops.store.store_index_keys` applies the norm
(with the compressor's norm weight), rope at position j * ratio, Hadamard and quantization.
"""

from __future__ import annotations

import torch

from .inputs import check_hidden, check_projected


def compress_projected(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int) -> torch.Tensor:
    """Pool projected rows: kv, gate [S, c*d], ape [ratio, c*d] -> fp32 [S // ratio, d]."""
    check_projected(kv, gate, ape, ratio)
    overlap = ratio == 4
    c = 2 if overlap else 1
    d = kv.shape[1] // c
    n = kv.shape[0] // ratio
    kvf = kv.detach().cpu().float()[: n * ratio].reshape(n, ratio, c * d)
    gf = gate.detach().cpu().float()[: n * ratio].reshape(n, ratio, c * d) + ape.detach().cpu().float()
    if overlap:
        prev_kv = torch.zeros(n, ratio, d)
        prev_gate = torch.full((n, ratio, d), float("-inf"))
        prev_kv[1:] = kvf[:-1, :, :d]
        prev_gate[1:] = gf[:-1, :, :d]
        rows_kv = torch.cat([prev_kv, kvf[:, :, d:]], dim=1)  # [n, 2*ratio, d]
        rows_gate = torch.cat([prev_gate, gf[:, :, d:]], dim=1)
    else:
        rows_kv, rows_gate = kvf, gf
    return (torch.softmax(rows_gate, dim=1) * rows_kv).sum(dim=1)


def compress(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor, ratio: int) -> torch.Tensor:
    """Hidden states x [S, hidden], wkv / wgate [c*d, hidden], ape [ratio, c*d] -> fp32 [S // ratio, d]."""
    check_hidden(x, wkv, wgate)
    xf = x.detach().cpu().float()
    return compress_projected(xf @ wkv.detach().cpu().float().T, xf @ wgate.detach().cpu().float().T, ape, ratio)
