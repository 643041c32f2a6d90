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
    """Kernel-side description of a key encoding.

    code: the KeyCode the codec functions switch on. decode_block_n: key tile of the decode scores kernel
    measured fastest on the H200 for this encoding (fp4: for ``ScoresConfig.decode_fp4 = "dequant"``;
    blocks_block_n: the tile of the per-block decode path, ``"blocks"``). decode_tiles / decode_stages: key
    tiles per program and pipeline stages of the decode kernel measured fastest for it at <= 64 query-head
    columns per program (``ScoresConfig`` fields left at None take these; wider programs use 8 and 3).
    prefill_stages: pipeline stages of the prefill (tile) kernel's per-head q loads for this encoding.
    fp8_dot: the stored values can feed fp8 tensor cores as they are (the per-entry scale is then applied per
    score column). page_term: the format keeps a side value
    per page (a page-centred format's centre): the scores kernels add a per-page term q . c to every logit
    and the store kernel runs twice (first the pages' side values, from their entry 0, then the entries).
    """

    code: KeyCode
    decode_block_n: int
    blocks_block_n: int = 64
    decode_tiles: int = 8
    decode_stages: int = 3
    prefill_stages: int = 3
    fp8_dot: bool = False
    page_term: bool = False

    def pool_views(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Typed flat views (values, scales) of a uint8 pool, as the codec functions index them."""
        flat = pool.view(-1)
        if self.code == KeyCode.BF16:
            return flat.view(torch.bfloat16), flat
        if self.code in (KeyCode.FP8, KeyCode.FP8_CENTRED):
            return flat, flat.view(torch.float32)
        return flat, flat


KEY_CODECS: dict[str, KeyCodec] = {
    # decode tiles / stages chosen on the H200 at B = 64 x N = 64K / 128K, H 64 (launch sweep
    # sweep_topk_h200_1ceb8eb): bf16 0.293 -> 0.284 ms at 64K, fp8 0.198 -> 0.168 ms (BLOCK_N 128), fp4
    # "blocks" 0.332 -> 0.279 ms; fp8 confirmed beside DeepGEMM's logits (0.168 vs 0.149 ms,
    # vs_deepgemm_h200_b8bb071_run{1,2})
    # prefill stages: bf16 keys ran 0.4-2.3 % faster on 2 than 3 in each of three sweeps (sweep_topk_h200_5b7286f,
    # _f6afd91_prefill, _c5a81f2_prefill: 18.35 / 18.78 / 18.33 ms against 18.43 / 19.22 / 18.70 at 8192 x 64K);
    # fp8 keys 15.5 ms against 13.3 (3 stages kept)
    "bf16": KeyCodec(KeyCode.BF16, decode_block_n=64, decode_tiles=16, decode_stages=5, prefill_stages=2),
    "fp8": KeyCodec(KeyCode.FP8, decode_block_n=128, fp8_dot=True, decode_tiles=16, decode_stages=5),
    "fp4": KeyCodec(KeyCode.FP4, decode_block_n=128, decode_tiles=16, decode_stages=5),
    # page-centred formats, by format name (their kind is the residual's encoding)
    "fp8-centred": KeyCodec(KeyCode.FP8_CENTRED, decode_block_n=64, fp8_dot=True, page_term=True),
    "fp4-centred": KeyCodec(KeyCode.FP4_CENTRED, decode_block_n=128, page_term=True),
}
