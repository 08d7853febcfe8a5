"""The errors the engine raises at its door, each mapped by the server to one HTTP status:
RequestRejected 400 (names the field), QueueFull 429 (with Retry-After), EngineUnavailable 503."""

from __future__ import annotations

import re

__all__ = ["EngineUnavailable", "QueueFull", "RequestRejected", "rejection"]


class RequestRejected(ValueError):
    """A request refused before any rank saw it; ``field`` names the field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class QueueFull(RuntimeError):
    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineUnavailable(RuntimeError):
    """The ranks are starting, restarting or stopped."""


# The field each of the door's messages (dp_runtime/serving/admission.py) names, first match wins.
_FIELDS = (
    (r"prompt_ids", "prompt_ids"),
    (r"KV tokens", "max_new_tokens"),
    (r"\b(max_new_tokens|temperature|top_p|top_k|min_p|seed|stop_token_ids|ignore_eos|logit_bias"
     r"|presence_penalty|frequency_penalty|repetition_penalty|min_tokens)\b", None),
    (r"\brid\b", "rid"),
)


def rejection(message: str) -> RequestRejected:
    """A RequestRejected for one of the door's messages, its field read from the message."""
    for pattern, name in _FIELDS:
        m = re.search(pattern, message)
        if m:
            return RequestRejected(name or m.group(1), message)
    return RequestRejected("request", message)
