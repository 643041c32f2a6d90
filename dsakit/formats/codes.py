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


@dataclass(frozen=True)
class KeyCodec:
    """Kernel-side description of a key encoding.

    code: the KeyCode the codec functions switch on. decode_block_n: key tile of the decode scores kernel
    measured fastest on the H200 for this encoding. fp8_dot: the stored values can feed fp8 tensor cores as
    they are (the per-entry scale is then applied per score column).
    """

    code: KeyCode
    decode_block_n: int
    fp8_dot: bool = False

    def pool_views(self, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Typed flat views (values, scales) of a uint8 pool, as the codec functions index them."""
        flat = pool.view(-1)
        if self.code == KeyCode.BF16:
            return flat.view(torch.bfloat16), flat
        if self.code == KeyCode.FP8:
            return flat, flat.view(torch.float32)
        return flat, flat


KEY_CODECS: dict[str, KeyCodec] = {
    "bf16": KeyCodec(KeyCode.BF16, decode_block_n=64),
    "fp8": KeyCodec(KeyCode.FP8, decode_block_n=64, fp8_dot=True),
    "fp4": KeyCodec(KeyCode.FP4, decode_block_n=128),
}
