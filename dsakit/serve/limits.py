"""The memory budget of ``dsakit serve``, and the limits derived from it (docs/serve.md, "Memory and admission").

One request's memory above the loaded model, on the CPU reference ops, is modelled as

    request_bytes = tokens * cache_bytes_per_token                       (paged caches of every layer)
                  + query_chunk * (window + topk) * WORK_BYTES_PER_READ  (attention working set of a chunk)
                  + prompt_chars * TOKENIZER_BYTES_PER_CHAR               (the tokenizer's own buffers)

where a "read" is one cached entry gathered for one query (512 fp32 values, plus the scores, the dequantised
copy and the softmax: measured about 4 KiB on the tiny model, see the constant). The server refuses a setting
(at startup) or a request (with a 400) whose model exceeds ``--request-memory-mb``: top-k above what one
decode step can afford, a context whose caches do not fit, and it picks the prefill chunk so that the working
set of a chunk fits what the caches leave. Only one request runs at a time, so the server's resident memory
stays under ``loaded model + request budget + max_pending * max_body_bytes * JSON_BYTES_PER_BODY_BYTE``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._memory import check_int

MIB = 1 << 20
# attention working set per (query, gathered entry), CPU reference ops, fp32: measured with the tiny model
# (4 layers, 2 heads of 512, window 16) as the peak RSS growth of one prefill + 2 decode steps: 300 tokens at
# top-k 1024 / 4096 (chunk = the prompt): +1206 / +4784 MB; 4096 tokens at top-k 1024, chunk 512: +2215 MB
# => 3.9 KiB per read in each; 6 KiB leaves a 1.5x margin
WORK_BYTES_PER_READ = 6 << 10
# the tokenizer's buffers: 160-290 MB per MB of prompt measured on the tiny model's tokenizer (issue 35)
TOKENIZER_BYTES_PER_CHAR = 320
# parsed JSON per body byte (Python str + dict overhead of a prompt-sized body): ~1-4x, a margin of 8
JSON_BYTES_PER_BODY_BYTE = 8
# bytes of a body per prompt character at most: JSON escapes a character as \\uXXXX (6 bytes), plus the
# body's other fields
BODY_BYTES_PER_CHAR = 6
BODY_OVERHEAD_BYTES = 64 << 10
MIN_QUERY_CHUNK = 16


@dataclass(frozen=True)
class MemoryModel:
    """Bytes one request needs, from the model's geometry (see the module docstring)."""

    cache_bytes_per_token: int
    window: int

    def work_bytes(self, query_chunk: int, topk: int) -> int:
        return query_chunk * (self.window + topk) * WORK_BYTES_PER_READ

    def request_bytes(self, tokens: int, topk: int, query_chunk: int, prompt_chars: int = 0) -> int:
        return (tokens * self.cache_bytes_per_token + self.work_bytes(query_chunk, topk)
                + prompt_chars * TOKENIZER_BYTES_PER_CHAR)


def cache_bytes_per_token(layer_types: list[str], kv_entry_bytes: int, index_entry_bytes: int,
                          hca_ratio: int) -> int:
    """Paged-cache bytes one token costs across the layers (main KV on every layer; a compressed entry per 4
    tokens on csa layers plus an index key; per ``hca_ratio`` on hca layers), twice over: pools grow by
    doubling."""
    total = 0
    for kind in layer_types:
        total += kv_entry_bytes
        if kind == "csa":
            total += (kv_entry_bytes + index_entry_bytes) / 4
        elif kind == "hca":
            total += kv_entry_bytes / hca_ratio
    return int(2 * total) + 1


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for, all derived at startup and checked there (ValueError, one line).

    max_context: prompt + completion tokens. max_new_tokens: cap on max_tokens. max_topk: largest top-k a
    request may ask for. request_bytes: the per-request memory budget. max_prompt_chars: longest prompt text
    (checked before tokenizing: no token is shorter than a character... of the prompt, see
    :func:`derive_limits`). max_body_bytes, max_pending: the HTTP layer's bounds."""

    max_context: int
    max_new_tokens: int
    max_topk: int
    request_bytes: int
    max_prompt_chars: int
    max_body_bytes: int
    max_pending: int

    def server_bytes(self) -> int:
        """Memory above the loaded model the server may use at once: one request running, every admitted
        request's body read and parsed."""
        return self.request_bytes + self.max_pending * self.max_body_bytes * JSON_BYTES_PER_BODY_BYTE

    def query_chunk(self, memory: MemoryModel, tokens: int, topk: int) -> int:
        """The prefill chunk whose working set fits what the caches of ``tokens`` tokens leave of the budget."""
        left = self.request_bytes - tokens * memory.cache_bytes_per_token - \
            self.max_prompt_chars * TOKENIZER_BYTES_PER_CHAR
        per_query = memory.work_bytes(1, topk)
        return max(MIN_QUERY_CHUNK, left // per_query)


def derive_limits(memory: MemoryModel, *, request_mb: int, model_context: int, max_context: int | None,
                  default_topk: int, topk_limit: int, max_new_tokens: int, max_pending: int,
                  chars_per_token: int) -> ServerLimits:
    """The limits of a server with ``request_mb`` MiB per request. ``model_context``: the config's
    ``max_position_embeddings``; ``max_context`` None = the largest the budget affords, up to it; ``topk_limit``:
    the top-k ops' limit; ``chars_per_token``: the longest token text of the tokenizer, so that a prompt of more
    than ``max_context * chars_per_token`` characters is known to be too long before tokenizing."""
    check_int("--request-memory-mb", request_mb, 1, message="--request-memory-mb must be an int >= 1 (MiB)")
    check_int("max_position_embeddings", model_context, 1,
              message="the config's max_position_embeddings must be an int >= 1")
    check_int("--max-context", max_context, 1, model_context, allow_none=True,
              message=f"--max-context must be an int in 1..{model_context} (the config's max_position_embeddings)")
    check_int("--max-new-tokens", max_new_tokens, 1, message="--max-new-tokens must be an int >= 1")
    check_int("--max-pending", max_pending, 1, message="--max-pending must be an int >= 1")
    check_int("--topk", default_topk, 1, topk_limit,
              message=f"--topk must be an int in 1..{topk_limit} (the top-k ops' limit)")
    budget = request_mb * MIB
    # per token of context: its caches and the tokenizer's buffers for its longest text
    per_token = memory.cache_bytes_per_token + TOKENIZER_BYTES_PER_CHAR * chars_per_token
    afford_context = (budget - memory.work_bytes(MIN_QUERY_CHUNK, default_topk)) // per_token
    context = min(model_context, afford_context) if max_context is None else max_context
    if context < 1 or context > afford_context:
        raise ValueError(f"--request-memory-mb {request_mb} affords {max(afford_context, 0)} tokens of context at "
                         f"top-k {default_topk}, less than {context if max_context else 'one'}: raise the budget "
                         f"or lower --max-context / --topk")
    check_int("--max-new-tokens", max_new_tokens, 1, context - 1,
              message=f"--max-new-tokens must leave room for a prompt in a context of {context} tokens (at most "
                      f"{context - 1})")
    # the largest top-k whose prefill chunk of MIN_QUERY_CHUNK queries fits what a full context leaves
    max_topk = min(topk_limit, (budget - context * per_token) // (MIN_QUERY_CHUNK * WORK_BYTES_PER_READ)
                   - memory.window)
    max_chars = context * chars_per_token
    return ServerLimits(max_context=context, max_new_tokens=max_new_tokens, max_topk=max_topk,
                        request_bytes=budget, max_prompt_chars=max_chars,
                        max_body_bytes=max_chars * BODY_BYTES_PER_CHAR + BODY_OVERHEAD_BYTES, max_pending=max_pending)
