"""Real sweeps against ``dsakit serve-reference`` running as a separate process on a free loopback port.

Covers: calibration accuracy (no tokenizer), exact fitting (tokenizer), fp8 vs bf16 index keys changing the
found pattern, multi-needle scoring, streaming + reasoning separation, length stops, retries under injected
failures, a server killed and restarted mid-sweep, and a CLI run killed (SIGKILL, then SIGINT) and resumed
without lost or duplicated rows (behind a gate that decides how far each run gets, so the outcome does not
depend on the machine's speed). Every test stops the servers it starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from dsakit.niah.client import EndpointConfig
from dsakit.niah.sweep import Cell, PromptBuilder, SweepConfig, run_sweep
from dsakit.niah.tokens import ReferenceCounter

MODEL = "dsakit-reference"
START_TIMEOUT_S = 120  # the CI machine may be busy: importing torch can take a while
LINE_RE = re.compile(r"^  lines=[ \d]{4} depth=\d\.\d\d prompt_tok=[ \d?]{5} found=(True |False|None ) "
                     r"finish=\S+ ans=(['\"]).*\2$")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``dsakit serve-reference`` in a child process; ``port = 0`` lets the server pick a free port."""

    def __init__(self, workdir: Path, *args: str, port: int = 0):
        self.workdir = workdir
        self.args = args
        self.port = port
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ServerProcess":
        self.workdir.mkdir(parents=True, exist_ok=True)
        port_file = self.workdir / f"port-{time.monotonic_ns()}"
        log = open(self.workdir / "server.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dsakit.cli", "serve-reference", "--port", str(self.port), "--port-file",
             str(port_file), *self.args], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:  # any failure below stops the child: a test never leaves a server running
            deadline = time.monotonic() + START_TIMEOUT_S
            while not port_file.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited: {(self.workdir / 'server.log').read_text()}")
                if time.monotonic() > deadline:
                    raise RuntimeError("server did not start in time")
                time.sleep(0.1)
            self.port = int(port_file.read_text())
            assert httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=10).json() == {"status": "ok"}
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def kill(self) -> None:
        """SIGKILL: what a crashing server looks like."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("plain")).start()
    yield srv
    srv.stop()


def sweep(url: str, out: Path, lengths, depths, *, tokenizer: str | None = None, endpoint: str = "chat",
          extra_body: dict | None = None, multi: bool = False, trials: int = 1, max_tokens: int = 64,
          stream: bool = False, max_retries: int = 8, concurrency: int = 2, resume: bool = False):
    config = SweepConfig(lengths=tuple(lengths), depths=tuple(depths), multi_needle=multi, trials=trials,
                         concurrency=concurrency)
    ep = EndpointConfig(base_url=url, model=MODEL, endpoint=endpoint, max_tokens=max_tokens, stream=stream,
                        timeout_s=60, max_retries=max_retries, backoff_s=0.05, backoff_max_s=0.5,
                        extra_body=extra_body or {})
    counter = ReferenceCounter() if tokenizer == "reference" else None
    return asyncio.run(run_sweep(config, ep, out, counter=counter, tokenizer_spec=tokenizer, resume=resume))


def found_by_length(rows) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in rows:
        out[r["length"]] = out.get(r["length"], 0) + r["found_count"]
    return out


# -- lengths ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_calibration_converges_within_one_percent(server, tmp_path, endpoint):
    outcome = sweep(server.url, tmp_path, [1500, 9000], [0.1, 0.9], endpoint=endpoint, trials=2)
    assert not outcome.errors and len(outcome.rows) == 8
    for row in outcome.rows:
        assert abs(row["prompt_tokens"] - row["length"]) <= 0.01 * row["length"], row["cell"]
        needle = row["needles"][0]
        assert needle["token_exact"] is False and needle["token"] is not None
    # the needle's estimated token position is close to its true one (counted with the server's tokenizer)
    builder = PromptBuilder(SweepConfig(lengths=(1500, 9000), depths=(0.1, 0.9), trials=2), endpoint)
    counter = ReferenceCounter()
    for row in outcome.rows:
        cell = Cell(row["length"], tuple(row["depths"]), row["trial"])
        text = builder.build(cell, row["filler_words"]).text
        assert counter.count(text, endpoint) == row["prompt_tokens"]  # the row describes the prompt sent
        true_position = counter.count_prompt(text[: row["needles"][0]["char"]])
        assert abs(row["needles"][0]["token"] - true_position) <= 0.02 * row["length"] + 5
    cpt = outcome.calibration.chars_per_token
    assert set(cpt) == {1500, 9000} and all(3 < v < 8 for v in cpt.values())
    assert (tmp_path / "calibration.json").exists()
    probes = outcome.calibration.probes
    assert len([p for p in probes if p["length"] == 9000]) <= 3  # the fitted line makes later lengths quick


def test_tokenizer_fits_prompts_exactly(server, tmp_path):
    outcome = sweep(server.url, tmp_path, [800, 5000], [0.3], tokenizer="reference", endpoint="completions")
    assert not outcome.errors
    counter = ReferenceCounter()
    for row in outcome.rows:
        assert row["prompt_tokens"] == row["prompt_tokens_local"]
        assert row["length"] - 3 <= row["prompt_tokens"] <= row["length"]
        needle = row["needles"][0]
        assert needle["token_exact"] and 0 < needle["token"] < row["prompt_tokens"]
        assert outcome.calibration is None and counter.count_prompt("x") == 1


# -- what the index-key format changes --------------------------------------------------------------

def test_fp8_index_keys_lose_the_needle_that_bf16_keeps(server, tmp_path):
    lengths, depths = [1000, 16000], [0.2, 0.5, 0.8]
    bf16 = sweep(server.url, tmp_path / "bf16", lengths, depths, tokenizer="reference",
                 extra_body={"dsakit": {"index_key_format": "bf16"}})
    fp8 = sweep(server.url, tmp_path / "fp8", lengths, depths, tokenizer="reference",
                extra_body={"dsakit": {"index_key_format": "fp8"}})
    assert found_by_length(bf16.rows) == {1000: 3, 16000: 3}
    fp8_found = found_by_length(fp8.rows)
    assert fp8_found[1000] == 3  # short context: the needle stays in the top-k
    assert fp8_found[16000] <= 1  # long context: quantization noise of the shared component buries it
    misses = [r for r in fp8.rows if not r["found"]]
    assert all(r["answer"] and r["finish"] == "stop" for r in misses)  # a wrong answer, not a broken request


def test_multi_needle_scores_each_needle(server, tmp_path):
    bf16 = sweep(server.url, tmp_path / "bf16", [1000, 16000], [0.2, 0.5, 0.8], tokenizer="reference", multi=True)
    assert [r["found_count"] for r in bf16.rows] == [3, 3] and all(r["found"] for r in bf16.rows)
    fp8 = sweep(server.url, tmp_path / "fp8", [16000], [0.2, 0.5, 0.8], tokenizer="reference", multi=True,
                extra_body={"dsakit": {"index_key_format": "fp8"}})
    (row,) = fp8.rows
    flags = [n["found"] for n in row["needles"]]
    assert row["found"] is False and row["found_count"] == flags.count(True)
    assert True in flags and False in flags  # scored needle by needle, not all-or-nothing
    assert sorted(n["depth"] for n in row["needles"]) == [0.2, 0.5, 0.8]
    chars = [n["char"] for n in sorted(row["needles"], key=lambda n: n["depth"])]
    assert chars == sorted(chars)


# -- answers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("endpoint,mode", [("chat", "field"), ("completions", "tags")])
def test_streaming_with_reasoning_is_separated(server, tmp_path, endpoint, mode):
    outcome = sweep(server.url, tmp_path, [2000], [0.5], tokenizer="reference", endpoint=endpoint, stream=True,
                    max_tokens=600, extra_body={"dsakit": {"reasoning": mode}})
    (row,) = outcome.rows
    code = row["needles"][0]["code"]
    assert row["answer"] == code and row["found"] is True and row["finish"] == "stop"
    assert "selected entries" in row["reasoning"] and row["needles"][0]["found_in_reasoning"]
    assert row["prompt_tokens"] == row["prompt_tokens_local"]  # usage arrives in the stream


def test_length_stop_is_reported_not_scored(server, tmp_path):
    outcome = sweep(server.url, tmp_path, [1000], [0.5], tokenizer="reference", max_tokens=400,
                    extra_body={"dsakit": {"reasoning": "field"}})
    assert outcome.rows[0]["found"] is True
    cut = sweep(server.url, tmp_path / "cut", [1000], [0.5], tokenizer="reference", max_tokens=30,
                extra_body={"dsakit": {"reasoning": "field"}})  # the budget runs out inside the reasoning
    (row,) = cut.rows
    assert row["finish"] == "length" and row["answer"] == "" and row["found"] is None


# -- robustness ------------------------------------------------------------------------------------

def test_retries_under_injected_failures(tmp_path):
    # about 45% of requests fail (error status or dropped connection): 12 cells all see a fault with
    # probability 1 - 0.55^12 > 0.999, and 21 failures in a row for one request are out of reach (< 1e-7)
    srv = ServerProcess(tmp_path / "srv", "--fail-rate", "0.35", "--drop-connection", "0.15", "--fault-seed", "3").start()
    try:
        outcome = sweep(srv.url, tmp_path / "out", [1000, 2000, 3000], [0.1, 0.4, 0.6, 0.9], max_retries=20,
                        concurrency=3)
    finally:
        srv.stop()
    assert not outcome.errors and len(outcome.rows) == 12
    assert all(r["found"] for r in outcome.rows)
    assert sum(r["attempts"] for r in outcome.rows) > len(outcome.rows)  # some requests really were retried
    lines = (tmp_path / "out" / "results.jsonl").read_text().splitlines()
    assert len(lines) == len({json.loads(line)["cell"] for line in lines}) == 12


def test_sweep_survives_a_server_restart(tmp_path):
    port = free_port()
    srv = ServerProcess(tmp_path / "srv", "--latency", "0.3", port=port).start()
    results = tmp_path / "out" / "results.jsonl"
    box: dict = {}

    def run():
        try:
            box["outcome"] = sweep(srv.url, tmp_path / "out", [1000, 2000], [0.1, 0.5, 0.9], tokenizer="reference",
                                   max_retries=400, concurrency=1)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread, which reports it
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True)  # a stuck sweep must not keep pytest from exiting
    worker.start()
    try:
        deadline = time.monotonic() + 120
        while not (results.exists() and results.read_text().count("\n") >= 2):
            assert time.monotonic() < deadline and worker.is_alive(), "sweep did not progress"
            time.sleep(0.05)
        srv.kill()  # crash mid-sweep ...
        time.sleep(0.5)
        srv.start()  # ... and come back on the same port
        worker.join(180)
        assert not worker.is_alive()
    finally:
        srv.stop()
        worker.join(5)
    assert "error" not in box, f"the sweep raised {box.get('error')!r}"
    outcome = box["outcome"]
    assert not outcome.errors and len(outcome.rows) == 6 and all(r["found"] for r in outcome.rows)
    assert len(results.read_text().splitlines()) == 6


class GatedProxy:
    """A loopback HTTP proxy in front of a server that forwards only the first ``allowed`` POSTs of a round and
    holds the next ones: a sweep behind it stops making progress at a point the test chose, so a kill or a
    Ctrl-C sent after that point always lands mid-sweep, however fast or slow the machine is.

    :meth:`open_round` starts a round (``allowed=None``: forward everything) and drops the requests held in
    the previous one; call it only once the CLI that sent them has exited.
    """

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")  # http://host:port, without /v1 (the request paths carry it)
        self._cond = threading.Condition()
        self._round = 0
        self._allowed: int | None = 0
        self._passed = 0
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if not gate._take_turn():
                    self.close_connection = True  # its CLI is gone: drop the request unanswered
                    return
                try:
                    resp = httpx.post(gate.upstream + self.path, content=body, timeout=120,
                                      headers={"Content-Type": self.headers.get("Content-Type", "application/json")})
                    self.send_response(resp.status_code)
                    self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
                    self.send_header("Content-Length", str(len(resp.content)))
                    self.end_headers()
                    self.wfile.write(resp.content)
                except (httpx.HTTPError, OSError):  # the client went away mid-answer (killed): nothing to tell it
                    self.close_connection = True

            def log_message(self, *args):
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._http.server_address[1]}/v1"

    def _take_turn(self) -> bool:
        with self._cond:
            mine = self._round
            self._cond.wait_for(lambda: self._round != mine or self._allowed is None or self._passed < self._allowed)
            if self._round != mine:
                return False
            self._passed += 1
            return True

    def open_round(self, allowed: int | None) -> None:
        with self._cond:
            self._round += 1
            self._passed = 0
            self._allowed = allowed
            self._cond.notify_all()

    def close(self) -> None:
        self.open_round(0)  # held requests are dropped, new ones wait for nothing
        self._http.shutdown()
        self._http.server_close()


def _cli(url: str, out: Path, *extra: str, started: list | None = None) -> subprocess.Popen:
    """``dsakit niah`` in a child process; appended to ``started`` so the test's cleanup can kill it."""
    args = [sys.executable, "-m", "dsakit.cli", "niah", "--base-url", url, "--model", MODEL,
            "--lengths", "1000,2000", "--depths", "lin:0.05:0.95:5", "--concurrency", "1", "--tokenizer", "reference",
            "--backoff", "0.05", "--backoff-max", "0.5", "--out", str(out), "--no-progress", *extra]
    # SIGINT back to its default in the child: a shell that starts the test suite in the background (no job
    # control) leaves SIGINT ignored, Python then installs no KeyboardInterrupt handler, and the Ctrl-C below
    # would be ignored while the CLI waits on the held request
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "200"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if started is not None:
        started.append(proc)
    return proc


def _wait_rows(path: Path, count: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (path.exists() and path.read_bytes().count(b"\n") >= count):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"CLI stopped or stalled before {count} rows: {proc.communicate()}")
        time.sleep(0.02)


def test_cli_killed_interrupted_and_resumed_loses_and_duplicates_nothing(tmp_path):
    srv = ServerProcess(tmp_path / "srv", "--latency", "0.25").start()
    gate = GatedProxy(f"http://127.0.0.1:{srv.port}")
    out = tmp_path / "run"
    results = out / "results.jsonl"
    clis: list[subprocess.Popen] = []
    try:
        # a request slower than the per-request timeout is retried, then reported; the cell gets no row
        config = SweepConfig(lengths=(1000,), depths=(0.5,))
        slow = EndpointConfig(base_url=srv.url, model=MODEL, timeout_s=0.1, max_retries=1, backoff_s=0.01)
        timed_out = asyncio.run(run_sweep(config, slow, tmp_path / "timeout", counter=ReferenceCounter()))
        assert timed_out.rows == [] and "Timeout" in timed_out.errors[0]["error"]
        assert (tmp_path / "timeout" / "errors.jsonl").exists()
        assert (tmp_path / "timeout" / "results.jsonl").read_bytes() == b""

        # each CLI below runs behind the gate: one cell = one POST, so a round of n lets exactly n cells finish
        gate.open_round(2)
        first = _cli(gate.url, out, started=clis)
        _wait_rows(results, 2, first)  # 2 rows, and the third cell's request is held: the sweep cannot finish
        first.send_signal(signal.SIGKILL)
        first.wait(30)
        with open(results, "ab") as fh:  # as if the kill had landed in the middle of a write
            fh.write(b'{"cell": "L2000-d0.9500-t0", "fou')
        before = results.read_bytes().rsplit(b"\n", 1)[0] + b"\n"
        assert before.count(b"\n") == 2

        refused = _cli(gate.url, out, started=clis)  # an existing run is never overwritten without --resume
        assert refused.wait(120) == 2 and "--resume" in refused.communicate()[1]

        gate.open_round(2)  # drops the killed CLI's held request
        second = _cli(gate.url, out, "--resume", started=clis)
        _wait_rows(results, before.count(b"\n") + 2, second)
        second.send_signal(signal.SIGINT)  # Ctrl-C while the next cell's request is held: always mid-sweep
        stdout, stderr = second.communicate(timeout=120)  # generous: it only turns a hang into a failure
        assert second.returncode == 130 and "--resume" in stderr
        middle = results.read_bytes()
        assert middle.startswith(before) and middle.endswith(b"\n") and middle.count(b"\n") == 4
        assert all(json.loads(line) for line in middle.splitlines())

        gate.open_round(None)
        third = _cli(gate.url, out, "--resume", started=clis)
        stdout, stderr = third.communicate(timeout=180)
        assert third.returncode == 0, stderr
    finally:
        for proc in clis:  # a failed wait or communicate above leaves its CLI running otherwise
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
        gate.close()
        srv.stop()
    final = results.read_bytes()
    assert final.startswith(middle)
    cells = [json.loads(line)["cell"] for line in final.splitlines()]
    assert len(cells) == len(set(cells)) == 10  # 2 lengths x 5 depths, each exactly once
    assert all(json.loads(line)["found"] for line in final.splitlines())
    # the last run prints every row (old and new) in the line format, then the summary table
    lines = stdout.splitlines()
    assert "resuming:" in lines[0]
    assert "=== needle at START (depth 0.05), distinct filler, sweep length ===" in lines
    assert sum(1 for line in lines if LINE_RE.match(line)) >= 10 + (10 - middle.count(b"\n"))
    assert any(line.startswith("    all |") and line.split("|")[1].split() == ["100%", "100%"] for line in lines)
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "summary.txt").exists() and json.loads((out / "run.json").read_text())["fingerprint"]["model"] == MODEL
