"""The engine's books: a request in flight (``Live``) and what the engine knows of a rank
(``RankView``), both guarded by the engine's lock; ``batch_refusal``, the door's rules on what
is in flight; ``take_outputs``, what a rank's poll gives each request in flight; and
``call_quietly``, how a request's callback is called from a poller thread."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dp_runtime.serving.request import Request
from launch.engine_errors import EngineUnavailable, QueueFull, RequestRejected
from launch.engine_types import RequestOutput

__all__ = ["Live", "RankView", "batch_refusal", "call_quietly", "take_outputs"]

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


def batch_refusal(requests: Sequence[Request], state: str, detail: str, live: Mapping[str, Live],
                  capacity: int) -> Exception | None:
    """Why the engine (in ``state``, with ``live`` in flight) cannot take ``requests`` now, or
    None: EngineUnavailable unless ready, RequestRejected for an rid in flight or given twice,
    QueueFull past ``capacity`` requests in flight (``Engine.capacity``)."""
    if state != "ready":
        return EngineUnavailable(f"the engine is {state}" + (f": {detail}" if detail else ""))
    rids = [r.rid for r in requests]
    if twice := next((rid for rid in rids if rid in live), None):
        return RequestRejected("rid", f"request {twice!r} is already in flight")
    if len(set(rids)) < len(rids):
        return RequestRejected("rid", "an rid appears twice among the requests submitted together")
    if len(live) + len(requests) > capacity:
        more = f" (+{len(requests)} submitted together)" if len(requests) > 1 else ""
        return QueueFull(f"{len(live)} requests in flight{more}, the limit is {capacity} "
                         f"(max_running_requests x ranks + max_queued)", retry_after_s=1.0)
    return None


def take_outputs(live: dict[str, Live], st: Any) -> list[tuple[Live, RequestOutput]]:
    """The outputs a rank's poll (``RankStatus``) gives the requests in ``live`` (under the
    engine's lock): new tokens of those still running, and the last output of each finished one
    (its tokens not yet emitted), which leaves ``live``. Rids not in flight are ignored."""
    outs: list[tuple[Live, RequestOutput]] = []
    finished = {res.rid for res in st.results}
    logprobs = dict(st.logprobs)
    for rid, toks in st.tokens:
        one = live.get(rid)
        if one is not None and rid not in finished:
            one.emitted += len(toks)
            outs.append((one, RequestOutput(rid, toks, new_logprobs=logprobs.get(rid))))
    for res in st.results:
        one = live.pop(res.rid, None)
        if one is not None:
            lps = None if res.logprobs is None else res.logprobs[one.emitted:]
            last = RequestOutput(res.rid, res.output_ids[one.emitted:], True, res, new_logprobs=lps)
            outs.append((one, last))
    return outs


def call_quietly(callback: Callable[[RequestOutput], None], out: RequestOutput) -> None:
    # A failing callback (a closed client's queue, say) must not stop the poller: the other
    # requests of the step still need their outputs.
    try:
        callback(out)
    except Exception:
        logger.exception("engine: the output callback of request %r raised", out.rid)
