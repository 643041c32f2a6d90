"""Attention blocks of a DeepSeek-V4 layer on dsakit's paged caches: CSA, HCA and window-only.

One :class:`V4Attention` module is the attention block of one layer (the part between the layer's input norm
and its residual / hyper-connection mixing). ``layer_type`` picks the kind:

* ``"csa"`` (compressed sparse attention): each query attends to the last ``window`` raw tokens (itself
  included) plus the ``index_topk`` compressed entries (ratio 4, overlapping windows) chosen by the lightning
  indexer from its own compressed index keys;
* ``"hca"`` (heavily compressed attention): the window plus every ratio-128 entry complete at the query;
* ``"window"``: the window only (V4's first layers).

Shapes: S new tokens of one sequence, H attention heads, D = 512 head dim (448 no-rope + 64 rope dims,
interleaved pairs, trailing), Hi index heads, Di = 128 index head dim, K top-k, W window. Per call::

    q_res = RMSNorm(x @ q_a_proj.T) * q_a_norm.weight                                 [S, q_lora]
    q     = rope(unit_RMSNorm(q_res @ q_b_proj.T viewed [S, H, D]), pos)                 [S, H, D]
    kv    = RMSNorm(x @ kv_proj.T) -> rope(pos) -> main KV pool (one entry per token)    [S, D]
    comp  = compressor(x) (dsakit.ops.compress.device, decode state per sequence)
            -> RMSNorm -> rope(j * ratio) -> extra KV pool (one entry per block)         [n, D]
    (csa) index keys = indexer's compressor -> RMSNorm -> rope(4j) -> Hadamard -> key format -> index pool
    (csa) top-k = index_topk(Hadamard(rope(q_res @ iq_b.T)), weights_proj(x) * Di^-0.5 * Hi^-0.5, ...)
    out   = sparse_attention(q, window slots ++ top-k / all visible entries, sink) * D^-0.5 softmax
    out   = rope(out, -pos) on the rope dims, then grouped output projection o_a (g groups) and o_b.

Positions are the sequence's own token count in the cache (contiguous from 0). Entry j of a ratio-r
compressor is visible to the query at position t iff j < (t + 1) // r. Everything after the boundary checks
runs on the tensors' device without reading a device value back; long prefills are processed in query chunks
so no stage allocates memory proportional to S x N.

The index-key format is a constructor argument; when it is not given, the environment variable
``DSAKIT_INDEX_KEY_FORMAT`` overrides the preset's default (deployments flip it without code). Submodule and
parameter names mirror transformers' ``DeepseekV4Attention`` so its state dict loads as is and
:mod:`dsakit.integrations.transformers` can share the parameters. See docs/layers.md.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..batch import upload
from ..cache import PagedCache
from ..formats import ATTENTION_HEAD_DIM, ENTRIES_PER_PAGE, INDEX_HEAD_DIM, AttentionKVFormat, KeyFormat
from ..ops import attention as attention_ops
from ..ops._backend import resolve_backend
from ..ops.compress.device import CompressorState, compress_step
from ..ops.store import store_attention_kv, store_index_keys
from ..ops import topk as topk_ops
from ..presets import DSAPreset, get_preset
from ..transforms import ROPE_V4, RopeConfig, RopeLayout, hadamard_matrix

try:  # the launchers behind dsakit.ops.store (triton is an optional dependency)
    from ..ops.store.triton import launch_store_attention_kv, launch_store_index_keys
except ImportError:  # pragma: no cover - without triton every store runs the reference
    launch_store_attention_kv = launch_store_index_keys = None

__all__ = ["V4Attention", "V4LayerCache", "INDEX_KEY_FORMAT_ENV", "resolve_index_key_format", "LAYER_TYPES"]

INDEX_KEY_FORMAT_ENV = "DSAKIT_INDEX_KEY_FORMAT"
LAYER_TYPES = {"csa": 4, "hca": 128, "window": 0}
# queries per chunk of a prefill: bounds the [chunk, K] / [chunk, N_hca] index tensors and the attention's
# working set (the top-k op bounds its own score workspace)
DEFAULT_QUERY_CHUNK = 4096


def resolve_index_key_format(index_key_format: "KeyFormat | str | None", preset: DSAPreset) -> KeyFormat:
    """The explicit format if given; else ``$DSAKIT_INDEX_KEY_FORMAT`` if set; else the preset's default."""
    if index_key_format is not None:
        return KeyFormat.parse(index_key_format)
    env = os.environ.get(INDEX_KEY_FORMAT_ENV)
    if env is not None and env.strip():
        try:
            return KeyFormat.parse(env.strip())
        except ValueError as err:
            raise ValueError(f"${INDEX_KEY_FORMAT_ENV}={env!r} is not an index-key format: {err}") from None
    return preset.default_key_format


def _device(device: "str | torch.device") -> torch.device:
    """A device with its index: 'cuda' means the current CUDA device, so comparisons with tensors' devices
    (always indexed) hold."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _positive_int(value, what: str, allow_zero: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if allow_zero else 1):
        raise ValueError(f"{what} must be a {'non-negative' if allow_zero else 'positive'} int, got {value!r}")
    return value


class RMSNorm(nn.Module):
    """x -> x * rsqrt(mean(x^2) + eps) * weight, in fp32 (the weight is kept as given)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = float(eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight.float()


class _Scorer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class V4Compressor(nn.Module):
    """Projections of one compressor: kv_proj, gate_proj [c*d, hidden], position_bias [ratio, c*d], kv_norm [d]."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float = 1e-6):
        super().__init__()
        c = 2 if ratio == 4 else 1
        self.ratio, self.dim = ratio, dim
        self.kv_proj = nn.Linear(hidden, c * dim, bias=False)
        self.gate_proj = nn.Linear(hidden, c * dim, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, c * dim))
        self.kv_norm = RMSNorm(dim, eps)

    def step(self, x: torch.Tensor, state: CompressorState) -> tuple[torch.Tensor, int]:
        """x [S, hidden] (next tokens of the sequence) -> (pre-norm entries fp32 [n, d], first entry index)."""
        return compress_step(_linear(x, self.kv_proj), _linear(x, self.gate_proj), self.position_bias,
                             self.ratio, state)

    def new_state(self, device) -> CompressorState:
        return CompressorState(self.ratio, self.kv_proj.weight.shape[0], device=device)


class V4Indexer(V4Compressor):
    """Lightning indexer of a CSA layer: its own compressor at Di = 128, q_b_proj [Hi * Di, q_lora] and
    scorer.weights_proj [Hi, hidden]."""

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, eps: float = 1e-6):
        super().__init__(hidden, INDEX_HEAD_DIM, 4, eps)
        self.heads = heads
        self.q_b_proj = nn.Linear(q_lora_rank, heads * INDEX_HEAD_DIM, bias=False)
        self.scorer = _Scorer(hidden, heads)


class _CompressorWithIndexer(V4Compressor):
    def __init__(self, hidden: int, dim: int, q_lora_rank: int, index_heads: int, eps: float):
        super().__init__(hidden, dim, 4, eps)
        self.indexer = V4Indexer(hidden, q_lora_rank, index_heads, eps)


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """x @ W.T in the weight's dtype (as the model computes it)."""
    return F.linear(x.to(layer.weight.dtype), layer.weight)


class _RopeTable:
    """fp32 [max_position, rope_dim] cos|sin table of one RopeConfig on one device, grown by doubling."""

    def __init__(self, rope: RopeConfig):
        self.rope = rope
        self.table: torch.Tensor | None = None

    def get(self, max_position: int, device: torch.device) -> torch.Tensor:
        device = _device(device)
        if self.table is None or self.table.shape[0] < max_position or self.table.device != device:
            size = max(max_position, 1024 if self.table is None else 2 * self.table.shape[0])
            self.table = self.rope.cos_sin_table(size).to(device)
        return self.table


def _rope_v4(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing rope dims of x [S, ..., Dh] (interleaved pairs) at positions [S]; fp32 out.

    ``inverse`` rotates by -angle (undoes the rotation V carries into the output, K = V)."""
    rope_dim = table.shape[1]
    half = rope_dim // 2
    cs = table[positions]  # [S, rope_dim]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cs[:, :half].reshape(shape), cs[:, half:].reshape(shape)
    if inverse:
        sin = -sin
    x = x.float()
    rope = x[..., -rope_dim:].unflatten(-1, (half, 2))
    a, b = rope[..., 0], rope[..., 1]
    rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated], dim=-1)


# --------------------------------------------------------------------------------------------------
# Ops behind the shared contracts (sparse attention, PagedBatch top-k)
# --------------------------------------------------------------------------------------------------


def sparse_attention_paged(q: torch.Tensor, kv_cache: torch.Tensor, indices: torch.Tensor, *,
                           kv_format: AttentionKVFormat, extra_kv_cache: torch.Tensor | None = None,
                           extra_indices: torch.Tensor | None = None, sink: torch.Tensor | None = None,
                           softmax_scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Sparse attention over the main pool (``indices``) and the compressed-entry pool (``extra_indices``),
    global slots, -1 skipped -> out [T, Hq, 512] fp32 (``dsakit.ops.attention.sparse_attention``)."""
    out, _ = attention_ops.sparse_attention(
        q, kv_cache, indices, kv_format=kv_format, extra_kv_cache=extra_kv_cache,
        extra_kv_format=kv_format if extra_kv_cache is not None else None, extra_indices=extra_indices,
        sink=sink, softmax_scale=softmax_scale, backend=backend)
    return out.float()


_ROPE_PAIRING, _ROPE_PLACEMENT = RopeLayout.parse(ROPE_V4).name.rsplit("-", 1)


def _write_attention_kv(rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                        fmt: AttentionKVFormat, table: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        backend: str) -> None:
    """``dsakit.ops.store.store_attention_kv`` (rope layout V4) minus its host-side value checks.

    The layer makes ``slots`` (its own allocator: in range, distinct) and ``positions`` (< the rope table's
    rows) itself, so they are valid by construction. The public op would copy both to the host on every call
    to check them: a device sync per store, and on a long prefill a CPU sort of every slot for the duplicate
    check. The kernel also drops any row whose slot or position is out of range, so nothing can be written
    out of bounds either way. The reference (CPU) path keeps the public op and its checks.
    """
    if resolve_backend(backend, rows, pool) == "reference":
        store_attention_kv(rows, positions, slots, pool, fmt, table, norm_weight, ROPE_V4, eps, backend="reference")
    elif torch.compiler.is_compiling():  # the custom op is the traceable form of the same launch
        torch.ops.dsakit.store_attention_kv(rows, positions, slots, pool, table, norm_weight.contiguous(), fmt.name,
                                            RopeLayout.parse(ROPE_V4).name, float(eps))
    else:
        launch_store_attention_kv(rows, positions, slots, pool, table, norm_weight.contiguous(), fmt,
                                  _ROPE_PAIRING, _ROPE_PLACEMENT, float(eps))


def _write_index_keys(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                      fmt: KeyFormat, table: torch.Tensor, norm_weight: torch.Tensor, transform,
                      backend: str) -> None:
    """``dsakit.ops.store.store_index_keys`` (RMSNorm, no bias) minus its host-side value checks: see
    :func:`_write_attention_kv`."""
    if resolve_backend(backend, keys, pool) == "reference":
        store_index_keys(keys, positions, slots, pool, fmt, table, norm_weight, None, transform, backend="reference")
        return
    layout = RopeLayout.parse(transform.rope_layout)
    if torch.compiler.is_compiling():
        torch.ops.dsakit.store_index_keys(keys, positions, slots, pool, table, norm_weight.contiguous(), None,
                                          fmt.name, transform.norm, layout.name, bool(transform.hadamard),
                                          float(transform.eps))
    else:
        pairing, placement = layout.name.rsplit("-", 1)
        launch_store_index_keys(keys, positions, slots, pool, table, norm_weight.contiguous(), None, fmt,
                                transform.norm, pairing, placement, bool(transform.hadamard), float(transform.eps))


def _topk(q: torch.Tensor, weights: torch.Tensor, cache: PagedCache, seq: int, k: int, positions: torch.Tensor,
          ratio: int, backend: str) -> torch.Tensor:
    """index_topk for the queries of one sequence -> int32 [T, k] entry indices (-1 padded), on q's device.
    The batch comes from the cache's host metadata (no device sync)."""
    batch = cache.batch([seq], query_lens=[q.shape[0]], query_positions=positions, ratio=ratio)
    return topk_ops.index_topk(q, weights, batch, k, backend=backend).to(q.device)


# --------------------------------------------------------------------------------------------------
# Caches
# --------------------------------------------------------------------------------------------------


class V4LayerCache:
    """Paged caches of one V4 attention layer for a set of sequences.

    * ``kv``: main KV pool, one entry per raw token (slot of token p = its entry p), AttentionKVFormat;
    * ``extra``: compressed entries of the layer's compressor (csa / hca), same format;
    * ``index``: index keys of the CSA indexer, KeyFormat;
    * per sequence: the compressors' decode states (fp32 rings, :class:`CompressorState`);
    * per sequence and attention pool (``kv``, ``extra``): a *slot map* on the device, int32
      ``[pad + capacity]``: the global slot of entry e at index ``pad + e``, -1 in the ``pad`` leading
      positions (``kv``: pad = the window, so a query's window is a slice even at the start of the sequence;
      ``extra``: pad = 1, so entry index -1 maps to slot -1). The map is appended to as entries are reserved
      (a scalar fill or one asynchronous upload of the new slots), so the attention's slot sets are views or
      one gather: no block-table arithmetic and no device sync per step.

    Pools are sized for ``max_tokens`` tokens per sequence x ``max_sequences`` and grow (doubling, a page
    copy on the device) when a sequence outgrows them.
    """

    _MAPPED = ("kv", "extra")

    def __init__(self, layer: "V4Attention", max_tokens: int = 4096, max_sequences: int = 1,
                 device: "str | torch.device | None" = None):
        if not isinstance(layer, V4Attention):
            raise ValueError(f"layer must be a V4Attention, got {type(layer).__name__}")
        _positive_int(max_tokens, "max_tokens")
        _positive_int(max_sequences, "max_sequences")
        self.layer = layer
        self.device = _device(device) if device is not None else layer.q_a_proj.weight.device
        pages = lambda tokens: max(1, math.ceil(tokens / ENTRIES_PER_PAGE)) * max_sequences  # noqa: E731
        self.kv = PagedCache(layer.kv_format, pages(max_tokens), device=self.device)
        self.extra = PagedCache(layer.kv_format, pages(max_tokens // layer.ratio), device=self.device) \
            if layer.ratio else None
        self.index = PagedCache(layer.index_key_format, pages(max_tokens // 4), device=self.device) \
            if layer.layer_type == "csa" else None
        self._max_tokens = max_tokens
        self._ids: dict[int, dict[str, int]] = {}
        self._states: dict[int, dict[str, CompressorState]] = {}
        self._maps: dict[tuple[str, int], torch.Tensor] = {}
        self._next = 0

    def caches(self) -> dict[str, PagedCache]:
        return {name: c for name, c in (("kv", self.kv), ("extra", self.extra), ("index", self.index))
                if c is not None}

    def add_sequence(self) -> int:
        seq = self._next
        self._next += 1
        self._ids[seq] = {name: c.add_sequence() for name, c in self.caches().items()}
        states = {}
        if self.layer.compressor is not None:
            states["compressor"] = self.layer.compressor.new_state(self.device)
            if self.layer.layer_type == "csa":
                states["indexer"] = self.layer.compressor.indexer.new_state(self.device)
        self._states[seq] = states
        return seq

    def free_sequence(self, seq: int) -> None:
        self._check(seq)
        for name, c in self.caches().items():
            c.free_sequence(self._ids[seq][name])
        del self._ids[seq], self._states[seq]
        self._maps = {k: v for k, v in self._maps.items() if k[1] != seq}

    @property
    def sequences(self) -> list[int]:
        return sorted(self._ids)

    def _check(self, seq) -> None:
        if seq not in self._ids:
            raise ValueError(f"unknown sequence id {seq!r}; live sequences: {self.sequences}")

    def length(self, seq: int) -> int:
        """Tokens of the sequence held (its next token's position)."""
        self._check(seq)
        return self.kv.length(self._ids[seq]["kv"])

    def id_in(self, name: str, seq: int) -> int:
        return self._ids[seq][name]

    def state(self, seq: int, name: str) -> CompressorState:
        return self._states[seq][name]

    def map_pad(self, name: str) -> int:
        """Leading -1 positions of the slot maps of pool ``name`` ("kv": the window; "extra": 1)."""
        return self.layer.window if name == "kv" else 1

    def slot_map(self, name: str, seq: int) -> torch.Tensor | None:
        """int32 [pad + capacity] slot map of the sequence in pool ``name`` ("kv" | "extra"), on the device:
        entry e at ``pad + e`` (valid for e < the sequence's entries), -1 before; None before its first reserve."""
        return self._maps.get((name, seq))

    def _map_for(self, name: str, seq: int, entries: int) -> torch.Tensor:
        """The slot map with room for ``entries`` entries (grown by doubling: one device copy, no sync)."""
        pad = self.map_pad(name)
        old = self._maps.get((name, seq))
        if old is None or old.shape[0] < pad + entries:
            have = 0 if old is None else old.shape[0] - pad
            first = self._max_tokens // (self.layer.ratio if name == "extra" else 1)  # the initial capacity
            cap = max(entries, 2 * have, min(first, 1 << 16), ENTRIES_PER_PAGE)
            new = torch.full((pad + cap,), -1, dtype=torch.int32, device=self.device)
            if old is not None:
                new[: old.shape[0]].copy_(old)
            self._maps[(name, seq)] = old = new
        return old

    def _put(self, dst: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy host int slots [n] into the device view ``dst`` without a device sync."""
        if host_slots.numel() == 1:  # a decode step: one fill kernel, the value travels as its argument
            dst.fill_(int(host_slots[0]))
        elif host_slots.numel():
            dst.copy_(upload(host_slots, self.device))  # int64 -> int32 on the device

    def reserve(self, name: str, seq: int, n: int) -> torch.Tensor:
        """Append n entries to the sequence in pool ``name`` (growing it if needed) -> slots [n] on the
        device (int32 for "kv" / "extra": a view of the slot map; int64 for "index"). Host work O(n); no
        device sync."""
        cache = getattr(self, name)
        sid = self._ids[seq][name]
        old = cache.length(sid)
        need = math.ceil((old + n) / ENTRIES_PER_PAGE) - math.ceil(old / ENTRIES_PER_PAGE)
        if need > cache.free_pages:
            setattr(self, name, self._grow(name, cache, need - cache.free_pages))
            cache = getattr(self, name)
            sid = self._ids[seq][name]
        host = cache.append(sid, n)  # int64 CPU [n]: only the new entries' slots
        if name not in self._MAPPED:
            return upload(host, self.device)
        pad = self.map_pad(name)
        dst = self._map_for(name, seq, old + n)[pad + old: pad + old + n]
        self._put(dst, host)
        return dst

    def _grow(self, name: str, old: PagedCache, short: int) -> PagedCache:
        new = PagedCache(old.fmt, max(2 * old.num_pages, old.num_pages + short), device=self.device)
        for seq, ids in self._ids.items():
            length = old.length(ids[name])
            nid = new.add_sequence()
            new.append(nid, length)
            if length:
                # each used page's entry 0 -> its page id, in both pools (host lists: no sync)
                src = old.slots(ids[name])[::ENTRIES_PER_PAGE] // ENTRIES_PER_PAGE
                dst = new.slots(nid)[::ENTRIES_PER_PAGE] // ENTRIES_PER_PAGE
                new.pool[upload(dst, self.device)] = old.pool[upload(src, self.device)]
                if (name, seq) in self._maps:  # every slot moved: rewrite the map's valid prefix
                    pad = self.map_pad(name)
                    self._put(self._maps[(name, seq)][pad: pad + length], new.slots(nid))
            ids[name] = nid
        return new


# --------------------------------------------------------------------------------------------------
# The attention block
# --------------------------------------------------------------------------------------------------


class V4Attention(nn.Module):
    """Attention block of one DeepSeek-V4 layer (inference) on dsakit's paged caches.

    Args:
        layer_type: "csa" | "hca" | "window".
        hidden_size, q_lora_rank: model dims; num_heads (default: the preset's), head_dim 512 (448 + 64 rope).
        o_groups, o_lora_rank: grouped output projection (o_a: g groups of H * D / g -> o_lora_rank).
        index_heads: indexer heads Hi (csa); index_topk: K (default: the preset's); index_key_format: index-key
            cache format (default ``$DSAKIT_INDEX_KEY_FORMAT`` or the preset's).
        kv_format: main / compressed KV cache format ("bf16" | "fp8-rope-bf16").
        window: sliding window in raw tokens (default: the preset's 128).
        rope: RopeConfig of the attention and compressed entries (default: the preset's; V4 uses the plain
            "main" rope theta 10000 on window-only layers, the YaRN "compress" rope on csa / hca).
        eps: RMSNorm epsilon of every norm of the block.
        hca_ratio: tokens per entry of an hca block (V4: 128).
        backend: "auto" | "reference" | "triton" for the store / top-k / attention ops.
        query_chunk: queries per chunk of a prefill.
    """

    def __init__(self, layer_type: str, hidden_size: int, q_lora_rank: int, *,
                 preset: "str | DSAPreset" = "deepseek-v4-flash", num_heads: int | None = None,
                 o_groups: int = 8, o_lora_rank: int = 1024, index_heads: int | None = None,
                 index_topk: int | None = None, index_key_format: "KeyFormat | str | None" = None,
                 kv_format: "AttentionKVFormat | str" = "bf16", window: int | None = None,
                 rope: RopeConfig | None = None, eps: float = 1e-6, hca_ratio: int = 128, backend: str = "auto",
                 query_chunk: int = DEFAULT_QUERY_CHUNK):
        super().__init__()
        preset = get_preset(preset)
        if layer_type not in LAYER_TYPES:
            raise ValueError(f"layer_type must be one of {sorted(LAYER_TYPES)}, got {layer_type!r}")
        if preset.compress_ratio != 4 or preset.attention_head_dim != ATTENTION_HEAD_DIM:
            raise ValueError(f"V4Attention needs a DeepSeek-V4 preset, got {preset.name!r}")
        if preset.rope_layout != ROPE_V4:
            raise ValueError(f"V4Attention rotates interleaved trailing pairs; preset rope layout is "
                             f"{RopeLayout.parse(preset.rope_layout).name}")
        _positive_int(hidden_size, "hidden_size")
        _positive_int(q_lora_rank, "q_lora_rank")
        heads = _positive_int(preset.attention_heads if num_heads is None else num_heads, "num_heads")
        _positive_int(o_groups, "o_groups")
        _positive_int(o_lora_rank, "o_lora_rank")
        if heads * ATTENTION_HEAD_DIM % o_groups:
            raise ValueError(f"num_heads * 512 = {heads * ATTENTION_HEAD_DIM} must be divisible by o_groups {o_groups}")
        self.index_topk = _positive_int(preset.index_topk if index_topk is None else index_topk, "index_topk")
        index_heads = _positive_int(preset.index_heads if index_heads is None else index_heads, "index_heads")
        self.window = _positive_int(preset.sliding_window if window is None else window, "window")
        if rope is not None and not isinstance(rope, RopeConfig):
            raise ValueError(f"rope must be a RopeConfig or None, got {type(rope).__name__}")
        self.rope = preset.rope if rope is None else rope
        if self.rope.rope_dim != preset.attention_rope_dim:
            raise ValueError(f"rope_dim must be {preset.attention_rope_dim}, got {self.rope.rope_dim}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            raise ValueError(f"eps must be a number >= 0, got {eps!r}")
        if backend not in ("auto", "reference", "triton"):
            raise ValueError(f"backend must be 'auto', 'reference' or 'triton', got {backend!r}")
        self.query_chunk = _positive_int(query_chunk, "query_chunk")
        _positive_int(hca_ratio, "hca_ratio")
        if hca_ratio == 4:
            raise ValueError("hca_ratio 4 would be the overlapping CSA compressor; HCA blocks do not overlap")
        self.preset, self.layer_type = preset, layer_type
        self.ratio = hca_ratio if layer_type == "hca" else LAYER_TYPES[layer_type]
        self.kv_format = AttentionKVFormat.parse(kv_format)
        self.index_key_format = resolve_index_key_format(index_key_format, preset)
        self.backend = backend
        self.num_heads, self.head_dim, self.hidden_size = heads, ATTENTION_HEAD_DIM, hidden_size
        self.o_groups, self.o_lora_rank = o_groups, o_lora_rank
        self.eps = float(eps)
        d = ATTENTION_HEAD_DIM
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, heads * d, bias=False)
        self.kv_proj = nn.Linear(hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, eps)
        self.o_a_proj = nn.Linear(heads * d // o_groups, o_groups * o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(heads))
        if layer_type == "csa":
            self.compressor = _CompressorWithIndexer(hidden_size, d, q_lora_rank, index_heads, eps)
        elif layer_type == "hca":
            self.compressor = V4Compressor(hidden_size, d, hca_ratio, eps)
        else:
            self.compressor = None
        self._rope_table = _RopeTable(self.rope)
        self._hadamard: torch.Tensor | None = None

    def extra_repr(self) -> str:
        return (f"layer_type={self.layer_type}, heads={self.num_heads}, window={self.window}, "
                f"index_topk={self.index_topk}, index_key_format={self.index_key_format.name}, "
                f"kv_format={self.kv_format.name}")

    # -- helpers ------------------------------------------------------------------------------------
    def new_cache(self, max_tokens: int = 4096, max_sequences: int = 1, device=None) -> V4LayerCache:
        return V4LayerCache(self, max_tokens, max_sequences, device)

    def _hadamard_on(self, device: torch.device) -> torch.Tensor:
        if self._hadamard is None or self._hadamard.device != device:
            self._hadamard = hadamard_matrix(INDEX_HEAD_DIM).to(device)
        return self._hadamard

    def index_transform(self):
        """The preset's key transform with the indexer's own norm epsilon."""
        return dataclasses.replace(self.preset.key_transform, eps=float(self.compressor.indexer.kv_norm.variance_epsilon))

    def rope_table(self, max_position: int, device: "str | torch.device") -> torch.Tensor:
        """fp32 [>= max_position, 64] cos|sin table of the block's rope on ``device`` (cached, grown by doubling)."""
        return self._rope_table.get(max_position, device)

    def _check_hidden(self, hidden) -> None:
        if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() != 2 \
                or hidden.shape[1] != self.hidden_size:
            got = f"{hidden.dtype} {list(hidden.shape)}" if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"hidden must be a floating [S, {self.hidden_size}] tensor, got {got}")

    # -- stages (public so benchmarks can time them alone) ---------------------------------------------
    def queries(self, hidden: torch.Tensor, positions: torch.Tensor,
                table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [S, hidden] -> (q fp32 [S, H, D] normed and roped, q_res [S, q_lora] in the weights' dtype)."""
        q_res = self.q_a_norm(_linear(hidden, self.q_a_proj)).to(self.q_b_proj.weight.dtype)
        q = _linear(q_res, self.q_b_proj).float().view(hidden.shape[0], self.num_heads, self.head_dim)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + self.eps)
        return _rope_v4(q, table, positions), q_res

    def store(self, hidden: torch.Tensor, cache: V4LayerCache, seq: int, start: int, table: torch.Tensor, *,
              positions: torch.Tensor | None = None) -> None:
        """Project, compress and store the S new tokens' raw KV, compressed entries and index keys
        (``positions``: start .. start + S - 1 on the device if the caller has them)."""
        self.store_kv(hidden, cache, seq, start, table, positions=positions)
        if self.compressor is None:
            return
        comp = self.compressor
        for lo in range(0, hidden.shape[0], self.query_chunk):  # bounded working set: the rings carry state
            h = hidden[lo:lo + self.query_chunk]
            entries, first = comp.step(h, cache.state(seq, "compressor"))
            self.store_entries(entries, first, cache, seq, table)
            if self.layer_type == "csa":
                keys, first = comp.indexer.step(h, cache.state(seq, "indexer"))
                self.store_index_keys(keys, first, cache, seq, table)

    def store_kv(self, hidden: torch.Tensor, cache: V4LayerCache, seq: int, start: int, table: torch.Tensor, *,
                 positions: torch.Tensor | None = None) -> None:
        """Project the S new tokens' raw KV and store it at entries start .. start + S - 1 of the main pool."""
        s = hidden.shape[0]
        if positions is None:
            positions = torch.arange(start, start + s, device=cache.device)
        slots = cache.reserve("kv", seq, s)
        self.write_attention_kv(_linear(hidden, self.kv_proj), positions, slots, cache.kv.pool, table, self.kv_norm)

    def store_entries(self, entries: torch.Tensor, first: int, cache: V4LayerCache, seq: int,
                      table: torch.Tensor) -> None:
        """Store the compressor's pre-norm entries fp32 [n, 512] (indices first ..) in the extra pool."""
        n = entries.shape[0]
        if n:
            comp = self.compressor
            slots = cache.reserve("extra", seq, n)
            pos = torch.arange(first * comp.ratio, (first + n) * comp.ratio, comp.ratio, device=cache.device)
            self.write_attention_kv(entries, pos, slots, cache.extra.pool, table, comp.kv_norm)

    def store_index_keys(self, keys: torch.Tensor, first: int, cache: V4LayerCache, seq: int,
                         table: torch.Tensor) -> None:
        """Store the indexer's pre-norm keys fp32 [n, 128] (indices first ..) in the index pool (csa)."""
        n = keys.shape[0]
        if n:
            slots = cache.reserve("index", seq, n)
            pos = torch.arange(first * 4, (first + n) * 4, 4, device=cache.device)
            self.write_index_keys(keys, pos, slots, cache.index.pool, table)

    def write_attention_kv(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                           pool: torch.Tensor, table: torch.Tensor, norm: RMSNorm) -> None:
        """Norm, rope and store rows [N, 512] at slots [N] reserved in this layer's cache (the fused store
        kernel on CUDA; no host-side value checks: the cache made the slots)."""
        _write_attention_kv(rows, positions, slots, pool, self.kv_format, table, norm.weight, norm.variance_epsilon,
                            self.backend)

    def write_index_keys(self, keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                         pool: torch.Tensor, table: torch.Tensor) -> None:
        """Index keys [N, 128] at slots [N] reserved in this layer's cache (see :meth:`write_attention_kv`)."""
        _write_index_keys(keys, positions, slots, pool, self.index_key_format, table,
                          self.compressor.indexer.kv_norm.weight.float(), self.index_transform(), self.backend)

    def index_queries(self, hidden: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
                      table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries fp32 [S, Hi, 128] (rope, Hadamard) and weights fp32 [S, Hi] (both scales folded)."""
        ix = self.compressor.indexer
        qi = _linear(q_res, ix.q_b_proj).float().view(hidden.shape[0], ix.heads, INDEX_HEAD_DIM)
        qi = _rope_v4(qi, table, positions)
        if self.preset.key_transform.hadamard:
            qi = qi @ self._hadamard_on(qi.device)
        w = _linear(hidden, ix.scorer.weights_proj).float() * (INDEX_HEAD_DIM ** -0.5 * ix.heads ** -0.5)
        return qi, w

    def select(self, qi: torch.Tensor, w: torch.Tensor, cache: V4LayerCache, seq: int,
               positions: torch.Tensor) -> torch.Tensor:
        """Top-k compressed entries of each query -> extra-pool slots int32 [S, K] (-1 padded)."""
        entries = _topk(qi, w, cache.index, cache.id_in("index", seq), self.index_topk, positions, 4, self.backend)
        slot_map = cache.slot_map("extra", seq)
        if slot_map is None:  # no entry yet: the top-k is all padding
            return entries
        # the map's one leading -1 turns entry -1 (padding) into slot -1: one gather
        return torch.index_select(slot_map, 0, (entries + 1).reshape(-1)).view(entries.shape)

    def attend(self, q: torch.Tensor, cache: V4LayerCache, seq: int, positions: torch.Tensor,
               extra_slots: torch.Tensor | None, *, start: int | None = None) -> torch.Tensor:
        """q [S, H, D] -> attention output fp32 [S, H, D] over the window (+ the extra-pool slots given).

        ``start``: the host value of ``positions[0]`` when the positions are start .. start + S - 1 (as the
        forward's are): the window slots are then a view of the slot map, with no kernel at all for S = 1."""
        win_slots = self.window_slots(cache, seq, positions, start=start)
        qk = q.to(self.q_b_proj.weight.dtype) if q.is_cuda else q
        return sparse_attention_paged(qk, cache.kv.pool, win_slots, kv_format=self.kv_format,
                                      extra_kv_cache=None if extra_slots is None else cache.extra.pool,
                                      extra_indices=extra_slots, sink=self.sinks.float(),
                                      softmax_scale=self.head_dim ** -0.5, backend=self.backend)

    def window_slots(self, cache: V4LayerCache, seq: int, positions: torch.Tensor, *,
                     start: int | None = None) -> torch.Tensor:
        """Main-pool slots int32 [S, window] of each query's window: entries p - window + 1 .. p (-1 before 0)."""
        slot_map, w = cache.slot_map("kv", seq), self.window
        if slot_map is None:
            return torch.full((positions.shape[0], w), -1, dtype=torch.int32, device=positions.device)
        # entry e sits at map index w + e, so the window of p is map[p + 1 .. p + w]
        if start is not None:
            return slot_map.unfold(0, w, 1)[start + 1: start + 1 + positions.shape[0]].contiguous()
        return slot_map[positions.unsqueeze(1) + torch.arange(1, w + 1, device=positions.device)]

    def hca_slots(self, cache: V4LayerCache, seq: int, positions: torch.Tensor, *,
                  start: int | None = None) -> torch.Tensor:
        """Every ratio-128 entry visible to each query -> extra-pool slots int32 [S, N] (-1 where not visible).

        ``start`` as in :meth:`attend`: when every query sees every entry (a decode step), a view of the map."""
        n = cache.extra.length(cache.id_in("extra", seq))
        slot_map, s = cache.slot_map("extra", seq), positions.shape[0]
        if n == 0 or slot_map is None:
            return torch.full((s, 1), -1, dtype=torch.int32, device=positions.device)
        slots = slot_map[1:1 + n]
        if start is not None and (start + 1) // self.ratio >= n:
            return slots.view(1, n).expand(s, n).contiguous()
        visible = torch.arange(n, device=positions.device).unsqueeze(0) < (positions.unsqueeze(1) + 1) // self.ratio
        return torch.where(visible, slots.unsqueeze(0), -1)

    def output(self, out: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Attention output fp32 [S, H, D] -> rope(-pos) on the rope dims -> grouped o_a -> o_b: [S, hidden]."""
        s = out.shape[0]
        out = _rope_v4(out, table, positions, inverse=True)
        dtype = self.o_a_proj.weight.dtype
        grouped = out.to(dtype).reshape(s, self.o_groups, -1).transpose(0, 1)  # [g, S, H * D / g]
        w = self.o_a_proj.weight.view(self.o_groups, self.o_lora_rank, -1)  # [g, r, H * D / g]
        mixed = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(s, -1)  # [S, g * r]
        return _linear(mixed, self.o_b_proj)

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, cache: V4LayerCache, seq: "int | Sequence[int]") -> torch.Tensor:
        """hidden [S, hidden] of one sequence's next S tokens (or [B, S, hidden] with B sequence ids)
        -> [S, hidden] (or [B, S, hidden]) in the weights' dtype. Prefill and decode are the same call."""
        if not isinstance(cache, V4LayerCache) or cache.layer is not self:
            raise ValueError("cache must be a V4LayerCache made for this layer (layer.new_cache())")
        if isinstance(hidden, torch.Tensor) and hidden.dim() == 3:
            seqs = [seq] if isinstance(seq, int) else list(seq)
            if len(seqs) != hidden.shape[0]:
                raise ValueError(f"hidden has {hidden.shape[0]} sequences, got {len(seqs)} sequence ids")
            if len(set(seqs)) != len(seqs):
                raise ValueError(f"sequence ids of a batch must differ, got {seqs}")
            self._check_hidden(hidden[0])
            for s in seqs:  # every row is checked before the first one is stored
                self._check_seq(cache, s)
            return torch.stack([self._forward_one(h, cache, s) for h, s in zip(hidden, seqs)])
        return self._forward_one(hidden, cache, seq)

    @staticmethod
    def _check_seq(cache: V4LayerCache, seq) -> None:
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise ValueError(f"seq must be a sequence id (int) for a [S, hidden] input, got {seq!r}")
        cache._check(seq)

    def _forward_one(self, hidden: torch.Tensor, cache: V4LayerCache, seq: int) -> torch.Tensor:
        self._check_hidden(hidden)
        self._check_seq(cache, seq)
        if hidden.device != cache.device:
            raise ValueError(f"hidden is on {hidden.device}, the cache on {cache.device}")
        s = hidden.shape[0]
        if s == 0:
            return hidden.new_zeros(0, self.hidden_size, dtype=self.o_b_proj.weight.dtype)
        start = cache.length(seq)
        table = self.rope_table(start + s, hidden.device)
        all_positions = torch.arange(start, start + s, device=hidden.device)
        self.store(hidden, cache, seq, start, table, positions=all_positions)
        outs = []
        for lo in range(0, s, self.query_chunk):
            h = hidden[lo:lo + self.query_chunk]
            positions = all_positions[lo:lo + self.query_chunk]
            q, q_res = self.queries(h, positions, table)
            extra = None
            if self.layer_type == "csa":
                qi, w = self.index_queries(h, q_res, positions, table)
                extra = self.select(qi, w, cache, seq, positions)
            elif self.layer_type == "hca":
                extra = self.hca_slots(cache, seq, positions, start=start + lo)
            out = self.attend(q, cache, seq, positions, extra, start=start + lo)
            outs.append(self.output(out, positions, table))
        return torch.cat(outs) if len(outs) > 1 else outs[0]
