"""The index-key format codes the Triton kernels compile for, and what a kernel needs to know per format.

One registry: :data:`KEY_CODECS` maps a key format's encoding (``KeyFormat.kind``) to its :class:`KeyCodec`;
the kernels receive ``CODE = int(codec.code)`` as a compile-time constant and call the dispatching codec
functions of :mod:`dsakit.formats.triton`, which switch on these codes (nothing else does).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch


class KeyCode(IntEnum):
    """Compile-time code of an index-key encoding (the ``CODE`` argument of the kernels)."""

    BF16 = 0
    FP8 = 1
    FP4 = 2
    FP8_CENTRED = 3  # fp8 residuals + a bf16 centre per page
    FP4_CENTRED = 4  # fp4 residuals + a bf16 centre per page


@dataclass(frozen=True)
class KeyCodec:
    """Kernel-side description of a key encoding: layout and semantics only (launch tuning lives in the ops'
    config objects, e.g. :class:`dsakit.ops.indexer.config.ScoresConfig`).

    code: the KeyCode the codec functions switch on. fp8_dot: the stored values can feed fp8 tensor cores as
    they are (the per-entry scale is then applied per score column). page_term: the format keeps a side value
    per page (a page-centred format's centre): the scores add a per-page term q . c to every logit (computed
    once per query, head and page) and the store kernel runs twice (first the pages' side values, from their
    entry 0, then the entries). residual_code: the plain code whose entry layout the format's entries share
    (a page-centred format's residuals are laid out like that plain format's keys, followed by the centre).
    """

    code: KeyCode
    fp8_dot: bool = False
    page_term: bool = False
    residual_code: KeyCode | None = None

    @property
    def entry_code(self) -> KeyCode:
        """The plain code of the entries' layout (the residual's for page-centred formats)."""
        return self.code if self.residual_code is None else self.residual_code

    def pool_views(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Typed flat views (values, scales) of a uint8 pool, as the codec functions index them."""
        flat = pool.view(-1)
        if self.code == KeyCode.BF16:
            return flat.view(torch.bfloat16), flat
        if self.entry_code == KeyCode.FP8:
            return flat, flat.view(torch.float32)
        return flat, flat


KEY_CODECS: dict[str, KeyCodec] = {
    "bf16": KeyCodec(KeyCode.BF16),
    "fp8": KeyCodec(KeyCode.FP8, fp8_dot=True),
    "fp4": KeyCodec(KeyCode.FP4),
    # page-centred formats, by format name (their kind is the residual's encoding)
    "fp8-centred": KeyCodec(KeyCode.FP8_CENTRED, fp8_dot=True, page_term=True, residual_code=KeyCode.FP8),
    "fp4-centred": KeyCodec(KeyCode.FP4_CENTRED, page_term=True, residual_code=KeyCode.FP4),
}
