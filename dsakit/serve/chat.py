"""The chat template of dsakit's servers and the checks every request's text goes through.

Template (serve-reference's, and ``dsakit serve``'s for a tokenizer without its own): ``<|role|>\\n{content}\\n``
per message, then ``<|assistant|>\\n``. The shipped tiny model's tokenizer carries the same template
(:data:`dsakit.models.tokenizer.CHAT_TEMPLATE`), so training prompts and served prompts agree.
"""

from __future__ import annotations

from .http import RequestError

ASSISTANT_HEADER = "<|assistant|>\n"


def check_text(name: str, text: str) -> str:
    """``text`` if it can be sent to a tokenizer: a lone surrogate (JSON allows ``"\\ud800"``) cannot be
    encoded as UTF-8 and makes Rust tokenizers raise a TypeError, so it is a 400 here, naming where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(400, f"{name} holds a lone surrogate (U+{ord(text[exc.start]):04X}) at character "
                                f"{exc.start}: not valid Unicode text") from None
    return text


def message_text(i: int, message) -> tuple[str, str]:
    """(role, content text) of ``messages[i]``; content parts keep their text parts. 400 on anything else."""
    if not isinstance(message, dict) or "role" not in message:
        raise RequestError(400, f"messages[{i}] must be an object with 'role' and 'content'")
    role = message["role"]
    if not isinstance(role, str):
        raise RequestError(400, f"messages[{i}].role must be a string, got {role!r}")
    content = message.get("content") or ""
    if isinstance(content, list):  # content parts: keep the text ones
        texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise RequestError(400, f"messages[{i}].content: the 'text' of a text part must be a string")
        content = "".join(texts)
    if not isinstance(content, str):
        raise RequestError(400, f"messages[{i}].content must be a string or a list of text parts")
    check_text(f"messages[{i}].content", role + content)
    return role, content


def chat_messages(messages, max_chars: int | None = None) -> list[dict]:
    """``messages`` checked -> [{"role", "content"}] with plain-text contents. 400 when it is not a non-empty
    list, a message is malformed, no message is the user's, or the text is longer than ``max_chars``
    (checked before any template or tokenizer sees it)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list")
    plain, chars = [], 0
    for i, message in enumerate(messages):
        role, content = message_text(i, message)
        chars += len(role) + len(content)
        if max_chars is not None and chars > max_chars:
            raise RequestError(400, f"the messages hold more than {max_chars} characters, more than the longest "
                                    f"prompt this server accepts")
        plain.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in plain):
        raise RequestError(400, "messages hold no 'user' message: nothing to answer")
    return plain


def render_chat(messages) -> tuple[str, tuple[int, int]]:
    """Apply the template -> (prompt, char span of the last user message's content, trailing space cut)."""
    parts: list[str] = []
    offset = 0
    span: tuple[int, int] = (0, 0)
    for message in chat_messages(messages):
        header = f"<|{message['role']}|>\n"
        content = message["content"]
        if message["role"] == "user":
            span = (offset + len(header), offset + len(header) + len(content.rstrip()))
        piece = f"{header}{content}\n"
        parts.append(piece)
        offset += len(piece)
    return "".join(parts) + ASSISTANT_HEADER, span
