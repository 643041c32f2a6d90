"""``dsakit serve``: a DeepSeek-V4 checkpoint behind serve-reference's HTTP layer, on dsakit's blocks (CPU).

A tiny random checkpoint (hidden 64, the shipped model's tokenizer) is written once per module; the server runs
in a thread on a free loopback port. Covers: completions and chat with ``usage.prompt_tokens`` equal to the
tokenizer's count, bad requests (bad JSON, unknown settings, bad top-k / max_tokens / stop, wrong model,
over-long prompts), concurrent clients (queued, none dropped, answers identical to sequential ones),
per-request overrides, caches freed after each request, streaming, and missing or corrupt model directories
(a clear ValueError, exit status 2 from the CLI).
"""

from __future__ import annotations

import gc
import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
pytest.importorskip("tokenizers")

import torch  # noqa: E402

from dsakit.niah.server import ReferenceHTTPServer  # noqa: E402
from dsakit.serve import ModelRunner, ModelService, load_model_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TOKENIZER_DIR = REPO / "models" / "dsakit-v4-tiny"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT = "The amber river watched the quiet farmer.\nThe secret passphrase is ZEBRA-4492-OMEGA.\nAnswer:"


def write_tiny_checkpoint(directory: Path) -> Path:
    from transformers import DeepseekV4ForCausalLM

    from dsakit.models.config import model_config
    from dsakit.models.tokenizer import load_tokenizer

    vocab = load_tokenizer(TOKENIZER_DIR).get_vocab_size()
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(model_config(vocab, topk=4, hidden_size=64, max_positions=512))
    with torch.no_grad():  # transformers leaves the position biases at zero: give the pooling some shape
        for name, p in model.named_parameters():
            if name.endswith("position_bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-v4"))


@pytest.fixture(scope="module")
def served(checkpoint):
    model, tokenizer = load_model_dir(checkpoint)
    runner = ModelRunner(model, tokenizer, index_key_format="bf16", topk=4, max_context=512, max_new_tokens=32)
    server = ReferenceHTTPServer(("127.0.0.1", 0), ModelService(runner, "tiny"))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.url, runner
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def post(url: str, path: str, body, timeout: float = 120.0) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=timeout)
    return httpx.post(url + path, json=body, timeout=timeout)


def test_completion_and_chat_report_usage(served):
    url, runner = served
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
    assert prompt == "<|user|>\nRead this.\nWhat is it?\n<|assistant|>\n"
    assert chat["usage"]["prompt_tokens"] == len(runner.tokenizer(prompt)["input_ids"])
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert httpx.get(url + "/models").json()["data"][0]["id"] == "tiny"


def test_greedy_answer_matches_the_runner_and_caches_are_freed(served):
    url, runner = served
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
    ({"prompt": PROMPT, "dsakit": {"topk": 10 ** 6}}, 400, "exceeds"),
    ({"prompt": PROMPT, "dsakit": {"reasoning": "field"}}, 400, "reasoning"),
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ({"prompt": 7}, 400, "prompt"),
    ({"prompt": PROMPT, "model": "other"}, 404, "does not exist"),
    ({"prompt": "filler " * 600}, 400, "maximum context length"),
    ([1, 2], 400, "JSON object"),
])
def test_bad_requests_get_clear_errors(served, body, status, needle):
    url, _ = served
    r = post(url, "/completions", body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]


def test_bad_chat_messages(served):
    url, _ = served
    for messages in ([], [{"content": "x"}], [{"role": "assistant", "content": "only me"}]):
        r = post(url, "/chat/completions", {"messages": messages})
        assert r.status_code == 400, r.text


def test_concurrent_clients_are_queued_not_dropped(served):
    url, runner = served
    prompts = [f"The {w} river watched the farmer.\nAnswer:" for w in ("amber", "quiet", "rusty", "golden",
                                                                       "narrow", "gentle")]
    expected = [runner.generate(runner.encode(p), 3)[0] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: post(url, "/completions", {"prompt": p, "max_tokens": 3}), prompts))
    assert [r.status_code for r in responses] == [200] * len(prompts)
    assert [r.json()["choices"][0]["text"] for r in responses] == expected
    gc.collect()
    assert len(runner.live_caches) == 0


def test_per_request_overrides_change_the_settings_and_restore_the_defaults(served):
    url, runner = served
    base = runner.generate(runner.encode(PROMPT), 3)
    r = post(url, "/completions", {"prompt": PROMPT, "max_tokens": 3,
                                   "dsakit": {"index_key_format": "fp4", "topk": 1}})
    assert r.status_code == 200, r.text
    attn = runner.model.model.layers[2].self_attn
    assert (attn.index_key_format.name, attn.index_topk) == ("fp4", 1)
    assert runner.generate(runner.encode(PROMPT), 3) == base  # next request: the defaults again
    attn = runner.model.model.layers[2].self_attn
    assert (attn.index_key_format.name, attn.index_topk) == ("bf16", 4)


def test_stop_sequences_and_streaming(served):
    url, runner = served
    full = runner.generate(runner.encode(PROMPT), 6)[0]
    r = post(url, "/completions", {"prompt": PROMPT, "max_tokens": 6, "stream": True,
                                   "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == full
    assert events[-1]["usage"]["completion_tokens"] <= 6
    if len(full) > 1:
        r = post(url, "/completions", {"prompt": PROMPT, "max_tokens": 6, "stop": full[1:]})
        assert r.json()["choices"][0]["text"] == full[:1]
        assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_missing_or_corrupt_model_directory(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="does not exist"):
        load_model_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        load_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not a JSON object"):
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
    _, cpu_runner = served
    model, tokenizer = load_model_dir(checkpoint, device="cuda")
    runner = ModelRunner(model, tokenizer, index_key_format="bf16", topk=4, max_context=512, max_new_tokens=8)
    ids = runner.encode(PROMPT)
    text, count, finish = runner.generate(ids, 4)
    assert 0 <= count <= 4 and finish in ("stop", "length")
    gc.collect()
    assert len(runner.live_caches) == 0
    with torch.inference_mode():
        gpu = runner.model(input_ids=torch.tensor([ids], device="cuda"), use_cache=False).logits[0, -1].float().cpu()
        cpu = cpu_runner.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].float()
    assert float((gpu - cpu).abs().max()) <= 0.03 * float(cpu.abs().max())
