"""Async client for OpenAI-compatible endpoints (chat and completions) with retries and backoff.

One :class:`OpenAIClient` wraps one ``httpx.AsyncClient``. :meth:`OpenAIClient.complete` sends one request
(each attempt bounded by ``timeout_s`` of wall time, streaming included) and retries, with exponential
backoff and jitter (honouring ``Retry-After``), on HTTP 408/409/425/429/5xx, timeouts, connection errors
(refused, reset, dropped mid-response) and 200 responses whose JSON is not a completion, so a sweep survives
a server that restarts. When retries run out, the error carries the last HTTP status (None if the last
attempt got none). Other statuses (400 context overflow, 401, 404 unknown model) raise :class:`EndpointError` at once.

Response bodies are read in chunks and capped at ``max_response_bytes`` (default 64 MiB; a stream counts all
its events): a larger answer raises :class:`EndpointError` at once, before it can fill the client's memory.
JSON nested deeper than the parser's recursion limit is a malformed response, like any other.

Reasoning ("thinking") content is separated from the answer: ``reasoning_content`` / ``reasoning`` fields of
the message or stream deltas, and ``<think>...</think>`` blocks inside the content (an unclosed ``<think>``
means the whole rest is reasoning; a lone ``</think>`` means everything before it was).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from .._memory import check_choice, check_float, check_int

ENDPOINTS = ("chat", "completions")
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
#: Default cap on a response body (a stream: all its events together). A 32k-token streamed answer takes a few MB.
MAX_RESPONSE_BYTES = 64 << 20
#: Error responses are only read this far (their message is cut to 500 characters anyway).
ERROR_BODY_BYTES = 64 << 10
#: Deepest nesting an ``extra_body`` may have (request bodies are flat; the server's parser has limits too).
MAX_EXTRA_BODY_DEPTH = 32


class MalformedResponse(ValueError):
    """A 200 response that is not a usable completion (retried like a dropped connection)."""


def usage_count(usage, name: str) -> int | None:
    """``usage[name]`` as a token count: None when absent, else a non-negative int (prompt_tokens >= 1).

    A server that reports 0, a negative, a bool, a float (NaN included) or a string is broken: its counts
    would steer the length calibration anywhere, so the response counts as malformed.
    """
    if not isinstance(usage, dict):
        raise MalformedResponse(f"'usage' must be an object, got {usage!r:.80}")
    value = usage.get(name)
    if value is None:
        return None
    low = 1 if name == "prompt_tokens" else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise MalformedResponse(f"usage.{name} must be an int >= {low}, got {value!r:.80}")
    return value


def parse_json(data: "bytes | str"):
    """json.loads, with nesting deeper than the recursion limit a :class:`MalformedResponse` (not RecursionError)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise MalformedResponse("response JSON is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise MalformedResponse(f"response is not UTF-8: {exc}") from None


def json_depth(value) -> int:
    """Nesting depth of a JSON value (0 for a scalar), counted without recursion."""
    depth, stack = 0, [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, level + 1) for v in item)
        else:
            continue
        depth = max(depth, level + 1)
    return depth


class EndpointError(Exception):
    """A request that failed for good (non-retryable status, or retries exhausted)."""

    def __init__(self, message: str, status: int | None = None, attempts: int = 1):
        super().__init__(message)
        self.status = status
        self.attempts = attempts


@dataclass(frozen=True)
class EndpointConfig:
    """Where and how to send requests."""

    base_url: str
    model: str
    api_key: str | None = None
    endpoint: str = "chat"  # "chat" -> /chat/completions, "completions" -> /completions
    max_tokens: int = 64
    temperature: float = 0.0
    stream: bool = False
    timeout_s: float = 600.0
    max_retries: int = 8
    backoff_s: float = 0.5  # first retry wait; doubles each attempt (with jitter)
    backoff_max_s: float = 30.0
    extra_body: dict = field(default_factory=dict)
    max_response_bytes: int = MAX_RESPONSE_BYTES

    def __post_init__(self):
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"base_url must look like http://host:port/v1, got {self.base_url!r}")
        try:
            parts.port  # noqa: B018 - urlsplit checks the port range only when it is read
        except ValueError as exc:  # "Port out of range 0-65535": httpx would raise OverflowError much later
            raise ValueError(f"base_url {self.base_url!r}: {exc}") from None
        check_choice("endpoint", self.endpoint, ENDPOINTS)
        if not self.model:
            raise ValueError("model name must not be empty")
        for name, low in (("max_tokens", 1), ("max_retries", 0), ("max_response_bytes", 1)):
            check_int(name, getattr(self, name), low)
        for name in ("temperature", "timeout_s", "backoff_s", "backoff_max_s"):
            check_float(name, getattr(self, name))
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout_s}")
        if self.backoff_s < 0 or self.backoff_max_s < 0:
            raise ValueError(f"backoff times must be >= 0, got {self.backoff_s}, {self.backoff_max_s}")
        if not isinstance(self.extra_body, dict):
            raise ValueError(f"extra_body must be a JSON object, got {self.extra_body!r:.200}")
        depth = json_depth(self.extra_body)
        if depth > MAX_EXTRA_BODY_DEPTH:
            raise ValueError(f"extra_body is nested {depth} levels deep, more than {MAX_EXTRA_BODY_DEPTH}")
        try:
            json.dumps(self.extra_body, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"extra_body must be plain JSON (no NaN/Inf, str keys): {exc}") from None

    @property
    def api_root(self) -> str:
        """Base URL with a ``/v1`` path when none was given (``http://host:8000`` -> ``.../v1``)."""
        url = self.base_url.rstrip("/")
        return url if urlsplit(url).path not in ("", "/") else url + "/v1"

    @property
    def url(self) -> str:
        return self.api_root + ("/chat/completions" if self.endpoint == "chat" else "/completions")


@dataclass
class Completion:
    """One finished request. ``text`` is the answer with reasoning removed."""

    text: str
    reasoning: str
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    attempts: int
    latency_s: float


_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def split_reasoning(content: str, reasoning: str = "") -> tuple[str, str]:
    """(answer, reasoning) from a message's content and its separate reasoning field, if any."""
    content = content or ""
    parts = [reasoning] if reasoning else []
    parts += [m.group(1) for m in _THINK_BLOCK.finditer(content)]
    content = _THINK_BLOCK.sub("", content)
    if "<think>" in content:  # unclosed (cut by max_tokens): everything after it is reasoning
        before, _, after = content.partition("<think>")
        parts.append(after)
        content = before
    elif "</think>" in content:  # template opened <think> in the prompt: everything before the close
        before, _, after = content.partition("</think>")
        parts.append(before)
        content = after
    return content.strip(), "\n".join(p.strip() for p in parts if p and p.strip())


def backoff_delay(attempt: int, base: float, cap: float, retry_after: str | None = None,
                  rng: random.Random | None = None) -> float:
    """Seconds to wait before retry ``attempt`` (1-based): Retry-After if given, else base*2^(a-1) with jitter."""
    if retry_after is not None:
        try:
            return min(cap, max(0.0, float(retry_after)))
        except ValueError:
            pass
    rng = rng or random
    return min(cap, base * 2 ** (attempt - 1)) * (0.5 + 0.5 * rng.random())


class OpenAIClient:
    """Sends prompts to one endpoint. Use as ``async with OpenAIClient(cfg, concurrency) as client``."""

    def __init__(self, config: EndpointConfig, concurrency: int = 4):
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.config = config
        self._limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._client: httpx.AsyncClient | None = None
        self._rng = random.Random()

    async def __aenter__(self) -> "OpenAIClient":
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        timeout = httpx.Timeout(self.config.timeout_s, connect=min(10.0, self.config.timeout_s))
        self._client = httpx.AsyncClient(headers=headers, timeout=timeout, limits=self._limits)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def request_body(self, prompt: str, max_tokens: int | None = None) -> dict:
        """JSON body for a prompt (chat: one user message; the server applies its chat template)."""
        cfg = self.config
        body: dict = {"model": cfg.model, "max_tokens": max_tokens or cfg.max_tokens, "temperature": cfg.temperature}
        if cfg.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if cfg.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        body.update(cfg.extra_body)
        return body

    async def complete(self, prompt: str, max_tokens: int | None = None) -> Completion:
        """Send one prompt, retrying transient failures; raises :class:`EndpointError` when it gives up."""
        if self._client is None:
            raise RuntimeError("use 'async with OpenAIClient(...)' before calling complete()")
        cfg = self.config
        body = self.request_body(prompt, max_tokens)
        started = time.monotonic()
        last_error, last_status = "no attempt made", None
        for attempt in range(1, cfg.max_retries + 2):
            retry_after, last_status = None, None
            try:
                # timeout_s bounds the whole attempt (httpx's own timeouts bound each read/connect only)
                send = self._send_stream(body) if cfg.stream else self._send(body)
                result = await asyncio.wait_for(send, cfg.timeout_s)
                if isinstance(result, Completion):
                    result.attempts = attempt
                    result.latency_s = time.monotonic() - started
                    return result
                last_status, message, retry_after = result
                last_error = f"HTTP {last_status}: {message}"
                if last_status not in RETRY_STATUSES:
                    raise EndpointError(last_error, last_status, attempt)
            except asyncio.TimeoutError:
                last_error = f"Timeout: no complete response within {cfg.timeout_s} s"
            except (httpx.TransportError, httpx.StreamError, httpx.DecodingError, json.JSONDecodeError, KeyError,
                    IndexError, TypeError, AttributeError, MalformedResponse) as exc:
                # AttributeError/TypeError/KeyError/MalformedResponse: a 200 whose JSON is not a completion
                last_error = f"{type(exc).__name__}: {exc}"
            if attempt > cfg.max_retries:
                break
            await asyncio.sleep(backoff_delay(attempt, cfg.backoff_s, cfg.backoff_max_s, retry_after, self._rng))
        raise EndpointError(f"gave up after {cfg.max_retries + 1} attempts; last error: {last_error}",
                            last_status, cfg.max_retries + 1)

    async def _read_body(self, response: httpx.Response) -> bytes:
        """The body, at most max_response_bytes of it (EndpointError beyond); error statuses: the first 64 KiB."""
        limit = self.config.max_response_bytes if response.status_code == 200 else ERROR_BODY_BYTES
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                if response.status_code != 200:
                    chunks.append(chunk[: len(chunk) - (size - limit)])
                    break
                self._too_large()
            chunks.append(chunk)
        return b"".join(chunks)

    async def _lines(self, response: httpx.Response):
        """Lines of a streamed body (str, newline stripped), max_response_bytes in all (EndpointError beyond)."""
        pending, size = bytearray(), 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > self.config.max_response_bytes:
                self._too_large()
            pending += chunk
            if b"\n" in chunk:  # split (one copy) only when a line ended
                *lines, rest = bytes(pending).split(b"\n")
                pending = bytearray(rest)
                for line in lines:
                    yield _decode(line)
        if pending:
            yield _decode(bytes(pending))

    def _too_large(self):
        # not retried: the same request would get the same answer
        raise EndpointError(f"response body exceeds {self.config.max_response_bytes} bytes "
                            f"(max_response_bytes): not read further", 200)

    @staticmethod
    def _error(status: int, raw: bytes, headers) -> tuple[int, str, str | None]:
        text = raw[:500].decode("utf-8", "replace")
        try:
            text = parse_json(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):  # MalformedResponse (deep nesting) is a ValueError
            pass
        return status, text, headers.get("Retry-After")

    async def _send(self, body: dict) -> "Completion | tuple[int, str, str | None]":
        async with self._client.stream("POST", self.config.url, json=body) as response:
            raw = await self._read_body(response)
        if response.status_code != 200:
            return self._error(response.status_code, raw, response.headers)
        data = parse_json(raw)
        choice = data["choices"][0]
        if self.config.endpoint == "chat":
            message = choice.get("message") or {}
            content = message.get("content") or ""
            reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        else:
            content, reasoning = choice.get("text") or "", ""
        text, reasoning = split_reasoning(content, reasoning)
        usage = data.get("usage")
        usage = {} if usage is None else usage
        return Completion(text, reasoning, choice.get("finish_reason"), usage_count(usage, "prompt_tokens"),
                          usage_count(usage, "completion_tokens"), 1, 0.0)

    async def _send_stream(self, body: dict) -> "Completion | tuple[int, str, str | None]":
        content, reasoning = [], []
        finish, usage = None, {}
        async with self._client.stream("POST", self.config.url, json=body) as response:
            if response.status_code != 200:
                return self._error(response.status_code, await self._read_body(response), response.headers)
            done = False
            async with contextlib.aclosing(self._lines(response)) as lines:  # closed here, even on a break
                async for line in lines:
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        done = True
                        break
                    event = parse_json(payload)
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or []:
                        if self.config.endpoint == "chat":
                            delta = choice.get("delta") or {}
                            content.append(delta.get("content") or "")
                            reasoning.append(delta.get("reasoning_content") or delta.get("reasoning") or "")
                        else:
                            content.append(choice.get("text") or "")
                        finish = choice.get("finish_reason") or finish
            if not done and finish is None:
                # the server went away mid-stream: treat like a dropped connection (retried)
                raise httpx.RemoteProtocolError("stream ended before [DONE] and without a finish_reason")
        text, thought = split_reasoning("".join(content), "".join(reasoning))
        return Completion(text, thought, finish, usage_count(usage, "prompt_tokens"),
                          usage_count(usage, "completion_tokens"), 1, 0.0)


def _decode(line: bytes) -> str:
    try:
        return line.decode("utf-8").rstrip("\r")
    except UnicodeDecodeError as exc:
        raise MalformedResponse(f"stream line is not UTF-8: {exc}") from None
