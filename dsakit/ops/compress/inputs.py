"""Input checks of the compressor (no record: its inputs are plain tensors and a ratio, checked by the entry
points of ``reference.py`` and ``device.py`` through these functions)."""

from __future__ import annotations

from ..._memory import check_ratio, check_tensor


def check_floating(**tensors) -> None:
    """Every tensor given floating, else ValueError naming the first that is not."""
    for what, t in tensors.items():
        check_tensor(what, t, floating=True, message=f"{what} must be a floating tensor")


def check_projected(kv, gate, ape, ratio: int) -> None:
    """Projected rows kv, gate [S, c*d] and ape [ratio, c*d] (c = 2 for ratio 4, else 1), else ValueError."""
    check_ratio(ratio)
    check_floating(kv=kv, gate=gate, ape=ape)
    check_tensor("kv", kv, dims=2, message="kv and gate must be the same [S, c*d] shape")
    check_tensor("gate", gate, shape=tuple(kv.shape), message=f"kv and gate must be the same [S, c*d] shape "
                                                              f"(kv {list(kv.shape)})")
    check_tensor("ape", ape, shape=(ratio, kv.shape[1]), message=f"ape must be [ratio, c*d] = [{ratio}, {kv.shape[1]}]")
    if ratio == 4 and kv.shape[1] % 2:
        raise ValueError(f"ratio 4 overlaps two halves: the feature dim W = c*d must be divisible by 2, "
                         f"got {kv.shape[1]}")


def check_hidden(x, wkv, wgate) -> None:
    """x [S, hidden] and wkv, wgate [c*d, hidden] floating, else ValueError."""
    check_floating(x=x, wkv=wkv, wgate=wgate)
    if x.dim() != 2 or wkv.dim() != 2 or wkv.shape[1] != x.shape[1] or wgate.shape != wkv.shape:
        raise ValueError(f"need x [S, hidden] and wkv, wgate [c*d, hidden]; got {list(x.shape)}, "
                         f"{list(wkv.shape)}, {list(wgate.shape)}")


__all__ = ["check_floating", "check_projected", "check_hidden"]
