"""The lightning indexer of a DeepSeek-V4 CSA layer, one module for both uses (docs/spec.md §2.1 and §3).

:class:`V4Indexer` holds the indexer's weights under transformers' names (``q_b_proj``, ``scorer.weights_proj``
and its own compressor: ``kv_proj``, ``gate_proj``, ``position_bias``, ``kv_norm``). It serves

* the attention block (:class:`dsakit.layers.V4Attention`), on the device: :meth:`V4Indexer.step` feeds the
  compressor's decode state, :meth:`V4Indexer.device_queries` / :meth:`V4Indexer.device_weights` make a
  chunk's queries and head weights;
* the reference pipeline (pure PyTorch, fp32), used by the conformance tests, the recall lab and demos:
  :meth:`queries`, :meth:`weights`, :meth:`keys`, :meth:`scores`, :meth:`store_keys`, :meth:`topk`.

:class:`DSAIndexer` is the same module built from weight tensors (fp32 copies, no gradients), with
:meth:`DSAIndexer.random` and :meth:`DSAIndexer.from_transformers`.

Shapes use the letters of docs/spec.md §1: S context tokens, T query tokens, H index heads, D = 128 index head dim,
N = S // ratio compressed entries, K top-k. Pipeline::

    q[t]    = rope_V4(reshape(q_latent[t] @ wq_b.T, [H, D]), position[t]) @ H128 / sqrt(128)   [T, H, D]
    w[t]    = (hidden[t] @ weights_proj.T) * D^-0.5 * H^-0.5                                     [T, H]
    c       = compress(hidden, wkv, wgate, ape, ratio)          (pre-norm entries)              [N, D]
    k[j]    = hadamard(rope_V4(RMSNorm(c[j]) * norm_weight, position 4j))   -> quantized to a   [N, D]
              PagedCache of the chosen key format by dsakit.ops.store.store_index_keys
    top-k   = dsakit.ops.indexer.index_topk(q, w, cache.batch(...), k), entry j visible to t iff j < (pos_t + 1) // 4

(wq_b = q_b_proj.weight, weights_proj = scorer.weights_proj.weight, wkv / wgate = kv_proj / gate_proj.weight,
ape = position_bias, norm_weight = kv_norm.weight: the names of the formulas are properties of the module.)
Hadamard is applied to both q and k (``hadamard=False`` turns it off on both sides; exact scores do not
change because H is orthogonal, quantized scores do). Queries stay fp32 unless ``query_format`` asks for
a simulated quantization (DeepSeek's reference simulates fp4 on q as well). See docs/conventions.md for
every convention difference between transformers, DeepSeek's reference and dsakit.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from .._memory import INDEX_DTYPES, check_float, check_instance, check_int, check_positive_int, check_tensor
from ..cache import PagedCache
from ..formats import INDEX_HEAD_DIM, KeyFormat
from ..ops.compress import compress
from ..ops.indexer import index_scores_dense
from ..ops.store import prepare_index_keys, store_index_keys
from ..ops.indexer import index_topk
from ..presets import DSAPreset, get_preset
from ..transforms import RopeConfig, apply_rope, hadamard_matrix, hadamard_transform
from .from_transformers import indexer_arguments_from_transformers, rope_from_transformers
from .modules import V4Compressor, linear, rope_v4

__all__ = ["V4Indexer", "DSAIndexer", "rope_from_transformers"]


def _as_matrix(value: Any, shape: tuple[int, ...], what: str) -> torch.Tensor:
    check_tensor(what, value)
    check_tensor(what, value, shape=shape, floating=True, message=f"{what} must have shape {list(shape)}")
    return value.detach().float()


def _check_rows(x: Any, width: int, what: str) -> None:
    check_tensor(what, x, shape=(None, width), message=f"{what} must be a [rows, {width}] tensor")
    check_tensor(what, x, floating=True)


def _check_positions(positions: Any, t: int) -> torch.Tensor:
    check_tensor("positions", positions, shape=(t,), dtypes=INDEX_DTYPES,
                 message=f"positions must be an int32/int64 [T] = [{t}] tensor")
    pos = positions.detach().cpu().long()
    if t and int(pos.min()) < 0:
        raise ValueError(f"positions must be >= 0, got {int(pos.min())}")
    return pos


def _v4_indexer_preset(preset: "str | DSAPreset") -> DSAPreset:
    """The preset, if it is one of a V4 CSA indexer (ratio 4 with overlap, 128-dim index heads)."""
    preset = get_preset(preset)
    if preset.compress_ratio != 4 or not preset.compress_overlap or preset.index_head_dim != INDEX_HEAD_DIM:
        raise ValueError(f"the V4 CSA indexer has ratio 4 with overlap and {INDEX_HEAD_DIM}-dim heads; preset "
                         f"{preset.name!r} has ratio {preset.compress_ratio}, dim {preset.index_head_dim}")
    return preset


class _Scorer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class V4Indexer(V4Compressor):
    """Lightning indexer of one CSA layer: its compressor at D = 128 (ratio 4, overlapping), q_b_proj
    [H * D, q_lora_rank] (head-major rows) and scorer.weights_proj [H, hidden].

    Args: hidden, q_lora_rank, heads (H); eps: the keys' RMSNorm epsilon (``kv_norm.variance_epsilon``, which
    transformers' modules carry and :mod:`dsakit.layers.from_transformers` copies); preset: a V4 preset
    (its key transform); rope: override of the preset's RopeConfig; index_topk: override of the preset's K.
    """

    def __init__(self, hidden: int, q_lora_rank: int, heads: int, eps: float = 1e-6, *,
                 preset: "str | DSAPreset" = "deepseek-v4-flash", rope: RopeConfig | None = None,
                 index_topk: int | None = None):
        preset = _v4_indexer_preset(preset)
        if index_topk is not None:
            check_positive_int("index_topk", index_topk)
        eps = check_float("norm_eps", eps, minimum=0)
        rope = preset.rope if rope is None else check_instance("rope", rope, RopeConfig)
        if rope.rope_dim != preset.key_transform.rope_dim:
            raise ValueError(f"rope_dim {rope.rope_dim} differs from the key transform's "
                             f"{preset.key_transform.rope_dim}")
        super().__init__(hidden, INDEX_HEAD_DIM, preset.compress_ratio, eps)
        self.heads, self.head_dim, self.hidden_size, self.q_lora_rank = heads, INDEX_HEAD_DIM, hidden, q_lora_rank
        self.q_b_proj = nn.Linear(q_lora_rank, heads * INDEX_HEAD_DIM, bias=False)
        self.scorer = _Scorer(hidden, heads)
        self.preset = dataclasses.replace(preset, rope=rope, index_heads=heads,
                                          index_topk=preset.index_topk if index_topk is None else index_topk)
        self._hadamard: torch.Tensor | None = None

    # -- configuration ----------------------------------------------------------------------------------
    @property
    def rope(self) -> RopeConfig:
        return self.preset.rope

    @property
    def index_topk(self) -> int:
        return self.preset.index_topk

    # the weights under the names of the formulas (and of the DSAIndexer constructor)
    wq_b = property(lambda self: self.q_b_proj.weight)
    weights_proj = property(lambda self: self.scorer.weights_proj.weight)
    wkv = property(lambda self: self.kv_proj.weight)
    wgate = property(lambda self: self.gate_proj.weight)
    ape = property(lambda self: self.position_bias)
    norm_weight = property(lambda self: self.kv_norm.weight)

    def transform(self, hadamard: bool | None = None):
        """The key transform (RMSNorm with this module's epsilon, V4 rope, Hadamard), with Hadamard optionally
        overridden."""
        changes = {"eps": float(self.kv_norm.variance_epsilon)}
        if hadamard is not None:
            changes["hadamard"] = bool(hadamard)
        return dataclasses.replace(self.preset.key_transform, **changes)

    def key_positions(self, num_entries: int) -> torch.Tensor:
        """int64 [N]: rope position of each compressed entry = its first token, j * ratio."""
        return torch.arange(num_entries, dtype=torch.long) * self.ratio

    # -- on the device (the attention block's stages) --------------------------------------------------
    def device_queries(self, q_res: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """q_res [S, q_lora] -> queries fp32 [S, H, 128] (rope at positions from ``table``, Hadamard) on q_res's
        device."""
        qi = linear(q_res, self.q_b_proj).float().view(q_res.shape[0], self.heads, INDEX_HEAD_DIM)
        qi = rope_v4(qi, table, positions)
        if self.preset.key_transform.hadamard:
            if self._hadamard is None or self._hadamard.device != qi.device:
                self._hadamard = hadamard_matrix(INDEX_HEAD_DIM).to(qi.device)
            qi = qi @ self._hadamard
        return qi

    def device_weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> head weights fp32 [S, H] with both scales (D^-0.5, H^-0.5) folded in."""
        return linear(hidden, self.scorer.weights_proj).float() * (INDEX_HEAD_DIM ** -0.5 * self.heads ** -0.5)

    # -- the reference pipeline (fp32; queries and weights on the CPU) ------------------------------------------------------------------------------
    @torch.no_grad()
    def queries(self, q_latent: torch.Tensor, positions: torch.Tensor, *, hadamard: bool | None = None,
                query_format: "KeyFormat | str | None" = None) -> torch.Tensor:
        """q_latent [T, q_lora_rank], positions int [T] -> fp32 [T, H, D].

        q = q_latent @ wq_b.T, reshaped head-major; rope on the trailing 64 dims (interleaved pairs) at each
        token's position; Hadamard over D (unless disabled); then, if ``query_format`` is given, quantized
        and dequantized per (token, head) row with that key format (fp4 simulation of DeepSeek's reference).
        """
        _check_rows(q_latent, self.q_lora_rank, "q_latent")
        t = q_latent.shape[0]
        pos = _check_positions(positions, t)
        q = (q_latent.detach().float().to(self.wq_b.device) @ self.wq_b.T).reshape(t, self.heads, self.head_dim)
        cos, sin = self.rope.cos_sin(pos)
        q = apply_rope(q.cpu(), cos, sin, self.preset.key_transform.rope_layout, self.rope.rope_dim)
        if self.transform(hadamard).hadamard:
            q = hadamard_transform(q)
        if query_format is not None:
            fmt = KeyFormat.parse(query_format)
            rows = q.reshape(t * self.heads, self.head_dim)
            q = fmt.dequantize(*fmt.quantize(rows)).reshape(t, self.heads, self.head_dim)
        return q

    @torch.no_grad()
    def weights(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> fp32 [T, H] = weights_proj(hidden) * D^-0.5 * H^-0.5 (both factors folded in)."""
        _check_rows(hidden, self.hidden_size, "hidden")
        w = hidden.detach().float().to(self.weights_proj.device) @ self.weights_proj.T
        return (w * (self.head_dim ** -0.5 * self.heads ** -0.5)).cpu()

    # -- keys ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def compressed_keys(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] -> pre-norm compressed entries fp32 [S // 4, D] (incomplete tail block dropped)."""
        _check_rows(hidden, self.hidden_size, "hidden")
        # computed where the weights live, like queries() / weights(): a CPU-held indexer given CUDA hidden
        # states (DSAIndexer.topk on a GPU cache) must not hand the device path CPU weights
        return compress(hidden.to(self.wkv.device), self.wkv, self.wgate, self.ape, self.ratio)

    @torch.no_grad()
    def keys(self, hidden: torch.Tensor, *, hadamard: bool | None = None) -> torch.Tensor:
        """hidden [S, hidden] -> fp32 [N, D] index keys after RMSNorm, rope at 4j and Hadamard; not quantized."""
        entries = self.compressed_keys(hidden)
        n = entries.shape[0]
        table = self.rope.cos_sin_table(max(1, (n - 1) * self.ratio + 1))
        return prepare_index_keys(entries, self.key_positions(n), table, self.norm_weight.cpu(), None,
                                  self.transform(hadamard))

    @torch.no_grad()
    def scores(self, hidden: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor | None = None, *,
               hadamard: bool | None = None) -> torch.Tensor:
        """Prefill scores without quantization: hidden [S, hidden], q_latent [S, q_lora_rank] (every token is
        a query), positions int [S] (default 0..S-1) -> fp32 [S, N], -inf where j >= (pos + 1) // 4."""
        _check_rows(hidden, self.hidden_size, "hidden")
        _check_rows(q_latent, self.q_lora_rank, "q_latent")
        self._query_hidden(hidden, q_latent.shape[0])
        positions = torch.arange(q_latent.shape[0]) if positions is None else positions
        q = self.queries(q_latent, positions, hadamard=hadamard)
        w = self.weights(hidden)
        keys = self.keys(hidden, hadamard=hadamard)
        return index_scores_dense(q, w, keys, positions.cpu(), self.ratio)

    def _query_hidden(self, hidden: torch.Tensor, t: int) -> torch.Tensor:
        if hidden.shape[0] != t:
            raise ValueError(f"hidden has {hidden.shape[0]} rows but there are {t} queries: this helper handles a "
                             f"prefill where every token is a query (use queries() / weights() otherwise)")
        return hidden

    @torch.no_grad()
    def store_keys(self, hidden: torch.Tensor, cache: PagedCache, seq_id: int, *,
                   backend: str = "auto") -> torch.Tensor:
        """Compress hidden [S, hidden] (the sequence from token 0) and store the entries the cache does not
        hold yet (entries cache.length(seq_id) .. S // 4 - 1); returns their slots int64 [new]."""
        if not isinstance(cache, PagedCache) or not isinstance(cache.fmt, KeyFormat):
            raise ValueError(f"cache must be a PagedCache of index keys, got {cache!r}")
        entries = self.compressed_keys(hidden)
        have = cache.length(seq_id)
        if have > entries.shape[0]:
            raise ValueError(f"sequence {seq_id} already holds {have} entries, hidden yields only {entries.shape[0]}")
        new = entries[have:]
        positions = self.key_positions(entries.shape[0])[have:]
        slots = cache.append(seq_id, new.shape[0])
        if new.shape[0]:
            table = self.rope.cos_sin_table(int(positions[-1]) + 1).to(cache.pool.device)
            try:
                store_index_keys(new.to(cache.pool.device), positions.to(cache.pool.device),
                                 slots.to(cache.pool.device), cache.pool, cache.fmt, table,
                                 self.norm_weight.to(cache.pool.device), None, self.transform(), backend=backend,
                                 summaries=cache.summaries)
            except Exception:
                # a failed store (bad backend, kernel error) must not leave reserved but unwritten entries
                cache.truncate(seq_id, have)
                raise
        return slots

    @torch.no_grad()
    def topk(self, hidden: torch.Tensor, q_latent: torch.Tensor, positions: torch.Tensor | None = None, *,
             key_format: "KeyFormat | str" = "bf16", k: int | None = None, backend: str = "auto",
             device: "str | torch.device | None" = None) -> torch.Tensor:
        """Prefill top-k of one sequence: hidden [S, hidden], q_latent [S, q_lora_rank] -> int32 [S, K] entry indices.

        Keys are stored with ``store_index_keys`` into a fresh PagedCache of ``key_format`` and selected with
        ``index_topk`` (rules of dsakit.ops.indexer: descending score, ties to the lower index, -1 padding once
        the visible entries are used up). ``positions`` defaults to 0..S-1; ``k`` to the preset's index_topk.
        ``device`` (default: hidden's) holds the cache; on CUDA ``backend="auto"`` runs the Triton kernels,
        whose scores kernel rounds the fp32 queries to bf16 for its tensor-core dot (see dsakit.ops.indexer).
        """
        _check_rows(hidden, self.hidden_size, "hidden")
        _check_rows(q_latent, self.q_lora_rank, "q_latent")
        t = q_latent.shape[0]
        self._query_hidden(hidden, t)
        positions = torch.arange(t) if positions is None else positions
        k = self.index_topk if k is None else k
        check_int("k", k, 1, message="k must be a positive int")
        fmt = KeyFormat.parse(key_format)
        q = self.queries(q_latent, positions)
        w = self.weights(hidden)
        num_entries = hidden.shape[0] // self.ratio
        device = torch.device(device) if device is not None else hidden.device
        cache = PagedCache(fmt, num_pages=max(1, math.ceil(num_entries / fmt.entries_per_page)), device=device)
        seq = cache.add_sequence()
        self.store_keys(hidden, cache, seq, backend=backend)
        batch = cache.batch([seq], query_lens=[t], query_positions=positions.to(device), ratio=self.ratio)
        return index_topk(q.to(device), w.to(device), batch, k, backend=backend)


class DSAIndexer(V4Indexer):
    """A :class:`V4Indexer` made from weight tensors (fp32 copies, no gradients; inference only).

    Args (nn.Linear weight layout, [out, in]):
        wq_b: [H * D, q_lora_rank], head-major rows (row h * D + d).
        weights_proj: [H, hidden].
        wkv, wgate: [2 * D, hidden] compressor projections (first D features: the entry's contribution to
            the next overlapping window, last D: to its own window; docs/spec.md §3).
        ape: [ratio, 2 * D] learned position bias of the gate.
        norm_weight: [D] RMSNorm weight of the compressed keys.
        preset: a V4 preset (ratio 4 with overlap); its rope, key transform and index_topk are used.
        rope: override of the preset's RopeConfig (``from_transformers`` reads it off the module).
        index_topk: override of the preset's K.
        norm_eps: epsilon of the keys' RMSNorm (default: the preset's key transform, 1e-6 for V4);
            ``from_transformers`` passes the module's ``kv_norm.variance_epsilon`` (its config's rms_norm_eps).
    """

    def __init__(self, wq_b: torch.Tensor, weights_proj: torch.Tensor, wkv: torch.Tensor, wgate: torch.Tensor,
                 ape: torch.Tensor, norm_weight: torch.Tensor, preset: "str | DSAPreset" = "deepseek-v4-flash",
                 rope: RopeConfig | None = None, index_topk: int | None = None, norm_eps: float | None = None):
        preset = _v4_indexer_preset(preset)  # before the weights: their shapes follow from it
        check_tensor("weights_proj", weights_proj, dims=2, message="weights_proj must be a [H, hidden] tensor")
        heads, hidden = weights_proj.shape
        check_tensor("wq_b", wq_b, dims=2, message="wq_b must be a [H * D, q_lora_rank] tensor")
        d, ratio = INDEX_HEAD_DIM, preset.compress_ratio
        weights = {"q_b_proj.weight": _as_matrix(wq_b, (heads * d, wq_b.shape[1]), "wq_b"),
                   "scorer.weights_proj.weight": _as_matrix(weights_proj, (heads, hidden), "weights_proj"),
                   "kv_proj.weight": _as_matrix(wkv, (2 * d, hidden), "wkv"),
                   "gate_proj.weight": _as_matrix(wgate, (2 * d, hidden), "wgate"),
                   "position_bias": _as_matrix(ape, (ratio, 2 * d), "ape"),
                   "kv_norm.weight": _as_matrix(norm_weight, (d,), "norm_weight")}
        eps = check_float("norm_eps", preset.key_transform.eps if norm_eps is None else norm_eps, minimum=0)
        device = weights["q_b_proj.weight"].device
        with torch.device("meta"):  # placeholders: every weight is set below
            super().__init__(hidden, wq_b.shape[1], heads, eps, preset=preset, rope=rope,
                             index_topk=index_topk)
        for name, value in weights.items():
            module, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(module), leaf, nn.Parameter(value.to(device, copy=True), requires_grad=False))

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def random(cls, hidden_size: int, q_lora_rank: int, heads: int = 4, preset: "str | DSAPreset" = "deepseek-v4-flash",
               generator: torch.Generator | None = None, **kwargs: Any) -> "DSAIndexer":
        """An indexer with Gaussian weights scaled like a trained layer (for tests, the recall lab, demos)."""
        d = INDEX_HEAD_DIM
        g = generator

        def randn(*shape: int, scale: float) -> torch.Tensor:
            return torch.randn(*shape, generator=g) * scale

        return cls(wq_b=randn(heads * d, q_lora_rank, scale=q_lora_rank ** -0.5),
                   weights_proj=randn(heads, hidden_size, scale=hidden_size ** -0.5),
                   wkv=randn(2 * d, hidden_size, scale=hidden_size ** -0.5),
                   wgate=randn(2 * d, hidden_size, scale=hidden_size ** -0.5),
                   ape=randn(4, 2 * d, scale=0.1), norm_weight=1.0 + randn(d, scale=0.1), preset=preset, **kwargs)

    @classmethod
    def from_transformers(cls, indexer_module: torch.nn.Module, compressor_module: torch.nn.Module | None = None,
                          preset: "str | DSAPreset" = "deepseek-v4-flash") -> "DSAIndexer":
        """Copy the weights of transformers' ``DeepseekV4Indexer`` (or a ``DeepseekV4CSACompressor``, whose
        ``.indexer`` is used).

        In transformers 5.x the indexer owns its compressor (``kv_proj``, ``gate_proj``, ``position_bias``,
        ``kv_norm`` at ``index_head_dim``); ``compressor_module`` may name another module holding those four
        at the same dim (e.g. a checkpoint that splits them out). The keys' RMSNorm epsilon is the module's
        ``kv_norm.variance_epsilon`` (the config's ``rms_norm_eps``). The rope is rebuilt from the module's
        config (``rope_parameters["compress"]``) and checked against the module's own ``inv_freq`` buffer at
        that buffer's precision (a model cast with ``.to(torch.bfloat16)`` holds bf16-rounded frequencies).
        Raises ValueError if the module scales cos/sin (YaRN ``attention_factor`` != 1), which V4 does not.
        """
        return cls(**indexer_arguments_from_transformers(indexer_module, compressor_module), preset=preset)
