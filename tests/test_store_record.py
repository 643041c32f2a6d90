"""The store ops' checked record and trusted path (dsakit.ops.store.IndexKeyStore / AttentionKVStore,
store_checked): checks run once per call, the trusted path writes the same bytes as the public op."""

from __future__ import annotations

import pytest
import torch

import dsakit.pool
from dsakit.formats import AttentionKVFormat, KeyFormat, is_centred
from dsakit.ops.store import AttentionKVStore, IndexKeyStore, store_checked, store_index_keys
from dsakit.presets import KeyTransform
from dsakit.transforms import ROPE_V4

#: the Triton store runs on a GPU, or on the CPU under the interpreter; the reference runs on the CPU
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["reference"] + (["triton"] if torch.cuda.is_available()
                            or __import__("os").environ.get("TRITON_INTERPRET") == "1" else [])


def _on(backend: str, *tensors: torch.Tensor) -> tuple:
    """The tensors on the backend's device (the Triton store's device, the CPU for the reference)."""
    return tuple(t.to(TRITON_DEVICE if backend == "triton" else "cpu") for t in tensors)


def _inputs(n: int, dim: int, rope_dim: int, pages: int, page_bytes: int, in_order: bool = False):
    """in_order: slots 0..n-1 (a page-centred page is stored from its entry 0 on), else scattered."""
    g = torch.Generator().manual_seed(n * 7 + dim)
    rows = torch.randn(n, dim, generator=g)
    positions = torch.randint(0, 32, (n,), generator=g)
    slots = torch.arange(n) if in_order else torch.randperm(pages * 64, generator=g)[:n]
    slots[1] = -1  # padding
    table = torch.randn(32, rope_dim, generator=g)
    return rows, positions, slots, torch.zeros(pages, page_bytes, dtype=torch.uint8), table


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp8", "fp4-centred"])
def test_trusted_path_writes_the_public_ops_bytes(backend, fmt):
    fmt = KeyFormat.parse(fmt)
    keys, positions, slots, pool, table, weight = _on(
        backend, *_inputs(70, 128, 64, 3, fmt.page_bytes, in_order=is_centred(fmt)), torch.rand(128) + 0.5)
    public = pool.clone()
    store_index_keys(keys, positions, slots, public, fmt, table, weight, backend=backend)
    record = IndexKeyStore.check(keys, positions, slots, pool, fmt, table, weight, None, KeyTransform(),
                                 backend=backend, check_values=False)
    store_checked(record)
    assert torch.equal(pool, public)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_kv_record_matches_public_op(backend):
    fmt = AttentionKVFormat.FP8_ROPE_BF16
    kv, positions, slots, pool, table, weight = _on(backend, *_inputs(9, 512, 64, 1, fmt.page_bytes),
                                                    torch.rand(512) + 0.5)
    from dsakit.ops.store import store_attention_kv

    public = pool.clone()
    store_attention_kv(kv, positions, slots, public, fmt, table, weight, backend=backend)
    store_checked(AttentionKVStore.check(kv, positions, slots, pool, fmt, table, weight, ROPE_V4, 1e-6,
                                         backend=backend, check_values=False))
    assert torch.equal(pool, public)


def test_reference_store_checks_slots_once(monkeypatch):
    """One reference store copies the slots to the host and deduplicates them once (it did three times)."""
    calls = []
    real = dsakit.pool.check_slots

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    import dsakit.ops.store as store_op
    monkeypatch.setattr(store_op.inputs, "check_slots", counting)
    monkeypatch.setattr(dsakit.pool, "check_slots", counting)
    monkeypatch.setattr(store_op.reference, "check_slots", counting)
    keys, positions, slots, pool, table = _inputs(20, 128, 64, 1, KeyFormat.FP8.page_bytes)
    store_index_keys(keys, positions, slots, pool, "fp8", table, torch.ones(128), backend="reference")
    assert len(calls) == 1


def test_reference_record_checks_values_even_when_trusted():
    """The reference has no bounds guard of its own: its record checks slot values regardless."""
    keys, positions, slots, pool, table = _inputs(4, 128, 64, 1, KeyFormat.FP8.page_bytes)
    slots[0] = 64  # one past the pool
    before = pool.clone()
    with pytest.raises(ValueError, match="slot 64"):
        IndexKeyStore.check(keys, positions, slots, pool, "fp8", table, torch.ones(128), backend="reference",
                            check_values=False)
    with pytest.raises(ValueError, match="IndexKeyStore.check"):
        store_checked("not a record")
    assert torch.equal(pool, before)
