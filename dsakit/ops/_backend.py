"""Backend selection shared by the public ops: ``backend="auto" | "reference" | "triton"``.

``auto`` picks Triton when the data is on a CUDA device and Triton imports, the reference otherwise.
``TRITON_INTERPRET=1`` lets the Triton kernels run on CPU tensors (tests); ask for them with
``backend="triton"`` explicitly.
"""

from __future__ import annotations

import importlib.util

import torch

BACKENDS = ("auto", "reference", "triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)
        return "triton" if on_cuda and triton_available() else "reference"
    if backend == "triton" and not triton_available():
        raise ValueError("backend='triton' requested but triton is not installed (pip install triton)")
    return backend
