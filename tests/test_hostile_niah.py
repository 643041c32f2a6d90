"""Bad input and broken servers against ``dsakit niah`` and ``dsakit serve-reference``.

Every test runs in-process on loopback: a misbehaving OpenAI-style server (each way of reporting a wrong
``usage.prompt_tokens``), the reference server under 64 concurrent clients, malformed request bodies, and CLI
arguments that used to end in tracebacks. Sweeps are bounded by generous timeouts that only a hang reaches.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from dsakit.cli import app
from dsakit.niah.client import EndpointConfig
from dsakit.niah.retrieval import RetrievalConfig, RetrievalModel
from dsakit.serve.http import CompletionHTTPServer, RequestError
from dsakit.serve.reference import ReferenceService
from dsakit.niah.sweep import (CALIBRATION_FILE, ERRORS_FILE, MAX_LENGTH, RESULTS_FILE, RUN_FILE, SweepConfig,
                               run_sweep)
from dsakit.niah.tokens import ReferenceCounter

HANG_GUARD_S = 120  # far above the few seconds these sweeps take; only a hang gets there


# -- a server that lies about usage.prompt_tokens --------------------------------------------------

def _words(body: dict) -> int:
    text = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
    return len(text.split())


# mode -> the raw JSON text of usage.prompt_tokens for a request body
PROMPT_TOKEN_MODES = {
    "constant": lambda body: "7",
    "too-small": lambda body: str(max(1, _words(body) // 200)),  # grows, but 200x too slowly
    "boolean": lambda body: "true",
    "zero": lambda body: "0",
    "string": lambda body: json.dumps(str(_words(body))),
    "nan": lambda body: "NaN",  # Python's json module reads it as float('nan')
    "negative": lambda body: str(-_words(body)),
}


class _LyingHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - signature of the base class
        pass

    def do_POST(self):  # noqa: N802 - http.server naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        tokens = PROMPT_TOKEN_MODES[self.server.mode](body)
        self.server.requests += 1
        message = '{"role": "assistant", "content": "ZEBRA-0000-OMEGA"}'
        data = ('{"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": %s, '
                '"finish_reason": "stop"}], "usage": {"prompt_tokens": %s, "completion_tokens": 3}}'
                % (message, tokens)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _LyingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, mode: str):
        super().__init__(("127.0.0.1", 0), _LyingHandler)
        self.mode = mode
        self.requests = 0


def _sweep_in_thread(coro_factory) -> object:
    """Run a sweep in a daemon thread; fail (instead of hanging the suite) when it does not end in time."""
    box: dict = {}

    def target():
        try:
            box["outcome"] = asyncio.run(coro_factory())
        except BaseException as exc:  # noqa: BLE001 - handed to the test below
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(HANG_GUARD_S)
    assert not thread.is_alive(), f"the sweep did not finish within {HANG_GUARD_S} s"
    if "error" in box:
        raise box["error"]
    return box["outcome"]


MALFORMED = ("boolean", "zero", "string", "nan", "negative")  # not a token count at all


# With a tokenizer a wrong but well-formed count is only recorded next to the local count, so the modes
# that still send an int >= 1 (constant, too small) are swept without one, where they steer calibration.
@pytest.mark.parametrize("mode,tokenizer",
                         [(m, None) for m in PROMPT_TOKEN_MODES] + [(m, "reference") for m in MALFORMED])
def test_bad_prompt_tokens_end_in_an_error_row_not_a_hang(tmp_path, mode, tokenizer):
    malformed = mode in MALFORMED
    server = _LyingServer(mode)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        # two calibration probes: without the word-budget cap the second already lands on a wrong budget
        config = SweepConfig(lengths=(1000,), depths=(0.5,), max_calibration_probes=2, concurrency=1)
        endpoint = EndpointConfig(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", model="m",
                                  max_retries=1, backoff_s=0.0, timeout_s=60)
        counter = ReferenceCounter() if tokenizer else None
        outcome = _sweep_in_thread(lambda: run_sweep(config, endpoint, tmp_path, counter=counter,
                                                     tokenizer_spec=tokenizer))
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
    assert outcome.rows == [] and not (tmp_path / RESULTS_FILE).read_text()
    errors = [json.loads(line) for line in (tmp_path / ERRORS_FILE).read_text().splitlines()]
    assert len(errors) == 1 and errors == outcome.errors
    if tokenizer:
        assert errors[0]["cell"] == "L1000-d0.5000-t0"
    else:
        assert errors[0]["stage"] == "calibration" and errors[0]["length"] == 1000
    assert "prompt_tokens" in errors[0]["error"]
    if malformed:  # retried once (a malformed response may be a transient fault), then given up
        assert "gave up after 2 attempts" in errors[0]["error"] and server.requests == 2
    else:  # one probe, then the fitted budget (4000+ words for 1000 tokens) is refused without a request
        assert "filler words" in errors[0]["error"] and server.requests == 1


def test_sweep_lengths_are_bounded():
    SweepConfig(lengths=(MAX_LENGTH,), depths=(0.5,))
    with pytest.raises(ValueError, match="longest supported context"):
        SweepConfig(lengths=(400_000_000,), depths=(0.5,))


# -- the reference server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_server():
    torch.set_num_threads(1)
    server = CompletionHTTPServer(("127.0.0.1", 0), ReferenceService(RetrievalModel(RetrievalConfig())))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(10)


def _raw_post(address, body: bytes) -> bytes:
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection(address[:2], timeout=60) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


@pytest.mark.parametrize("body", [b'{"prompt": "\xff\xfe hello"}', b"[" * 100_000 + b"]" * 100_000],
                         ids=["invalid-utf8", "nested-100000-deep"])
def test_undecodable_bodies_get_a_400_not_a_dropped_connection(reference_server, body):
    received = _raw_post(reference_server.server_address, body)
    assert received.startswith(b"HTTP/1.1 400 "), received[:200]
    assert b"invalid_request_error" in received


def test_listen_backlog_covers_64_concurrent_clients(reference_server):
    """64 clients connect at the same moment and each sends a completion request: every one is answered."""
    assert CompletionHTTPServer.request_queue_size >= 128  # the default of 5 reset connections under load
    clients = 64
    barrier = threading.Barrier(clients)
    results: list = [None] * clients
    port = reference_server.server_address[1]
    body = json.dumps({"prompt": "The code is ZEBRA-1234-OMEGA.\n\nWhat is the code?", "max_tokens": 8})

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            barrier.wait(60)
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            results[i] = (response.status, json.loads(response.read()))
        except Exception as exc:  # noqa: BLE001 - a reset or refused connection is the failure counted here
            results[i] = exc
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_GUARD_S)
    failures = [r for r in results if not (isinstance(r, tuple) and r[0] == 200)]
    assert not failures, f"{len(failures)} of {clients} requests failed: {failures[:3]}"
    assert all("ZEBRA-1234-OMEGA" in r[1]["choices"][0]["text"] for r in results)


def test_requests_are_bounded_and_bad_fields_are_400():
    service = ReferenceService(RetrievalModel(RetrievalConfig(max_context=4096)))
    prompt = "The code is ZEBRA-1234-OMEGA.\n\nWhat is the code?"
    for topk in (2 ** 40, 10 ** 8, 4097):
        with pytest.raises(RequestError, match="exceeds 4096") as info:
            service.response({"prompt": prompt, "dsakit": {"topk": topk}}, chat=False)
        assert info.value.status == 400
    # the largest allowed top-k runs as the number of entries the prompt has (the rest is padding)
    answer = service.response({"prompt": prompt, "dsakit": {"topk": 4096}}, chat=False)
    assert "ZEBRA-1234-OMEGA" in answer["choices"][0]["text"]
    for parts in ([{"type": "text", "text": 5}], [{"type": "text", "text": ["a"]}], [{"type": "text", "text": None}]):
        with pytest.raises(RequestError, match="must be a string") as info:
            service.response({"messages": [{"role": "user", "content": parts}]}, chat=True)
        assert info.value.status == 400
    with pytest.raises(ValueError, match="topk"):
        service.model.retrieve(prompt, topk=True)


# -- CLI arguments ---------------------------------------------------------------------------------

def _niah(tmp_path: Path, *args: str):
    return CliRunner().invoke(app, ["niah", "--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--lengths", "1k",
                                    "--depths", "0.5", "--max-retries", "0", "--no-progress", *args])


def test_niah_port_out_of_range_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(app, ["niah", "--base-url", "http://127.0.0.1:99999/v1", "--model", "m",
                                      "--out", str(tmp_path / "o")])
    assert result.exit_code == 2 and "Port out of range" in result.output, result.output
    with pytest.raises(ValueError, match="99999"):
        EndpointConfig(base_url="http://127.0.0.1:99999/v1", model="m")


def test_niah_out_on_a_file_or_below_a_file_is_a_usage_error(tmp_path):
    a_file = tmp_path / "taken"
    a_file.write_text("not a directory")
    for out in (a_file, a_file / "below"):
        result = _niah(tmp_path, "--out", str(out))
        assert result.exit_code == 2 and str(out) in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("name,content", [(RUN_FILE, "{not json"), (RUN_FILE, "[1, 2]"),
                                          (CALIBRATION_FILE, "{not json"),
                                          (CALIBRATION_FILE, '{"probes": [{"words": "many"}]}')])
def test_niah_resume_with_a_corrupt_state_file_names_the_file(tmp_path, name, content):
    first = _niah(tmp_path, "--out", str(tmp_path))  # nothing listens on port 9: one calibration error
    assert first.exit_code == 1, first.output
    (tmp_path / name).write_text(content)
    result = _niah(tmp_path, "--out", str(tmp_path), "--resume")
    assert result.exit_code == 2, result.output
    assert str(tmp_path / name) in result.output.replace("\n", "")


@pytest.mark.parametrize("port", ["-1", "65536"])
def test_serve_reference_port_out_of_range_is_a_usage_error(port):
    """socket.bind raised OverflowError (a traceback); now one line naming the port, exit code 2."""
    result = CliRunner().invoke(app, ["serve-reference", "--port", port])
    assert result.exit_code == 2, result.output
    assert f"port must be an int in 0..65535 (0 = any free port), got {port}" in result.output
    assert "Traceback" not in result.output
    with pytest.raises(ValueError, match="port must be"):
        CompletionHTTPServer(("127.0.0.1", int(port)), ReferenceService(RetrievalModel(RetrievalConfig())))


# -- broken 200 responses, lying usage counts, huge grids and bodies (mocked transport, no sockets) -------

def _mock_endpoint(monkeypatch, handler, **kw) -> EndpointConfig:
    """An EndpointConfig whose requests go to ``handler(request) -> httpx.Response`` in-process."""
    import functools

    import httpx

    from dsakit.niah import client as client_module

    monkeypatch.setattr(client_module.httpx, "AsyncClient",
                        functools.partial(httpx.AsyncClient, transport=httpx.MockTransport(handler)))
    return EndpointConfig(base_url="http://127.0.0.1:9/v1", model="m", backoff_s=0.0, **kw)


def _chat(content: str = "ZEBRA-0000-OMEGA", prompt_tokens: int = 100, **extra) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 3}, **extra}


DEEP = "[" * 100_000 + "]" * 100_000  # deeper than json's recursion limit: RecursionError, not JSONDecodeError


@pytest.mark.parametrize("stream", [False, True])
def test_deeply_nested_json_in_a_200_is_an_error_row_not_a_crash(monkeypatch, tmp_path, stream):
    import httpx

    calls = []

    def handler(request):
        calls.append(request)
        if stream:
            return httpx.Response(200, content=f"data: {DEEP}\n\ndata: [DONE]\n\n".encode(),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, content=json.dumps(_chat())[:-1].encode() + b', "junk": ' + DEEP.encode() + b"}")

    endpoint = _mock_endpoint(monkeypatch, handler, max_retries=1, stream=stream)
    config = SweepConfig(lengths=(300,), depths=(0.25, 0.75), concurrency=1)
    outcome = asyncio.run(run_sweep(config, endpoint, tmp_path, counter=ReferenceCounter(),
                                    tokenizer_spec="reference"))
    assert outcome.rows == [] and len(outcome.errors) == 2 and len(calls) == 4  # each cell: retried once
    assert all("nested too deeply" in e["error"] and e["cell"] for e in outcome.errors)
    assert len((tmp_path / ERRORS_FILE).read_text().splitlines()) == 2


@pytest.mark.parametrize("stream", [False, True])
def test_response_bodies_are_capped_while_reading(monkeypatch, tmp_path, stream):
    import httpx

    calls = []

    def handler(request):
        calls.append(request)
        if stream:  # 200 events of ~1 KB: each is fine, together they pass the cap
            event = "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": "x" * 1000}}]}) + "\n\n"
            return httpx.Response(200, content=(event * 200 + "data: [DONE]\n\n").encode(),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=_chat("x" * 200_000))

    endpoint = _mock_endpoint(monkeypatch, handler, max_retries=3, stream=stream, max_response_bytes=64 << 10)
    config = SweepConfig(lengths=(300,), depths=(0.5,), concurrency=1)
    outcome = asyncio.run(run_sweep(config, endpoint, tmp_path, counter=ReferenceCounter(),
                                    tokenizer_spec="reference"))
    assert outcome.rows == [] and len(outcome.errors) == 1 and len(calls) == 1  # refused at once, not retried
    assert f"response body exceeds {64 << 10} bytes" in outcome.errors[0]["error"]
    with pytest.raises(ValueError, match="max_response_bytes"):
        EndpointConfig(base_url="http://127.0.0.1:9/v1", model="m", max_response_bytes=0)


def _usage_handler(counts, requests):
    """Chat responses whose usage.prompt_tokens is ``counts(words of the prompt)``."""
    import httpx

    def handler(request):
        body = json.loads(request.content)
        requests.append(body)
        return httpx.Response(200, json=_chat(prompt_tokens=counts(_words(body))))

    return handler


def _plausible(words: int) -> int:
    return 40 + (4 * words) // 3  # a tokenizer's count: ~1.33 tokens per filler word plus the template


@pytest.mark.parametrize("mode", ["1e18", "random", "decreasing"])
def test_calibration_refuses_implausible_usage_instead_of_running_empty_cells(monkeypatch, tmp_path, mode):
    """These counts used to end in cells with 0 filler words reported as 0 % found and no error."""
    import random

    rng = random.Random(0)
    counts = {"1e18": lambda w: 10 ** 18, "random": lambda w: rng.randint(1, 4000),
              "decreasing": lambda w: max(1, 3000 - w)}[mode]
    requests: list[dict] = []
    endpoint = _mock_endpoint(monkeypatch, _usage_handler(counts, requests), max_retries=0)
    config = SweepConfig(lengths=(1000,), depths=(0.5,), concurrency=1)
    outcome = asyncio.run(run_sweep(config, endpoint, tmp_path))
    assert outcome.rows == [] and [e["stage"] for e in outcome.errors] == ["calibration"]
    assert "usage.prompt_tokens" in outcome.errors[0]["error"]
    assert requests and all(body["max_tokens"] == 1 for body in requests)  # probes only: no cell was run
    assert not (tmp_path / CALIBRATION_FILE).exists()


def test_calibration_accepts_a_plausible_server(monkeypatch, tmp_path):
    requests: list[dict] = []
    endpoint = _mock_endpoint(monkeypatch, _usage_handler(_plausible, requests), max_retries=0)
    outcome = asyncio.run(run_sweep(SweepConfig(lengths=(1000, 3000), depths=(0.5,)), endpoint, tmp_path))
    assert not outcome.errors and len(outcome.rows) == 2
    assert all(abs(r["prompt_tokens"] - r["length"]) <= 0.01 * r["length"] for r in outcome.rows)


def test_huge_trial_counts_are_refused_before_any_cell_exists(tmp_path):
    with pytest.raises(ValueError, match="1000000000 cells"):
        SweepConfig(lengths=(1000,), depths=(0.5,), trials=1_000_000_000)
    assert SweepConfig(lengths=(1000,), depths=(0.5,), multi_needle=True, trials=1000).cell_count == 1000
    result = _niah(tmp_path, "--out", str(tmp_path / "o"), "--trials", "1000000000")
    assert result.exit_code == 2 and "more than 100000" in result.output, result.output


def test_resume_removes_the_errors_it_resolved(monkeypatch, tmp_path):
    """A first run fails the calibration of one length and one cell of the other; a resume finishes every
    cell: errors.jsonl keeps none of those errors. An error of a cell that still has no row stays."""
    import httpx

    state = {"broken": True, "cells": 0}

    def handler(request):
        body = json.loads(request.content)
        words = _words(body)
        probe = body["max_tokens"] == 1
        if not probe:
            state["cells"] += 1
        if state["broken"] and ((probe and words > 1500) or state["cells"] == 1):
            return httpx.Response(400, json={"error": {"message": "broken for now"}})
        return httpx.Response(200, json=_chat(prompt_tokens=_plausible(words)))

    endpoint = _mock_endpoint(monkeypatch, handler, max_retries=0)
    config = SweepConfig(lengths=(1000, 3000), depths=(0.25, 0.75), concurrency=1)
    first = asyncio.run(run_sweep(config, endpoint, tmp_path))
    assert len(first.rows) == 1 and sorted(e.get("stage", "cell") for e in first.errors) == ["calibration", "cell"]
    assert len((tmp_path / ERRORS_FILE).read_text().splitlines()) == 2
    with (tmp_path / ERRORS_FILE).open("a") as fh:
        fh.write(json.dumps({"cell": "L5000-d0.9000-t0", "error": "another grid"}) + "\n")
    state["broken"] = False
    second = asyncio.run(run_sweep(config, endpoint, tmp_path, resume=True))
    assert len(second.rows) == 4 and not second.errors
    left = [json.loads(line) for line in (tmp_path / ERRORS_FILE).read_text().splitlines()]
    assert left == [{"cell": "L5000-d0.9000-t0", "error": "another grid"}]


def test_partial_run_summary_and_heatmap_show_the_whole_grid(tmp_path):
    """Nothing listens on port 9: every length fails calibration. The summary and heatmap still have every
    requested depth and length, each cell 'miss', 'all' counted as not found; exit code 1."""
    result = _niah(tmp_path, "--out", str(tmp_path), "--lengths", "1k,2k", "--depths", "0.25,0.75")
    assert result.exit_code == 1, result.output
    summary = (tmp_path / "summary.txt").read_text()
    lines = summary.splitlines()
    for depth in ("0.25", "0.75"):
        row = next(line for line in lines if line.strip().startswith(depth))
        assert row.split("|")[1].split() == ["miss", "miss"] and row.split("|")[2].split() == ["miss"]
    assert "4 cell(s) have no row" in summary and "4 of 4 requested needle(s) have no row" in summary
    assert (tmp_path / "heatmap.png").read_bytes()[:4] == b"\x89PNG"


def test_extra_body_nested_too_deeply_is_a_usage_error(tmp_path):
    for body, message in ((DEEP, "nested too deeply"), ('{"a": ' * 40 + "1" + "}" * 40, "nested 40 levels deep")):
        result = _niah(tmp_path, "--out", str(tmp_path / "o"), "--extra-body", body)
        assert result.exit_code == 2 and message in result.output, result.output[-500:]
        assert "Traceback" not in result.output
