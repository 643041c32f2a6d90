"""The HTTP layer of dsakit's OpenAI-compatible loopback servers (``dsakit serve`` and ``dsakit serve-reference``).

Endpoints (JSON, HTTP/1.1 keep-alive; streaming responses are server-sent events and close the connection):

    GET  /health                 {"status": "ok"}
    GET  /v1/models              the one served model
    POST /v1/chat/completions    handed to the service (:class:`dsakit.serve.service.CompletionService`)
    POST /v1/completions         handed to the service

What this layer bounds, before the service sees a request (docs/serve.md, "Memory and admission"):

* admission: at most ``max_pending`` completion requests are held at once (reading their body, waiting for
  the model or running). One more gets 503 with ``Retry-After`` at once, before its body is read, so a burst
  of clients costs a bounded number of bodies, threads waiting on the model and parsed JSON objects;
* bodies: ``Content-Length`` is required and at most ``max_body_bytes`` (413 above), read with a timeout;
* clients that go away: a non-streamed request is cancelled between two tokens when its socket reaches EOF
  (``cancelled()``, polled by the service), a streamed one when a write fails. Either way the model is free
  for the next request at once;
* streaming: each event is written and flushed as the service yields it (tokens as they are made).

Faults for robustness tests (completion requests only, from a seeded RNG): ``latency`` seconds of delay,
``drop_connection`` probability of closing the socket without answering, ``fail_rate`` probability of an
error status (429 with Retry-After, 500 or 503).
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import select
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .._memory import check_float, check_int

DEFAULT_MAX_BODY_BYTES = 64 << 20
RETRY_AFTER_S = 1


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
    """An OpenAI-style error response (``headers``: extra response headers, e.g. Retry-After)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = headers or {}


class ClientGone(Exception):
    """The client closed its connection: nobody is waiting for the answer (raised inside the service)."""


def check_loopback(host: str) -> str:
    """Accept only loopback addresses ('localhost', 127.x.x.x, ::1); returns the host to bind."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    raise ValueError(f"dsakit servers bind loopback addresses only (127.0.0.1, ::1, localhost), got {host!r}")


class Admission:
    """At most ``capacity`` requests held at once; ``try_enter`` never waits (the caller answers 503)."""

    def __init__(self, capacity: int):
        self.capacity = check_int("max_pending", capacity, 1, message="max_pending must be an int >= 1")
        self._held = 0
        self._lock = threading.Lock()

    def try_enter(self) -> bool:
        with self._lock:
            if self._held >= self.capacity:
                return False
            self._held += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self._held -= 1

    @property
    def held(self) -> int:
        return self._held


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "CompletionHTTPServer"

    @property
    def server_version(self) -> str:  # noqa: D401 - read by BaseHTTPRequestHandler
        return self.server.server_name_header

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

    def _read_body(self):
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError(411, "Content-Length is required")
        try:
            size = int(length)
        except ValueError:
            raise RequestError(400, f"bad Content-Length {length!r}") from None
        limit = self.server.max_body_bytes
        if not 0 <= size <= limit:
            raise RequestError(413, f"request body of {size} bytes exceeds {limit}")
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

    def client_gone(self) -> bool:
        """True when the client closed its side (EOF or an error on the socket). A keep-alive client that
        already sent its next request is still there (its bytes wait in the buffer)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

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
        admission = self.server.admission
        if not admission.try_enter():
            self._send_error(503, f"the server holds {admission.capacity} requests already; retry later",
                             "server_error", {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
            return
        try:
            self._complete(path == "/v1/chat/completions")
        finally:
            admission.leave()

    def _complete(self, chat: bool) -> None:
        try:
            body = self._read_body()
        except RequestError as exc:
            self._send_error(exc.status, str(exc), exc.kind, {"Connection": "close", **exc.headers})
            return
        fault = self.server.draw_fault()
        if fault == "drop":
            self._drop()
            return
        if fault:
            headers = {"Retry-After": "0"} if fault == 429 else None
            self._send_error(fault, f"injected fault (HTTP {fault})", "server_error", headers)
            return
        service = self.server.service
        try:
            if isinstance(body, dict) and body.get("stream"):
                # every check runs (and may answer 4xx) before the 200 and the first event
                self._stream(service.stream(body, chat, self.client_gone))
            else:
                self._send_json(200, service.response(body, chat, self.client_gone))
        except RequestError as exc:
            self._send_error(exc.status, str(exc), exc.kind, exc.headers)
        except ValueError as exc:  # a model's own check of the request (e.g. the retrieval model's)
            self._send_error(400, str(exc), "invalid_request_error")
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away: nobody to answer
        except Exception as exc:  # noqa: BLE001 - a bug must reach the client as a 500, not a dropped socket
            self._send_error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    def _stream(self, events) -> None:
        """Write each event as the service yields it; a failed write closes the generator (which stops the
        generation and frees the model)."""
        first = next(events)  # the service's checks run here, before the status line
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for event in _chain(first, events):
                self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError, ClientGone):
            pass
        except Exception as exc:  # noqa: BLE001 - headers are sent: the stream can only end with an error event
            try:
                error = {"error": {"message": f"internal error: {type(exc).__name__}: {exc}",
                                   "type": "server_error", "code": 500}}
                self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
            except OSError:
                pass
        finally:
            events.close()


def _chain(first, rest):
    yield first
    yield from rest


class CompletionHTTPServer(ThreadingHTTPServer):
    """One thread per connection; ``service`` answers the completion requests (a
    :class:`dsakit.serve.service.CompletionService`)."""

    daemon_threads = True
    allow_reuse_address = True
    # listen backlog: the default of 5 makes the kernel reset connections when a harness opens dozens at once
    # (every accepted connection gets its own thread, so the backlog only has to cover bursts)
    request_queue_size = 256

    def __init__(self, address: tuple[str, int], service, faults: FaultConfig = FaultConfig(),
                 verbose: bool = False, request_timeout: float = 120.0, *,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_pending: int = 256,
                 name: str = "dsakit-serve"):
        if not 0 < request_timeout < float("inf"):
            raise ValueError(f"request_timeout must be a finite number of seconds > 0, got {request_timeout!r}")
        self.request_timeout = request_timeout
        self.max_body_bytes = check_int("max_body_bytes", max_body_bytes, 1)
        self.admission = Admission(max_pending)
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
        self.server_name_header = name
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
        and serve until SIGINT / SIGTERM; the sockets are closed on the way out."""
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
