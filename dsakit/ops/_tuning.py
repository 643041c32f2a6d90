"""Per-GPU tuning defaults shared by the op configs (``ScoresConfig``, ``TopkConfig``, ``StoreConfig``).

Each config class keeps a table ``{gpu name substring: config}``; :func:`gpu_key` maps a device to the key of
its table (``"default"`` for the CPU, the interpreter and GPUs not measured yet). Only the H200 has been
measured so far; its tables are the defaults for every GPU until another one is measured.
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


_KEYS: dict[tuple, str] = {}  # (device, table id) -> key: the lookup runs on every op call


def gpu_key(device: "torch.device | str | None", table: dict) -> str:
    """The key of ``table`` for ``device``: the first key (other than "default") found in the GPU's name."""
    cache_key = (device, id(table))
    found = _KEYS.get(cache_key)
    if found is not None:
        return found
    key = "default"
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        name = _device_name(dev.index if dev.index is not None else torch.cuda.current_device()).lower()
        key = next((k for k in table if k != "default" and k.lower() in name), "default")
    _KEYS[cache_key] = key
    return key
