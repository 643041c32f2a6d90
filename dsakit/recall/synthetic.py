"""Synthetic needle-in-a-haystack data for the recall lab (the model of docs/spec.md §6).

What is generated, for one *haystack* of N cached entries (context L = N * ratio tokens):

1. Token states. For every context token s the compressor's two projections are drawn as
   ``kv[s] = [mu, mu] + z[s]`` and ``gate[s] = gate_std * g[s]`` (z, g standard normal, [S, 2 * D]); the
   position bias ``ape`` [ratio, 2 * D] is a fixed draw of the same seed. ``mu`` [D] is a *shared
   component*: the same vector in every token (pooled keys of a real model share a large common
   direction). It lives in the dims rope leaves alone (dims 0..63 for V4, 64..127 for V3.2), because a
   common vector in the rotated dims would turn with the position and stop being common. It has zero mean over
   the channels (so LayerNorm's centering leaves it alone), as has the needle direction below.
2. Pooling. The token states go through the V4 compressor (:func:`dsakit.ops.compress.compress_projected`,
   ratio 4 with overlapping windows) and give the pre-norm keys ``k[j] = mu + zp[j]`` [N, D]; the softmax
   weights of the gated pooling sum to one per channel, so the shared part passes through unchanged while
   the individual part shrinks (``zp`` has the per-element spread ``sigma``, measured on the haystack).
   Presets without compression (V3.2) use ``k[j] = mu + z[j]`` directly.
3. The knobs are defined on the pooled keys, what the cache really stores:

   * ``shared_ratio`` = |mu| / |zp| (both over D dims): how far the keys sit from the origin compared to
     how much they differ from each other. Per-entry scaling sets each entry's quantization step from its
     largest element, which grows with |mu|, while the needle is separated from the other entries only
     by the individual part: a large ratio is what costs fp8 and fp4 their reach (docs/spec.md §5.4, §6).
   * ``needle_strength`` = how many standard deviations (of the distractors' spread along the query
     direction) the needle entry stands out. The needle is written into the 4 tokens of one block as an
     extra direction ``u`` orthogonal to mu, so after pooling it lands in entry p (own-block half) and,
     weaker, in entry p + 1 (the overlapping previous-block half); the amplitude is set so that entry p
     exceeds an average entry along u by exactly ``needle_strength * sigma``.
   * ``outlier_channels`` / ``outlier_scale``: that many channels of the key norm's learned weight are
     multiplied by ``outlier_scale`` (large, position-independent channels, as trained norms often have);
     they inflate every entry's largest element, the Hadamard rotation spreads them out again.
   * ``head_weight_spread``: head weights are ``D^-0.5 H^-0.5 * exp(spread * n_h)``: 0 = all heads count
     the same, larger = a few heads dominate (fewer heads to average the per-head noise away).
   * ``query_noise``: each head's query is ``a + query_noise * e_h`` with ``a`` the unit needle direction
     (as stored: norm weight applied, at the needle's rope phase) and ``e_h`` a random unit vector.
4. Queries are the last ``query_tokens`` tokens of the context. Each is built so that after rope at its
   own position it points at the needle's stored key (the ideal retrieval query), then goes through rope
   and the Hadamard rotation exactly like the keys (:func:`prepare_queries`).

Everything is drawn from one ``torch.Generator`` on the CPU, so a seed fixes every number.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .._memory import check_float, check_int, check_tensor
from ..ops.compress import compress_projected
from ..presets import DSAPreset, KeyTransform, get_preset
from ..transforms import RopeLayout, apply_rope, hadamard_transform


@dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of the synthetic generator (module docstring gives their physical meaning)."""

    preset: str = "deepseek-v4-flash"
    shared_ratio: float = 100.0
    needle_strength: float = 5.0
    outlier_channels: int = 0
    outlier_scale: float = 8.0
    head_weight_spread: float = 0.5
    query_noise: float = 0.5
    gate_std: float = 1.0
    query_tokens: int = 4
    compressed: bool = True

    def __post_init__(self):
        preset = get_preset(self.preset)  # raises ValueError for an unknown name
        for name in ("shared_ratio", "needle_strength", "outlier_scale", "head_weight_spread", "query_noise",
                     "gate_std"):
            value = getattr(self, name)
            check_float(name, value, message=f"SyntheticConfig.{name} must be a finite number")
        for name in ("outlier_channels", "query_tokens"):
            value = getattr(self, name)
            check_int(name, value, message=f"SyntheticConfig.{name} must be an int")
        checks = [
            ("shared_ratio", self.shared_ratio, self.shared_ratio >= 0),
            ("needle_strength", self.needle_strength, self.needle_strength >= 0),
            ("outlier_channels", self.outlier_channels, 0 <= self.outlier_channels <= preset.index_head_dim),
            ("outlier_scale", self.outlier_scale, self.outlier_scale > 0),
            ("head_weight_spread", self.head_weight_spread, self.head_weight_spread >= 0),
            ("query_noise", self.query_noise, self.query_noise >= 0),
            ("gate_std", self.gate_std, self.gate_std >= 0),
            ("query_tokens", self.query_tokens, self.query_tokens >= 1),
        ]
        for name, value, ok in checks:
            if not ok or (isinstance(value, float) and not math.isfinite(value)):
                raise ValueError(f"SyntheticConfig.{name} has an invalid value {value!r}")
        if self.compressed and preset.compress_ratio != 4 and preset.compress_ratio != 1:
            raise ValueError(f"preset {preset.name} has compress ratio {preset.compress_ratio}; the synthetic "
                             f"compressor path models ratio 4 (V4 CSA) or 1 (no compression)")

    @property
    def geometry(self) -> DSAPreset:
        return get_preset(self.preset)

    @property
    def ratio(self) -> int:
        return self.geometry.compress_ratio

    def as_dict(self) -> dict:
        return asdict(self)


def rope_free_dims(transform: KeyTransform, head_dim: int) -> torch.Tensor:
    """Indices [head_dim - rope_dim] of the dims rope does not rotate."""
    seg = transform.rope_layout.segment(head_dim, transform.rope_dim)
    keep = torch.ones(head_dim, dtype=torch.bool)
    keep[seg] = False
    return torch.nonzero(keep).flatten()


@dataclass
class Haystack:
    """One synthetic context: pre-norm keys and what is needed to add a needle to it.

    keys [N, D] fp32 pre-norm pooled keys; kv_gate [S, 2D] (compressed presets: the gate rows, to pool a
    needle with the same weights) or None; ape [ratio, 2D] or None; mu [D]; sigma = per-element spread of
    the individual part; norm_weight [D].
    """

    config: SyntheticConfig
    keys: torch.Tensor
    gate: torch.Tensor | None
    ape: torch.Tensor | None
    mu: torch.Tensor
    sigma: float
    norm_weight: torch.Tensor

    @property
    def num_entries(self) -> int:
        return self.keys.shape[0]

    @property
    def context_tokens(self) -> int:
        return self.num_entries * self.config.ratio


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm().clamp(min=1e-30)


def model_weights(config: SyntheticConfig, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed per-config draws: (norm_weight [D], ape [ratio, 2D]); drawn first from the generator."""
    d = config.geometry.index_head_dim
    norm_weight = torch.ones(d)
    if config.outlier_channels:
        channels = torch.randperm(d, generator=generator)[: config.outlier_channels]
        norm_weight[channels] = config.outlier_scale
    ape = 0.5 * torch.randn(config.ratio, 2 * d, generator=generator)
    return norm_weight, ape


def make_haystack(config: SyntheticConfig, num_entries: int, generator: torch.Generator,
                  norm_weight: torch.Tensor, ape: torch.Tensor) -> Haystack:
    """Draw a haystack of ``num_entries`` pre-norm keys (module docstring, steps 1-3)."""
    check_int("num_entries", num_entries, 1, message="num_entries must be a positive int")
    geo = config.geometry
    d = geo.index_head_dim
    free = rope_free_dims(geo.key_transform, d)
    mu_dir = torch.zeros(d)
    mu_dir[free] = torch.randn(free.numel(), generator=generator)
    # Zero mean over the channels: LayerNorm (V3.2) subtracts each key's channel mean, which would otherwise
    # turn part of the shared vector into a per-entry offset that every query sees.
    mu_dir[free] -= mu_dir[free].mean()
    mu_dir = _unit(mu_dir)
    use_compressor = config.compressed and config.ratio == 4
    if use_compressor:
        tokens = num_entries * config.ratio
        z = torch.randn(tokens, 2 * d, generator=generator)
        gate = config.gate_std * torch.randn(tokens, 2 * d, generator=generator)
        # The shared part [mu, mu] is identical in every row; the per-channel softmax weights of the pooling
        # sum to one, so pooling (mu + z) = mu + pooling(z). Pool z alone first to measure sigma.
        pooled = compress_projected(z, gate, ape, config.ratio)
    else:
        pooled = torch.randn(num_entries, d, generator=generator)
        gate, ape = None, None
    sigma = float(pooled.pow(2).mean().sqrt())
    mu = mu_dir * config.shared_ratio * sigma * math.sqrt(d)
    return Haystack(config=config, keys=pooled + mu, gate=gate, ape=ape, mu=mu, sigma=sigma,
                    norm_weight=norm_weight)


@dataclass
class Needle:
    """A needle placed at entry ``entry`` of a haystack.

    entries: int64 [E] the entries that carry it (p, and p + 1 through the overlapping pooling);
    keys: fp32 [E, D] their new pre-norm keys; direction: unit u [D] (orthogonal to mu).
    """

    entry: int
    entries: torch.Tensor
    keys: torch.Tensor
    direction: torch.Tensor


def needle_direction(haystack: Haystack, generator: torch.Generator) -> torch.Tensor:
    """A random unit direction u [D] orthogonal to the shared component mu, with zero channel mean."""
    u = torch.randn(haystack.keys.shape[1], generator=generator)
    u = u - u.mean()
    mu_hat = _unit(haystack.mu) if float(haystack.mu.norm()) > 0 else torch.zeros_like(u)
    return _unit(u - (u @ mu_hat) * mu_hat)


def place_needle(haystack: Haystack, entry: int, direction: torch.Tensor) -> Needle:
    """Write the needle direction into the tokens of block ``entry`` and pool them (module docstring)."""
    return place_needles(haystack, [entry], direction.unsqueeze(0))[0]


def place_needles(haystack: Haystack, entries: "list[int]", directions: torch.Tensor) -> list[Needle]:
    """:func:`place_needle` for several independent needles at once (each against the clean haystack).

    directions [B, D] unit vectors. With the compressor, each needle is pooled in a window of three blocks
    (p - 1, p, p + 1): entry p needs block p - 1 in its softmax and entry p + 1 reads block p as its
    previous block; the needle rows are nonzero only in block p. Missing neighbours (p = 0, p = N - 1) are
    padding blocks whose gates are -inf, which the softmax ignores exactly like the compressor's own j = 0
    case. All windows are pooled in one call; the first block of each window (whose own previous block is
    the neighbouring window) is discarded.
    """
    n = haystack.num_entries
    if directions.dim() != 2 or directions.shape[0] != len(entries):
        raise ValueError(f"directions must be [B, D] with B = {len(entries)} needles, got {list(directions.shape)}")
    for entry in entries:
        check_int("needle entry", entry, 0, n - 1)
    strength = haystack.config.needle_strength * haystack.sigma
    if haystack.gate is None:
        return [Needle(p, torch.tensor([p]), haystack.keys[p:p + 1] + strength * u, u)
                for p, u in zip(entries, directions)]
    ratio = haystack.config.ratio
    width = haystack.gate.shape[1]
    gates, rows = [], []
    for p, u in zip(entries, directions):
        for block in (p - 1, p, p + 1):
            if 0 <= block < n:
                gates.append(haystack.gate[block * ratio:(block + 1) * ratio])
            else:
                gates.append(torch.full((ratio, width), float("-inf")))
            needle_rows = torch.zeros(ratio, width)
            if block == p:
                needle_rows[:] = torch.cat([u, u])
            rows.append(needle_rows)
    pooled = compress_projected(torch.cat(rows), torch.cat(gates), haystack.ape, ratio).reshape(len(entries), 3, -1)
    needles = []
    for i, (p, u) in enumerate(zip(entries, directions)):
        along = float(pooled[i, 1] @ u)  # > 0: a convex combination of u's channels
        scale = strength / max(along, 1e-12)
        carried = torch.arange(p, min(p + 1, n - 1) + 1)
        contribution = pooled[i, 1:1 + carried.numel()]
        needles.append(Needle(p, carried, haystack.keys[carried] + scale * contribution, u))
    return needles


def _check_positions(positions) -> None:
    check_tensor("positions", positions, shape=(None,), message="positions must be a non-empty int tensor [T]")
    if positions.numel() == 0:
        raise ValueError(f"positions must be a non-empty int tensor [T], got {list(positions.shape)}")


def needle_entry_for_depth(depth: float, visible_entries: int) -> int:
    """Entry index of a needle at relative depth in [0, 1] of the entries the last query sees."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    if visible_entries < 1:
        raise ValueError(f"a needle needs at least one visible entry, got {visible_entries}")
    return min(visible_entries - 1, int(round(depth * (visible_entries - 1))))


def query_positions(config: SyntheticConfig, context_tokens: int, query_tokens: int | None = None) -> torch.Tensor:
    """int64 [T]: the last T token positions of a context of ``context_tokens`` tokens."""
    t = config.query_tokens if query_tokens is None else query_tokens
    if context_tokens < t:
        raise ValueError(f"context of {context_tokens} tokens is shorter than {t} query tokens")
    return torch.arange(context_tokens - t, context_tokens)


def make_queries(haystack: Haystack, needle: Needle, positions: torch.Tensor,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Pre-rope queries [T, H, D] and head weights [T, H] that look for ``needle``.

    The target direction is the needle's stored direction (norm weight applied), rotated to the needle's
    rope phase relative to each query: after rope at the query's own position it matches rope(u) at the
    needle's position 4p. Each head adds its own noise (``query_noise``).
    """
    cfg = haystack.config
    geo = cfg.geometry
    tr = geo.key_transform
    _check_positions(positions)
    if int(positions.max()) < needle.entry * cfg.ratio:
        raise ValueError(f"last query position {int(positions.max())} precedes the needle's entry {needle.entry} "
                         f"(token {needle.entry * cfg.ratio}): the last query must come after the needle")
    t = positions.shape[0]
    h, d = geo.index_heads, geo.index_head_dim
    target = haystack.norm_weight * needle.direction  # [D]
    relative = needle.entry * cfg.ratio - positions  # [T] rope phase the query must carry
    cos, sin = geo.rope.cos_sin(relative)
    target = apply_rope(target.expand(t, d), cos, sin, tr.rope_layout, tr.rope_dim)  # [T, D]
    target = target / target.norm(dim=-1, keepdim=True)
    noise = torch.randn(t, h, d, generator=generator)
    # Head noise is kept orthogonal to the stored shared component: a query that also leaned on mu would add
    # the same large offset to every entry and decide per head, at random, whether relu passes or kills it.
    shared = haystack.norm_weight * haystack.mu
    if float(shared.norm()) > 0:
        shared = _unit(shared)
        noise = noise - (noise @ shared).unsqueeze(-1) * shared
    noise = noise / noise.norm(dim=-1, keepdim=True)
    q = target.unsqueeze(1) + cfg.query_noise * noise
    spread = torch.randn(t, h, generator=generator) * cfg.head_weight_spread
    weights = torch.exp(spread) * (d ** -0.5) * (h ** -0.5)
    return q, weights


def prepare_queries(q: torch.Tensor, positions: torch.Tensor, rope_cos_sin: torch.Tensor,
                    layout: "RopeLayout | str", rope_dim: int, hadamard: bool) -> torch.Tensor:
    """Pre-rope queries [T, H, D] -> fp32 [T, H, D] after rope at their positions [T] and the rotation.

    The query side of the indexer transform (docs/spec.md §2.1): no norm, rope on the rope dims with ``layout``,
    then the Hadamard rotation when ``hadamard``.
    """
    _check_positions(positions)
    check_tensor("q", q, shape=(positions.shape[0], None, None),
                 message=f"q must be [T, H, D] with T = {positions.shape[0]} positions")
    if int(positions.max()) >= rope_cos_sin.shape[0] or int(positions.min()) < 0:
        raise ValueError(f"query positions {int(positions.min())}..{int(positions.max())} outside the rope table "
                         f"(0..{rope_cos_sin.shape[0] - 1})")
    table = rope_cos_sin.detach().cpu().float()[positions.detach().cpu().long()]
    half = rope_dim // 2
    out = apply_rope(q, table[:, :half], table[:, half:], layout, rope_dim)
    return hadamard_transform(out) if hadamard else out
