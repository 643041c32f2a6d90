"""Count what one host call of an op does on the device, measured on the CPU (TRITON_INTERPRET=1): Triton
kernel launches, torch ops that run a kernel, tensors allocated and device->host reads (the calls that
would sync a GPU). Used by tests/test_indexer_host.py and to fill the "Host path" note of docs/performance.md.

On a GPU each counted torch op is one more kernel launch and each allocation one more trip through the
caching allocator; a device->host read (``.item()``, ``.tolist()``, ``bool(t)``, ``int(t)``) is a sync.
What the Triton interpreter does inside a kernel is not counted.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that only make views or read metadata: no kernel, no storage
_NO_KERNEL = {"view", "_unsafe_view", "slice", "select", "expand", "as_strided", "reshape", "t", "transpose",
              "permute", "unsqueeze", "squeeze", "detach", "alias", "lift_fresh", "unbind", "split",
              "split_with_sizes", "narrow", "view_as", "_reshape_alias", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
              "empty_like_view", "diagonal"}
_ALLOCATORS = {"empty", "empty_strided", "new_empty", "new_empty_strided"}  # storage without a kernel
_SYNCS = {"_local_scalar_dense", "equal", "is_nonzero"}  # a device value read on the host


@dataclass
class HostCounts:
    launches: int = 0          # Triton kernel launches
    torch_kernels: int = 0     # torch ops that run a kernel (fill, copy, arithmetic, ...)
    allocations: int = 0       # tensors with fresh storage
    syncs: int = 0             # device -> host reads
    ops: list = field(default_factory=list)

    @property
    def device_launches(self) -> int:
        """Triton launches + torch kernels: what a GPU would launch."""
        return self.launches + self.torch_kernels


class _Mode(TorchDispatchMode):
    def __init__(self, counts: HostCounts):
        super().__init__()
        self.counts = counts
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        name = func._schema.name.split("::")[-1]
        if name in _NO_KERNEL:
            return out
        if name in _SYNCS:
            self.counts.syncs += 1
            self.counts.ops.append(name)
            return out
        inputs = {a.untyped_storage().data_ptr() for a in _tensors((args, kwargs)) if a.numel()}
        fresh = [t for t in _tensors(out) if t.untyped_storage().data_ptr() not in inputs]
        self.counts.allocations += len(fresh)
        if name not in _ALLOCATORS:
            self.counts.torch_kernels += 1
        self.counts.ops.append(name)
        return out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def _kernel_classes():
    import triton.runtime.jit as jit

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover
        pass
    return classes


@contextlib.contextmanager
def count_host_work():
    """Yield a :class:`HostCounts` filled by everything run inside the block."""
    counts = HostCounts()
    mode = _Mode(counts)
    originals = {cls: cls.run for cls in _kernel_classes()}
    tolist = torch.Tensor.tolist

    def counted_run(original):
        def run(self, *args, **kwargs):
            counts.launches += 1
            counts.ops.append(f"triton:{getattr(self, '__name__', getattr(self.fn, '__name__', '?'))}")
            mode.paused += 1  # the interpreter's own tensor work is the kernel, not host work
            try:
                return original(self, *args, **kwargs)
            finally:
                mode.paused -= 1
        return run

    def counted_tolist(self):
        if not mode.paused:
            counts.syncs += 1
            counts.ops.append("tolist")
        return tolist(self)

    for cls, original in originals.items():
        cls.run = counted_run(original)
    torch.Tensor.tolist = counted_tolist
    try:
        with mode:
            yield counts
    finally:
        torch.Tensor.tolist = tolist
        for cls, original in originals.items():
            cls.run = original
