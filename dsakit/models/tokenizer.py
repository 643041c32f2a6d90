"""The tiny model's tokenizer, built offline (no download, no training run): a ``tokenizers`` Unigram model whose
pieces are every word of the needle generator's texts (filler, templates, code words, chat roles) plus every
printable ASCII character, so any ASCII text encodes (unknown words fall back to characters, other characters
to ``<unk>``). Digits are always single tokens, so a code like ``ZEBRA-4492-OMEGA`` is 8 tokens:
``ZEBRA - 4 4 9 2 - OMEGA``.

Special tokens: ``<pad>`` 0, ``<unk>`` 1, ``<bos>`` 2 (prepended to every encoded text), ``<eos>`` 3 (ends an
answer). The chat roles ``<|user|>``, ``<|assistant|>``, ``<|system|>`` are single (non-special) tokens; the
chat template is the one of ``dsakit serve-reference`` (``<|role|>\\n{content}\\n`` per message, then
``<|assistant|>\\n``), so ``dsakit niah --tokenizer DIR`` counts chat prompts exactly.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, UNK, BOS, EOS)
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")
CHAT_TEMPLATE = ("{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
WORD_SCORE = -2.0   # a whole word always beats its spelling in characters (Viterbi sums the scores)
CHAR_SCORE = -8.0
_WORD = re.compile(r"[A-Za-z]+")
_META = "\u2581"  # Metaspace's replacement of a space


def corpus_words(texts) -> list[str]:
    """Sorted distinct words (runs of ASCII letters) of ``texts``."""
    words: set[str] = set()
    for text in texts:
        words.update(_WORD.findall(text))
    return sorted(words)


def build_tokenizer(words: list[str]):
    """A ``tokenizers.Tokenizer`` over ``words`` (each with and without a leading space) and ASCII characters."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if not words or not all(isinstance(w, str) and _WORD.fullmatch(w) for w in words):
        raise ValueError("words must be a non-empty list of ASCII-letter words")
    pieces: list[tuple[str, float]] = [(tok, 0.0) for tok in SPECIAL_TOKENS]
    seen = set(SPECIAL_TOKENS)
    chars = [c for c in string.printable if c not in " \r\x0b\x0c"] + [_META]
    for char in chars:
        if char not in seen:
            pieces.append((char, CHAR_SCORE))
            seen.add(char)
    for word in sorted(set(words)):
        for piece in (word, _META + word):
            if piece not in seen:
                pieces.append((piece, WORD_SCORE))
                seen.add(piece)
    tok = Tokenizer(models.Unigram(pieces, unk_id=SPECIAL_TOKENS.index(UNK), byte_fallback=False))
    tok.normalizer = normalizers.Replace(Regex("\r\n?"), "\n")
    # digits split one by one; spaces become the Metaspace mark in front of the next word
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.Metaspace(replacement=_META, prepend_scheme="never", split=True),
    ])
    tok.decoder = decoders.Metaspace(replacement=_META, prepend_scheme="never", split=True)
    bos_id = SPECIAL_TOKENS.index(BOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, bos_id)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ROLE_TOKENS])
    return tok


def save_tokenizer(tok, directory: "str | Path", model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json (loadable with AutoTokenizer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "model_max_length": model_max_length,
              "add_bos_token": True, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def load_tokenizer(directory: "str | Path"):
    """The ``tokenizers.Tokenizer`` of a model directory (its tokenizer.json), with a clear error if absent."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{directory} has no tokenizer.json")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"cannot load {path}: {exc}") from None

