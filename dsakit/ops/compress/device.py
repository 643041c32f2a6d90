"""The DeepSeek-V4 compressor on the tensors' own device (GPU or CPU): torch ops, no host round trip.

Same math as :mod:`dsakit.ops.compress.reference` (fp32 throughout), restructured for serving:

* :class:`CompressorState` is one sequence's decode state: an fp32 ring of the last ``R`` projected rows
  (``kv`` and ``gate + ape``; R = 2 * ratio with overlap, so the previous block's rows are at hand, else
  R = ratio) and the number of tokens seen, a host int. Ring slot of token p: p % R.
* :func:`compress_step` takes the projected rows of the next S tokens (any S: a prefill, a prefill chunk or
  one decode token), pools every block that these rows complete and updates the ring. Which blocks complete
  and where their rows sit in the ring follow from the host-side token count alone, so a step never reads a
  device value back (no sync) and a prefill can be cut into chunks anywhere with identical entries.
* :func:`compress_device` is the stateless prefill of a whole sequence (``x`` from token 0), equal to
  :func:`dsakit.ops.compress.reference.compress`.

Shapes: S new tokens, W = c * d projected features (c = 2 with overlap, ratio 4; else c = 1), d entry dim,
n new entries. Entry j covers tokens j * ratio .. (j + 1) * ratio - 1 and, with overlap, also draws on the
first d features of the previous block's rows (gate -inf, weight 0, before block 0).
Memory of a step: O((S + R) * W) fp32, nothing quadratic; callers bound S by chunking long prefills.
"""

from __future__ import annotations

import torch

from ..._memory import check_instance, check_int, check_ratio, check_same_device, is_int
from .inputs import check_hidden, check_projected

__all__ = ["CompressorState", "compress_step", "compress_device", "pool_blocks"]


class CompressorState:
    """Decode state of one sequence for one compressor: fp32 rings ``kv``, ``gate`` [R, W] and ``length``.

    ``gate`` rows already include the position bias (``ape[p % ratio]``). ``length`` (host int) counts the
    tokens fed so far; only the rows of the last R tokens are kept.
    """

    def __init__(self, ratio: int, width: int, device: "str | torch.device" = "cpu"):
        check_ratio(ratio)
        self.ratio = ratio
        self.overlap = ratio == 4
        check_int("width", width, 1, message=f"width must be a positive int"
                                              f"{' (even: ratio 4 overlaps)' if self.overlap else ''}")
        if self.overlap and width % 2:
            raise ValueError(f"width must be a positive int (even: ratio 4 overlaps), got {width!r}")
        self.width = width
        self.dim = width // 2 if self.overlap else width
        self.rows = 2 * ratio if self.overlap else ratio
        self.kv = torch.zeros(self.rows, width, dtype=torch.float32, device=device)
        self.gate = torch.full((self.rows, width), float("-inf"), dtype=torch.float32, device=device)
        self.length = 0

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @property
    def num_entries(self) -> int:
        """Entries emitted so far (complete blocks)."""
        return self.length // self.ratio

    def _read(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of tokens start .. start + count - 1 (all within the last R tokens, no wrap: see callers)."""
        s = start % self.rows
        return self.kv[s:s + count], self.gate[s:s + count]

    def _write(self, start: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """Store the rows of tokens start .. start + len - 1 (only the last R matter) at slots p % R."""
        n = kv.shape[0]
        if n > self.rows:
            kv, gate, start, n = kv[-self.rows:], gate[-self.rows:], start + n - self.rows, self.rows
        s = start % self.rows
        first = min(n, self.rows - s)
        self.kv[s:s + first] = kv[:first]
        self.gate[s:s + first] = gate[:first]
        if first < n:  # wrapped around the ring
            self.kv[: n - first] = kv[first:]
            self.gate[: n - first] = gate[first:]


def pool_blocks(kv: torch.Tensor, gate: torch.Tensor, ratio: int, prev_kv: torch.Tensor | None = None,
                prev_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Pool n complete blocks: kv, gate fp32 [n * ratio, W] (gate with the position bias added) -> fp32 [n, d].

    With overlap (ratio 4, W = 2d) block i also draws on the first d features of block i - 1's rows; block 0
    on ``prev_kv`` / ``prev_gate`` [ratio, d] (None: the sequence starts here, weight 0).
    """
    n = kv.shape[0] // ratio
    width = kv.shape[1]
    kv = kv[: n * ratio].reshape(n, ratio, width)
    gate = gate[: n * ratio].reshape(n, ratio, width)
    if ratio == 4:
        d = width // 2
        if prev_kv is None:
            prev_kv = kv.new_zeros(1, ratio, d)
            prev_gate = gate.new_full((1, ratio, d), float("-inf"))
        else:
            prev_kv, prev_gate = prev_kv[:, :d].unsqueeze(0), prev_gate[:, :d].unsqueeze(0)
        rows_kv = torch.cat([torch.cat([prev_kv, kv[:-1, :, :d]], dim=0), kv[:, :, d:]], dim=1)  # [n, 8, d]
        rows_gate = torch.cat([torch.cat([prev_gate, gate[:-1, :, :d]], dim=0), gate[:, :, d:]], dim=1)
    else:
        rows_kv, rows_gate = kv, gate
    return (torch.softmax(rows_gate, dim=1) * rows_kv).sum(dim=1)


def _check_rows(kv, gate, ape, ratio: int, state: CompressorState | None) -> None:
    check_projected(kv, gate, ape, ratio)
    check_same_device(kv.device, gate=gate, ape=ape)
    if state is not None:
        check_instance("state", state, CompressorState, label="CompressorState or None")
        if state.ratio != ratio or state.width != kv.shape[1]:
            raise ValueError(f"state is for ratio {state.ratio}, width {state.width}; rows are ratio {ratio}, "
                             f"width {kv.shape[1]}")
        if state.device != kv.device:
            raise ValueError(f"state is on {state.device}, rows on {kv.device}")


def compress_step(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, ratio: int,
                  state: CompressorState) -> tuple[torch.Tensor, int]:
    """Feed the projected rows of the next S tokens of a sequence; returns (entries fp32 [n, d], first index).

    kv, gate [S, W] (``x @ wkv.T``, ``x @ wgate.T``; any float dtype, pooled in fp32), ape [ratio, W].
    The entries are those of the blocks completed by these rows: indices first .. first + n - 1 with
    first = state.length // ratio (before the call). ``state`` is updated in place (ring rows, length).
    """
    _check_rows(kv, gate, ape, ratio, state)
    if state is None:
        raise ValueError("state must be a CompressorState (compress_device is the stateless prefill)")
    s = kv.shape[0]
    start = state.length
    first = start // ratio
    n = (start + s) // ratio - first
    positions = torch.arange(start, start + s, device=kv.device) % ratio
    kv32 = kv.float()
    gate32 = gate.float() + ape.float()[positions]
    if n:
        aligned = first * ratio  # first token of the first incomplete block (its rows before `start` are in the ring)
        head_kv, head_gate = state._read(aligned, start - aligned)
        rows_kv = torch.cat([head_kv, kv32], dim=0)[: n * ratio]
        rows_gate = torch.cat([head_gate, gate32], dim=0)[: n * ratio]
        prev_kv = prev_gate = None
        if state.overlap and first > 0:
            prev_kv, prev_gate = state._read(aligned - ratio, ratio)
        entries = pool_blocks(rows_kv, rows_gate, ratio, prev_kv, prev_gate)
    else:
        entries = kv32.new_zeros(0, state.dim)
    state._write(start, kv32, gate32)
    state.length = start + s
    return entries, first


def compress_device(x: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor, ape: torch.Tensor, ratio: int, *,
                    chunk_tokens: int | None = None) -> torch.Tensor:
    """Stateless prefill on x's device: x [S, hidden], wkv / wgate [W, hidden], ape [ratio, W] -> fp32
    [S // ratio, d] (incomplete tail block dropped), equal to the reference ``compress``.

    The projections run in the weights' dtype (as a model would), pooling in fp32. ``chunk_tokens`` bounds
    the working memory to that many tokens' rows (a multiple of ratio; default: all at once).
    """
    check_ratio(ratio)
    check_hidden(x, wkv, wgate)
    if chunk_tokens is not None and (not is_int(chunk_tokens) or chunk_tokens < ratio or chunk_tokens % ratio):
        raise ValueError(f"chunk_tokens must be a positive multiple of ratio {ratio}, got {chunk_tokens!r}")
    state = CompressorState(ratio, wkv.shape[0], device=x.device)
    step = x.shape[0] if chunk_tokens is None else chunk_tokens
    out = []
    for lo in range(0, max(x.shape[0], 1), max(step, 1)):
        xs = x[lo:lo + step]
        if xs.shape[0] == 0:
            break
        kv = torch.nn.functional.linear(xs.to(wkv.dtype), wkv)
        gate = torch.nn.functional.linear(xs.to(wgate.dtype), wgate)
        entries, _ = compress_step(kv, gate, ape, ratio, state)
        out.append(entries)
    return torch.cat(out, dim=0) if out else x.new_zeros(0, state.dim, dtype=torch.float32)
