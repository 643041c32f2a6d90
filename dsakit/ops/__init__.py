"""DSA ops. Each folder holds ``reference.py`` (pure PyTorch fp32 spec, CPU), a fast path (``triton.py``
launchers over ``_kernels.py`` kernels tuned by ``config.py``; for ``compress``, ``device.py``: torch ops on
the tensors' own device) and an ``__init__.py`` exporting one dispatching function with
``backend="auto" | "reference" | <fast path>``. The dispatcher checks the inputs once (into a frozen record
where the op has one: ``PagedBatch``, ``SparseAttentionInputs``, ``DecodeTopkPlan``, ``IndexKeyStore``);
the reference and the launchers trust it."""

from ._backend import BACKENDS, resolve_backend, triton_available, triton_interpreted

__all__ = ["BACKENDS", "resolve_backend", "triton_available", "triton_interpreted"]
