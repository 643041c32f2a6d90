"""Training documents for the tiny DSA model: long haystacks of distinct filler lines (dsakit's needle
generator, :mod:`dsakit.niah.text`) holding facts to retrieve, each ending with a question and its answer.

Four kinds, drawn per document (probabilities in :data:`KIND_WEIGHTS`):

* ``passkey``: one needle ``The secret passphrase is ZEBRA-4492-OMEGA.`` at a uniform depth, the niah
  question, answer = the code (exactly what ``dsakit niah`` asks);
* ``multi``: 2-4 such needles, the niah multi-needle question, answer = the codes in text order, ", "-joined;
* ``codes``: a line of 3-6 comma-separated codes somewhere in the filler, the question "Reply with every
  passphrase mentioned in the text above, separated by commas.", answer = that line (pure copying of random
  tokens: the strongest signal for the copying the other kinds need);
* ``kv``: 2-6 key-value lines ``The secret passphrase of the copper vault is ZEBRA-4492-OMEGA.`` with
  distinct keys, a question about one key, answer = its code (the indexer must find the right line, not any).

Filler lines repeat: with probability ``repeat_rate`` (training: 0.3) a line is a copy of an earlier line of
the document. Random filler never rewards looking back, so without repeats the only signal for copying is
the ~8 answer tokens of a 1-2K-token document, and a 2.6M-parameter model trained on it for ~1500 steps did
not learn to copy at all (answer loss stayed at the codes' entropy); a repeated line is predictable from its
first words onwards by copying, which teaches the copying (induction) attention the answers need.

Each document is written half the time as a completion prompt (``... \\nAnswer:`` + `` CODE``) and half as a
chat prompt (the serve-reference chat template, then ``CODE``), followed by ``<eos>``. Everything is a pure
function of (seed, step, row), so a batch is rebuilt identically on resume and by any number of workers.

Batch layout: ``input_ids`` int64 [B, L] (right-padded with ``<pad>``), ``answer_mask`` bool [B, L] (the
answer tokens and the ``<eos>``), ``valid`` bool [B, L] (not padding), ``copy_mask`` bool [B, L] (tokens of
repeated lines that copying predicts: the training log's ``copy`` loss falls once the model copies). L is drawn per step from the length
set and B = tokens_per_batch // L, so every step costs about the same.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from .._memory import check_choice
from ..serve.chat import render_chat
from ..niah.text import (DEFAULT_INTRO, DEFAULT_MULTI_QUESTION, DEFAULT_NEEDLE, DEFAULT_QUESTION, FillerStream,
                         Templates, build_haystack, completion_prompt, needle_codes)
from .tokenizer import BOS, EOS, PAD

KIND_WEIGHTS = {"passkey": 0.4, "multi": 0.15, "kv": 0.2, "codes": 0.25}
CODES_QUESTION = "Reply with every passphrase mentioned in the text above, separated by commas."
KV_KEYS = ("copper", "iron", "velvet", "granite", "cedar", "marble", "linen", "bronze", "coral", "slate",
           "ivory", "maroon", "olive", "scarlet", "teal", "violet")
KV_NEEDLE = "The secret passphrase of the {key} vault is {code}."
KV_QUESTION = "What is the secret passphrase of the {key} vault? Reply with the passphrase only."


def corpus_texts(count: int = 200, seed: int = 0) -> list[str]:
    """Example prompts + answers covering every word the documents use (to build the tokenizer's vocabulary)."""
    texts = [DEFAULT_INTRO, DEFAULT_NEEDLE, DEFAULT_QUESTION, DEFAULT_MULTI_QUESTION, KV_NEEDLE, KV_QUESTION,
             " ".join(KV_KEYS), completion_prompt(build_haystack(["x"], ["X"], [0.0], Templates()))]
    for i in range(count):
        texts.extend(FillerStream(f"vocab:{seed}:{i}").lines(40))
        texts.extend(needle_codes(8, seed * 100003 + i))
    return texts


@dataclass(frozen=True)
class Document:
    prompt: str
    answer: str
    kind: str
    repeated: tuple[str, ...] = ()  # filler lines that occur more than once in the prompt


def make_document(rng: random.Random, filler_lines: int, kind: str, chat: bool, seed_text: str,
                  repeat_rate: float = 0.0, needle_depth: float | None = None) -> Document:
    """One document with ``filler_lines`` filler lines (see the module docstring); each filler line after the
    first is, with probability ``repeat_rate``, a copy of an earlier one (half the time one of the 4 before).
    ``needle_depth`` (``passkey`` only): the needle's depth in the filler (0 first line .. 1 last, niah's
    convention) instead of a random one; the random draws stay the same, so the rest of the document does."""
    if needle_depth is not None:  # its range is checked where the haystack places it (needle_line_index)
        check_choice("document kind with a needle_depth", kind, ("passkey",))
    filler = FillerStream(seed_text).lines(filler_lines)
    repeated = set()
    for i in range(1, len(filler)):
        if rng.random() < repeat_rate:
            # half the copies come from the last few lines (inside the 128-token window: the easy case that
            # starts the copying), half from anywhere before (through the compressed entries)
            source = rng.randrange(max(0, i - 4), i) if rng.random() < 0.5 else rng.randrange(i)
            filler[i] = filler[source]
            repeated.add(filler[i])
    codes_seed = rng.randrange(1 << 30)
    if kind == "passkey":
        codes = needle_codes(1, codes_seed)
        depth = rng.random()
        hay = build_haystack(filler, codes, [depth if needle_depth is None else needle_depth], Templates())
        answer = codes[0]
    elif kind == "multi":
        count = rng.randint(2, 4)
        codes = needle_codes(count, codes_seed)
        depths = [rng.random() for _ in codes]
        hay = build_haystack(filler, codes, depths, Templates())
        in_text_order = [c for _, c in sorted(zip(depths, codes), key=lambda p: p[0])]
        answer = ", ".join(in_text_order)
    elif kind == "kv":
        count = rng.randint(2, 6)
        codes = needle_codes(count, codes_seed)
        keys = rng.sample(KV_KEYS, count)
        lines = [KV_NEEDLE.format(key=k, code=c) for k, c in zip(keys, codes)]
        asked = rng.randrange(count)
        templates = Templates(needle="{code}", question=KV_QUESTION.format(key=keys[asked]))
        hay = build_haystack(filler, lines, [rng.random() for _ in lines], templates)
        answer = codes[asked]
    elif kind == "codes":
        count = rng.randint(3, 6)
        codes = needle_codes(count, codes_seed)
        listing = ", ".join(codes)
        templates = Templates(needle="{code}", question=CODES_QUESTION)
        hay = build_haystack(filler, [listing], [rng.random()], templates)
        answer = listing
    else:
        raise ValueError(f"unknown document kind {kind!r}; known: {sorted(KIND_WEIGHTS)}")
    if chat:
        prompt, _ = render_chat([{"role": "user", "content": f"{hay.body}\n\n{hay.question}"}])
        return Document(prompt, answer, kind, tuple(sorted(repeated)))
    return Document(completion_prompt(hay), " " + answer, kind, tuple(sorted(repeated)))


class DocumentBatches(torch.utils.data.Dataset):
    """Batch ``step`` of the training stream (map-style, indexed by step: resumable, worker-independent)."""

    def __init__(self, tokenizer, lengths: list[int], tokens_per_batch: int, seed: int,
                 kind_weights: dict | None = None, prefix: str = "train", repeat_rate: float = 0.0,
                 short_steps: int = 0, short_length: int = 512, copy_steps: int = 0,
                 copy_gapped_share: float = 0.5, copy_min_gap: int = 32):
        if not lengths or any(not isinstance(n, int) or n < 128 for n in lengths):
            raise ValueError(f"lengths must be ints >= 128, got {lengths!r}")
        if tokens_per_batch < max(lengths):
            raise ValueError(f"tokens_per_batch {tokens_per_batch} is below the longest length {max(lengths)}")
        self.tokenizer = tokenizer
        self.lengths = list(lengths)
        self.tokens_per_batch = tokens_per_batch
        self.seed = seed
        self.prefix = prefix
        self.kind_weights = dict(kind_weights or KIND_WEIGHTS)
        if not 0.0 <= repeat_rate < 1.0:
            raise ValueError(f"repeat_rate must be in [0, 1), got {repeat_rate!r}")
        self.repeat_rate = repeat_rate
        # curriculum: the first ``short_steps`` steps draw only lengths <= short_length (copying is learnt
        # sooner on short documents, where a step also sees more answers)
        self.short_steps = short_steps
        self.short_lengths = [n for n in self.lengths if n <= short_length] or [min(self.lengths)]
        # warm-up: the first ``copy_steps`` steps are the copy toy (see ``copy_row``), which forms the copying
        # (induction) attention in a few hundred steps where documents alone did not in 1500
        self.copy_steps = copy_steps
        # in the second half of the warm-up, this share of the rows puts each repeat behind a gap of at least
        # copy_min_gap tokens (above the sliding window: the copy must go through the compressed entries)
        if not 0.0 <= copy_gapped_share <= 1.0:
            raise ValueError(f"copy_gapped_share must be in [0, 1], got {copy_gapped_share!r}")
        if not isinstance(copy_min_gap, int) or copy_min_gap < 1:
            raise ValueError(f"copy_min_gap must be an int >= 1, got {copy_min_gap!r}")
        self.copy_gapped_share = copy_gapped_share
        self.copy_min_gap = copy_min_gap
        self.vocab_size = tokenizer.get_vocab_size()
        self.bos_id = tokenizer.token_to_id(BOS)
        self.pad_id = tokenizer.token_to_id(PAD)
        self.eos_id = tokenizer.token_to_id(EOS)
        sample = FillerStream(f"{prefix}:calibrate:{seed}").lines(64)
        ids = tokenizer.encode("\n".join(sample), add_special_tokens=False).ids
        self.tokens_per_line = len(ids) / len(sample)

    def __len__(self) -> int:
        return 1 << 40

    def encode(self, doc: Document) -> tuple[list[int], int, list[int]]:
        """-> (token ids: BOS + prompt + answer + EOS, index of the first answer token, indices of the tokens
        of repeated filler lines that copying can predict: every later copy of a line, its first 3 tokens
        excepted)."""
        enc = self.tokenizer.encode(doc.prompt)
        answer = self.tokenizer.encode(doc.answer, add_special_tokens=False).ids + [self.eos_id]
        spans = []
        for line in doc.repeated:
            first = doc.prompt.find(line)
            at = doc.prompt.find(line, first + 1)
            while at >= 0:
                spans.append((at, at + len(line)))
                at = doc.prompt.find(line, at + 1)
        copyable = []
        for a, b in spans:
            inside = [i for i, (x, y) in enumerate(enc.offsets) if x >= a and y <= b and y > x]
            copyable.extend(inside[3:])
        return enc.ids + answer, len(enc.ids), copyable

    def document(self, step: int, row: int, length: int) -> tuple[list[int], int, list[int], Document]:
        rng = random.Random(f"{self.prefix}:{self.seed}:{step}:{row}")
        kinds, weights = zip(*sorted(self.kind_weights.items()))
        kind = rng.choices(kinds, weights)[0]
        chat = rng.random() < 0.5
        lines = max(1, int((length - 80) / self.tokens_per_line * rng.uniform(0.8, 1.0)))
        while True:
            doc = make_document(rng, lines, kind, chat, f"{self.prefix}:{self.seed}:{step}:{row}", self.repeat_rate)
            ids, start, copyable = self.encode(doc)
            if len(ids) <= length or lines == 1:
                return ids[:length], start, [i for i in copyable if i < length], doc
            lines = max(1, lines - 1 - (len(ids) - length) // max(1, int(self.tokens_per_line)))

    def copy_row(self, rng: random.Random, length: int, gaps: bool = False) -> tuple[list[int], list[int]]:
        """The copy toy: BOS + a random sequence of 16-48 tokens (ids drawn uniformly above the special tokens)
        repeated until ``length`` tokens; with ``gaps`` each repeat follows a run of ``copy_min_gap`` to
        max(copy_min_gap, length / 3) other random tokens, so the copy must reach past the sliding window
        (through the compressed entries) when copy_min_gap exceeds it.
        -> (ids, indices of the tokens that copying predicts: every repeat after its first 2 tokens). Nothing
        but copying lowers the loss on the repeats (ln(vocab) without it)."""
        first = max(self.pad_id, self.eos_id, self.bos_id) + 8  # above the specials and the chat-role tokens

        def draw(n: int) -> list[int]:
            return [rng.randrange(first, self.vocab_size) for _ in range(n)]

        seq = draw(rng.randint(16, 48))
        ids, copyable = [self.bos_id] + seq, []
        while len(ids) < length:
            if gaps:
                ids.extend(draw(rng.randint(self.copy_min_gap, max(self.copy_min_gap, length // 3))))
            copyable.extend(range(len(ids) + 2, len(ids) + len(seq)))
            ids.extend(seq)
        return ids[:length], [i for i in copyable if i < length]

    def batch(self, step: int, length: int | None = None) -> dict:
        if length is None and step < self.copy_steps:
            return self.copy_batch(step)
        if length is None:
            choices = self.short_lengths if step < self.short_steps else self.lengths
            length = choices[random.Random(f"{self.prefix}:{self.seed}:len:{step}").randrange(len(choices))]
        rows = max(1, self.tokens_per_batch // length)
        input_ids = torch.full((rows, length), self.pad_id, dtype=torch.long)
        answer_mask = torch.zeros((rows, length), dtype=torch.bool)
        valid = torch.zeros((rows, length), dtype=torch.bool)
        copy_mask = torch.zeros((rows, length), dtype=torch.bool)
        for row in range(rows):
            ids, start, copyable, _ = self.document(step, row, length)
            input_ids[row, :len(ids)] = torch.tensor(ids)
            answer_mask[row, start:len(ids)] = True
            valid[row, :len(ids)] = True
            copy_mask[row, copyable] = True
        return {"input_ids": input_ids, "answer_mask": answer_mask, "valid": valid, "copy_mask": copy_mask,
                "step": step}

    def copy_batch(self, step: int) -> dict:
        """A batch of ``copy_row`` rows (same layout as ``batch``; the repeats are both the answer and the copy
        mask, so the answer weight applies to them): the first half of the warm-up plain repeats at the shortest
        length, the second half at the short lengths with a ``copy_gapped_share`` of the rows' repeats behind
        gaps (see ``copy_row``)."""
        late = step >= self.copy_steps // 2
        choices = self.short_lengths if late else [min(self.lengths)]
        length = choices[random.Random(f"{self.prefix}:{self.seed}:len:{step}").randrange(len(choices))]
        rows = max(1, self.tokens_per_batch // length)
        input_ids = torch.empty((rows, length), dtype=torch.long)
        copy_mask = torch.zeros((rows, length), dtype=torch.bool)
        for row in range(rows):
            rng = random.Random(f"{self.prefix}:{self.seed}:copy:{step}:{row}")
            gapped = late and (row + 0.5) / rows <= self.copy_gapped_share
            ids, copyable = self.copy_row(rng, length, gaps=gapped)
            input_ids[row] = torch.tensor(ids)
            copy_mask[row, copyable] = True
        return {"input_ids": input_ids, "answer_mask": copy_mask.clone(), "valid": torch.ones_like(copy_mask),
                "copy_mask": copy_mask, "step": step}

    def __getitem__(self, step: int) -> dict:
        return self.batch(step)
