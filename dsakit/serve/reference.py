"""``dsakit serve-reference``: an OpenAI-compatible loopback server for testing NIAH harnesses.

Its "model" is :class:`dsakit.niah.retrieval.RetrievalModel`, a transparent retrieval procedure built on
dsakit's indexer (store -> top-k -> read the selected entries). It is not a language model: it answers with
the codes found in the entries its indexer selects, so the index-key format and top-k change what it finds,
exactly as in a DSA deployment.

Chat template: :mod:`dsakit.serve.chat`. ``usage`` counts tokens with the retrieval model's
:class:`~dsakit.niah.retrieval.SimpleTokenizer`. The completion is [reasoning trace (when ``--reasoning`` is
on)] + answer; ``max_tokens`` cuts it and sets ``finish_reason = "length"``, otherwise ``"stop"``. A request
may override the model's settings with ``"dsakit": {"index_key_format": "fp8", "topk": 64, "reasoning":
"field"}``. Streamed answers come a few tokens per event, so clients really have to reassemble.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, Optional

import typer

from .._memory import check_choice
from ..niah.retrieval import RetrievalConfig, RetrievalModel, SimpleTokenizer, question_paragraph
from ..ops.indexer.config import MAX_K
from .chat import chat_messages, render_chat
from .http import CompletionHTTPServer, FaultConfig, RequestError, check_loopback
from .service import REASONING_MODES, Completion, CompletionService, check_cancelled, never_cancelled

DEFAULT_MODEL_NAME = "dsakit-reference"
# tokens per streamed event: answers come in a few pieces, so clients really have to reassemble them
TOKENS_PER_EVENT = 4


class ReferenceService(CompletionService):
    """Answers with a :class:`RetrievalModel`."""

    def __init__(self, model: RetrievalModel, model_name: str = DEFAULT_MODEL_NAME, reasoning: str = "none"):
        check_choice("reasoning", reasoning, REASONING_MODES)
        self.model = model
        self.model_name = model_name
        self.reasoning = reasoning
        self.tokenizer = SimpleTokenizer()
        self.max_context = model.config.max_context
        # no prompt has more entries than tokens; no top-k op selects more than MAX_K
        self.max_topk = min(self.max_context, MAX_K)

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

    def begin(self, body, chat: bool, cancelled: Callable[[], bool] = never_cancelled) -> Completion:
        settings = self.request_settings(body)
        reasoning = settings.reasoning or self.reasoning
        if chat:
            prompt, (start, end) = render_chat(chat_messages(body.get("messages")))
            q_start, _ = question_paragraph(prompt[start:end])
            span: Optional[tuple[int, int]] = (start + q_start, end)
            max_tokens = self.max_tokens(body, None)
        else:
            prompt = self.completion_prompt(body)
            span = None
            max_tokens = self.max_tokens(body, 16)
        limit = self.max_context
        prompt_tokens = self.tokenizer.count(prompt)
        if prompt_tokens > limit:
            raise RequestError(400, f"This model's maximum context length is {limit} tokens. However, you "
                                    f"requested {prompt_tokens} tokens in the prompt.")
        check_cancelled(cancelled)
        result = self.model.retrieve(prompt, key_format=settings.index_key_format, topk=settings.topk,
                                     question_span=span)
        pieces: list[tuple[str, str]] = []
        if reasoning == "field" and chat:
            pieces.append(("reasoning", result.trace()))
        elif reasoning == "tags" or (reasoning == "field" and not chat):
            pieces.append(("content", f"<think>{result.trace()}</think>\n"))
        pieces.append(("content", result.answer))
        kept, completion_tokens, finish = self._cut(pieces, max_tokens)
        return Completion(chat=chat, model_name=self.model_name, prompt_tokens=prompt_tokens,
                          make_pieces=lambda c: self._events(kept, c, finish, completion_tokens),
                          reasoning_field=reasoning == "field" and chat)

    def _events(self, kept, completion: Completion, finish: str, completion_tokens: int):
        """The kept pieces, a few tokens at a time (cut at token boundaries)."""
        for kind, text in kept:
            _, spans = self.tokenizer.tokenize(text)
            cuts = [0] + [spans[i][1] for i in range(TOKENS_PER_EVENT - 1, len(spans) - 1, TOKENS_PER_EVENT)]
            cuts.append(len(text))
            for a, b in zip(cuts, cuts[1:]):
                if b > a:
                    yield kind, text[a:b]
        completion.finish(finish, completion_tokens)


def serve(config: RetrievalConfig, faults: FaultConfig = FaultConfig(), host: str = "127.0.0.1", port: int = 0,
          model_name: str = DEFAULT_MODEL_NAME, reasoning: str = "none", port_file: str | None = None,
          verbose: bool = False) -> None:
    """Run the server until SIGINT/SIGTERM. ``port = 0`` picks a free port; ``port_file`` receives it."""
    import torch

    torch.set_num_threads(1)  # small per-request tensors: threads only add contention on shared CPUs
    service = ReferenceService(RetrievalModel(config), model_name, reasoning)
    server = CompletionHTTPServer((host, port), service, faults, verbose, name="dsakit-serve-reference")

    banner = (f"dsakit serve-reference: listening on {server.url} (model '{model_name}', index keys "
              f"{config.key_format}, top-k {config.topk}, ratio {config.compress_ratio}, common scale "
              f"{config.common_scale}). A retrieval procedure for testing harnesses, not a language model.")
    server.run_until_stopped(banner, "dsakit serve-reference", port_file)


def serve_reference_command(
    host: str = typer.Option("127.0.0.1", "--host", help="loopback address only"),
    port: int = typer.Option(8000, "--port", help="TCP port (0 = any free port)"),
    port_file: Optional[Path] = typer.Option(None, "--port-file", help="write the bound port to this file"),
    model_name: str = typer.Option(DEFAULT_MODEL_NAME, "--model-name", help="name served in /v1/models"),
    index_key_format: str = typer.Option("bf16", "--index-key-format",
                                         help="bf16 | fp8 | fp8-ue8m0 | fp4 | fp4-rne | fp8-centred | fp4-centred"),
    topk: int = typer.Option(128, "--topk", help="entries the indexer selects"),
    ratio: int = typer.Option(4, "--ratio", help="tokens per index entry (mean pooling)"),
    common_scale: float = typer.Option(120.0, "--common-scale",
                                       help="norm of the shared key component over a token's own part "
                                            "(docs/spec.md §6)"),
    max_context: int = typer.Option(131072, "--max-context", help="longest prompt accepted, in tokens"),
    reasoning: str = typer.Option("none", "--reasoning",
                                  help="none | field (reasoning_content) | tags (<think> in the content)"),
    fail_rate: float = typer.Option(0.0, "--fail-rate", help="probability of an injected 429/500/503"),
    latency: float = typer.Option(0.0, "--latency", help="seconds added to every completion request"),
    drop_connection: float = typer.Option(0.0, "--drop-connection",
                                          help="probability of closing the connection without a response"),
    fault_seed: int = typer.Option(0, "--fault-seed", help="seed of the fault injection"),
    verbose: bool = typer.Option(False, "--verbose", help="log every request"),
) -> None:
    """OpenAI-compatible test server whose "model" is a retrieval procedure on dsakit's indexer (not an LLM)."""
    try:
        check_loopback(host)
        config = RetrievalConfig(key_format=index_key_format, topk=topk, compress_ratio=ratio,
                                 common_scale=common_scale, max_context=max_context)
        faults = FaultConfig(fail_rate=fail_rate, latency=latency, drop_connection=drop_connection, seed=fault_seed)
        serve(config, faults, host=host, port=port, model_name=model_name, reasoning=reasoning,
              port_file=str(port_file) if port_file else None, verbose=verbose)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
