"""``dsakit serve``: an OpenAI-compatible loopback server running a DeepSeek-V4 checkpoint on dsakit's blocks.

The model directory is a transformers ``DeepseekV4ForCausalLM`` checkpoint (config.json, safetensors
weights, a tokenizer). It is loaded with ``from_pretrained`` and put on dsakit's attention blocks with
:func:`dsakit.integrations.transformers.patch_deepseek_v4`, so the CSA layers keep their index keys in the
chosen format (``--index-key-format``) and select ``--topk`` compressed entries per query.

The HTTP layer is serve-reference's (:class:`dsakit.niah.server.ReferenceHTTPServer`: bounded bodies, 400 on
bad JSON, a listen backlog of 256, one thread per connection, idle connections timed out). The model runs one
request at a time: concurrent requests wait on a lock, in arrival order of the lock, none is dropped. Each
request gets fresh caches (a new transformers cache object holding dsakit's paged caches), dropped when it
ends, so no request sees another's keys and memory returns to the pool.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (``prompt``, ``max_tokens``
default 16, ``stop``, ``stream``) and ``POST /v1/chat/completions`` (``messages``, ``max_tokens`` /
``max_completion_tokens``, default up to ``--max-new-tokens``; the tokenizer's chat template, or
serve-reference's ``<|role|>\\n{content}\\n`` ... ``<|assistant|>\\n`` without one). Decoding is greedy
(``temperature`` and ``top_p`` are accepted and ignored). ``usage.prompt_tokens`` counts the prompt's tokens
with the special tokens the tokenizer adds (BOS). A request may override the index-key format and top-k with
an extra body field ``"dsakit": {"index_key_format": "fp8", "topk": 16}``.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import typer

from ._memory import check_choice, check_int
from .formats import KeyFormat
from .niah.server import (FaultConfig, ReferenceHTTPServer, ReferenceService, RequestError, check_loopback,
                          render_chat)

DEFAULT_MAX_NEW_TOKENS = 256
MAX_STOP_SEQUENCES = 4


@dataclass(frozen=True)
class _Limits:
    """What serve-reference's request checks read from ``service.model.config``."""

    max_context: int


def load_model_dir(path: "str | Path", device: "str | torch.device" = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a DeepseekV4ForCausalLM checkpoint directory; ValueError naming what is wrong."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist (or is not a directory)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{path} has no config.json: not a transformers checkpoint directory")
    try:
        model_type = json.loads(config_file.read_text()).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"{config_file} is not a JSON object: {exc}") from None
    if model_type != "deepseek_v4":
        raise ValueError(f"{config_file} has model_type {model_type!r}; dsakit serve runs 'deepseek_v4' checkpoints")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} has no *.safetensors weights")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ValueError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    try:
        from transformers import AutoTokenizer, DeepseekV4ForCausalLM
    except ImportError as exc:
        raise ValueError(f"dsakit serve needs transformers with DeepSeek-V4 (pip install 'dsakit[serve]'): "
                         f"{exc}") from None
    try:
        model = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - safetensors / transformers raise many types on a corrupt file
        raise ValueError(f"cannot load the checkpoint in {path}: {type(exc).__name__}: {exc}") from None
    return model.to(device).eval(), tokenizer


class ModelRunner:
    """A patched DeepseekV4ForCausalLM and its tokenizer; runs one greedy generation at a time.

    ``index_key_format`` / ``topk``: the defaults of every request (``topk`` None = the config's index_topk).
    """

    def __init__(self, model, tokenizer, *, index_key_format: str = "bf16", topk: int | None = None,
                 backend: str = "auto", max_context: int | None = None,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS):
        from .integrations.transformers import patch_deepseek_v4

        self.model, self.tokenizer = model, tokenizer
        self.backend = backend
        self.device = next(model.parameters()).device
        self.default_format = KeyFormat.parse(index_key_format).name
        self.default_topk = int(model.config.index_topk) if topk is None else topk
        if max_context is None:
            max_context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 131072
        self.config = _Limits(max_context=int(max_context))
        check_int("max_new_tokens", max_new_tokens, 1, message="max_new_tokens must be a positive int")
        self.max_new_tokens = max_new_tokens
        self.eos_ids = self._eos_ids()
        self._lock = threading.Lock()
        self._settings: tuple[str, int] | None = None
        self.live_caches: "weakref.WeakSet" = weakref.WeakSet()  # caches of requests still running
        patch_deepseek_v4(model, self.default_format, self.default_topk, backend=backend)
        self._settings = (self.default_format, self.default_topk)

    def _eos_ids(self) -> set[int]:
        ids = self.model.config.eos_token_id
        ids = set(ids if isinstance(ids, (list, tuple)) else [ids]) - {None}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _configure(self, index_key_format: str, topk: int) -> None:
        """Re-patch the attention blocks when a request asks for other settings (parameters stay shared)."""
        from .integrations.transformers import patch_deepseek_v4, unpatch_deepseek_v4

        if self._settings == (index_key_format, topk):
            return
        unpatch_deepseek_v4(self.model)
        patch_deepseek_v4(self.model, index_key_format, topk, backend=self.backend)
        self._settings = (index_key_format, topk)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_prompt(self, messages: list) -> str:
        """The prompt text of a chat request (serve-reference's checks on ``messages`` run first)."""
        prompt, _ = render_chat(messages)
        if not getattr(self.tokenizer, "chat_template", None):
            return prompt
        plain = [{"role": str(m["role"]), "content": _text_content(m.get("content"))} for m in messages]
        try:
            return self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja errors of the model's own template
            raise RequestError(400, f"the chat template rejects these messages: {exc}") from None

    def generate(self, prompt_ids: list[int], max_new_tokens: int, index_key_format: str | None = None,
                 topk: int | None = None, stop: tuple[str, ...] = ()) -> tuple[str, int, str]:
        """Greedy continuation -> (text, completion tokens, finish_reason 'stop' | 'length')."""
        from transformers import DynamicCache

        fmt = self.default_format if index_key_format is None else KeyFormat.parse(index_key_format).name
        k = self.default_topk if topk is None else topk
        with self._lock, torch.inference_mode():
            self._configure(fmt, k)
            cache = DynamicCache(config=self.model.config)
            self.live_caches.add(cache)
            try:
                return self._decode(cache, prompt_ids, max_new_tokens, stop)
            finally:
                del cache  # the request's dsakit caches hang off it: dropped here, freed now
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    def _decode(self, cache, prompt_ids: list[int], max_new_tokens: int, stop: tuple[str, ...]):
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        out: list[int] = []
        text, finish = "", "length"
        for _ in range(max_new_tokens):
            logits = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            if token in self.eos_ids:
                finish = "stop"
                break
            out.append(token)
            text = self.tokenizer.decode(out, skip_special_tokens=True)
            cut = min((text.find(s) for s in stop if s in text), default=-1)
            if cut >= 0:
                text, finish = text[:cut], "stop"
                break
            ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
        return text, len(out), finish


def _text_content(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def _stop_sequences(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if (not isinstance(stop, list) or len(stop) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOP_SEQUENCES} "
                                f"non-empty strings, got {stop!r}")
    return tuple(stop)


class ModelService(ReferenceService):
    """serve-reference's request handling (model name, overrides, max_tokens, responses, streaming) with a
    :class:`ModelRunner` producing the completions."""

    def __init__(self, runner: ModelRunner, model_name: str):
        super().__init__(runner, model_name, "none")

    def complete(self, body: dict, chat: bool) -> tuple[dict, list[tuple[str, str]], str, dict]:
        fmt, topk, reasoning = self._request_settings(body)
        if reasoning != "none":
            raise RequestError(400, "dsakit.reasoning is a serve-reference setting; a served model answers as it is")
        runner: ModelRunner = self.model
        if chat:
            prompt = runner.chat_prompt(body.get("messages"))
            max_tokens = self._max_tokens(body, runner.max_new_tokens)
        else:
            prompt = self._completion_prompt(body)
            max_tokens = self._max_tokens(body, 16)
        stop = _stop_sequences(body)
        max_tokens = min(max_tokens, runner.max_new_tokens)
        prompt_ids = runner.encode(prompt)
        limit = runner.config.max_context
        if len(prompt_ids) + max_tokens > limit:
            raise RequestError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                    f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the "
                                    f"prompt, {max_tokens} for the completion).")
        text, completion_tokens, finish = runner.generate(prompt_ids, max_tokens, fmt, topk, stop)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                 "total_tokens": len(prompt_ids) + completion_tokens}
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": self.model_name, "reasoning_field": False}
        return meta, [("content", text)], finish, usage


def serve_model(model_dir: str, *, index_key_format: str = "bf16", topk: int | None = None,
                device: str | None = None, dtype: str = "float32", backend: str = "auto",
                host: str = "127.0.0.1", port: int = 0, model_name: str | None = None,
                max_context: int | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                threads: int = 0, port_file: str | None = None, verbose: bool = False) -> None:
    """Load ``model_dir`` and serve it until SIGINT/SIGTERM (``port = 0`` picks a free port)."""
    host = check_loopback(host)
    KeyFormat.parse(index_key_format)
    check_int("--topk", topk, 1, message="--topk must be a positive int", allow_none=True)
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    check_choice("--dtype", dtype, sorted(dtypes))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if threads:
        torch.set_num_threads(threads)
    model, tokenizer = load_model_dir(model_dir, device, dtypes[dtype])
    runner = ModelRunner(model, tokenizer, index_key_format=index_key_format, topk=topk, backend=backend,
                         max_context=max_context, max_new_tokens=max_new_tokens)
    name = model_name or Path(model_dir).resolve().name
    server = ReferenceHTTPServer((host, port), ModelService(runner, name), FaultConfig(), verbose)

    banner = (f"dsakit serve: listening on {server.url} (model '{name}' from {model_dir} on {device}, index keys "
              f"{runner.default_format}, top-k {runner.default_topk}, max context {runner.config.max_context})")
    server.run_until_stopped(banner, "dsakit serve", port_file)


def serve_command(
    model: Path = typer.Option(..., "--model", help="DeepseekV4ForCausalLM checkpoint directory"),
    index_key_format: str = typer.Option("bf16", "--index-key-format",
                                         help="bf16 | fp8 | fp8-ue8m0 | fp4 | fp4-rne | fp8-centred | fp4-centred"),
    topk: Optional[int] = typer.Option(None, "--topk", help="entries the indexer selects (default: the config's)"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu | cuda (default: cuda when available)"),
    dtype: str = typer.Option("float32", "--dtype", help="float32 | bfloat16 weights"),
    backend: str = typer.Option("auto", "--backend", help="auto | reference | triton (dsakit's ops)"),
    host: str = typer.Option("127.0.0.1", "--host", help="loopback address only"),
    port: int = typer.Option(8000, "--port", help="TCP port (0 = any free port)"),
    port_file: Optional[Path] = typer.Option(None, "--port-file", help="write the bound port to this file"),
    model_name: Optional[str] = typer.Option(None, "--model-name", help="name in /v1/models (default: dir name)"),
    max_context: Optional[int] = typer.Option(None, "--max-context",
                                              help="longest prompt + completion in tokens (default: the config's)"),
    max_new_tokens: int = typer.Option(DEFAULT_MAX_NEW_TOKENS, "--max-new-tokens", help="cap on max_tokens"),
    threads: int = typer.Option(0, "--threads", help="torch CPU threads (0 = torch's default)"),
    verbose: bool = typer.Option(False, "--verbose", help="log every request"),
) -> None:
    """OpenAI-compatible server running a DeepSeek-V4 checkpoint on dsakit's attention blocks."""
    try:
        serve_model(str(model), index_key_format=index_key_format, topk=topk, device=device, dtype=dtype,
                    backend=backend, host=host, port=port, model_name=model_name, max_context=max_context,
                    max_new_tokens=max_new_tokens, threads=threads, port_file=str(port_file) if port_file else None,
                    verbose=verbose)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
