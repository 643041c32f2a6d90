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
          (hierarchical_topk instead when the config has a ``hierarchy``: the index pool then keeps page summaries)
    out   = sparse_attention(q, window slots ++ top-k / all visible entries, sink) * D^-0.5 softmax
    out   = rope(out, -pos) on the rope dims, then grouped output projection o_a (g groups) and o_b.

Positions are the sequence's own token count in the cache (contiguous from 0). Entry j of a ratio-r
compressor is visible to the query at position t iff j < (t + 1) // r. Everything after the boundary checks
runs on the tensors' device without reading a device value back; long prefills are processed in query chunks
so no stage allocates memory proportional to S x N.

The block's settings are one frozen :class:`~dsakit.layers.config.V4AttentionConfig`; its caches are
:class:`~dsakit.layers.kv_cache.V4LayerCache` objects (pools, slot maps, compressor rings), and a call that
fails leaves them as they were (a transaction of the cache). Submodule and parameter names mirror
transformers' ``DeepseekV4Attention`` so its state dict loads as is; :meth:`V4Attention.from_transformers`
(through :mod:`dsakit.layers.from_transformers`) builds a block on a transformers module's own parameters.
See docs/layers.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._memory import check_int, check_tensor
from ..cache import PagedCache
from ..formats import ATTENTION_HEAD_DIM, AttentionKVFormat, KeyFormat
from ..ops import attention as attention_ops
from ..ops import indexer as indexer_ops
from ..ops.indexer.config import HierarchyConfig
from ..ops._backend import resolve_backend
from ..ops.store import AttentionKVStore, IndexKeyStore, store_checked
from ..transforms import ROPE_V4
from .config import DEFAULT_QUERY_CHUNK, INDEX_KEY_FORMAT_ENV, LAYER_TYPES, V4AttentionConfig, \
    resolve_index_key_format
from .from_transformers import adopt_parameters, layer_config_from_transformers
from .indexer import V4Indexer
from .kv_cache import V4LayerCache
from .modules import RMSNorm, RopeTable, V4Compressor, linear, rope_v4

# V4LayerCache, the config names and resolve_index_key_format are re-exported: they were defined here
__all__ = ["V4Attention", "V4AttentionConfig", "V4LayerCache", "INDEX_KEY_FORMAT_ENV", "resolve_index_key_format",
           "LAYER_TYPES", "DEFAULT_QUERY_CHUNK"]


class _CompressorWithIndexer(V4Compressor):
    """The CSA layer's compressor (ratio 4, D = 512) holding the layer's lightning indexer (transformers'
    nesting: ``compressor.indexer``)."""

    def __init__(self, config: V4AttentionConfig):
        super().__init__(config.hidden_size, ATTENTION_HEAD_DIM, 4, config.eps)
        self.indexer = V4Indexer(config.hidden_size, config.q_lora_rank, config.index_heads, config.eps,
                                 preset=config.preset, rope=config.rope, index_topk=config.index_topk)


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


def _store_attention_kv(rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                        fmt: AttentionKVFormat, table: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        backend: str) -> None:
    """``dsakit.ops.store.store_attention_kv`` (rope layout V4) on its trusted path: the inputs' shapes, dtypes
    and devices are checked, their values are not (``check_values=False``).

    The layer makes ``slots`` (its own allocator: in range, distinct) and ``positions`` (< the rope table's
    rows) itself, so they are valid by construction; checking them would copy both to the host on every call
    (a device sync per store, and on a long prefill a CPU sort of every slot). The kernel drops any row whose
    slot or position is out of range, so nothing is written out of bounds either way; the reference backend
    checks the values regardless."""
    store_checked(AttentionKVStore.check(rows, positions, slots, pool, fmt, table, norm_weight, ROPE_V4, eps,
                                         backend=backend, check_values=False))


def _store_index_keys(keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, pool: torch.Tensor,
                      fmt: KeyFormat, table: torch.Tensor, norm_weight: torch.Tensor, transform,
                      backend: str, summaries=None) -> None:
    """``dsakit.ops.store.store_index_keys`` (RMSNorm, no bias) on its trusted path: see
    :func:`_store_attention_kv`. ``summaries``: the index cache's page summaries, if it keeps them."""
    store_checked(IndexKeyStore.check(keys, positions, slots, pool, fmt, table, norm_weight, None, transform,
                                      backend=backend, check_values=False, summaries=summaries))


def _topk(q: torch.Tensor, weights: torch.Tensor, cache: PagedCache, seq: int, k: int, positions: torch.Tensor,
          ratio: int, backend: str, hierarchy: HierarchyConfig | None = None) -> torch.Tensor:
    """index_topk (``hierarchy`` None) or hierarchical_topk (with that config and the cache's page summaries,
    which the batch carries) for the queries of one sequence -> int32 [T, k] entry indices (-1 padded), on q's
    device. The batch comes from the cache's host metadata (no device sync)."""
    batch = cache.batch([seq], query_lens=[q.shape[0]], query_positions=positions, ratio=ratio)
    if hierarchy is not None:
        return indexer_ops.hierarchical_topk(q, weights, batch, k, config=hierarchy, backend=backend).to(q.device)
    return indexer_ops.index_topk(q, weights, batch, k, backend=backend).to(q.device)


def _config_property(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.layer_config, name), doc=doc)


class V4Attention(nn.Module):
    """Attention block of one DeepSeek-V4 layer (inference) on dsakit's paged caches.

    ``V4Attention(config)`` with a :class:`V4AttentionConfig`, or ``V4Attention(layer_type, hidden_size,
    q_lora_rank, **settings)``, which makes one with :meth:`V4AttentionConfig.from_preset` (every setting not
    given comes from the preset: ``preset``, ``num_heads``, ``o_groups``, ``o_lora_rank``, ``index_heads``,
    ``index_topk``, ``index_key_format``, ``kv_format``, ``window``, ``rope``, ``eps``, ``hca_ratio``,
    ``backend``, ``query_chunk``, ``hierarchy``). The settings are read through ``layer.layer_config`` and, by
    name, as read-only attributes (``layer.window``, ``layer.index_topk``, ...).
    """

    layer_type = _config_property("layer_type", '"csa" | "hca" | "window"')
    hidden_size = _config_property("hidden_size", "model width")
    num_heads = _config_property("num_heads", "attention heads H")
    head_dim = _config_property("head_dim", "512 (448 no-rope + 64 rope dims)")
    window = _config_property("window", "sliding window in raw tokens")
    index_topk = _config_property("index_topk", "compressed entries per query (csa)")
    index_key_format = _config_property("index_key_format", "index-key cache format (csa)")
    kv_format = _config_property("kv_format", "main / compressed KV cache format")
    ratio = _config_property("ratio", "tokens per compressed entry (0: window)")
    backend = _config_property("backend", "backend of the ops")
    query_chunk = _config_property("query_chunk", "queries per prefill chunk")
    eps = _config_property("eps", "epsilon of the queries' unit RMSNorm")
    preset = _config_property("preset", "the model's DSAPreset")
    rope = _config_property("rope", "RopeConfig of the attention and compressed entries")
    o_groups = _config_property("o_groups", "groups of the output projection")
    o_lora_rank = _config_property("o_lora_rank", "rank of each output-projection group")
    hierarchy = _config_property("hierarchy", "HierarchyConfig of hierarchical selection (csa), None = flat top-k")

    def __init__(self, config: "V4AttentionConfig | str | None" = None, hidden_size: int | None = None,
                 q_lora_rank: int | None = None, **settings):
        super().__init__()
        if config is None and "layer_type" in settings:  # the first parameter's name before the config
            config = settings.pop("layer_type")
        if isinstance(config, V4AttentionConfig):
            if hidden_size is not None or q_lora_rank is not None or settings:
                raise ValueError("pass either a V4AttentionConfig or (layer_type, hidden_size, q_lora_rank, "
                                 "**settings), not both")
        else:
            config = V4AttentionConfig.from_preset(config, hidden_size, q_lora_rank, **settings)
        self.layer_config = config
        d, heads, hidden, eps = ATTENTION_HEAD_DIM, config.num_heads, config.hidden_size, config.eps
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(config.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * d, bias=False)
        self.kv_proj = nn.Linear(hidden, d, bias=False)
        self.kv_norm = RMSNorm(d, eps)
        self.o_a_proj = nn.Linear(heads * d // config.o_groups, config.o_groups * config.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(config.o_groups * config.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(heads))
        if config.layer_type == "csa":
            self.compressor = _CompressorWithIndexer(config)
        elif config.layer_type == "hca":
            self.compressor = V4Compressor(hidden, d, config.hca_ratio, eps)
        else:
            self.compressor = None
        self._rope_table = RopeTable(config.rope)

    @classmethod
    def from_transformers(cls, module: nn.Module, *, index_key_format: "KeyFormat | str | None" = "bf16",
                          topk: int | None = None, kv_format: "AttentionKVFormat | str" = "bf16",
                          backend: str = "auto") -> "V4Attention":
        """A block on a transformers ``DeepseekV4Attention``'s own parameters (the same ``nn.Parameter``
        objects, names and norm epsilons; the rope rebuilt from its config). ``topk`` None = the config's
        ``index_topk``; ``index_key_format`` None = ``$DSAKIT_INDEX_KEY_FORMAT`` or the preset's."""
        config = layer_config_from_transformers(module, index_key_format=index_key_format, topk=topk,
                                                kv_format=kv_format, backend=backend)
        with torch.device("meta"):  # placeholders only: every parameter is the module's
            layer = cls(config)
        adopt_parameters(layer, module)
        return layer

    def extra_repr(self) -> str:
        return (f"layer_type={self.layer_type}, heads={self.num_heads}, window={self.window}, "
                f"index_topk={self.index_topk}, index_key_format={self.index_key_format.name}, "
                f"kv_format={self.kv_format.name}" + (f", hierarchy={self.hierarchy}" if self.hierarchy else ""))

    # -- helpers ------------------------------------------------------------------------------------
    def new_cache(self, max_tokens: int = 4096, max_sequences: int = 1, device=None) -> V4LayerCache:
        return V4LayerCache(self, max_tokens, max_sequences, device)

    def index_transform(self):
        """The preset's key transform with the indexer's own norm epsilon."""
        return self.compressor.indexer.transform()

    def rope_table(self, max_position: int, device: "str | torch.device") -> torch.Tensor:
        """fp32 [>= max_position, 64] cos|sin table of the block's rope on ``device`` (cached, grown by doubling)."""
        return self._rope_table.get(max_position, device)

    def _check_hidden(self, hidden) -> None:
        check_tensor("hidden", hidden, shape=(None, self.hidden_size), floating=True,
                     message=f"hidden must be a floating [S, {self.hidden_size}] tensor")

    # -- stages (public so benchmarks can time them alone) ---------------------------------------------
    def queries(self, hidden: torch.Tensor, positions: torch.Tensor,
                table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [S, hidden] -> (q fp32 [S, H, D] normed and roped, q_res [S, q_lora] in the weights' dtype)."""
        q_res = self.q_a_norm(linear(hidden, self.q_a_proj)).to(self.q_b_proj.weight.dtype)
        q = linear(q_res, self.q_b_proj).float().view(hidden.shape[0], self.num_heads, self.head_dim)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + self.eps)
        return rope_v4(q, table, positions), q_res

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
        self.write_attention_kv(linear(hidden, self.kv_proj), positions, slots, cache.kv.pool, table, self.kv_norm)

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
            self.write_index_keys(keys, pos, slots, cache.index.pool, table, cache.index.summaries)

    def write_attention_kv(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                           pool: torch.Tensor, table: torch.Tensor, norm: RMSNorm) -> None:
        """Norm, rope and store rows [N, 512] at slots [N] reserved in this layer's cache (the fused store
        kernel on CUDA; no host-side value checks: the cache made the slots)."""
        _store_attention_kv(rows, positions, slots, pool, self.kv_format, table, norm.weight, norm.variance_epsilon,
                            self.backend)

    def write_index_keys(self, keys: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                         pool: torch.Tensor, table: torch.Tensor, summaries=None) -> None:
        """Index keys [N, 128] at slots [N] reserved in this layer's cache (see :meth:`write_attention_kv`);
        ``summaries``: the pool's page summaries when the cache keeps them."""
        _store_index_keys(keys, positions, slots, pool, self.index_key_format, table,
                          self.compressor.indexer.kv_norm.weight.float(), self.index_transform(), self.backend,
                          summaries)

    def index_queries(self, hidden: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor,
                      table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries fp32 [S, Hi, 128] (rope, Hadamard) and weights fp32 [S, Hi] (both scales folded)."""
        ix = self.compressor.indexer
        return ix.device_queries(q_res, positions, table), ix.device_weights(hidden)

    def select(self, qi: torch.Tensor, w: torch.Tensor, cache: V4LayerCache, seq: int,
               positions: torch.Tensor) -> torch.Tensor:
        """Top-k compressed entries of each query -> extra-pool slots int32 [S, K] (-1 padded)."""
        entries = _topk(qi, w, cache.index, cache.id_in("index", seq), self.index_topk, positions, 4, self.backend,
                        self.layer_config.hierarchy)
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
                                      softmax_scale=self.head_dim ** -0.5, backend=self.attention_backend())

    def attention_backend(self) -> str:
        """The sparse-attention op's backend: ``backend``, except that "auto" takes the reference where the
        Triton kernel cannot run this block's head count (it takes TRITON_HEADS; small test and toy models such
        as the shipped tiny model have 2), so a CUDA model of any size runs under the default."""
        if self.backend == "auto" and self.num_heads not in attention_ops.TRITON_HEADS:
            return "reference"
        return self.backend

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
        out = rope_v4(out, table, positions, inverse=True)
        dtype = self.o_a_proj.weight.dtype
        grouped = out.to(dtype).reshape(s, self.o_groups, -1).transpose(0, 1)  # [g, S, H * D / g]
        w = self.o_a_proj.weight.view(self.o_groups, self.o_lora_rank, -1)  # [g, r, H * D / g]
        mixed = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(s, -1)  # [S, g * r]
        return linear(mixed, self.o_b_proj)

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, cache: V4LayerCache, seq: "int | Sequence[int]") -> torch.Tensor:
        """hidden [S, hidden] of one sequence's next S tokens (or [B, S, hidden] with B sequence ids)
        -> [S, hidden] (or [B, S, hidden]) in the weights' dtype. Prefill and decode are the same call.

        Every input is checked before the first token is stored, and if anything fails later the cache's
        transaction puts every sequence of the call back as it was."""
        if not isinstance(cache, V4LayerCache) or cache.layer is not self:
            raise ValueError("cache must be a V4LayerCache made for this layer (layer.new_cache())")
        batched = isinstance(hidden, torch.Tensor) and hidden.dim() == 3
        if batched:
            seqs = [seq] if isinstance(seq, int) else list(seq)
            if len(seqs) != hidden.shape[0]:
                raise ValueError(f"hidden has {hidden.shape[0]} sequences, got {len(seqs)} sequence ids")
            if len(set(seqs)) != len(seqs):
                raise ValueError(f"sequence ids of a batch must differ, got {seqs}")
            self._check_hidden(hidden[0])
        else:
            self._check_hidden(hidden)
            seqs = [seq]
        for s in seqs:
            self._check_seq(cache, s)
        if hidden.device != cache.device:
            raise ValueError(f"hidden is on {hidden.device}, the cache on {cache.device}")
        self._check_backend(hidden, cache)
        with cache.transaction(seqs):
            if batched:
                return torch.stack([self._forward_one(h, cache, s) for h, s in zip(hidden, seqs)])
            return self._forward_one(hidden, cache, seq)

    def _check_backend(self, hidden: torch.Tensor, cache: V4LayerCache) -> None:
        """The ops' backend can run on these tensors (asked before anything is stored)."""
        if resolve_backend(self.attention_backend(), hidden, cache.kv.pool) == "triton":
            heads = attention_ops.TRITON_HEADS
            if self.num_heads not in heads:
                raise ValueError(f"backend {self.backend!r} runs the Triton attention kernel, which takes "
                                 f"{heads} heads; this block has {self.num_heads} (use backend='reference')")

    @staticmethod
    def _check_seq(cache: V4LayerCache, seq) -> None:
        check_int("seq", seq, message="seq must be a sequence id (int) for a [S, hidden] input")
        cache._check(seq)

    def _forward_one(self, hidden: torch.Tensor, cache: V4LayerCache, seq: int) -> torch.Tensor:
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
