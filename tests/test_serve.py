"""``dsakit serve`` (dsakit/serve/): a DeepSeek-V4 checkpoint behind the shared HTTP layer, on dsakit's blocks (CPU).

A tiny random checkpoint (the shipped model's config at hidden 64 and 512 positions, its tokenizer) is written
once per module; the server runs in a thread on a free loopback port with a 256 MiB request budget. Covers:
completions and chat with ``usage.prompt_tokens`` equal to the tokenizer's count, bad requests (each an
OpenAI-style 4xx), concurrent clients, per-request overrides served without re-patching, caches freed after
each request, streaming as tokens are made, cancellation when a client goes away, the memory budget, a
50-client load test, strict checkpoint loading and every startup setting checked before the server listens.
"""

from __future__ import annotations

import gc
import json
import resource
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
pytest.importorskip("tokenizers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from dsakit.formats import KeyFormat  # noqa: E402
from dsakit.ops import indexer as indexer_ops  # noqa: E402
from dsakit.ops.indexer import HierarchyConfig  # noqa: E402
from dsakit.niah.retrieval import SimpleTokenizer  # noqa: E402
from dsakit.niah.tokens import ReferenceCounter  # noqa: E402
from dsakit.serve.chat import render_chat  # noqa: E402
from dsakit.serve.http import CompletionHTTPServer  # noqa: E402
from dsakit.serve.limits import MIB, MemoryModel, derive_limits  # noqa: E402
from dsakit.serve.model import ModelRunner, ModelService, load_model_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "dsakit-v4-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT = "The amber river watched the quiet farmer.\nThe secret passphrase is ZEBRA-4492-OMEGA.\nAnswer:"
BUDGET_MB = 256
MAX_PENDING = 8


def write_tiny_checkpoint(directory: Path, **config_changes) -> Path:
    """The shipped tiny model's config (hidden 64, 512 positions, top-k 4 unless changed), random weights."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    raw = json.loads((TINY / "config.json").read_text())
    raw.update(hidden_size=64, index_topk=4, max_position_embeddings=512, **config_changes)
    for key in ("architectures", "model_type", "transformers_version"):
        raw.pop(key, None)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**raw))
    with torch.no_grad():  # transformers leaves the position biases at zero: give the pooling some shape
        for name, p in model.named_parameters():
            if name.endswith("position_bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-v4"))


def start(service, **kwargs):
    server = CompletionHTTPServer(("127.0.0.1", 0), service, **kwargs)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture(scope="module")
def served(checkpoint):
    model, tokenizer = load_model_dir(checkpoint)
    runner = ModelRunner(model, tokenizer, index_key_format="bf16", topk=4, max_new_tokens=32,
                         request_memory_mb=BUDGET_MB, max_pending=MAX_PENDING)
    server, thread = start(ModelService(runner, "tiny"), max_body_bytes=runner.limits.max_body_bytes,
                           max_pending=runner.limits.max_pending)
    try:
        yield server.url, runner, server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def post(url: str, path: str, body, timeout: float = 120.0) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=timeout)
    return httpx.post(url + path, json=body, timeout=timeout)


def test_completion_and_chat_report_usage(served):
    url, runner, server = served
    r = post(url, "/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny"
    assert body["usage"]["prompt_tokens"] == len(runner.tokenizer(PROMPT)["input_ids"])
    assert body["usage"]["prompt_tokens"] == len(runner.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]) + 1
    assert 0 <= body["usage"]["completion_tokens"] <= 3
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    messages = [{"role": "user", "content": "Read this.\nWhat is it?"}]
    r = post(url, "/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    chat = r.json()
    prompt = runner.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == render_chat(messages)[0] == "<|user|>\nRead this.\nWhat is it?\n<|assistant|>\n"
    assert chat["usage"]["prompt_tokens"] == len(runner.tokenizer(prompt)["input_ids"])
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert httpx.get(url + "/models").json()["data"][0]["id"] == "tiny"


def test_niah_reference_counter_uses_the_servers_chat_template():
    """niah's client counts chat prompts without importing the server: its template must be the server's."""
    content = "long text\n\nWhat is the code?"
    prompt, _ = render_chat([{"role": "user", "content": content}])
    assert ReferenceCounter().count_chat(content) == SimpleTokenizer().count(prompt)


def test_greedy_answer_matches_the_runner_and_caches_are_freed(served):
    url, runner, server = served
    r = post(url, "/completions", {"prompt": PROMPT, "max_tokens": 4})
    text, count, finish = runner.generate(runner.encode(PROMPT), 4)
    assert r.json()["choices"][0]["text"] == text and r.json()["usage"]["completion_tokens"] == count
    gc.collect()
    assert len(runner.live_caches) == 0


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    ({"prompt": PROMPT, "dsakit": {"index_key_format": "fp7"}}, 400, "fp7"),
    ({"prompt": PROMPT, "dsakit": {"speed": 2}}, 400, "unknown dsakit settings"),
    ({"prompt": PROMPT, "dsakit": {"topk": 0}}, 400, "topk"),
    ({"prompt": PROMPT, "dsakit": {"topk": 16384}}, 400, "exceeds"),
    ({"prompt": PROMPT, "dsakit": {"reasoning": "field"}}, 400, "reasoning"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": None}, 400, "max_tokens must be a positive int (or left out), got null"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": None}, 400,
     "max_completion_tokens must be a positive int"),
    (b'{"prompt": "a lone \\ud800 surrogate"}', 400, "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "x\\udfff"}]}', 400, "lone surrogate"),
    ({"prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ({"prompt": 7}, 400, "prompt"),
    ({"prompt": PROMPT, "model": "other"}, 404, "does not exist"),
    ({"prompt": "filler " * 600}, 400, "maximum context length"),
    ({"prompt": "x" * 200_000}, 413, "exceeds"),  # the body limit follows from the longest prompt
    ({"prompt": "filler " * 1000}, 400, "characters"),  # refused by length before the tokenizer runs
    ([1, 2], 400, "JSON object"),
])
def test_bad_requests_get_clear_errors(served, body, status, needle):
    url, _, _ = served
    path = "/chat/completions" if b"messages" in (body if isinstance(body, bytes) else json.dumps(body).encode()) \
        else "/completions"
    r = post(url, path, body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_long_prompts_are_refused_before_the_tokenizer_runs(served, monkeypatch):
    url, runner, server = served
    calls = []
    monkeypatch.setattr(runner, "encode", lambda text: calls.append(len(text)) or [1] * 10)
    limit = runner.limits.max_prompt_chars
    assert post(url, "/completions", {"prompt": "a" * (limit + 1)}).status_code == 400
    messages = [{"role": "user", "content": "a" * (limit // 2)}, {"role": "user", "content": "b" * (limit // 2 + 1)}]
    assert post(url, "/chat/completions", {"messages": messages}).status_code == 400
    assert calls == []


def test_bad_chat_messages(served):
    url, _, _ = served
    for messages in ([], [{"content": "x"}], [{"role": "assistant", "content": "only me"}], [{"role": 3}]):
        r = post(url, "/chat/completions", {"messages": messages})
        assert r.status_code == 400, r.text


def test_concurrent_clients_are_queued_not_dropped(served):
    url, runner, server = served
    prompts = [f"The {w} river watched the farmer.\nAnswer:" for w in ("amber", "quiet", "rusty", "golden")]
    expected = [runner.generate(runner.encode(p), 2)[0] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: post(url, "/completions", {"prompt": p, "max_tokens": 2}), prompts))
    assert [r.status_code for r in responses] == [200] * len(prompts)
    assert [r.json()["choices"][0]["text"] for r in responses] == expected
    gc.collect()
    assert len(runner.live_caches) == 0


def test_per_request_overrides_run_without_repatching(served):
    url, runner, server = served
    blocks = [layer.self_attn for layer in runner.model.model.layers]
    configs = [b.layer_config for b in blocks]
    base = runner.generate(runner.encode(PROMPT), 3)
    seen = []
    hook = blocks[2].register_forward_pre_hook(
        lambda module, args: seen.append((module.index_key_format.name, module.index_topk)))
    try:
        r = post(url, "/completions", {"prompt": PROMPT, "max_tokens": 3,
                                       "dsakit": {"index_key_format": "fp4", "topk": 1}})
    finally:
        hook.remove()
    assert r.status_code == 200, r.text
    assert seen and set(seen) == {("fp4", 1)}  # the request ran on its settings
    assert r.json()["choices"][0]["text"] == runner.generate(runner.encode(PROMPT), 3, KeyFormat.parse("fp4"), 1)[0]
    # the same block objects (nothing re-patched) with the patch's configs back
    assert [layer.self_attn for layer in runner.model.model.layers] == blocks
    assert [b.layer_config for b in blocks] == configs
    assert runner.generate(runner.encode(PROMPT), 3) == base


def test_streaming_sends_each_token_as_it_is_made(served):
    url, runner, server = served
    service = ModelService(runner, "tiny")
    forwards = []
    hook = runner.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        events = service.stream({"prompt": PROMPT, "max_tokens": 4}, chat=False)
        first = next(events)
        assert first["choices"][0]["text"] and len(forwards) == 1  # the first token, before the second forward
        rest = list(events)
    finally:
        hook.remove()
    full = runner.generate(runner.encode(PROMPT), 4)[0]
    assert first["choices"][0]["text"] + "".join(e["choices"][0]["text"] for e in rest) == full
    r = post(url, "/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True,
                                   "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == full
    assert events[-1]["usage"]["completion_tokens"] <= 4
    if len(full) > 1:
        r = post(url, "/completions", {"prompt": PROMPT, "max_tokens": 4, "stop": full[1:]})
        assert r.json()["choices"][0]["text"] == full[:full.find(full[1:])]  # cut at the first occurrence
        assert r.json()["choices"][0]["finish_reason"] == "stop"


def _abandon(address, body: dict) -> None:
    """Send a completion request and close the socket without reading the answer."""
    data = json.dumps(body).encode()
    with socket.create_connection(address, timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
        time.sleep(0.3)  # long enough for the server to start generating


def test_abandoned_requests_stop_generating(served):
    url, runner, server = served
    address = ("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0]))
    forwards = []
    hook = runner.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    try:
        for _ in range(3):
            _abandon(address, {"prompt": PROMPT, "max_tokens": 32})
        deadline = time.monotonic() + 60
        while server.admission.held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.admission.held == 0
    finally:
        hook.remove()
    # three 32-token generations run to the end would take 96 forwards
    assert len(forwards) < 3 * 32 / 2, len(forwards)
    t = time.monotonic()
    assert post(url, "/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    assert time.monotonic() - t < 20


def test_a_request_stays_within_its_memory_budget(served):
    """A 300-token prompt asking for the largest top-k allowed: the process grows by less than the budget
    (before the fix, top-k 16384 on a 300-token prompt grew the server by 22 GB)."""
    url, runner, server = served
    prompt = " ".join(["river"] * 300)
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    r = post(url, "/completions", {"prompt": prompt, "max_tokens": 1, "dsakit": {"topk": runner.limits.max_topk}})
    assert r.status_code == 200, r.text
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert grown < runner.limits.request_bytes, grown


def test_limits_follow_from_the_budget():
    memory = MemoryModel(cache_bytes_per_token=10_000, window=128)
    limits = derive_limits(memory, request_mb=1024, model_context=65536, max_context=None, default_topk=16,
                           topk_limit=16384, max_new_tokens=256, max_pending=4, chars_per_token=10)
    assert 256 < limits.max_context <= 65536 and limits.max_topk >= 16
    # the worst request the limits allow fits the budget: a full context at the largest top-k
    worst = memory.request_bytes(limits.max_context, limits.max_topk,
                                 limits.query_chunk(memory, limits.max_context, limits.max_topk),
                                 limits.max_prompt_chars)
    assert worst <= limits.request_bytes
    # a 16K-token prompt at the default top-k: the prefill chunk keeps the working set inside the budget
    chunk = limits.query_chunk(memory, 16384, 16)
    assert memory.request_bytes(16384, 16, chunk, limits.max_prompt_chars) <= 1024 * MIB
    assert limits.server_bytes() > limits.request_bytes
    with pytest.raises(ValueError, match="request-memory-mb"):
        derive_limits(memory, request_mb=1, model_context=65536, max_context=None, default_topk=16,
                      topk_limit=16384, max_new_tokens=256, max_pending=4, chars_per_token=10)


def test_fifty_clients_mixing_valid_oversized_malformed_and_abandoned_requests(served):
    """The server stays up, every client gets an answer or a clear error (503 + Retry-After when the queue is
    full), resident memory stays under the documented budget, and a normal request afterwards is fast."""
    url, runner, server = served
    address = ("127.0.0.1", int(url.rsplit(":", 1)[1].split("/")[0]))
    limits = runner.limits
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    bodies = [
        {"prompt": PROMPT, "max_tokens": 1},                                  # valid
        {"prompt": "x" * (limits.max_prompt_chars + 10)},                     # oversized prompt
        b"{not json",                                                         # malformed
        {"prompt": PROMPT, "max_tokens": None},                               # null
        {"prompt": PROMPT, "dsakit": {"topk": 16384}},                        # top-k above the budget
        "abandon",                                                            # client goes away
    ]
    barrier = threading.Barrier(50)

    def client(i: int):
        body = bodies[i % len(bodies)]
        barrier.wait(30)
        if body == "abandon":
            _abandon(address, {"prompt": PROMPT, "max_tokens": 32})
            return "abandoned", None
        r = post(url, "/completions", body, timeout=120)
        return r.status_code, r

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(client, range(50)))
    for status, r in results:
        if status == "abandoned":
            continue
        assert status in (200, 400, 413, 503), (status, r.text)
        if status == 503:
            assert r.headers["Retry-After"] and "retry later" in r.json()["error"]["message"]
        elif status != 200:
            assert r.json()["error"]["message"]
    assert any(status == 200 for status, _ in results)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert grown < limits.server_bytes(), grown
    deadline = time.monotonic() + 60
    while server.admission.held and time.monotonic() < deadline:  # abandoned requests stop at their next token
        time.sleep(0.05)
    assert server.admission.held == 0
    t = time.monotonic()
    assert post(url, "/completions", {"prompt": PROMPT, "max_tokens": 2}).status_code == 200
    assert time.monotonic() - t < 20
    assert httpx.get(url + "/health").json() == {"status": "ok"}


# -- loading and startup --------------------------------------------------------------------------------


def test_missing_or_corrupt_model_directory(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="does not exist"):
        load_model_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json that is a JSON object"):
        load_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="no config.json that is a JSON object"):
        load_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="deepseek_v4"):
        load_model_dir(tmp_path)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(checkpoint, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="cannot load the checkpoint"):
        load_model_dir(corrupt)
    (corrupt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model_dir(corrupt)


def _error_lines(output: str) -> int:
    """Lines of the CLI's error (transformers may log a warning about the test config's rope beside it)."""
    return sum(1 for line in output.splitlines() if line.startswith("error:"))


def _edit_weights(directory: Path, edit) -> None:
    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


def _bad_checkpoints(checkpoint: Path, root: Path):
    def copy(name):
        return Path(shutil.copytree(checkpoint, root / name))

    missing = copy("missing")
    # the file keeps DeepSeek's names (attn.wkv); the error names the model's (self_attn.kv_proj)
    _edit_weights(missing, lambda t: t.pop("model.layers.2.attn.wkv.weight"))
    yield missing, "missing tensor 'model.layers.2.self_attn.kv_proj.weight'"
    head = copy("no-head")
    _edit_weights(head, lambda t: t.pop("head.weight"))
    yield head, "missing tensor 'lm_head.weight'"
    nan = copy("nan")
    _edit_weights(nan, lambda t: t["model.layers.1.attn.wq_a.weight"].view(-1)[0].fill_(float("nan")))
    yield nan, "'model.layers.1.self_attn.q_a_proj.weight' has non-finite values"
    for name, layers in (("more-layers", 5), ("fewer-layers", 3)):
        changed = copy(name)
        raw = json.loads((changed / "config.json").read_text())
        raw["num_hidden_layers"] = layers
        raw["layer_types"] = (raw["layer_types"] + ["compressed_sparse_attention"])[:layers]
        raw["mlp_layer_types"] = (raw["mlp_layer_types"] + ["moe"])[:layers]
        (changed / "config.json").write_text(json.dumps(raw))
        yield changed, "missing tensor 'model.layers.4." if layers == 5 else "unexpected tensor 'model.layers.3."


def test_bad_checkpoints_stop_the_server_before_it_listens(tmp_path, checkpoint, monkeypatch):
    from typer.testing import CliRunner

    from dsakit.cli import app

    def listened(*args, **kwargs):
        raise AssertionError("the server listened")

    monkeypatch.setattr(CompletionHTTPServer, "run_until_stopped", listened)
    for directory, needle in _bad_checkpoints(checkpoint, tmp_path):
        with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
            load_model_dir(directory)
        result = CliRunner().invoke(app, ["serve", "--model", str(directory), "--port", "0"])
        assert result.exit_code == 2, (directory.name, result.output)
        assert needle in result.output and _error_lines(result.output) == 1, result.output
        assert "Traceback" not in result.output


@pytest.fixture
def broken_template(tmp_path, checkpoint) -> Path:
    directory = Path(shutil.copytree(checkpoint, tmp_path / "template"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for message in messages %}{{ message['content'] }"  # unclosed tag
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def negative_positions(tmp_path, checkpoint) -> Path:
    directory = Path(shutil.copytree(checkpoint, tmp_path / "negative"))
    raw = json.loads((directory / "config.json").read_text())
    raw["max_position_embeddings"] = -4
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


@pytest.mark.parametrize("args, needle, model", [
    (["--max-context", "0"], "--max-context must be an int", None),
    (["--max-context", "100000"], "--max-context must be an int in 1..512", None),
    (["--topk", "1000000"], "--topk must be an int in 1..16384", None),
    (["--backend", "triton", "--device", "cpu"], "triton runs on CUDA only", None),
    (["--threads", "-1"], "--threads must be an int >= 0", None),
    (["--device", "tpu"], "--device (cpu or cuda[:N])", None),
    (["--request-memory-mb", "0"], "--request-memory-mb must be an int >= 1", None),
    (["--request-memory-mb", "1"], "affords", None),
    (["--max-pending", "0"], "--max-pending must be an int >= 1", None),
    (["--max-new-tokens", "600"], "must leave room for a prompt", None),
    (["--hierarchy-pages", "4"], "--hierarchy-pages needs --hierarchy", None),
    (["--hierarchy-exact"], "--hierarchy-exact needs --hierarchy", None),
    (["--hierarchy", "--hierarchy-pages", "0"], "--hierarchy-pages must be an int in 1..16384", None),
    (["--hierarchy", "--hierarchy-recent-pages", "0"], "--hierarchy-recent-pages must be an int in 1..1024", None),
    (["--hierarchy", "--hierarchy-first-pages", "-1"], "--hierarchy-first-pages must be an int in 0..1024", None),
    ([], "chat template does not render", "broken_template"),
    ([], "max_position_embeddings must be an int >= 1", "negative_positions"),
])
def test_every_setting_is_checked_before_the_server_listens(request, checkpoint, monkeypatch, args, needle, model):
    from typer.testing import CliRunner

    from dsakit.cli import app

    def listened(*a, **k):
        raise AssertionError("the server listened")

    monkeypatch.setattr(CompletionHTTPServer, "run_until_stopped", listened)
    directory = request.getfixturevalue(model) if model else checkpoint
    result = CliRunner().invoke(app, ["serve", "--model", str(directory), "--port", "0", *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output, result.output
    assert _error_lines(result.output) == 1 and "Traceback" not in result.output


def test_hierarchy_flags_reach_the_csa_layers(checkpoint, monkeypatch):
    """``dsakit serve --hierarchy --hierarchy-pages 2 --hierarchy-exact``: the runner and every CSA block get
    that HierarchyConfig (the other blocks have no indexer), the banner names it, the memory model counts the
    page summaries."""
    from typer.testing import CliRunner

    from dsakit.cli import app

    seen = {}

    def listened(server, banner, *args):
        runner = server.service.runner
        seen["banner"] = banner
        seen["runner"] = runner.hierarchy
        seen["blocks"] = {layer.self_attn.layer_type: layer.self_attn.hierarchy for layer in runner.model.model.layers}
        seen["bytes"] = runner.memory.cache_bytes_per_token

    monkeypatch.setattr(CompletionHTTPServer, "run_until_stopped", listened)
    result = CliRunner().invoke(app, ["serve", "--model", str(checkpoint), "--port", "0", "--hierarchy",
                                      "--hierarchy-pages", "2", "--hierarchy-exact"])
    assert result.exit_code == 0, result.output
    rule = HierarchyConfig(pages=2, exact=True)
    assert seen["runner"] == rule and seen["blocks"]["csa"] == rule
    assert all(h is None for kind, h in seen["blocks"].items() if kind != "csa")
    assert "hierarchical top-k (m 2, first 1, recent 2, exact)" in seen["banner"]
    with_summaries = seen["bytes"]
    result = CliRunner().invoke(app, ["serve", "--model", str(checkpoint), "--port", "0"])
    assert result.exit_code == 0 and "flat top-k" in seen["banner"] and seen["blocks"]["csa"] is None
    assert with_summaries > seen["bytes"]  # the summaries' 12 B per index entry


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory, checkpoint) -> Path:
    """The test checkpoint with 1024 positions: room for prompts of 3+ index pages (> 512 tokens)."""
    directory = Path(shutil.copytree(checkpoint, tmp_path_factory.mktemp("long") / "tiny"))
    raw = json.loads((directory / "config.json").read_text())
    raw["max_position_embeddings"] = 1024
    (directory / "config.json").write_text(json.dumps(raw))
    return directory


def test_a_request_served_with_the_hierarchy_on(long_checkpoint, monkeypatch):
    """One completion through a server whose CSA layers select hierarchically (the exact mode with the fewest
    pages: m 1, no first page, one recent page) over a 3-page prompt: it calls hierarchical_topk (prefill and
    every decode step) and answers what the flat runner answers."""
    prompt = "\n".join([PROMPT] * 22)
    flat = ModelRunner(*load_model_dir(long_checkpoint), topk=4, max_new_tokens=8, request_memory_mb=BUDGET_MB)
    ids = flat.encode(prompt)
    assert 2 * 64 * 4 < len(ids) <= 1000  # 3 index pages of 64 entries (ratio 4)
    expected = flat.generate(ids, 2)
    runner = ModelRunner(*load_model_dir(long_checkpoint), topk=4, max_new_tokens=8, request_memory_mb=BUDGET_MB,
                         hierarchy=HierarchyConfig(pages=1, first_pages=0, recent_pages=1, exact=True))
    calls = []
    real = indexer_ops.hierarchical_topk

    def counted(q, weights, batch, k, **kwargs):
        calls.append((q.shape[0], batch.summaries is not None))
        return real(q, weights, batch, k, **kwargs)

    monkeypatch.setattr(indexer_ops, "hierarchical_topk", counted)
    server, thread = start(ModelService(runner, "tiny"), max_body_bytes=runner.limits.max_body_bytes)
    try:
        r = post(server.url, "/completions", {"prompt": prompt, "max_tokens": 2})
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert r.status_code == 200, r.text
    assert (r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]) == expected[:2]
    csa_layers = sum(layer.self_attn.layer_type == "csa" for layer in runner.model.model.layers)
    assert calls and all(has_summaries for _, has_summaries in calls)
    decode_steps = expected[1] - (expected[2] == "length")  # the last token is fed back only before an EOS
    assert sum(t for t, _ in calls) == csa_layers * (len(ids) + decode_steps)  # every query of every CSA layer


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused_at_startup(checkpoint):
    from typer.testing import CliRunner

    from dsakit.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", str(checkpoint), "--port", "0", "--device", "cuda"])
    assert result.exit_code == 2 and "CUDA is not available" in result.output, result.output


def test_cli_reports_a_missing_model_directory(tmp_path):
    from typer.testing import CliRunner

    from dsakit.cli import app

    result = CliRunner().invoke(app, ["serve", "--model", str(tmp_path / "missing"), "--port", "0"])
    assert result.exit_code == 2
    assert "does not exist" in result.output


@pytest.mark.gpu
def test_serve_runs_on_cuda_like_on_the_cpu(checkpoint, served):
    """The same checkpoint served on CUDA (Triton kernels): a request completes, its caches are freed, and the
    prompt's last logits match the CPU's within 3% of the largest logit (bf16 kernels against the fp32 spec)."""
    _, cpu_runner, _ = served
    model, tokenizer = load_model_dir(checkpoint, device="cuda")
    runner = ModelRunner(model, tokenizer, index_key_format="bf16", topk=4, max_new_tokens=8,
                         request_memory_mb=BUDGET_MB)
    ids = runner.encode(PROMPT)
    text, count, finish = runner.generate(ids, 4)
    assert 0 <= count <= 4 and finish in ("stop", "length")
    gc.collect()
    assert len(runner.live_caches) == 0
    with torch.inference_mode():
        gpu = runner.model(input_ids=torch.tensor([ids], device="cuda"), use_cache=False).logits[0, -1].float().cpu()
        cpu = cpu_runner.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    assert float((gpu - cpu).abs().max()) <= 0.03 * float(cpu.abs().max())
