"""What every dsakit completion service shares: request checks, the per-request settings, and the response and
stream shapes (OpenAI's), with no HTTP here so it is easy to test.

A service implements :meth:`CompletionService.begin`: every check of the request, then a :class:`Completion`
whose ``pieces`` generator makes the answer lazily, piece by piece. :meth:`response` drains it;
:meth:`stream` turns each piece into a server-sent event the moment it is made. Checks all happen in
``begin``, so a bad request is answered 4xx before any 200 or event.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from ..formats import KeyFormat
from .chat import check_text
from .http import ClientGone, RequestError

REASONING_MODES = ("none", "field", "tags")
OVERRIDE_KEYS = ("index_key_format", "topk", "reasoning")


def never_cancelled() -> bool:
    return False


@dataclass(frozen=True)
class RequestSettings:
    """A request's ``"dsakit"`` overrides, parsed once here at the edge (None = the server's default)."""

    index_key_format: Optional[KeyFormat] = None
    topk: Optional[int] = None
    reasoning: Optional[str] = None


class Completion:
    """One request's answer as it is made: iterate :attr:`pieces` for (kind 'reasoning' | 'content', text);
    once drained, :attr:`finish_reason` and :attr:`completion_tokens` are set. :meth:`close` (also on
    ``with``) stops a generation that is not drained and frees what it holds (the model's lock).

    ``make_pieces(completion)``: the generator of pieces, which calls ``completion.finish(reason, tokens)``
    at its end."""

    def __init__(self, *, chat: bool, model_name: str, prompt_tokens: int,
                 make_pieces: Callable[["Completion"], Iterator[tuple[str, str]]], reasoning_field: bool = False,
                 release: Callable[[], None] | None = None):
        self.chat = chat
        self.prompt_tokens = prompt_tokens
        self.reasoning_field = reasoning_field
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                     "model": model_name}
        self._release = release
        self._pieces = make_pieces(self)

    @property
    def pieces(self) -> Iterator[tuple[str, str]]:
        return self._pieces

    def finish(self, reason: str, completion_tokens: int) -> None:
        self.finish_reason, self.completion_tokens = reason, completion_tokens

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def close(self) -> None:
        close = getattr(self._pieces, "close", None)
        if close is not None:
            close()
        release, self._release = self._release, None
        if release is not None:
            release()

    def __enter__(self) -> "Completion":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CompletionService(ABC):
    """Base of the services: subclasses set ``model_name`` and ``max_context`` and implement :meth:`begin`."""

    model_name: str
    max_context: int
    #: the ``"dsakit"`` override keys this service honours
    override_keys: tuple[str, ...] = OVERRIDE_KEYS
    #: the largest top-k a request may ask for
    max_topk: int

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "dsakit",
                                             "max_model_len": self.max_context}]}

    # -- request checks -------------------------------------------------------------------------------
    def request_settings(self, body) -> RequestSettings:
        """The body's checks every service shares (a JSON object naming this model, if any) -> its overrides."""
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        name = body.get("model")
        if name is not None and name != self.model_name:
            raise RequestError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                               "not_found_error")
        extra = body.get("dsakit") or {}
        if not isinstance(extra, dict):
            raise RequestError(400, "'dsakit' must be an object like {\"index_key_format\": \"fp8\", \"topk\": 64}")
        unknown = sorted(set(extra) - set(OVERRIDE_KEYS))
        if unknown:
            raise RequestError(400, f"unknown dsakit settings {unknown}; known: {', '.join(OVERRIDE_KEYS)}")
        refused = sorted(set(extra) - set(self.override_keys))
        if refused:
            raise RequestError(400, f"dsakit.{refused[0]} is not a setting of this server (it takes "
                                    f"{', '.join(self.override_keys)})")
        fmt, topk, reasoning = extra.get("index_key_format"), extra.get("topk"), extra.get("reasoning")
        if reasoning is not None and reasoning not in REASONING_MODES:
            raise RequestError(400, f"dsakit.reasoning must be one of {REASONING_MODES}, got {reasoning!r}")
        if fmt is not None:
            try:
                fmt = KeyFormat.parse(fmt)  # the one parse of a request's format: objects from here on
            except (ValueError, TypeError) as exc:
                raise RequestError(400, f"dsakit.index_key_format: {exc}") from None
        if topk is not None and (not isinstance(topk, int) or isinstance(topk, bool) or topk < 1):
            raise RequestError(400, f"dsakit.topk must be a positive int, got {topk!r}")
        if topk is not None and topk > self.max_topk:
            raise RequestError(400, f"dsakit.topk {topk} exceeds {self.max_topk}, this server's top-k limit "
                                    f"(docs/serve.md, 'Memory and admission')")
        return RequestSettings(fmt, topk, reasoning)

    @staticmethod
    def max_tokens(body: dict, default: int | None) -> int | None:
        """``max_completion_tokens`` or ``max_tokens`` (the first present), ``default`` when both are absent.
        An explicit null is refused: it is not a count (OpenAI's clients omit the field instead)."""
        for key in ("max_completion_tokens", "max_tokens"):
            if key in body:
                value = body[key]
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise RequestError(400, f"{key} must be a positive int (or left out), got "
                                            f"{json_repr(value)}")
                return value
        return default

    @staticmethod
    def completion_prompt(body: dict, max_chars: int | None = None) -> str:
        """A completions request's 'prompt': a string, or a list of one string (as OpenAI clients send it);
        longer than ``max_chars`` is refused before any tokenizer sees it."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError(400, "'prompt' must be a string (or a list of one string)")
        if max_chars is not None and len(prompt) > max_chars:
            raise RequestError(400, f"the prompt has {len(prompt)} characters, more than the longest prompt this "
                                    f"server accepts ({max_chars} characters)")
        return check_text("prompt", prompt)

    # -- answers --------------------------------------------------------------------------------------
    @abstractmethod
    def begin(self, body, chat: bool, cancelled: Callable[[], bool] = never_cancelled) -> Completion:
        """Start answering a checked request body: the :class:`Completion` whose pieces are generated as they
        are read (each service: the reference echo or the model)."""

    def response(self, body, chat: bool, cancelled: Callable[[], bool] = never_cancelled) -> dict:
        """The whole answer as one response body."""
        with self.begin(body, chat, cancelled) as completion:
            pieces = list(completion.pieces)
        content = "".join(t for k, t in pieces if k == "content")
        reasoning = "".join(t for k, t in pieces if k == "reasoning")
        meta, finish = completion.meta, completion.finish_reason
        if chat:
            message = {"role": "assistant", "content": content}
            if completion.reasoning_field:
                message["reasoning_content"] = reasoning or None
            choice = {"index": 0, "message": message, "finish_reason": finish}
            return {**meta, "object": "chat.completion", "choices": [choice], "usage": completion.usage}
        choice = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
        return {**meta, "object": "text_completion", "choices": [choice], "usage": completion.usage}

    def stream(self, body, chat: bool, cancelled: Callable[[], bool] = never_cancelled) -> Iterator[dict]:
        """Server-sent event payloads (without the final [DONE]), each yielded as its piece is made. The
        request is checked when the first event is asked for (a RequestError then, before any event)."""
        completion = self.begin(body, chat, cancelled)
        with completion:
            obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(delta_or_text, finish_reason=None):
                if chat:
                    choice = {"index": 0, "delta": delta_or_text, "finish_reason": finish_reason}
                else:
                    choice = {"index": 0, "text": delta_or_text, "finish_reason": finish_reason, "logprobs": None}
                return {**completion.meta, "object": obj, "choices": [choice]}

            if chat:
                yield chunk({"role": "assistant", "content": ""})
            for kind, text in completion.pieces:
                if not text:
                    continue
                if chat:
                    yield chunk({"reasoning_content": text} if kind == "reasoning" else {"content": text})
                else:
                    yield chunk(text)
            yield chunk({} if chat else "", completion.finish_reason)
            options = body.get("stream_options") or {}
            if isinstance(options, dict) and options.get("include_usage"):
                yield {**completion.meta, "object": obj, "choices": [], "usage": completion.usage}

    def stream_events(self, body, chat: bool) -> list[dict]:
        """Every event of :meth:`stream` (tests and tools)."""
        return list(self.stream(body, chat))


def check_cancelled(cancelled: Callable[[], bool]) -> None:
    """Raise :class:`ClientGone` when the client went away (polled between units of work)."""
    if cancelled():
        raise ClientGone("the client closed the connection")


def json_repr(value) -> str:
    return "null" if value is None else repr(value)
