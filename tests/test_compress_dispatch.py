"""dsakit.ops.compress.compress dispatches like the other ops: reference (spec) or the device path."""

from __future__ import annotations

import pytest
import torch

from dsakit.ops.compress import compress, compress_reference


@pytest.mark.parametrize("ratio", [4, 128])
def test_device_path_matches_the_reference(ratio):
    g = torch.Generator().manual_seed(ratio)
    width = 16 if ratio == 4 else 8
    x = torch.randn(300, 12, generator=g)
    wkv, wgate = torch.randn(width, 12, generator=g), torch.randn(width, 12, generator=g)
    ape = torch.randn(ratio, width, generator=g)
    want = compress_reference(x, wkv, wgate, ape, ratio)
    assert torch.equal(compress(x, wkv, wgate, ape, ratio), want)  # auto on CPU tensors: the reference
    torch.testing.assert_close(compress(x, wkv, wgate, ape, ratio, backend="device", chunk_tokens=2 * ratio), want,
                               rtol=1e-5, atol=1e-5)


def test_bad_backend_and_reference_chunking_are_refused():
    x, w, ape = torch.randn(8, 4), torch.randn(4, 4), torch.randn(2, 4)
    with pytest.raises(ValueError, match="unknown backend 'triton'"):
        compress(x, w, w, ape, 2, backend="triton")
    with pytest.raises(ValueError, match="chunk_tokens"):
        compress(x, w, w, ape, 2, backend="reference", chunk_tokens=4)
