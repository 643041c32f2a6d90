"""Fault injection: the known recall failure classes of docs/spec.md §5, one convention changed at a time.

A :class:`Fault` says which single convention differs from the model's truth on one side of the indexer.
The exact (fp32) reference always uses the correct conventions, so a fault shows as the difference between
the format path and the exact path of the same run. The ``signature`` text says what to look for.

=========================  ====================================================================  ==============
name                       what changes                                                          side
=========================  ====================================================================  ==============
none                       nothing (baseline of the same format)                                 -
rope-layout-mismatch       keys roped with the other pairing (half-split instead of interleaved   keys (store)
                           for V4, interleaved instead of half-split for V3.2)
hadamard-keys-only         keys rotated by the Hadamard transform, queries not                    queries
fp8-read-as-fnuz           fp8 key bytes decoded as e4m3fnuz (exponent bias 8, 0x80 = NaN)        keys (read)
causal-early               entry visible one entry early: j < (t + 1) // ratio + 1                scores (mask)
causal-late                entry visible one entry late: j < (t + 1) // ratio - 1                 scores (mask)
missing-key-scale          fp8 keys dequantized without their per-entry scale                     keys (read)
missing-centre             page-centred keys read without their page's centre (q . c dropped)     keys (read)
=========================  ====================================================================  ==============

The causal faults are injected by handing the scores op query positions shifted by one entry (ratio tokens);
rope still uses the true positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._memory import check_choice, check_tensor
from ..formats import KeyFormat, decode_e4m3, is_centred


@dataclass(frozen=True)
class Fault:
    name: str
    description: str
    signature: str
    key_rope_swap: bool = False  # keys stored with the other rope pairing
    query_hadamard: bool = True  # False: queries skip the rotation the keys get
    fp8_read: str = "e4m3fn"  # "e4m3fn" | "e4m3fnuz"
    key_scale: bool = True  # False: fp8 keys dequantized without their scale
    visibility_shift: int = 0  # entries added to the causal visible count
    fp8_only: bool = False  # only meaningful for fp8 formats
    centre: bool = True  # False: page-centred keys read as their residuals alone
    centred_only: bool = False  # only meaningful for the page-centred formats

    @property
    def custom_reader(self) -> bool:
        """True when the keys must be decoded by the fault's own reader instead of the scores op."""
        return self.fp8_read != "e4m3fn" or not self.key_scale or not self.centre

    def applies_to(self, fmt: KeyFormat) -> bool:
        return (not self.fp8_only or fmt.kind == "fp8") and (not self.centred_only or is_centred(fmt))


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("none", "correct conventions on both sides", "baseline of the format"),
    Fault("rope-layout-mismatch", "keys roped with the other pairing (interleaved vs half-split)",
          "exact rank stays 0 while set recall falls well below the baseline's and the needle's rank grows with "
          "context: the rope half of every score is scrambled",
          key_rope_swap=True),
    Fault("hadamard-keys-only", "keys rotated by the Hadamard transform, queries not",
          "scores unrelated to the exact ones: needle rank and set recall far worse than the baseline at every "
          "length, needle score ratio arbitrary",
          query_hadamard=False),
    Fault("fp8-read-as-fnuz", "fp8 key bytes decoded as e4m3fnuz (bias 8, byte 0x80 = NaN)",
          "needle score ratio half the baseline's (every finite value halves); keys holding a -0 byte score NaN "
          "and jump to the top of the list (NaN column), pushing the needle down by as many",
          fp8_read="e4m3fnuz", fp8_only=True),
    Fault("causal-early", "entry visible one entry early: j < (t+1)//ratio + 1",
          "future entries get selected (leaked > 0) while the needle is still found",
          visibility_shift=+1),
    Fault("causal-late", "entry visible one entry late: j < (t+1)//ratio - 1",
          "a needle in the newest complete entry (depth 1.0) is never found, other depths are",
          visibility_shift=-1),
    Fault("missing-key-scale", "fp8 keys dequantized without their per-entry scale",
          "needle score ratio ~100x the baseline's (448 / amax); entries are reweighted by 1 / scale, so ranks "
          "change only where the entries' largest elements differ",
          key_scale=False, fp8_only=True),
    Fault("missing-centre", "page-centred keys read without their page's centre (the q . c term dropped)",
          "needle score ratio far from 1 and ranks scrambled across pages: each page's scores lose a different "
          "offset q . c, so the needle survives only against entries of its own page",
          centre=False, centred_only=True),
)}


def parse_faults(names: "str | list[str]") -> list[Fault]:
    """'all' | 'off' (no fault rows) | comma-separated names -> faults, the baseline 'none' always first."""
    if isinstance(names, str):
        text = names.strip().lower()
        if text in ("", "off"):
            return []
        if text == "all":
            return list(FAULTS.values())
        names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        check_choice("fault", name, sorted(FAULTS) + ["all"])
    if not names:
        return []
    # each fault once, in the order given, after the baseline (wherever, or whether, 'none' was named)
    return [FAULTS["none"]] + [FAULTS[name] for name in dict.fromkeys(names) if name != "none"]


def decode_fp8_entries(values: torch.Tensor, scales: torch.Tensor, fault: Fault) -> torch.Tensor:
    """fp8 entry bytes (values uint8 [N, 128], scales uint8 [N, 4]) -> fp32 [N, 128] as the fault reads them."""
    # a wrong width would pair scales with the wrong entries (or fail inside view()) instead
    check_tensor("values", values, shape=(None, 128), dtypes=torch.uint8,
                 message="fp8 entry bytes must be uint8 values [N, 128]")
    check_tensor("scales", scales, shape=(values.shape[0], 4), dtypes=torch.uint8,
                 message=f"fp8 entry bytes must be uint8 scales [N, 4] = [{values.shape[0]}, 4]")
    if fault.fp8_read == "e4m3fnuz":
        decoded = values.contiguous().view(torch.float8_e4m3fnuz).to(torch.float32)
    elif fault.fp8_read == "e4m3fn":
        decoded = decode_e4m3(values)
    else:
        raise ValueError(f"unknown fp8 read type {fault.fp8_read!r}")
    if fault.key_scale:
        decoded = decoded * scales.contiguous().view(torch.float32).reshape(-1, 1)
    return decoded
