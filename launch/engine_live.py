"""The engine's books: a request in flight (``Live``) and what the engine knows of a rank
(``RankView``), both guarded by the engine's lock; and ``call_quietly``, how a request's
callback is called from a poller thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dp_runtime.serving.request import Request
from launch.engine_types import RequestOutput

__all__ = ["Live", "RankView", "call_quietly"]

logger = logging.getLogger("launch")


@dataclass(eq=False)
class Live:
    request: Request
    rank: int
    on_output: Callable[[RequestOutput], None]
    due: float = 0.0  # time.monotonic() at which it arrives (``Request.arrival_s`` after submit)
    emitted: int = 0

    @property
    def outstanding(self) -> int:
        """Tokens still to compute: the prompt until its first token, then what may follow."""
        prompt = len(self.request.prompt_ids) if self.emitted == 0 else 0
        return prompt + self.request.sampling.max_new_tokens - self.emitted


@dataclass
class RankView:
    metrics: dict[str, Any] = field(default_factory=dict)
    routed: int = 0


def call_quietly(callback: Callable[[RequestOutput], None], out: RequestOutput) -> None:
    # A failing callback (a closed client's queue, say) must not stop the poller: the other
    # requests of the step still need their outputs.
    try:
        callback(out)
    except Exception:
        logger.exception("engine: the output callback of request %r raised", out.rid)
