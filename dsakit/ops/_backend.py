"""Backend selection shared by the public ops: ``backend="auto" | "reference" | "triton"``.

``auto`` picks Triton when the data is on a CUDA device and Triton imports, the reference otherwise.
``TRITON_INTERPRET=1`` lets the Triton kernels run on CPU tensors (tests); ask for them with
``backend="triton"`` explicitly.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

BACKENDS = ("auto", "reference", "triton")


# looked up once at import: torch.compile cannot trace importlib (a fullgraph trace of the store failed on
# torch 2.11 at this call), and the answer cannot change while the process runs
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    return _TRITON_AVAILABLE


# the GPU the Gluon kernels are written for: wgmma and the 227 KB shared memory of sm_90 (H100 / H200 / H800)
GLUON_CAPABILITY = (9, 0)


@functools.lru_cache(maxsize=None)
def gluon_importable() -> bool:
    """True when this Triton ships Gluon with the Hopper wgmma API the Gluon kernels use (Triton >= 3.5)."""
    try:
        hopper = importlib.import_module("triton.experimental.gluon.language.nvidia.hopper")
    except ImportError:
        return False
    return all(hasattr(hopper, name) for name in ("warpgroup_mma", "warpgroup_mma_wait", "warpgroup_mma_init"))


def gluon_platform_reason(location: str, capability: tuple[int, int] | None, kernel: str,
                          importable: bool | None = None) -> str | None:
    """Why no Gluon sm_90 kernel can run here (None: one can), whatever its inputs: ``location`` says where
    the data is ("q is on cpu"), ``capability`` is its GPU's (major, minor) (None off CUDA), ``kernel`` names
    the kernel in the reason; ``importable``: None = :func:`gluon_importable`, asked only on an sm_90 GPU."""
    if capability is None:
        return f"{location}, not a CUDA GPU"
    if tuple(capability) != GLUON_CAPABILITY:
        return f"the GPU is sm_{capability[0]}{capability[1]}, {kernel} is written for sm_90 (wgmma)"
    if not (gluon_importable() if importable is None else importable):
        return "this Triton has no Gluon Hopper API (triton.experimental.gluon, Triton >= 3.5)"
    if triton_interpreted():
        return "TRITON_INTERPRET=1: Gluon kernels do not run in the interpreter"
    return None


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device (asked once per device), None for any other device."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def triton_interpreted() -> bool:
    """True when Triton runs its kernels in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """'auto' | 'reference' | 'triton' -> 'reference' | 'triton' for data ``tensors`` (ValueError if impossible).

    Explicit 'triton' on tensors none of which is on CUDA needs the interpreter (TRITON_INTERPRET=1); without
    it Triton fails deep inside its launcher ("0 active drivers"), so it is refused here by name.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)
        return "triton" if on_cuda and triton_available() else "reference"
    if backend == "triton" and not triton_available():
        raise ValueError("backend='triton' requested but triton is not installed (pip install triton)")
    data = [t for t in tensors if isinstance(t, torch.Tensor)]
    if backend == "triton" and data and not any(t.is_cuda for t in data) and not triton_interpreted():
        raise ValueError(f"backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 for CPU tensors; the data "
                         f"is on {data[0].device} (use backend='reference' or 'auto')")
    return backend
