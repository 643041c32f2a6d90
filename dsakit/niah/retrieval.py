"""The reference server's "model": a transparent retrieval procedure built on dsakit's own indexer.

It is NOT a language model. It exists so that needle-in-a-haystack harnesses can be tested end to end
against a real HTTP server whose answers depend on the index-key format and top-k exactly the way a DSA
model's do. The procedure, for one prompt of S tokens:

1. Tokenize with :class:`SimpleTokenizer` (words, single digits, single punctuation marks; deterministic).
2. Embed token t as  e(t) = mu + g(t) + rho  in 128 dims (V4 layout: content in the 64 no-rope dims
   0..63, rope dims 64..127 trailing):
     mu   fixed shared direction of norm ``common_scale * E|g|`` in dims 0..63: every token carries it, like
          the large common component of real pooled keys (docs/spec.md §6);
     g(t) the token's own Gaussian vector in dims 0..63, seeded by a hash of the lower-cased token;
     rho  small constant in the rope dims (norm ``rope_scale * E|g|``) so stored keys go through the real
          rope; the query leaves the rope dims empty, so scores do not depend on distance.
3. Entries: mean pooling of blocks of ``compress_ratio`` tokens (entry j = tokens r*j .. r*j+r-1), giving
   keys [N, 128] with N = S // r. Pooling averages the individual parts g and keeps mu.
4. Store the keys with :func:`dsakit.ops.store.store_index_keys` into a :class:`dsakit.cache.PagedCache` of
   the chosen :class:`~dsakit.formats.KeyFormat` (RMSNorm with unit weight, V4 rope at position r*j with
   the V4 YaRN table, Hadamard, quantization in the format's byte layout).
5. Query: the question is the last paragraph of the prompt. c = mean of g(t) over its non-stopword tokens,
   with its component along mu removed (the question asks for content, not for "any text"); then
   q = c + ``query_common_share`` * |c| * mu/|mu|, a positive share of mu so that relu(q . k) passes every
   entry; rope at the last prompt position, Hadamard; one head, weight 1. Selection with
   :func:`dsakit.ops.indexer.index_topk` (k = ``topk``, ratio r, causal, reference backend).
6. Reading: each selected entry is read together with the ``read_ahead_tokens`` tokens that follow it (a
   fact's value follows its key in text, and a sliding window would see it). The answer is every distinct
   code (``WORD-1234-WORD``) found in the read text, in rank order of the entries, joined by ", ";
   "I don't know" when no selected entry holds a code.

Why the format matters: after RMSNorm every key is dominated by mu, so the per-entry quantization scale is
set by mu, and the quantization error of each score is proportional to |mu| while the needle's margin over
the filler is only the individual part. fp8/fp4 storage adds noise comparable to that margin to every
distractor: the needle's rank grows with the number of entries and it drops out of the top-k at long
context, while bf16 (error ~0.2%) keeps it. ``common_scale`` is the knob (docs/spec.md §6).
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from .._memory import check_float, check_int
from ..cache import PagedCache
from ..formats import ENTRIES_PER_PAGE, KeyFormat
from ..presets import get_preset
from ..transforms import apply_rope, hadamard_transform
from .text import CODE_PATTERN

CONTENT_DIM = 64  # no-rope dims 0..63 of the V4 layout
HEAD_DIM = 128
_TOKEN_RE = re.compile(r"[A-Za-z]+|\d|[^\sA-Za-z\d]")
STOPWORDS = frozenset(
    "a an and are as at be by do does each every for from has have in is it its of on or that the this to "
    "was what which who with you your text above only reply answer question mentioned follows below".split())


class SimpleTokenizer:
    """Deterministic tokenizer: runs of letters, single digits, single punctuation marks; spaces dropped.

    ``tokenize(text)`` -> (tokens, char spans [(start, end)]). About 5.3 characters per token on the sweep's
    filler (real subword tokenizers: about 4-5), so calibration code sees realistic ratios.
    """

    def tokenize(self, text: str) -> tuple[list[str], list[tuple[int, int]]]:
        tokens, spans = [], []
        for match in _TOKEN_RE.finditer(text):
            tokens.append(match.group(0))
            spans.append(match.span())
        return tokens, spans

    def count(self, text: str) -> int:
        return sum(1 for _ in _TOKEN_RE.finditer(text))


@dataclass(frozen=True)
class RetrievalConfig:
    """Knobs of the procedure (see the module docstring)."""

    key_format: str = "bf16"
    topk: int = 128
    compress_ratio: int = 4
    common_scale: float = 120.0
    rope_scale: float = 0.1
    query_common_share: float = 1.0
    read_ahead_tokens: int = 16
    embed_seed: int = 0
    max_context: int = 131072

    def __post_init__(self):
        KeyFormat.parse(self.key_format)
        for name, low in (("topk", 1), ("compress_ratio", 1), ("read_ahead_tokens", 0), ("max_context", 1),
                          ("embed_seed", 0)):
            check_int(name, getattr(self, name), low)
        from ..ops.indexer.config import MAX_K

        if self.topk > MAX_K:
            raise ValueError(f"topk must be <= {MAX_K} (what the top-k ops select at most), got {self.topk}")
        for name in ("common_scale", "rope_scale", "query_common_share"):
            check_float(name, getattr(self, name), 0)


@dataclass
class Retrieval:
    """Outcome of one prompt: the answer and everything needed to explain it."""

    answer: str
    prompt_tokens: int
    entries: int
    selected: list[int]  # entry indices, best first
    query_terms: list[str]
    codes_by_entry: list[tuple[int, str]] = field(default_factory=list)

    def trace(self, limit: int = 8) -> str:
        """Human-readable account of the procedure (served as reasoning content)."""
        shown = ", ".join(str(j) for j in self.selected[:limit])
        more = "" if len(self.selected) <= limit else f" ... ({len(self.selected)} in all)"
        hits = "; ".join(f"entry {j}: {c}" for j, c in self.codes_by_entry) or "none"
        return (f"query terms: {' '.join(self.query_terms) or '(none)'}. {self.entries} entries indexed; "
                f"selected entries (best first): {shown}{more}. Codes read from the selected entries: {hits}.")


def _content_vector(token: str, seed: int) -> np.ndarray:
    digest = hashlib.blake2b(f"{seed}:{token.lower()}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "little")).standard_normal(CONTENT_DIM).astype(np.float32)


def question_paragraph(prompt: str) -> tuple[int, str]:
    """(char offset, text) of the last non-empty paragraph (text after the last blank line)."""
    stripped = prompt.rstrip()
    cut = stripped.rfind("\n\n")
    start = 0 if cut < 0 else cut + 2
    return start, stripped[start:]


class RetrievalModel:
    """Runs the procedure of the module docstring. Thread-safe (one prompt at a time, like one GPU)."""

    def __init__(self, config: RetrievalConfig = RetrievalConfig()):
        self.config = config
        self.tokenizer = SimpleTokenizer()
        self._preset = get_preset("deepseek-v4-flash")
        self._lock = threading.Lock()
        self._vectors: dict[str, np.ndarray] = {}
        rng = np.random.default_rng(config.embed_seed + 1_000_003)
        typical = float(np.sqrt(CONTENT_DIM))  # E|g| for a standard Gaussian in 64 dims
        mu = rng.standard_normal(CONTENT_DIM)
        self._mu_direction = torch.from_numpy((mu / np.linalg.norm(mu)).astype(np.float32))
        self._mu = self._mu_direction * (config.common_scale * typical)
        rho = rng.standard_normal(HEAD_DIM - CONTENT_DIM)
        self._rho = torch.from_numpy((rho / np.linalg.norm(rho) * config.rope_scale * typical).astype(np.float32))
        self._rope_table = torch.zeros(0, self._preset.key_transform.rope_dim)

    # -- pieces ---------------------------------------------------------------------------------------
    def _content(self, tokens: list[str]) -> torch.Tensor:
        """fp32 [S, 64] individual parts g(t)."""
        seed = self.config.embed_seed
        rows = []
        for token in tokens:
            key = token.lower()
            vec = self._vectors.get(key)
            if vec is None:
                vec = _content_vector(key, seed)
                if len(self._vectors) < 200_000:
                    self._vectors[key] = vec
            rows.append(vec)
        if not rows:
            return torch.zeros(0, CONTENT_DIM)
        return torch.from_numpy(np.stack(rows))

    def _rope(self, max_position: int) -> torch.Tensor:
        if self._rope_table.shape[0] < max_position:
            size = max(max_position, 2 * self._rope_table.shape[0], 4096)
            self._rope_table = self._preset.rope.cos_sin_table(size)
        return self._rope_table

    def entry_keys(self, content: torch.Tensor) -> torch.Tensor:
        """Pre-norm keys [N, 128]: mean of r consecutive token embeddings mu + g + rho."""
        r = self.config.compress_ratio
        n = content.shape[0] // r
        pooled = content[: n * r].reshape(n, r, CONTENT_DIM).mean(dim=1)
        keys = torch.empty(n, HEAD_DIM)
        keys[:, :CONTENT_DIM] = pooled + self._mu
        keys[:, CONTENT_DIM:] = self._rho
        return keys

    def query_vector(self, question_tokens: list[str], position: int) -> tuple[torch.Tensor, list[str]]:
        """q [1, 1, 128] after rope (at ``position``) and Hadamard, and the query terms used."""
        terms = [t for t in question_tokens if t.isalpha() and t.lower() not in STOPWORDS]
        q = torch.zeros(1, HEAD_DIM)
        if terms:
            content = self._content(terms).mean(dim=0)
            mu_hat = self._mu_direction
            content = content - (content @ mu_hat) * mu_hat  # the content part: orthogonal to mu
            # plus a positive share of mu so that relu(q . k) passes every entry ("expects text at all")
            q[0, :CONTENT_DIM] = content + self.config.query_common_share * content.norm() * mu_hat
        transform = self._preset.key_transform
        table = self._rope(position + 1)[position: position + 1]
        half = transform.rope_dim // 2
        q = apply_rope(q, table[:, :half], table[:, half:], transform.rope_layout, transform.rope_dim)
        return hadamard_transform(q).reshape(1, 1, HEAD_DIM), [t.lower() for t in terms]

    # -- the procedure -------------------------------------------------------------------------------
    def retrieve(self, prompt: str, key_format: str | None = None, topk: int | None = None,
                 question_span: tuple[int, int] | None = None) -> Retrieval:
        """Answer the question of ``prompt`` (see the module docstring).

        The question is the characters ``question_span = (start, end)`` of the prompt (default: the last
        paragraph). The server passes the last paragraph of the last user message, so chat-template tokens
        around it do not enter the query.
        """
        from ..ops.store import store_index_keys

        cfg = self.config
        fmt = KeyFormat.parse(key_format or cfg.key_format)
        k = cfg.topk if topk is None else topk
        check_int("topk", k, 1, message="topk must be a positive int")
        tokens, spans = self.tokenizer.tokenize(prompt)
        s = len(tokens)
        if s > cfg.max_context:
            raise ValueError(f"prompt has {s} tokens, more than the model's max context {cfg.max_context}")
        if question_span is None:
            question_span = (question_paragraph(prompt)[0], len(prompt))
        q_start, q_end = question_span
        if not 0 <= q_start <= q_end <= len(prompt):
            raise ValueError(f"question_span {question_span} outside the prompt (0..{len(prompt)})")
        question_tokens = [t for t, (a, b) in zip(tokens, spans) if a >= q_start and b <= q_end]
        with self._lock:
            content = self._content(tokens)
            keys = self.entry_keys(content)
            n = keys.shape[0]
            if n == 0:
                return Retrieval("I don't know", s, 0, [], [])
            r = cfg.compress_ratio
            k = min(k, n)  # a larger k only pads with -1: same answer, without a [1, k] buffer of any size
            cache = PagedCache(fmt, num_pages=(n + ENTRIES_PER_PAGE - 1) // ENTRIES_PER_PAGE)
            seq = cache.add_sequence()
            slots = cache.append(seq, n)
            transform = self._preset.key_transform
            store_index_keys(keys, torch.arange(n, dtype=torch.int64) * r, slots, cache.pool, fmt,
                             self._rope(n * r), torch.ones(HEAD_DIM), None, transform, summaries=cache.summaries)
            q, terms = self.query_vector(question_tokens, s - 1)
            batch = cache.batch([seq], query_positions=torch.tensor([s - 1], dtype=torch.int64), ratio=r)
            selected = _index_topk()(q, torch.ones(1, 1), batch, k, backend="reference")
        order = [int(j) for j in selected[0].tolist() if j >= 0]
        codes: list[str] = []
        codes_by_entry: list[tuple[int, str]] = []
        for j in order:
            first = j * r
            last = min(s, first + r + cfg.read_ahead_tokens) - 1
            text = prompt[spans[first][0]: spans[last][1]]
            for code in CODE_PATTERN.findall(text):
                if code not in codes:
                    codes.append(code)
                    codes_by_entry.append((j, code))
        answer = ", ".join(codes) if codes else "I don't know"
        return Retrieval(answer, s, n, order, terms, codes_by_entry)


def _index_topk():
    from ..ops.indexer import index_topk

    return index_topk
