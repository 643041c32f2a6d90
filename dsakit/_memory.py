"""Up-front checks, the ground floor every public function validates with (imports nothing of ours).

Argument checks: each helper returns the checked value or raises a ValueError that names the argument and
what it got, so a boundary reads as a list of checks and every message has one wording::

    k = check_int("k", k, minimum=1)
    check_bool("return_slots", return_slots)
    check_tensor("weights", weights, shape=(t, h), dtypes=WEIGHT_DTYPES, device=device)

A boundary runs them once and hands a frozen record of the checked values inward (``PagedBatch``,
``SparseAttentionInputs``, the store ops' ``IndexKeyStore`` ...); nothing behind it checks again.
Bools are never ints here: ``True`` passed as a count is a mistake, not a 1.

Devices and memory sizes: refuse an allocation that cannot fit, naming its size. An allocation larger than
the device holds fails inside the allocator with a RuntimeError (or, on the CPU, gets the process killed by
the OS); constructors that size buffers from user numbers check first (:func:`check_fits`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch


#: the integer dtypes index tensors (slots, block tables, counts, positions) may have
INDEX_DTYPES = (torch.int32, torch.int64)
#: the floating dtypes activations and weights may have
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def describe(x) -> str:
    """Short description of a value for an error message: dtype, shape and device of a tensor, else its type."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {list(x.shape)} on {x.device}"
    return type(x).__name__


def is_int(value) -> bool:
    """True for a Python int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int_wording(name: str, minimum, maximum, noun: str = "an int") -> str:
    if minimum is not None and maximum is not None:
        return f"{name} must be {noun} in {minimum}..{maximum}"
    if minimum is not None:
        return f"{name} must be {noun} >= {minimum}"
    if maximum is not None:
        return f"{name} must be {noun} <= {maximum}"
    return f"{name} must be {noun}"


def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None, *,
              message: str | None = None, allow_none: bool = False) -> int | None:
    """``value`` as an int in minimum..maximum (either bound optional; bools refused; None passes when
    ``allow_none``), else ValueError.

    ``message`` replaces the standard wording ("{name} must be an int >= 1") where a boundary says more
    (what the value means); ", got {value!r}" is appended."""
    if allow_none and value is None:
        return None
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{message or _int_wording(name, minimum, maximum)}, got {value!r}")
    return value


def check_power_of_two(name: str, value, minimum: int = 1, maximum: int | None = None, *,
                       message: str | None = None, allow_none: bool = False) -> int | None:
    """``value`` as a power-of-two int in minimum..maximum (None passes when ``allow_none``), else ValueError
    ("{name} must be a power of two >= 16, got 24")."""
    if allow_none and value is None:
        return None
    if not is_int(value) or value < minimum or value & (value - 1) or (maximum is not None and value > maximum):
        raise ValueError(f"{message or _int_wording(name, minimum, maximum, 'a power of two')}, got {value!r}")
    return value


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= minimum (bools refused), else ValueError naming it."""
    return check_int(name, value, minimum)


def check_ratio(ratio) -> int:
    """Tokens per cache entry: an int >= 1."""
    return check_int("ratio", ratio, 1, message="ratio must be a positive int")


def check_k(k, limit: int | None = None) -> int:
    """k a positive int (<= limit when given), else ValueError."""
    check_int("k", k, 1, message="k must be a positive int")
    if limit is not None and k > limit:
        raise ValueError(f"k must be <= {limit} here, got {k}")
    return k


def check_int_list(name: str, values, minimum: int | None = None, *, length: int | None = None,
                   message: str | None = None) -> list[int]:
    """A list of ints (each >= minimum; ``length`` of them when given), else ValueError naming it."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        ok = False
    else:
        values = list(values)
        ok = (length is None or len(values) == length) and all(
            is_int(v) and (minimum is None or v >= minimum) for v in values)
    if not ok:
        if message is None:
            count = "" if length is None else f"{length} "
            message = f"{name} must be {count}ints" + ("" if minimum is None else f" >= {minimum}")
        raise ValueError(f"{message}, got {values!r}")
    return values


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool, else ValueError (0 / 1 / "yes" are mistakes, not flags)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def check_float(name: str, value, minimum: float | None = None, *, positive: bool = False,
                message: str | None = None, allow_none: bool = False) -> float | None:
    """``value`` as a finite float (an int is fine, a bool is not), > 0 when ``positive``, >= minimum when
    given (None passes when ``allow_none``), else ValueError."""
    if allow_none and value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and not (positive and value <= 0) and not (minimum is not None and value < minimum)
    if not ok:
        if message is None:
            bound = " > 0" if positive else ("" if minimum is None else f" >= {minimum}")
            message = f"{name} must be a finite number{bound}"
        raise ValueError(f"{message}, got {value!r}")
    return float(value)


def check_choice(name: str, value, choices, *, what: str | None = None):
    """``value`` if it is one of ``choices``, else ValueError listing them."""
    try:
        ok = value in choices
    except TypeError:  # an unhashable value asked of a dict / set
        ok = False
    if not ok:
        raise ValueError(f"unknown {what or name} {value!r}; choose one of {tuple(choices)}")
    return value


def check_instance(name: str, value, cls: type, hint: str = "", label: str | None = None):
    """``value`` if it is a ``cls``, else ValueError ("batch must be a dsakit.PagedBatch (hint), got str";
    ``label`` names the class, default its bare name)."""
    if not isinstance(value, cls):
        label = label or cls.__name__
        article = "an" if label[0].lower() in "aeiou" else "a"
        raise ValueError(f"{name} must be {article} {label}{f' ({hint})' if hint else ''}, got "
                         f"{type(value).__name__}")
    return value


def check_tensor(name: str, x, *, dims: int | None = None, shape: tuple | None = None, dtypes=None,
                 device: torch.device | None = None, contiguous: bool = False, owner: str = "the batch",
                 message: str | None = None, floating: bool = False) -> torch.Tensor:
    """``x`` if it is a tensor with the given rank / shape (None entries = any size) / dtype / device.

    Messages: "{name} must be a torch.Tensor, got list", "{name} must have shape [*, 128], got [4, 64]",
    "{name} must have dtype in ['torch.int32', 'torch.int64'], got torch.float32", "{name} is on cpu but ...".
    ``message`` ("q must be [T, H, 128]") replaces the first two with "{message}, got [4, 64]" (or the type);
    ``floating``: a floating dtype, any width ("{name} must be a floating tensor, got torch.int64").
    """
    if not isinstance(x, torch.Tensor) or x.is_meta:  # a meta tensor has a shape but no values to read
        got = "a meta tensor (no data)" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{message}, got {got}" if message
                         else f"{name} must be a torch.Tensor with data, got {got}")
    if shape is not None:
        bad = x.dim() != len(shape) or any(want is not None and got != want for got, want in zip(x.shape, shape))
    else:
        bad = dims is not None and x.dim() != dims
    if bad:
        if message:
            raise ValueError(f"{message}, got {list(x.shape)}")
        if shape is None:
            raise ValueError(f"{name} must be a {dims}-D tensor, got {list(x.shape)}")
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape [{want}], got {list(x.shape)}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{message or f'{name} must be a floating tensor'}, got {x.dtype}")
    if dtypes is not None:
        if message and x.dtype not in ((dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)):
            raise ValueError(f"{message}, got {x.dtype} {list(x.shape)}")
        check_dtype(name, x, dtypes)
    if device is not None:
        check_device(name, x, device, owner)
    if contiguous and not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(x.stride())}")
    return x


def check_dtype(name: str, x: torch.Tensor, dtypes) -> torch.Tensor:
    """``x`` if its dtype is one of ``dtypes`` (one dtype or a tuple), else ValueError."""
    dtypes = (dtypes,) if isinstance(dtypes, torch.dtype) else tuple(dtypes)
    if x.dtype not in dtypes:
        want = str(dtypes[0]).replace("torch.", "") if len(dtypes) == 1 else f"one of {[str(d) for d in dtypes]}"
        raise ValueError(f"{name} must be {want}, got {x.dtype}")
    return x


def check_device(name: str, x: torch.Tensor, device: torch.device, owner: str = "the batch") -> torch.Tensor:
    """``x`` if it lives on ``device`` (where ``owner`` lives), else ValueError naming both devices."""
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but {owner} is on {device}; put every input on one device")
    return x


def check_same_device(device: torch.device, **tensors) -> None:
    """Every tensor given (None skipped) on ``device``, else ValueError naming the first that is not."""
    for name, tensor in tensors.items():
        if tensor is not None:
            check_device(name, tensor, device)


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


__all__ = ["FLOAT_DTYPES", "INDEX_DTYPES", "check_bool", "check_choice", "check_device", "check_dtype", "check_fits",
           "check_float", "check_instance", "check_int", "check_int_list", "check_k", "check_positive_int",
           "check_power_of_two", "check_ratio", "check_same_device", "check_tensor", "describe",
           "device_memory_bytes", "indexed_device", "is_int", "parse_device"]
