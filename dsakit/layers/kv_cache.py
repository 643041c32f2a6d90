"""Cache bookkeeping of one V4 attention layer: :class:`V4LayerCache` (pools, slot maps, compressor rings per
sequence) and its checkpoints, so a call that fails leaves the cache as it was."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..batch import upload
from .._memory import check_positive_int
from ..cache import PagedCache
from ..formats import ENTRIES_PER_PAGE
from ..ops.compress.device import CompressorState
from .config import V4AttentionConfig
from .modules import indexed_device

__all__ = ["V4LayerCache", "CacheCheckpoint"]


@dataclass(frozen=True)
class CacheCheckpoint:
    """What :meth:`V4LayerCache.rollback` needs to undo everything done to some sequences since
    :meth:`V4LayerCache.checkpoint`: the pool objects, id and slot-map dicts (never mutated in place, so
    references suffice), each sequence's entry counts, and its compressor rings (one device copy)."""

    pools: dict
    ids: dict
    maps: dict
    lengths: dict
    rings: torch.Tensor | None
    ring_lengths: dict


class V4LayerCache:
    """Paged caches of one V4 attention layer for a set of sequences.

    * ``kv``: main KV pool, one entry per raw token (slot of token p = its entry p), AttentionKVFormat;
    * ``extra``: compressed entries of the layer's compressor (csa / hca), same format;
    * ``index``: index keys of the CSA indexer, KeyFormat, with its :class:`dsakit.pool.PageSummaries`
      (``index.summaries``) when the layer's config asks for hierarchical selection (None otherwise);
    * per sequence: the compressors' decode states (fp32 rings, :class:`CompressorState`);
    * per sequence and attention pool (``kv``, ``extra``): a *slot map* on the device, int32
      ``[pad + capacity]``: the global slot of entry e at index ``pad + e``, -1 in the ``pad`` leading
      positions (``kv``: pad = the window, so a query's window is a slice even at the start of the sequence;
      ``extra``: pad = 1, so entry index -1 maps to slot -1), and -1 past the sequence's entries. The map is
      appended to as entries are reserved (a scalar fill or one asynchronous upload of the new slots), so the
      attention's slot sets are views or one gather: no block-table arithmetic and no device sync per step.

    Pools are sized for ``max_tokens`` tokens per sequence x ``max_sequences`` and grow (doubling, a page
    copy on the device) when a sequence outgrows them.

    A call that changes sequences runs inside :meth:`transaction`: on an exception every pool, slot map and
    ring of those sequences is put back as it was (the bytes of entries reserved by the failed call are left
    in pages that are free again, and never read).
    """

    _MAPPED = ("kv", "extra")
    _POOLS = ("kv", "extra", "index")

    def __init__(self, layer, max_tokens: int = 4096, max_sequences: int = 1,
                 device: "str | torch.device | None" = None):
        config = getattr(layer, "layer_config", None)
        if not isinstance(config, V4AttentionConfig):
            raise ValueError(f"layer must be a V4Attention, got {type(layer).__name__}")
        check_positive_int("max_tokens", max_tokens)
        check_positive_int("max_sequences", max_sequences)
        self.layer = layer
        self.config = config
        self.device = indexed_device(device) if device is not None else layer.q_a_proj.weight.device
        pages = lambda tokens: max(1, math.ceil(tokens / ENTRIES_PER_PAGE)) * max_sequences  # noqa: E731
        self.kv = PagedCache(config.kv_format, pages(max_tokens), device=self.device)
        self.extra = PagedCache(config.kv_format, pages(max_tokens // config.ratio), device=self.device) \
            if config.ratio else None
        # hierarchical selection reads the index pool's page summaries: the cache keeps them (768 B per page)
        self.index = PagedCache(config.index_key_format, pages(max_tokens // 4), device=self.device,
                                summaries=config.hierarchy is not None) if config.layer_type == "csa" else None
        self._max_tokens = max_tokens
        # copy-on-write: the dicts below are replaced, never changed in place, once a sequence exists in them,
        # so a checkpoint holds them by reference
        self._ids: dict[int, dict[str, int]] = {}
        self._maps: dict[tuple[str, int], torch.Tensor] = {}
        self._states: dict[int, dict[str, CompressorState]] = {}
        self._next = 0
        self._open = 0  # transactions open (only the outermost one checkpoints)

    def caches(self) -> dict[str, PagedCache]:
        return {name: getattr(self, name) for name in self._POOLS if getattr(self, name) is not None}

    def add_sequence(self) -> int:
        seq = self._next
        self._next += 1
        self._ids = {**self._ids, seq: {name: c.add_sequence() for name, c in self.caches().items()}}
        states = {}
        compressor = self.layer.compressor
        if compressor is not None:
            states["compressor"] = compressor.new_state(self.device)
            if self.config.layer_type == "csa":
                states["indexer"] = compressor.indexer.new_state(self.device)
        self._states[seq] = states
        return seq

    def free_sequence(self, seq: int) -> None:
        self._check(seq)
        for name, c in self.caches().items():
            c.free_sequence(self._ids[seq][name])
        self._ids = {s: ids for s, ids in self._ids.items() if s != seq}
        del self._states[seq]
        self._maps = {k: v for k, v in self._maps.items() if k[1] != seq}

    @property
    def sequences(self) -> list[int]:
        return sorted(self._ids)

    def _check(self, seq) -> None:
        if isinstance(seq, bool) or seq not in self._ids:
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
        return self.config.window if name == "kv" else 1

    def slot_map(self, name: str, seq: int) -> torch.Tensor | None:
        """int32 [pad + capacity] slot map of the sequence in pool ``name`` ("kv" | "extra"), on the device:
        entry e at ``pad + e`` (valid for e < the sequence's entries), -1 before; None before its first reserve."""
        return self._maps.get((name, seq))

    # -- checkpoints ----------------------------------------------------------------------------------
    def checkpoint(self, seqs) -> CacheCheckpoint:
        """Everything :meth:`rollback` needs to put ``seqs`` back as they are now (host ints and references,
        plus one device copy of the sequences' compressor rings)."""
        rings = [t for seq in seqs for state in self._states[seq].values() for t in (state.kv, state.gate)]
        return CacheCheckpoint(
            pools=self.caches(), ids=self._ids, maps=self._maps,
            lengths={(name, seq): c.length(self._ids[seq][name]) for seq in seqs for name, c in self.caches().items()},
            rings=torch.cat([t.reshape(-1) for t in rings]) if rings else None,
            ring_lengths={(seq, name): state.length for seq in seqs for name, state in self._states[seq].items()})

    def rollback(self, cp: CacheCheckpoint) -> None:
        """Put the checkpointed sequences back as they were at ``cp`` (pools that grew since are replaced by
        the pools of then, which the growth only read)."""
        for name, pool in cp.pools.items():
            setattr(self, name, pool)
        self._ids, self._maps = cp.ids, cp.maps
        for (name, seq), length in cp.lengths.items():
            pool = cp.pools[name]
            pool.truncate(self._ids[seq][name], length)
            slot_map = self._maps.get((name, seq))
            if slot_map is not None:  # entries reserved since are past `length`: -1 again
                slot_map[self.map_pad(name) + length:].fill_(-1)
        offset = 0
        for (seq, name), length in cp.ring_lengths.items():
            state = self._states[seq][name]
            for t in (state.kv, state.gate):
                t.copy_(cp.rings[offset: offset + t.numel()].view_as(t))
                offset += t.numel()
            state.length = length

    @contextlib.contextmanager
    def transaction(self, seqs):
        """Run a block that changes ``seqs``; if it raises, :meth:`rollback` to the state before it. Nested
        transactions are covered by the outermost one."""
        if self._open:
            yield
            return
        cp = self.checkpoint(seqs)
        self._open += 1
        try:
            yield
        except BaseException:
            self.rollback(cp)
            raise
        finally:
            self._open -= 1

    # -- reserving entries ----------------------------------------------------------------------------
    def _map_for(self, name: str, seq: int, entries: int) -> torch.Tensor:
        """The slot map with room for ``entries`` entries (grown by doubling: one device copy, no sync)."""
        pad = self.map_pad(name)
        old = self._maps.get((name, seq))
        if old is None or old.shape[0] < pad + entries:
            have = 0 if old is None else old.shape[0] - pad
            first = self._max_tokens // (self.config.ratio if name == "extra" else 1)  # the initial capacity
            cap = max(entries, 2 * have, min(first, 1 << 16), ENTRIES_PER_PAGE)
            new = torch.full((pad + cap,), -1, dtype=torch.int32, device=self.device)
            if old is not None:
                new[: old.shape[0]].copy_(old)
            self._maps = {**self._maps, (name, seq): new}
            old = new
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
            self._grow(name, cache, need - cache.free_pages)
            cache = getattr(self, name)
            sid = self._ids[seq][name]
        host = cache.append(sid, n)  # int64 CPU [n]: only the new entries' slots
        if name not in self._MAPPED:
            return upload(host, self.device)
        pad = self.map_pad(name)
        dst = self._map_for(name, seq, old + n)[pad + old: pad + old + n]
        self._put(dst, host)
        return dst

    def _grow(self, name: str, old: PagedCache, short: int) -> None:
        """Replace pool ``name`` by one with at least ``short`` more free pages: every sequence's pages copied
        on the device, its slot map rewritten in a new tensor (the old pool and maps are only read, so a
        checkpoint taken before still holds them as they were). Page summaries, if the pool keeps them, move
        with their pages (a row is a pure function of its page's bytes, so the copy is the row a store would
        compute)."""
        new = PagedCache(old.fmt, max(2 * old.num_pages, old.num_pages + short), device=self.device,
                         summaries=old.summaries is not None)
        ids, maps = {}, dict(self._maps)
        for seq, seq_ids in self._ids.items():
            length = old.length(seq_ids[name])
            nid = new.add_sequence()
            new.append(nid, length)
            if length:
                # each used page's entry 0 -> its page id, in both pools (host lists: no sync)
                src = old.slots(seq_ids[name])[::ENTRIES_PER_PAGE] // ENTRIES_PER_PAGE
                dst = new.slots(nid)[::ENTRIES_PER_PAGE] // ENTRIES_PER_PAGE
                src, dst = upload(src, self.device), upload(dst, self.device)
                new.pool[dst] = old.pool[src]
                if old.summaries is not None:
                    for field in ("centre", "lower", "upper"):
                        getattr(new.summaries, field)[dst] = getattr(old.summaries, field)[src]
                if (name, seq) in maps:  # every slot moved: rewrite the map's valid prefix
                    pad = self.map_pad(name)
                    maps[(name, seq)] = fresh = maps[(name, seq)].clone()
                    self._put(fresh[pad: pad + length], new.slots(nid))
            ids[seq] = {**seq_ids, name: nid}
        self._ids, self._maps = ids, maps
        setattr(self, name, new)
