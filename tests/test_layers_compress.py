"""The device compressor (dsakit.ops.compress.device) against the fp32 reference, on CPU tensors (the same code
runs on the GPU): stateless prefill, chunked prefill and token-by-token decode through CompressorState."""

from __future__ import annotations

import pytest
import torch

from dsakit.ops.compress import CompressorState, compress, compress_device, compress_projected, compress_step


def weights(ratio: int, d: int, hidden: int = 24, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    c = 2 if ratio == 4 else 1
    wkv = torch.randn(c * d, hidden, generator=g) * hidden ** -0.5
    wgate = torch.randn(c * d, hidden, generator=g) * hidden ** -0.5
    ape = torch.randn(ratio, c * d, generator=g) * 0.5
    return wkv, wgate, ape


@pytest.mark.parametrize("ratio,d,seq", [(4, 16, 61), (4, 8, 4), (128, 8, 300), (128, 4, 127)])
def test_prefill_equals_reference(ratio, d, seq):
    wkv, wgate, ape = weights(ratio, d)
    x = torch.randn(seq, 24, generator=torch.Generator().manual_seed(1))
    ref = compress(x, wkv, wgate, ape, ratio)
    assert torch.allclose(compress_device(x, wkv, wgate, ape, ratio), ref, atol=1e-6, rtol=1e-5)
    chunked = compress_device(x, wkv, wgate, ape, ratio, chunk_tokens=ratio * 3)
    assert chunked.shape == ref.shape == (seq // ratio, d)
    assert torch.allclose(chunked, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("ratio,d,seq", [(4, 16, 75), (128, 8, 389)])
def test_chunks_and_decode_equal_reference(ratio, d, seq):
    """Cut anywhere (a prefill of an odd length, chunks of random sizes, then single tokens): the concatenated
    entries equal the reference over the whole sequence, each reported at the right index."""
    wkv, wgate, ape = weights(ratio, d, seed=2)
    x = torch.randn(seq, 24, generator=torch.Generator().manual_seed(3))
    kv, gate = x @ wkv.T, x @ wgate.T
    ref = compress_projected(kv, gate, ape, ratio)
    g = torch.Generator().manual_seed(4)
    cuts, pos = [], 0
    while pos < seq:
        size = 1 if pos > seq - 40 else int(torch.randint(1, 2 * ratio + 3, (1,), generator=g))
        cuts.append((pos, min(seq, pos + size)))
        pos += size
    state = CompressorState(ratio, kv.shape[1])
    got = []
    for lo, hi in cuts:
        entries, first = compress_step(kv[lo:hi], gate[lo:hi], ape, ratio, state)
        assert first == lo // ratio and entries.shape == (hi // ratio - lo // ratio, d)
        got.append(entries)
    assert state.length == seq and state.num_entries == seq // ratio
    assert torch.allclose(torch.cat(got), ref, atol=1e-6, rtol=1e-5)


def test_bf16_rows_are_pooled_in_fp32():
    wkv, wgate, ape = weights(4, 16, seed=5)
    x = torch.randn(40, 24, generator=torch.Generator().manual_seed(6))
    kv, gate = (x @ wkv.T).bfloat16(), (x @ wgate.T).bfloat16()
    state = CompressorState(4, 32)
    out, _ = compress_step(kv, gate, ape, 4, state)
    assert out.dtype == torch.float32 and state.kv.dtype == torch.float32
    assert torch.allclose(out, compress_projected(kv.float(), gate.float(), ape, 4), atol=1e-6)


def test_validation():
    wkv, wgate, ape = weights(4, 8)
    state = CompressorState(4, 16)
    rows = torch.zeros(3, 16)
    with pytest.raises(ValueError, match="ape"):
        compress_step(rows, rows, ape[:2], 4, state)
    with pytest.raises(ValueError, match="state is for ratio 4, width 16"):
        compress_step(torch.zeros(3, 8), torch.zeros(3, 8), torch.zeros(128, 8), 128, state)
    with pytest.raises(ValueError, match="same"):
        compress_step(rows, torch.zeros(2, 16), ape, 4, state)
    with pytest.raises(ValueError, match="state must be"):
        compress_step(rows, rows, ape, 4, None)
    with pytest.raises(ValueError, match="ratio"):
        CompressorState(0, 16)
    with pytest.raises(ValueError, match="width"):
        CompressorState(4, 15)
    with pytest.raises(ValueError, match="chunk_tokens"):
        compress_device(torch.zeros(8, 24), wkv, wgate, ape, 4, chunk_tokens=6)
    assert state.length == 0 and torch.equal(state.kv, torch.zeros(8, 16))  # failed calls changed nothing
