"""The OpenAI response bodies of ``dp-runtime serve``: a whole completion or chat completion,
one streamed chunk, and ``usage``; ``respond.py`` fills them with the choices' text, finish
reasons and token ids (the request side, and the error body, are ``protocol.py``)."""

from __future__ import annotations

import time
from typing import Any, Literal

__all__ = ["Kind", "chunk", "now", "response", "usage"]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


Kind = Literal["completion", "chat"]


def response(
    kind: Kind,
    rid: str,
    model: str,
    created: int,
    text: str,
    finish_reason: str,
    use: dict[str, int],
    tool_calls: list[dict] | None = None,
) -> dict[str, Any]:
    """The whole (non-streamed) response body; ``tool_calls``: a chat message's calls (its
    content then null when empty, as OpenAI's)."""
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message = {**message, "content": text or None, "tool_calls": tool_calls}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": use,
    }


def chunk(
    kind: Kind,
    rid: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None,
    *,
    first: bool = False,
    use: dict[str, int] | None = None,
    tool_calls: list[dict] | None = None,
) -> dict[str, Any]:
    """One streamed event body; ``text`` None with ``use`` is the final usage-only chunk;
    ``tool_calls``: a chat delta's calls (each with its ``index``)."""
    if kind == "chat":
        # The first carries the role and an empty content, as OpenAI's and vLLM's do.
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = (
            []
            if text is None
            else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
        )
        obj = "chat.completion.chunk"
    else:
        choices = (
            []
            if text is None
            else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
        )
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def now() -> int:
    return int(time.time())
