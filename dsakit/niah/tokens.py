"""Local token counters for fitting prompts to an exact token count (``dsakit niah --tokenizer``).

``--tokenizer`` accepts:

* a ``tokenizer.json`` file (loaded with the ``tokenizers`` package: ``pip install dsakit[niah]``);
* a directory with a Hugging Face tokenizer (``transformers.AutoTokenizer``, local files only; its chat
  template, when it has one, is used to count chat prompts; without transformers its tokenizer.json is used);
* ``reference``: the reference server's :class:`~dsakit.niah.retrieval.SimpleTokenizer` and chat template,
  which makes counts exact against ``dsakit serve-reference``.

Counts include the special tokens the server adds (BOS for completions, the chat template for chat).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path


class TokenCounter(ABC):
    """Counts the tokens of a completion prompt or of a chat prompt (one user message)."""

    name = "tokenizer"
    #: True when chat counts include the chat template (otherwise they count the message text only)
    counts_chat_template = False

    @abstractmethod
    def count_prompt(self, text: str) -> int:
        """Tokens of a completion prompt, special tokens included."""

    def count_chat(self, content: str) -> int:
        return self.count_prompt(content)

    def count(self, text: str, endpoint: str) -> int:
        return self.count_chat(text) if endpoint == "chat" else self.count_prompt(text)


class ReferenceCounter(TokenCounter):
    """Exact counts for ``dsakit serve-reference`` (same tokenizer and chat template)."""

    name = "reference"
    counts_chat_template = True

    def __init__(self):
        from .retrieval import SimpleTokenizer

        self._tok = SimpleTokenizer()

    def count_prompt(self, text: str) -> int:
        return self._tok.count(text)

    def count_chat(self, content: str) -> int:
        # the reference server's chat template for one user message (dsakit.serve.chat, docs/niah.md): the
        # wire format of the server measured, written out here because a client imports nothing of a server
        # (tests/test_serve.py checks that the two agree)
        return self._tok.count(f"<|user|>\n{content}\n<|assistant|>\n")


class JsonTokenizerCounter(TokenCounter):
    """A ``tokenizer.json`` through the ``tokenizers`` package (post-processor adds BOS etc.)."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError("--tokenizer with a tokenizer.json needs the 'tokenizers' package: "
                             "pip install 'dsakit[niah]'") from None
        self.name = str(path)
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"cannot load tokenizer file {str(path)!r}: {exc}") from None

    def count_prompt(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=True).ids)


class TransformersCounter(TokenCounter):
    """A Hugging Face tokenizer directory; chat prompts go through its chat template when it has one."""

    def __init__(self, path: Path):
        from transformers import AutoTokenizer

        self.name = str(path)
        self._tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.counts_chat_template = bool(getattr(self._tok, "chat_template", None))

    def count_prompt(self, text: str) -> int:
        return len(self._tok(text, add_special_tokens=True)["input_ids"])

    def count_chat(self, content: str) -> int:
        if not self.counts_chat_template:
            return self.count_prompt(content)
        ids = self._tok.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                            add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return len(ids)


def load_counter(spec: str) -> TokenCounter:
    """``reference`` | path to tokenizer.json | tokenizer directory -> a :class:`TokenCounter`."""
    if spec == "reference":
        return ReferenceCounter()
    path = Path(spec).expanduser()
    if path.is_file():
        return JsonTokenizerCounter(path)
    if path.is_dir():
        try:
            import transformers  # noqa: F401 - only checking that it is installed
        except ImportError:
            if (path / "tokenizer.json").is_file():
                return JsonTokenizerCounter(path / "tokenizer.json")
            raise ValueError(f"tokenizer directory {path} needs transformers (or a tokenizer.json in it)") from None
        try:
            return TransformersCounter(path)
        except (OSError, ValueError) as exc:
            if (path / "tokenizer.json").is_file():
                return JsonTokenizerCounter(path / "tokenizer.json")
            raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from None
    raise ValueError(f"--tokenizer {spec!r} is neither 'reference', a tokenizer.json file nor a directory")
