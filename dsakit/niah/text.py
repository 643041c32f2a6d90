"""Haystack text: distinct filler lines, needle codes, needle/question templates and prompt assembly.

A haystack is a list of filler lines (every line unique, drawn from a vocabulary that shares no word with
the needle or question templates, so no filler line repeats the needle's pattern). Needles are whole lines
inserted between filler lines at a *depth* d in [0, 1] (fraction of the filler that precedes the needle).

    prompt (completions) = intro + "\\n\\n" + haystack + "\\n\\n" + question + "\\nAnswer:"
    prompt (chat)        = one user message: intro + "\\n\\n" + haystack + "\\n\\n" + question
                           (the chat template is applied by the server)

Everything is a pure function of its seed, so a cell of a sweep rebuilds the same prompt on resume.
"""

from __future__ import annotations

import bisect
import random
import re
from dataclasses import dataclass

from .._memory import check_int

DEFAULT_NEEDLE = "The secret passphrase is {code}."
DEFAULT_QUESTION = "What is the secret passphrase mentioned in the text above? Reply with the passphrase only."
DEFAULT_MULTI_QUESTION = ("What is each secret passphrase mentioned in the text above? "
                          "Reply with every passphrase, separated by commas.")
DEFAULT_INTRO = "Below is a long text. Read it carefully and answer the question that follows it."

# Code = WORD-DIGITS-WORD, like ZEBRA-4492-OMEGA. The same pattern finds codes in answers and in prompts.
CODE_PATTERN = re.compile(r"\b[A-Z]{3,}-\d{3,}-[A-Z]{3,}\b")
_CODE_WORDS = (
    "ZEBRA", "OMEGA", "FALCON", "TANGO", "COBALT", "EMBER", "GLACIER", "HARBOR", "INDIGO", "JASPER", "KESTREL",
    "LOTUS", "MAGNET", "NEBULA", "ORCHID", "PEPPER", "QUARTZ", "RAVEN", "SIERRA", "TUNDRA", "UMBER", "VECTOR",
    "WALRUS", "XENON", "YONDER", "ZENITH", "ALPHA", "BRAVO", "CANYON", "DELTA", "ECHO", "FJORD", "GAMMA",
    "HELIX", "IGLOO", "JUNIPER", "KOALA", "LAGOON", "MAPLE", "NECTAR", "OSPREY", "PRISM", "QUASAR", "RHINO",
)

# Filler vocabulary: deliberately free of any word used by the default needle, question and intro templates.
_ADJECTIVES = (
    "amber", "quiet", "rusty", "golden", "narrow", "gentle", "crooked", "silver", "dusty", "bright", "hollow",
    "ancient", "wooden", "frozen", "muddy", "crimson", "pale", "sturdy", "humble", "noisy", "tiny", "vast",
    "bitter", "sweet", "sleepy", "brave", "clumsy", "eager", "fancy", "grumpy", "jolly", "lazy", "modest",
    "nimble", "polite", "proud", "shy", "tidy", "wise", "young", "elderly", "cheerful", "distant", "early",
)
_NOUNS = (
    "river", "farmer", "lantern", "orchard", "bridge", "sailor", "meadow", "village", "kettle", "mountain",
    "baker", "garden", "window", "carpet", "forest", "teacher", "pigeon", "wagon", "castle", "harvest",
    "candle", "shepherd", "painter", "market", "barrel", "ladder", "tailor", "blanket", "cottage", "violin",
    "compass", "pebble", "island", "chimney", "saddle", "basket", "fountain", "library", "merchant", "tower",
    "beetle", "otter", "sparrow", "glove", "hammer", "mirror", "pillow", "quilt", "stable", "tunnel",
)
_VERBS = (
    "watched", "carried", "painted", "followed", "repaired", "visited", "crossed", "polished", "counted",
    "borrowed", "planted", "cleaned", "described", "guarded", "admired", "measured", "traded", "sketched",
    "remembered", "delivered", "ignored", "greeted", "wrapped", "climbed", "circled", "collected", "lifted",
)
_PLACES = (
    "near the harbour", "behind the mill", "after the storm", "before dawn", "during the fair",
    "beside the well", "under the old oak", "across the valley", "at the crossroads", "on a windy afternoon",
    "by the frozen lake", "along the northern road", "inside the warm barn", "past the stone wall",
)


class FillerStream:
    """An endless, reproducible list of distinct filler lines for one seed (extended on demand).

    Line i is drawn from an RNG seeded by (seed, i); a line that repeats an earlier one is redrawn, so every
    line is unique and asking for more lines extends the same list (prefix-stable).
    """

    def __init__(self, seed: "int | str"):
        self.seed = seed
        self._lines: list[str] = []
        self._seen: set[str] = set()
        self._words: list[int] = [0]  # cumulative word counts: _words[i] = words in lines[:i]

    def _extend(self, count: int) -> None:
        while len(self._lines) < count:
            rng = random.Random(f"filler:{self.seed}:{len(self._lines)}")
            while True:
                line = (f"The {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_VERBS)} the "
                        f"{rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)} {rng.choice(_PLACES)}, and the "
                        f"{rng.choice(_NOUNS)} {rng.choice(_VERBS)} a {rng.choice(_ADJECTIVES)} "
                        f"{rng.choice(_NOUNS)}.")
                if line not in self._seen:
                    break
            self._seen.add(line)
            self._lines.append(line)
            self._words.append(self._words[-1] + len(line.split()))

    def lines(self, count: int) -> list[str]:
        """The first ``count`` lines."""
        check_int("count", count, 0, message="count must be a non-negative int")
        self._extend(count)
        return self._lines[:count]

    def words(self, count: int) -> list[str]:
        """Lines holding the first ``count`` words of the stream (the last line cut after a word)."""
        check_int("count", count, 0, message="word count must be a non-negative int")
        while self._words[-1] < count:
            self._extend(len(self._lines) + 64)
        full = bisect.bisect_right(self._words, count) - 1  # whole lines that fit
        out = self._lines[:full]
        rest = count - self._words[full]
        if rest:
            out = out + [" ".join(self._lines[full].split()[:rest])]
        return out


def filler_lines(count: int, seed: "int | str") -> list[str]:
    """``count`` distinct filler lines, a pure function of the seed, prefix-stable in ``count``."""
    return FillerStream(seed).lines(count)


def random_code(rng: random.Random) -> str:
    """A code like ``ZEBRA-4492-OMEGA`` (two different words, four digits)."""
    first, last = rng.sample(_CODE_WORDS, 2)
    return f"{first}-{rng.randint(1000, 9999)}-{last}"


def needle_codes(count: int, seed: int) -> list[str]:
    """``count`` distinct codes for one cell, a pure function of the seed."""
    if count < 1:
        raise ValueError(f"needle count must be >= 1, got {count}")
    rng = random.Random(f"codes:{seed}")
    codes: list[str] = []
    while len(codes) < count:
        code = random_code(rng)
        if code not in codes:
            codes.append(code)
    return codes


def normalize_answer(text: str) -> str:
    """Upper-case, unify dashes and drop whitespace/markup so ``zebra - 4492 – omega`` matches the code."""
    text = text.upper()
    text = re.sub(r"[\u2010-\u2015\u2212_]", "-", text)  # hyphen-like characters -> '-'
    return re.sub(r"[^A-Z0-9-]", "", text)


def code_found(code: str, answer: str) -> bool:
    """Substring match of the normalized code in the normalized answer."""
    return normalize_answer(code) in normalize_answer(answer)


@dataclass(frozen=True)
class Templates:
    """Needle and question templates. The needle needs ``{code}``; the question may use ``{count}``."""

    needle: str = DEFAULT_NEEDLE
    question: str = DEFAULT_QUESTION
    multi_question: str = DEFAULT_MULTI_QUESTION
    intro: str = DEFAULT_INTRO

    def __post_init__(self):
        if "{code}" not in self.needle:
            raise ValueError(f"needle template must contain '{{code}}', got {self.needle!r}")
        for name in ("question", "multi_question"):
            text = getattr(self, name)
            if not text.strip():
                raise ValueError(f"{name} template must not be empty")

    def question_for(self, needles: int) -> str:
        text = self.question if needles == 1 else self.multi_question
        return text.replace("{count}", str(needles))

    def check_filler_is_distinct(self) -> None:
        """Raise if a filler word appears in the needle or question (the filler would echo the needle)."""
        words = set(re.findall(r"[a-z]+", " ".join([self.needle, self.question, self.multi_question]).lower()))
        vocabulary = set(_ADJECTIVES) | set(_NOUNS) | set(_VERBS)
        clash = sorted(words & vocabulary)
        if clash:
            raise ValueError(f"needle/question templates use filler words {clash}; pick other words so that no "
                             f"filler line repeats the needle's pattern")


@dataclass(frozen=True)
class Haystack:
    """One prompt's text parts. ``needle_chars`` are the character offsets of each needle line in ``body``."""

    body: str  # intro + filler with needles (everything before the question)
    question: str
    codes: tuple[str, ...]
    depths: tuple[float, ...]
    filler_line_count: int
    needle_chars: tuple[int, ...]


def needle_line_index(depth: float, lines: int) -> int:
    """Insert position (0..lines) of a needle at ``depth`` among ``lines`` filler lines."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    return min(lines, max(0, round(depth * lines)))


def build_haystack(filler: list[str], codes: list[str], depths: list[float], templates: Templates) -> Haystack:
    """Interleave needles (one per code, at the matching depth) into the filler lines."""
    if len(codes) != len(depths) or not codes:
        raise ValueError(f"need one depth per code, got {len(codes)} codes and {len(depths)} depths")
    n = len(filler)
    inserts = sorted((needle_line_index(d, n), k) for k, d in enumerate(depths))
    parts: list[str] = [templates.intro, ""]
    needle_at: dict[int, int] = {}
    offset = len(templates.intro) + 2  # intro + "\n\n"
    cursor = 0
    for line_index, k in inserts + [(n, -1)]:
        for line in filler[cursor:line_index]:
            parts.append(line)
            offset += len(line) + 1
        cursor = line_index
        if k >= 0:
            needle_at[k] = offset
            text = templates.needle.replace("{code}", codes[k])
            parts.append(text)
            offset += len(text) + 1
    body = "\n".join(parts)
    return Haystack(body=body, question=templates.question_for(len(codes)), codes=tuple(codes),
                    depths=tuple(depths), filler_line_count=n,
                    needle_chars=tuple(needle_at[k] for k in range(len(codes))))


def completion_prompt(haystack: Haystack) -> str:
    return f"{haystack.body}\n\n{haystack.question}\nAnswer:"


def chat_content(haystack: Haystack) -> str:
    return f"{haystack.body}\n\n{haystack.question}"
