"""``dsakit serve-reference``: an OpenAI-compatible HTTP server on loopback for testing NIAH harnesses.

Its "model" is :class:`dsakit.niah.retrieval.RetrievalModel`, a transparent retrieval procedure built on
dsakit's indexer (store -> top-k -> read the selected entries). It is not a language model: it answers
with the codes found in the entries its indexer selects, so the index-key format and top-k change what it
finds, exactly as in a DSA deployment.

Endpoints (JSON, HTTP/1.1 keep-alive; streaming responses are server-sent events and close the connection):

    GET  /health                 {"status": "ok"}
    GET  /v1/models              the one served model
    POST /v1/chat/completions    messages, max_tokens | max_completion_tokens, stream, stream_options
    POST /v1/completions         prompt, max_tokens (default 16), stream, stream_options

Chat template (applied here, by the server): ``<|role|>\\n{content}\\n`` per message, then
``<|assistant|>\\n``. ``usage`` counts tokens with the server's :class:`SimpleTokenizer`. The completion is
[reasoning trace (when ``--reasoning`` is on)] + answer; ``max_tokens`` cuts it and sets
``finish_reason = "length"``, otherwise ``"stop"``. A request may override the model's settings with an
extra body field ``"dsakit": {"index_key_format": "fp8", "topk": 64, "reasoning": "field"}``.

Faults for robustness tests (applied to completion requests only, from a seeded RNG): ``latency`` seconds
of delay, ``drop_connection`` probability of closing the socket without answering, ``fail_rate``
probability of an error status (429 with Retry-After, 500 or 503).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .._memory import check_choice, check_float, check_int
from ..formats import KeyFormat
from ..ops.indexer.config import MAX_K
from .retrieval import RetrievalConfig, RetrievalModel, SimpleTokenizer, question_paragraph

MAX_BODY_BYTES = 64 << 20
DEFAULT_MODEL_NAME = "dsakit-reference"
REASONING_MODES = ("none", "field", "tags")


@dataclass(frozen=True)
class FaultConfig:
    """Injected faults: probabilities in [0, 1] and a latency in seconds."""

    fail_rate: float = 0.0
    latency: float = 0.0
    drop_connection: float = 0.0
    seed: int = 0

    def __post_init__(self):
        for name in ("fail_rate", "drop_connection", "latency"):
            value = getattr(self, name)
            check_float(name, value)
        for name in ("fail_rate", "drop_connection"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value}")
        # NaN or inf would only fail later, inside time.sleep in a request thread (a dropped connection)
        if not 0 <= self.latency < float("inf"):
            raise ValueError(f"latency must be a finite number of seconds >= 0, got {self.latency}")


class RequestError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.kind = kind


def check_loopback(host: str) -> str:
    """Accept only loopback addresses ('localhost', 127.x.x.x, ::1); returns the host to bind."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    raise ValueError(f"serve-reference binds loopback addresses only (127.0.0.1, ::1, localhost), got {host!r}")


def render_chat(messages: list) -> tuple[str, tuple[int, int]]:
    """Apply the server's chat template -> (prompt, char span of the last user message's last paragraph)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list")
    parts: list[str] = []
    offset = 0
    span: tuple[int, int] | None = None
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise RequestError(400, f"messages[{i}] must be an object with 'role' and 'content'")
        role = str(message["role"])
        content = message.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if not all(isinstance(t, str) for t in texts):
                raise RequestError(400, f"messages[{i}].content: the 'text' of a text part must be a string")
            content = "".join(texts)
        if not isinstance(content, str):
            raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts")
        header = f"<|{role}|>\n"
        if role == "user":
            start, _ = question_paragraph(content)
            span = (offset + len(header) + start, offset + len(header) + len(content.rstrip()))
        piece = f"{header}{content}\n"
        parts.append(piece)
        offset += len(piece)
    prompt = "".join(parts) + "<|assistant|>\n"
    if span is None:
        raise RequestError(400, "messages hold no 'user' message: nothing to answer")
    return prompt, span


class ReferenceService:
    """Turns request bodies into OpenAI-style response bodies (no HTTP here, so it is easy to test)."""

    def __init__(self, model: RetrievalModel, model_name: str = DEFAULT_MODEL_NAME, reasoning: str = "none"):
        check_choice("reasoning", reasoning, REASONING_MODES)
        self.model = model
        self.model_name = model_name
        self.reasoning = reasoning
        self.tokenizer = SimpleTokenizer()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "dsakit",
                                             "max_model_len": self.model.config.max_context}]}

    def _overrides(self, body: dict) -> tuple[str | None, int | None, str]:
        extra = body.get("dsakit") or {}
        if not isinstance(extra, dict):
            raise RequestError(400, "'dsakit' must be an object like {\"index_key_format\": \"fp8\", \"topk\": 64}")
        unknown = sorted(set(extra) - {"index_key_format", "topk", "reasoning"})
        if unknown:
            raise RequestError(400, f"unknown dsakit settings {unknown}; known: index_key_format, topk, reasoning")
        fmt = extra.get("index_key_format")
        topk = extra.get("topk")
        reasoning = extra.get("reasoning", self.reasoning)
        if reasoning not in REASONING_MODES:
            raise RequestError(400, f"dsakit.reasoning must be one of {REASONING_MODES}, got {reasoning!r}")
        try:
            if fmt is not None:
                KeyFormat.parse(fmt)
        except ValueError as exc:
            raise RequestError(400, str(exc)) from None
        if topk is not None and (not isinstance(topk, int) or isinstance(topk, bool) or topk < 1):
            raise RequestError(400, f"dsakit.topk must be a positive int, got {topk!r}")
        # no prompt has more entries than tokens; no top-k op selects more than MAX_K
        limit = min(self.model.config.max_context, MAX_K)
        if topk is not None and topk > limit:
            raise RequestError(400, f"dsakit.topk {topk} exceeds {limit} (the max context of "
                                    f"{self.model.config.max_context} tokens, and the top-k ops' limit {MAX_K})")
        return fmt, topk, reasoning

    def _max_tokens(self, body: dict, default: int | None) -> int | None:
        value = body.get("max_completion_tokens", body.get("max_tokens", default))
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RequestError(400, f"max_tokens must be a positive int, got {value!r}")
        return value

    def _cut(self, pieces: list[tuple[str, str]], max_tokens: int | None) -> tuple[list[tuple[str, str]], int, str]:
        """Cut [(kind, text)] to max_tokens tokens -> (kept pieces, completion tokens, finish_reason)."""
        kept, used = [], 0
        for kind, text in pieces:
            tokens, spans = self.tokenizer.tokenize(text)
            if max_tokens is not None and used + len(tokens) > max_tokens:
                room = max_tokens - used
                if room > 0:
                    kept.append((kind, text[: spans[room - 1][1]]))
                return kept, max_tokens, "length"
            kept.append((kind, text))
            used += len(tokens)
        return kept, used, "stop"

    def _request_settings(self, body) -> tuple:
        """The body's checks every service shares (a JSON object naming this model, if any) -> the per-request
        overrides (index-key format, top-k, reasoning)."""
        if not isinstance(body, dict):
            raise RequestError(400, "request body must be a JSON object")
        name = body.get("model")
        if name is not None and name != self.model_name:
            raise RequestError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                               "not_found_error")
        return self._overrides(body)

    @staticmethod
    def _completion_prompt(body: dict) -> str:
        """A completions request's 'prompt': a string, or a list of one string (as OpenAI clients send it)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise RequestError(400, "'prompt' must be a string (or a list of one string)")
        return prompt

    def complete(self, body: dict, chat: bool) -> tuple[dict, list[tuple[str, str]], str, dict]:
        """-> (meta, [(kind 'reasoning'|'content', text)], finish_reason, usage)."""
        fmt, topk, reasoning = self._request_settings(body)
        if chat:
            prompt, span = render_chat(body.get("messages"))
            max_tokens = self._max_tokens(body, None)
        else:
            prompt = self._completion_prompt(body)
            span = None
            max_tokens = self._max_tokens(body, 16)
        limit = self.model.config.max_context
        prompt_tokens = self.tokenizer.count(prompt)
        if prompt_tokens > limit:
            raise RequestError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                    f"requested {prompt_tokens} tokens in the prompt.")
        result = self.model.retrieve(prompt, key_format=fmt, topk=topk, question_span=span)
        pieces: list[tuple[str, str]] = []
        if reasoning == "field" and chat:
            pieces.append(("reasoning", result.trace()))
        elif reasoning == "tags" or (reasoning == "field" and not chat):
            pieces.append(("content", f"<think>{result.trace()}</think>\n"))
        pieces.append(("content", result.answer))
        kept, completion_tokens, finish = self._cut(pieces, max_tokens)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": self.model_name, "reasoning_field": reasoning == "field" and chat}
        return meta, kept, finish, usage

    def response(self, body: dict, chat: bool) -> dict:
        meta, pieces, finish, usage = self.complete(body, chat)
        reasoning_field = meta.pop("reasoning_field")
        content = "".join(t for k, t in pieces if k == "content")
        reasoning = "".join(t for k, t in pieces if k == "reasoning")
        if chat:
            message = {"role": "assistant", "content": content}
            if reasoning_field:
                message["reasoning_content"] = reasoning or None
            choice = {"index": 0, "message": message, "finish_reason": finish}
            return {**meta, "object": "chat.completion", "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": content, "finish_reason": finish, "logprobs": None}
        return {**meta, "object": "text_completion", "choices": [choice], "usage": usage}

    def stream_events(self, body: dict, chat: bool) -> list[dict]:
        """Server-sent event payloads of a streamed response (without the final [DONE])."""
        meta, pieces, finish, usage = self.complete(body, chat)
        meta.pop("reasoning_field")
        events: list[dict] = []
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta_or_text, finish_reason=None):
            if chat:
                choice = {"index": 0, "delta": delta_or_text, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": delta_or_text, "finish_reason": finish_reason, "logprobs": None}
            return {**meta, "object": obj, "choices": [choice]}

        if chat:
            events.append(chunk({"role": "assistant", "content": ""}))
        for kind, text in pieces:
            # a few pieces per part, cut at token boundaries, so clients really have to reassemble
            _, spans = self.tokenizer.tokenize(text)
            cuts = [0] + [spans[i][1] for i in range(3, len(spans) - 1, 4)] + [len(text)]
            for a, b in zip(cuts, cuts[1:]):
                if b <= a:
                    continue
                piece = text[a:b]
                if chat:
                    events.append(chunk({"reasoning_content": piece} if kind == "reasoning" else {"content": piece}))
                else:
                    events.append(chunk(piece))
        events.append(chunk({} if chat else "", finish))
        options = body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            events.append({**meta, "object": obj, "choices": [], "usage": usage})
        return events


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "dsakit-serve-reference"
    server: "ReferenceHTTPServer"

    def setup(self):
        # bounds every socket read and write: a client that stalls mid-request (headers sent, body never
        # finished) or an idle keep-alive connection gives its thread back instead of holding it forever
        self.timeout = self.server.request_timeout
        super().setup()

    def log_message(self, format, *args):  # noqa: A002 - signature of the base class
        if self.server.verbose:
            super().log_message(format, *args)

    # -- helpers ------------------------------------------------------------------------------------
    def _send_json(self, status: int, payload: dict, headers: dict | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str, kind: str, headers: dict | None = None) -> None:
        self._send_json(status, {"error": {"message": message, "type": kind, "code": status}}, headers)

    def _read_body(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(411, "Content-Length is required")
        try:
            size = int(length)
        except ValueError:
            raise RequestError(400, f"bad Content-Length {length!r}") from None
        if not 0 <= size <= MAX_BODY_BYTES:
            raise RequestError(413, f"request body of {size} bytes exceeds {MAX_BODY_BYTES}")
        raw = self.rfile.read(size)
        try:
            return json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:  # bytes json.loads cannot decode as UTF-8
            raise RequestError(400, f"request body is not valid JSON: {exc}") from None
        except RecursionError:  # arrays or objects nested deeper than the parser's recursion limit
            raise RequestError(400, "request body is nested too deeply") from None

    def _drop(self) -> None:
        """Close the socket without a response (what a crashing server looks like to a client)."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- routes -------------------------------------------------------------------------------------
    def do_GET(self):  # noqa: N802 - http.server naming
        path = self.path.split("?")[0].rstrip("/")
        if path in ("/health", "/v1/health"):
            self._send_json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._send_json(200, self.server.service.models())
        else:
            self._send_error(404, f"no route GET {self.path}", "not_found_error")

    def do_POST(self):  # noqa: N802 - http.server naming
        path = self.path.split("?")[0].rstrip("/")
        # Answers sent before the body is read close the connection (and say so): the unread body bytes
        # would otherwise be parsed as the next request on this keep-alive connection.
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._send_error(404, f"no route POST {self.path}", "not_found_error", {"Connection": "close"})
            return
        try:
            body = self._read_body()
        except RequestError as exc:
            self._send_error(exc.status, str(exc), exc.kind, {"Connection": "close"})
            return
        fault = self.server.draw_fault()
        if fault == "drop":
            self._drop()
            return
        if fault:
            headers = {"Retry-After": "0"} if fault == 429 else None
            self._send_error(fault, f"injected fault (HTTP {fault})", "server_error", headers)
            return
        chat = path == "/v1/chat/completions"
        try:
            if body.get("stream") if isinstance(body, dict) else False:
                events = self.server.service.stream_events(body, chat)
                self._stream(events)
            else:
                self._send_json(200, self.server.service.response(body, chat))
        except RequestError as exc:
            self._send_error(exc.status, str(exc), exc.kind)
        except ValueError as exc:
            self._send_error(400, str(exc), "invalid_request_error")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away: nobody to answer
        except Exception as exc:  # noqa: BLE001 - a bug must reach the client as a 500, not a dropped socket
            self._send_error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    def _stream(self, events: list[dict]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        for event in events:
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


class ReferenceHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # listen backlog: the default of 5 makes the kernel reset connections when a harness opens dozens at once
    # (every accepted connection gets its own thread, so the backlog only has to cover bursts)
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], service: ReferenceService, faults: FaultConfig = FaultConfig(),
                 verbose: bool = False, request_timeout: float = 120.0):
        if not 0 < request_timeout < float("inf"):
            raise ValueError(f"request_timeout must be a finite number of seconds > 0, got {request_timeout!r}")
        self.request_timeout = request_timeout
        port = address[1]
        # socket.bind would raise OverflowError (not an OSError) for -1 or 70000
        check_int("port", port, 0, 65535, message="port must be an int in 0..65535 (0 = any free port)")
        host = check_loopback(address[0])
        if ":" in host:
            self.address_family = socket.AF_INET6
        super().__init__((host, port), _Handler)
        self.service = service
        self.faults = faults
        self.verbose = verbose
        self._rng = random.Random(faults.seed)
        self._rng_lock = threading.Lock()

    def draw_fault(self) -> "str | int | None":
        """Sleep the injected latency, then maybe pick a fault: 'drop', 429, 500, 503 or None."""
        f = self.faults
        if f.latency:
            time.sleep(f.latency)
        with self._rng_lock:
            drop = self._rng.random() < f.drop_connection
            fail = self._rng.random() < f.fail_rate
            status = self._rng.choice((429, 500, 503))
        if drop:
            return "drop"
        return status if fail else None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}/v1"

    def run_until_stopped(self, banner: str, name: str, port_file: str | None = None) -> None:
        """Print ``banner``, write the bound port to ``port_file`` (atomically, for harnesses that picked port 0)
        and serve until SIGINT / SIGTERM; the sockets are closed on the way out. Shared by every dsakit server."""
        def stop(signum, frame):  # raise in the serving thread: serve_forever returns, sockets close
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        print(banner, flush=True)
        if port_file:
            tmp = f"{port_file}.tmp{os.getpid()}"
            with open(tmp, "w") as fh:
                fh.write(str(self.server_address[1]))
            os.replace(tmp, port_file)
        try:
            self.serve_forever(poll_interval=0.2)
        except KeyboardInterrupt:
            pass
        finally:
            self.server_close()
            print(f"{name}: stopped", file=sys.stderr, flush=True)


def serve(config: RetrievalConfig, faults: FaultConfig = FaultConfig(), host: str = "127.0.0.1", port: int = 0,
          model_name: str = DEFAULT_MODEL_NAME, reasoning: str = "none", port_file: str | None = None,
          verbose: bool = False) -> None:
    """Run the server until SIGINT/SIGTERM. ``port = 0`` picks a free port; ``port_file`` receives it."""
    import torch

    torch.set_num_threads(1)  # small per-request tensors: threads only add contention on shared CPUs
    service = ReferenceService(RetrievalModel(config), model_name, reasoning)
    server = ReferenceHTTPServer((host, port), service, faults, verbose)

    banner = (f"dsakit serve-reference: listening on {server.url} (model '{model_name}', index keys "
              f"{config.key_format}, top-k {config.topk}, ratio {config.compress_ratio}, common scale "
              f"{config.common_scale}). A retrieval procedure for testing harnesses, not a language model.")
    server.run_until_stopped(banner, "dsakit serve-reference", port_file)
