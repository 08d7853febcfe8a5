"""The forward mode of a batch. It lives here, below dp_runtime, so graph/ can compare it
without importing dp_runtime; dp_runtime.forward_mode re-exports the same class."""

from __future__ import annotations

from enum import Enum

__all__ = ["ForwardMode"]


class ForwardMode(Enum):
    """DECODE: one new token per request. EXTEND: a chunk of prompt tokens per request.
    IDLE: this rank has no tokens while other DP ranks do; it still joins every collective."""

    DECODE = "decode"
    EXTEND = "extend"
    IDLE = "idle"

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND

    def is_idle(self) -> bool:
        return self is ForwardMode.IDLE
