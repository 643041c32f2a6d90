"""Sweep axes: context lengths (tokens) and needle depths, parsed from short command-line specs.

Lengths (tokens; ``k`` = 1000, ``K`` = 1024)::

    "1k,2k,4500"          list
    "lin:1000:16000:4"    4 points evenly spaced from 1000 to 16000 (inclusive)
    "log:1k:64k:7"        7 points geometrically spaced (1000, 2000, ..., 64000)
    "range:1000:8000:1000" start:stop:step, stop included when reached

Depths (fraction of the filler before the needle, 0 = start, 1 = end)::

    "0.05,0.5,0.95"       list
    "lin:0:1:11"          11 evenly spaced points (0, 0.1, ..., 1)
    "lin:5"               5 evenly spaced points in [0, 1]
    "sigmoid:9"           9 points denser near both ends (the usual needle-test grid)
"""

from __future__ import annotations

import math

MAX_POINTS = 10_000  # more points than any sweep can run: a spec that asks for more is a typo


def _number(text: str) -> float:
    text = text.strip()
    scale = 1
    if text.endswith("k"):
        scale, text = 1000, text[:-1]
    elif text.endswith("K"):
        scale, text = 1024, text[:-1]
    try:
        value = float(text) * scale
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def _count(text: str, what: str) -> int:
    value = _number(text)
    if value != int(value) or not 1 <= value <= MAX_POINTS:
        raise ValueError(f"{what} point count must be an integer in 1..{MAX_POINTS}, got {text!r}")
    return int(value)


def parse_lengths(spec: str) -> list[int]:
    """Context lengths in tokens from a spec (module docstring) -> sorted distinct positive ints."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("lengths spec must be a non-empty string like '1k,2k,4k' or 'log:1k:64k:7'")
    parts = spec.strip().split(":")
    kind = parts[0].lower()
    if kind in ("lin", "log"):
        if len(parts) != 4:
            raise ValueError(f"'{kind}' lengths need {kind}:START:STOP:COUNT, got {spec!r}")
        start, stop, n = _number(parts[1]), _number(parts[2]), _count(parts[3], "lengths")
        if start <= 0 or stop < start:
            raise ValueError(f"lengths need 0 < START <= STOP, got {spec!r}")
        if n == 1:
            values = [start]
        elif kind == "lin":
            values = [start + (stop - start) * i / (n - 1) for i in range(n)]
        else:
            values = [start * (stop / start) ** (i / (n - 1)) for i in range(n)]
    elif kind == "range":
        if len(parts) != 4:
            raise ValueError(f"'range' lengths need range:START:STOP:STEP, got {spec!r}")
        start, stop, step = _number(parts[1]), _number(parts[2]), _number(parts[3])
        if start <= 0 or step <= 0 or stop < start:
            raise ValueError(f"range lengths need START > 0, STEP > 0, STOP >= START, got {spec!r}")
        count = int(math.floor((stop - start) / step + 1e-9)) + 1
        if count > MAX_POINTS:
            raise ValueError(f"range lengths {spec!r} give {count} points, more than {MAX_POINTS}: raise STEP")
        values = [start + i * step for i in range(count)]
    else:
        values = [_number(p) for p in spec.split(",") if p.strip()]
    lengths = sorted({int(round(v)) for v in values})
    if not lengths or lengths[0] < 1:
        raise ValueError(f"lengths must be positive token counts, got {spec!r}")
    return lengths


def sigmoid_depths(n: int, steepness: float = 6.0) -> list[float]:
    """n depths in [0, 1], evenly spaced in logit space: dense near 0 and 1, sparse in the middle."""
    if n < 1:
        raise ValueError(f"depth count must be >= 1, got {n}")
    if n == 1:
        return [0.5]
    lo, hi = 1 / (1 + math.exp(steepness)), 1 / (1 + math.exp(-steepness))
    out = []
    for i in range(n):
        x = -steepness + 2 * steepness * i / (n - 1)
        out.append((1 / (1 + math.exp(-x)) - lo) / (hi - lo))  # rescaled so the ends are exactly 0 and 1
    return out


def parse_depths(spec: str) -> list[float]:
    """Needle depths from a spec (module docstring) -> sorted distinct floats in [0, 1] (rounded to 1e-4)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("depths spec must be a non-empty string like '0.1,0.5,0.9', 'lin:11' or 'sigmoid:9'")
    parts = spec.strip().split(":")
    kind = parts[0].lower()
    if kind == "lin":
        if len(parts) == 2:
            start, stop, n = 0.0, 1.0, _count(parts[1], "depth")
        elif len(parts) == 4:
            start, stop, n = _number(parts[1]), _number(parts[2]), _count(parts[3], "depth")
        else:
            raise ValueError(f"'lin' depths need lin:COUNT or lin:START:STOP:COUNT, got {spec!r}")
        values = [start] if n == 1 else [start + (stop - start) * i / (n - 1) for i in range(n)]
    elif kind == "sigmoid":
        if len(parts) != 2:
            raise ValueError(f"'sigmoid' depths need sigmoid:COUNT, got {spec!r}")
        values = sigmoid_depths(_count(parts[1], "depth"))
    else:
        values = [_number(p) for p in spec.split(",") if p.strip()]
    depths = sorted({round(v, 4) for v in values})
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if not depths or bad:
        raise ValueError(f"depths must lie in [0, 1], got {bad or spec!r}")
    return depths
