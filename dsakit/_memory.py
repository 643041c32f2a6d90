"""Devices and memory sizes for up-front checks: refuse an allocation that cannot fit, naming its size.

An allocation larger than the device holds fails inside the allocator with a RuntimeError (or, on the CPU,
gets the process killed by the OS); constructors that size buffers from user numbers check first.
"""

from __future__ import annotations

import os

import torch


def parse_device(device, what: str = "device") -> torch.device:
    """``device`` (a torch.device or a name like "cpu", "cuda:0") as a torch.device, else ValueError. A CUDA
    device on a machine without CUDA is a ValueError here, not torch's AssertionError at first use."""
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"{what} must be a torch.device or a name like 'cpu' or 'cuda:0', got {device!r}")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{what} {device!r} is not a device name; use e.g. 'cpu' or 'cuda:0'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{what} {device} requested but CUDA is not available on this machine")
    return device


def indexed_device(device, what: str = "device") -> torch.device:
    """:func:`parse_device` with the index filled in: 'cuda' means the current CUDA device, so comparisons
    with tensors' devices (always indexed) hold."""
    device = parse_device(device, what)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_memory_bytes(device: torch.device) -> int | None:
    """Memory the device has: the GPU's total memory, the machine's physical memory for the CPU (None when
    unknown, e.g. a device type this module does not know)."""
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device} requested but CUDA is not available on this machine")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if not 0 <= index < torch.cuda.device_count():
            raise ValueError(f"device {device} does not exist (this machine has {torch.cuda.device_count()} GPUs)")
        return torch.cuda.get_device_properties(index).total_memory
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


def check_fits(nbytes: int, device: torch.device, what: str) -> None:
    """ValueError naming ``what`` and both sizes when ``nbytes`` exceed the device's memory (a size the
    allocator would refuse with a RuntimeError, or the OS answer by killing the process)."""
    memory = device_memory_bytes(device)
    if memory is not None and nbytes > memory:
        raise ValueError(f"{what} needs {_gib(nbytes)} ({nbytes:,} bytes), more than the {_gib(memory)} of "
                         f"memory on {device}")
