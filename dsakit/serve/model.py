"""``dsakit serve``: an OpenAI-compatible loopback server running a DeepSeek-V4 checkpoint on dsakit's blocks.

The model directory is a transformers ``DeepseekV4ForCausalLM`` checkpoint (config.json, safetensors weights,
a tokenizer). It is loaded strictly (:func:`dsakit.models.checkpoint.load_causal_lm_strict`: a missing,
unexpected, mis-shaped or non-finite tensor stops the server before it listens) and put on dsakit's attention
blocks with :func:`dsakit.integrations.transformers.patch_deepseek_v4`, so the CSA layers keep their index keys
in the chosen format (``--index-key-format``, parsed once here into a :class:`~dsakit.formats.KeyFormat`) and
select ``--topk`` compressed entries per query.

A request's ``"dsakit": {"index_key_format": ..., "topk": ...}`` runs under
:func:`~dsakit.integrations.transformers.layer_settings` (each block reads a replaced copy of its config for
that request; nothing is re-patched). Memory is bounded by :mod:`dsakit.serve.limits`; the model runs one
request at a time, later ones wait in a bounded queue (the HTTP layer's admission), a request whose client
goes away is stopped between two tokens, and streamed tokens are sent as they are made. docs/serve.md.
"""

from __future__ import annotations

import math
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import typer

from .._memory import check_choice, check_instance, check_int
from ..formats import AttentionKVFormat, KeyFormat
from ..ops._backend import BACKENDS
from ..formats import ENTRIES_PER_PAGE
from ..ops.indexer.config import MAX_K, HierarchyConfig
from .chat import chat_messages, render_chat
from .http import CompletionHTTPServer, RequestError, check_loopback
from .limits import MemoryModel, ServerLimits, cache_bytes_per_token, derive_limits
from .service import Completion, CompletionService, check_cancelled, never_cancelled

DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_REQUEST_MEMORY_MB = 2048
DEFAULT_MAX_PENDING = 16
MAX_STOP_SEQUENCES = 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LOCK_POLL_S = 0.05
SUMMARY_BYTES_PER_PAGE = 3 * 128 * 2  # dsakit.pool.PageSummaries: centre, lower, upper bf16 [128] per page


def load_model_dir(path: "str | Path", device: "str | torch.device" = "cpu", dtype: torch.dtype = torch.float32):
    """(model, tokenizer) of a DeepseekV4ForCausalLM checkpoint directory, loaded strictly; ValueError naming
    what is wrong (the directory, config.json, the weights' first bad tensor, the tokenizer, its chat template)."""
    from ..models.checkpoint import read_checkpoint_config

    path = Path(path)
    raw = read_checkpoint_config(path)
    config_file = path / "config.json"
    positions = raw.get("max_position_embeddings")
    check_int("max_position_embeddings", positions, 1,
              message=f"{config_file}: max_position_embeddings must be an int >= 1")
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ValueError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    try:
        from transformers import AutoTokenizer

        from ..models.checkpoint import load_causal_lm_strict
    except ImportError as exc:
        raise ValueError(f"dsakit serve needs transformers with DeepSeek-V4 (pip install 'dsakit[serve]'): "
                         f"{exc}") from None
    model = load_causal_lm_strict(path, dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - tokenizers raise many types on a corrupt file
        raise ValueError(f"cannot load the tokenizer in {path}: {type(exc).__name__}: {exc}") from None
    check_chat_template(tokenizer, path)
    return model.to(device).eval(), tokenizer


def check_chat_template(tokenizer, path) -> None:
    """A tokenizer's own chat template must render a plain conversation (a broken template would otherwise
    answer every chat request with 400)."""
    if not getattr(tokenizer, "chat_template", None):
        return
    try:
        text = tokenizer.apply_chat_template([{"role": "system", "content": "a"}, {"role": "user", "content": "b"}],
                                             tokenize=False, add_generation_prompt=True)
        problem = None if isinstance(text, str) and "b" in text else f"it drops the messages (rendered {text!r})"
    except Exception as exc:  # noqa: BLE001 - jinja raises many types
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        raise ValueError(f"{path}: the tokenizer's chat template does not render a conversation: {problem}")


def longest_token_chars(tokenizer) -> int:
    """Characters of the tokenizer's longest token text (a prompt of more than ``n * this`` characters has more
    than ``n`` tokens). Byte-level tokenizers (pieces of up to 4 bytes per character) are bounded the same."""
    vocab = tokenizer.get_vocab()
    longest = max((len(tokenizer.convert_tokens_to_string([t])) for t in vocab), default=1)
    return max(1, longest)


def memory_model(model) -> MemoryModel:
    """The :class:`MemoryModel` of a patched model (its layers' cache formats, its window)."""
    blocks = [layer.self_attn for layer in model.model.layers]
    kinds = [b.layer_type for b in blocks]
    kv = max(_entry_bytes(AttentionKVFormat.parse(b.kv_format)) for b in blocks)
    # the widest index format any request may pick (an fp8 server still gets bf16 requests)
    index = _entry_bytes(KeyFormat.parse("bf16"))
    if any(b.layer_config.hierarchy is not None for b in blocks):  # the index pools keep page summaries
        index += SUMMARY_BYTES_PER_PAGE // ENTRIES_PER_PAGE
    hca = max((b.layer_config.hca_ratio for b in blocks), default=128)
    return MemoryModel(cache_bytes_per_token(kinds, kv, index, hca), window=max(b.window for b in blocks))


def _entry_bytes(fmt) -> int:
    return -(-fmt.page_bytes // fmt.entries_per_page)  # values, scales and any per-page extra


@dataclass(frozen=True)
class Generation:
    """One request's settings as the runner needs them (objects, checked)."""

    prompt_ids: list
    max_new_tokens: int
    index_key_format: KeyFormat
    topk: int
    query_chunk: int
    stop: tuple = ()


class ModelRunner:
    """A patched DeepseekV4ForCausalLM and its tokenizer; runs one greedy generation at a time.

    ``index_key_format`` (a KeyFormat or its name, parsed here once) / ``topk``: the defaults of every request
    (``topk`` None = the config's index_topk). ``hierarchy``: None (flat top-k) or the
    :class:`~dsakit.ops.indexer.HierarchyConfig` of every request's CSA layers (no per-request override)."""

    def __init__(self, model, tokenizer, *, index_key_format: "KeyFormat | str" = "bf16", topk: int | None = None,
                 backend: str = "auto", max_context: int | None = None,
                 max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, request_memory_mb: int = DEFAULT_REQUEST_MEMORY_MB,
                 max_pending: int = DEFAULT_MAX_PENDING, hierarchy: HierarchyConfig | None = None):
        from ..integrations.transformers import patch_deepseek_v4

        self.model, self.tokenizer = model, tokenizer
        self.device = next(model.parameters()).device
        # the Triton kernels run on CUDA only
        check_choice("--backend", backend, BACKENDS if self.device.type == "cuda" else ("auto", "reference"),
                     what=f"--backend for a model on {self.device.type} (triton runs on CUDA only)")
        self.backend = backend
        self.default_format = KeyFormat.parse(index_key_format)
        config_topk = getattr(model.config, "index_topk", None)
        self.default_topk = config_topk if topk is None else topk
        check_int("--topk", self.default_topk, 1, MAX_K, message=f"--topk must be an int in 1..{MAX_K}")
        if hierarchy is not None:
            check_instance("hierarchy", hierarchy, HierarchyConfig, label="HierarchyConfig or None")
        self.hierarchy = hierarchy
        patch_deepseek_v4(model, self.default_format, self.default_topk, backend=backend, hierarchy=hierarchy)
        self.memory = memory_model(model)
        self.limits: ServerLimits = derive_limits(
            self.memory, request_mb=request_memory_mb, model_context=model.config.max_position_embeddings,
            max_context=max_context, default_topk=self.default_topk, topk_limit=MAX_K,
            max_new_tokens=max_new_tokens, max_pending=max_pending, chars_per_token=longest_token_chars(tokenizer))
        self.eos_ids = self._eos_ids()
        self._lock = threading.Lock()
        self.live_caches: "weakref.WeakSet" = weakref.WeakSet()  # caches of requests still running

    @property
    def max_new_tokens(self) -> int:
        return self.limits.max_new_tokens

    def _eos_ids(self) -> set[int]:
        ids = self.model.config.eos_token_id
        ids = set(ids if isinstance(ids, (list, tuple)) else [ids]) - {None}
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def chat_prompt(self, messages) -> str:
        """The prompt text of a chat request (messages checked, at most ``max_prompt_chars`` of text)."""
        plain = chat_messages(messages, self.limits.max_prompt_chars)
        if not getattr(self.tokenizer, "chat_template", None):
            return render_chat(plain)[0]
        try:
            return self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja errors of the model's own template
            raise RequestError(400, f"the chat template rejects these messages: {exc}") from None

    def acquire(self, cancelled: Callable[[], bool]) -> None:
        """Wait for the model (in the bounded queue the HTTP layer admits), giving up when the client goes."""
        while not self._lock.acquire(timeout=LOCK_POLL_S):
            check_cancelled(cancelled)

    def release(self) -> None:
        self._lock.release()

    def plan(self, prompt_ids: list, max_new_tokens: int, index_key_format: KeyFormat | None = None,
             topk: int | None = None, stop: tuple = ()) -> Generation:
        """A request's settings within the budget: the top-k no larger than the entries the sequence can have
        (a larger one only pads with -1: the same answer), the prefill chunk that fits the budget."""
        tokens = len(prompt_ids) + max_new_tokens
        k = self.default_topk if topk is None else topk
        k = max(1, min(k, math.ceil(tokens / 4)))
        chunk = self.limits.query_chunk(self.memory, tokens, k)
        return Generation(list(prompt_ids), max_new_tokens, index_key_format or self.default_format, k,
                          int(min(chunk, max(len(prompt_ids), 1))), tuple(stop))

    def generate(self, prompt_ids: list, max_new_tokens: int, index_key_format: "KeyFormat | str | None" = None,
                 topk: int | None = None, stop: tuple = ()) -> tuple[str, int, str]:
        """Greedy continuation -> (text, completion tokens, finish_reason 'stop' | 'length') (takes the lock)."""
        fmt = None if index_key_format is None else KeyFormat.parse(index_key_format)
        plan = self.plan(prompt_ids, max_new_tokens, fmt, topk, stop)
        self.acquire(never_cancelled)
        try:
            text, count, finish = "", 0, "length"
            for text, count, finish in self.tokens(plan, never_cancelled):
                pass
            return text, count, finish
        finally:
            self.release()

    def tokens(self, plan: Generation, cancelled: Callable[[], bool]) -> Iterator[tuple[str, int, str | None]]:
        """(text so far, tokens so far, finish_reason or None) after each token; the caller holds the lock.
        Stops with :class:`~dsakit.serve.http.ClientGone` when ``cancelled()`` turns true."""
        from transformers import DynamicCache

        from ..integrations.transformers import layer_settings

        with torch.inference_mode(), layer_settings(self.model, index_key_format=plan.index_key_format,
                                                    topk=plan.topk, query_chunk=plan.query_chunk):
            cache = DynamicCache(config=self.model.config)
            self.live_caches.add(cache)
            try:
                ids = torch.tensor([plan.prompt_ids], dtype=torch.long, device=self.device)
                out: list[int] = []
                text = ""
                for _ in range(plan.max_new_tokens):
                    check_cancelled(cancelled)
                    logits = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits
                    token = int(logits[0, -1].argmax())
                    if token in self.eos_ids:
                        yield text, len(out), "stop"
                        return
                    out.append(token)
                    text = self.tokenizer.decode(out, skip_special_tokens=True)
                    cut = min((text.find(s) for s in plan.stop if s in text), default=-1)
                    if cut >= 0:
                        yield text[:cut], len(out), "stop"
                        return
                    yield text, len(out), None
                    ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
                yield text, len(out), "length"
            finally:
                del cache  # the request's dsakit caches hang off it: dropped here, freed now
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()


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


class ModelService(CompletionService):
    """Completions of a :class:`ModelRunner` (greedy; ``dsakit.reasoning`` is serve-reference's only)."""

    override_keys = ("index_key_format", "topk")

    def __init__(self, runner: ModelRunner, model_name: str):
        self.runner = runner
        self.model_name = model_name
        self.max_context = runner.limits.max_context
        self.max_topk = runner.limits.max_topk

    def begin(self, body, chat: bool, cancelled: Callable[[], bool] = never_cancelled) -> Completion:
        runner = self.runner
        limits = runner.limits
        settings = self.request_settings(body)
        if chat:
            prompt = runner.chat_prompt(body.get("messages"))
            max_tokens = self.max_tokens(body, limits.max_new_tokens)
        else:
            prompt = self.completion_prompt(body, limits.max_prompt_chars)
            max_tokens = self.max_tokens(body, 16)
        stop = _stop_sequences(body)
        max_tokens = min(max_tokens, limits.max_new_tokens)
        runner.acquire(cancelled)  # one tokenizer and one generation at a time: their memory is the budget's
        try:
            prompt_ids = runner.encode(prompt)
            total = len(prompt_ids) + max_tokens
            if total > limits.max_context:
                raise RequestError(400, f"This model's maximum context length is {limits.max_context} tokens. "
                                        f"However, you requested {total} tokens ({len(prompt_ids)} in the prompt, "
                                        f"{max_tokens} for the completion).")
            plan = runner.plan(prompt_ids, max_tokens, settings.index_key_format, settings.topk, stop)
        except BaseException:
            runner.release()
            raise
        return Completion(chat=chat, model_name=self.model_name, prompt_tokens=len(prompt_ids),
                          make_pieces=lambda c: self._pieces(plan, c, cancelled), release=runner.release)

    def _pieces(self, plan: Generation, completion: Completion, cancelled) -> Iterator[tuple[str, str]]:
        """Text deltas as tokens are made. A delta is held back while the text so far ends in the start of a
        stop string, so no part of a stop string is ever sent."""
        sent = ""
        for text, count, finish in self.runner.tokens(plan, cancelled):
            if finish is not None:
                if len(text) > len(sent):
                    yield "content", text[len(sent):]
                completion.finish(finish, count)
                return
            safe = len(text) - _stop_prefix(text, plan.stop)
            # decoding a token may change the text before it (byte fallbacks): send only what stays
            if safe > len(sent) and text.startswith(sent):
                yield "content", text[len(sent):safe]
                sent = text[:safe]


def _stop_prefix(text: str, stops: tuple) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                best = max(best, n)
                break
    return best


def check_device(device: str | None) -> str:
    """'cpu' | 'cuda' | 'cuda:N' that this machine has (default: cuda when available)."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        kind = device
    check_choice("--device", kind, ("cpu", "cuda"), what="--device (cpu or cuda[:N])")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        check_int("--device", torch.device(device).index or 0, 0, count - 1,
                  message=f"--device {device}: " + (f"this machine has {count} CUDA device(s)" if count else
                                                    "CUDA is not available on this machine (use --device cpu)"))
    return device


def hierarchy_config(enabled: bool, pages: int | None = None, exact: bool = False, first_pages: int | None = None,
                     recent_pages: int | None = None) -> HierarchyConfig | None:
    """The server's :class:`HierarchyConfig` from its ``--hierarchy*`` flags (None: off, the default); each flag
    checked with a one-line error naming it (the page options need ``--hierarchy``)."""
    given = {"--hierarchy-pages": pages is not None, "--hierarchy-exact": exact,
             "--hierarchy-first-pages": first_pages is not None, "--hierarchy-recent-pages": recent_pages is not None}
    if not enabled:
        named = [flag for flag, on in given.items() if on]
        if named:
            raise ValueError(f"{named[0]} needs --hierarchy (hierarchical selection is off by default)")
        return None
    check_int("--hierarchy-pages", pages, 1, MAX_K, allow_none=True,
              message=f"--hierarchy-pages must be an int in 1..{MAX_K} (pages stage 1 keeps per query)")
    check_int("--hierarchy-first-pages", first_pages, 0, 1024, allow_none=True,
              message="--hierarchy-first-pages must be an int in 0..1024")
    check_int("--hierarchy-recent-pages", recent_pages, 1, 1024, allow_none=True,
              message="--hierarchy-recent-pages must be an int in 1..1024 (a query's own last page is always kept)")
    defaults = HierarchyConfig()
    return HierarchyConfig(pages=pages, exact=exact,
                           first_pages=defaults.first_pages if first_pages is None else first_pages,
                           recent_pages=defaults.recent_pages if recent_pages is None else recent_pages)


def describe_hierarchy(hierarchy: HierarchyConfig | None) -> str:
    """The banner's words for the selection rule."""
    if hierarchy is None:
        return "flat top-k"
    pages = "default m" if hierarchy.pages is None else f"m {hierarchy.pages}"
    return (f"hierarchical top-k ({pages}, first {hierarchy.first_pages}, recent {hierarchy.recent_pages}"
            f"{', exact' if hierarchy.exact else ''})")


def serve_model(model_dir: str, *, index_key_format: str = "bf16", topk: int | None = None,
                device: str | None = None, dtype: str = "float32", backend: str = "auto",
                host: str = "127.0.0.1", port: int = 0, model_name: str | None = None,
                max_context: int | None = None, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                request_memory_mb: int = DEFAULT_REQUEST_MEMORY_MB, max_pending: int = DEFAULT_MAX_PENDING,
                threads: int = 0, port_file: str | None = None, verbose: bool = False,
                hierarchy: HierarchyConfig | None = None) -> None:
    """Load ``model_dir`` and serve it until SIGINT/SIGTERM (``port = 0`` picks a free port). Every setting is
    checked before the model loads, and the derived limits before the server listens (ValueError).
    ``hierarchy``: None (flat top-k) or the CSA layers' :class:`HierarchyConfig` (:func:`hierarchy_config`)."""
    host = check_loopback(host)
    check_int("--port", port, 0, 65535, message="--port must be an int in 0..65535 (0 = any free port)")
    key_format = KeyFormat.parse(index_key_format)  # the one parse of the server's format
    check_int("--topk", topk, 1, MAX_K, message=f"--topk must be an int in 1..{MAX_K}", allow_none=True)
    check_int("--max-context", max_context, 1, message="--max-context must be an int >= 1 (tokens)", allow_none=True)
    check_int("--max-new-tokens", max_new_tokens, 1, message="--max-new-tokens must be an int >= 1")
    check_int("--threads", threads, 0, message="--threads must be an int >= 0 (0 = torch's default)")
    check_int("--max-pending", max_pending, 1, message="--max-pending must be an int >= 1")
    check_int("--request-memory-mb", request_memory_mb, 1, message="--request-memory-mb must be an int >= 1")
    check_choice("--dtype", dtype, sorted(DTYPES))
    if hierarchy is not None:
        check_instance("hierarchy", hierarchy, HierarchyConfig, label="HierarchyConfig or None")
    check_choice("--backend", backend, BACKENDS)
    device = check_device(device)
    check_choice("--backend", backend, BACKENDS if device.startswith("cuda") else ("auto", "reference"),
                 what=f"--backend on {device} (triton runs on CUDA only)")
    if threads:
        torch.set_num_threads(threads)
    try:  # a server's log: errors only, no progress bars (one line per refusal)
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
    except ImportError:
        pass  # load_model_dir says what is missing
    model, tokenizer = load_model_dir(model_dir, device, DTYPES[dtype])
    runner = ModelRunner(model, tokenizer, index_key_format=key_format, topk=topk, backend=backend,
                         max_context=max_context, max_new_tokens=max_new_tokens,
                         request_memory_mb=request_memory_mb, max_pending=max_pending, hierarchy=hierarchy)
    name = model_name or Path(model_dir).resolve().name
    limits = runner.limits
    server = CompletionHTTPServer((host, port), ModelService(runner, name), verbose=verbose,
                                  max_body_bytes=limits.max_body_bytes, max_pending=limits.max_pending)
    banner = (f"dsakit serve: listening on {server.url} (model '{name}' from {model_dir} on {device}, index keys "
              f"{runner.default_format.name}, top-k {runner.default_topk} (at most {limits.max_topk}, "
              f"{describe_hierarchy(hierarchy)}), max context "
              f"{limits.max_context}, {limits.request_bytes >> 20} MiB per request, {limits.max_pending} requests "
              f"held at most)")
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
                                              help="longest prompt + completion in tokens (default: the config's, "
                                                   "or less if the memory budget affords less)"),
    max_new_tokens: int = typer.Option(DEFAULT_MAX_NEW_TOKENS, "--max-new-tokens", help="cap on max_tokens"),
    request_memory_mb: int = typer.Option(DEFAULT_REQUEST_MEMORY_MB, "--request-memory-mb",
                                          help="memory budget of one request in MiB (limits top-k and context)"),
    max_pending: int = typer.Option(DEFAULT_MAX_PENDING, "--max-pending",
                                    help="completion requests held at once (running + queued); more get 503"),
    threads: int = typer.Option(0, "--threads", help="torch CPU threads (0 = torch's default)"),
    verbose: bool = typer.Option(False, "--verbose", help="log every request"),
    hierarchy: bool = typer.Option(False, "--hierarchy",
                                   help="hierarchical top-k in the CSA layers (page representatives, then exact "
                                        "scores in the pages kept; off by default: flat top-k)"),
    hierarchy_pages: Optional[int] = typer.Option(None, "--hierarchy-pages",
                                                  help="pages stage 1 keeps per query (default: max(16, 4 * "
                                                       "ceil(k / 64))); needs --hierarchy"),
    hierarchy_exact: bool = typer.Option(False, "--hierarchy-exact",
                                         help="also score every page whose bound reaches the k-th score (equals the "
                                              "flat top-k); needs --hierarchy"),
    hierarchy_first_pages: Optional[int] = typer.Option(None, "--hierarchy-first-pages",
                                                        help="first pages always kept (default 1); needs --hierarchy"),
    hierarchy_recent_pages: Optional[int] = typer.Option(None, "--hierarchy-recent-pages",
                                                         help="last pages always kept (default 2); needs --hierarchy"),
) -> None:
    """OpenAI-compatible server running a DeepSeek-V4 checkpoint on dsakit's attention blocks."""
    try:
        rule = hierarchy_config(hierarchy, hierarchy_pages, hierarchy_exact, hierarchy_first_pages,
                                hierarchy_recent_pages)
        serve_model(str(model), index_key_format=index_key_format, topk=topk, device=device, dtype=dtype,
                    backend=backend, host=host, port=port, model_name=model_name, max_context=max_context,
                    max_new_tokens=max_new_tokens, request_memory_mb=request_memory_mb, max_pending=max_pending,
                    threads=threads, port_file=str(port_file) if port_file else None, verbose=verbose,
                    hierarchy=rule)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {' '.join(str(exc).split())}", err=True)  # one line, whatever the message holds
        sys.exit(2)
