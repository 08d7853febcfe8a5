"""One HTTP request's life on the engine: submit, outputs into asyncio, text, finish, abort.

``submit(...)`` hands the request to the engine from the event loop; the engine calls back from
its own thread once per step, and ``loop.call_soon_threadsafe`` moves each ``RequestOutput`` onto
the request's asyncio queue. ``Flow`` reads that queue and turns ids into text deltas
(``TextStream``: UTF-8 whole, stop strings, hidden EOS).

Who ends a request, and what the client sees:

- its rank (length, EOS/stop token id, an error inside its step): the last output carries the
  result;
- a stop string found in the text: the server calls ``engine.abort`` and reports "stop" at
  once; the engine's final "abort" output still arrives and is only recorded in the metrics;
- the client (a closed stream, a disconnect): ``Flow.close`` aborts it; its rank frees the KV
  within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from launch.server.protocol import ApiError, Sampling
from launch.server.readiness import unavailable_error
from launch.server.text import TextStream

__all__ = ["Event", "Flow", "submit"]

# The engine's field names as a client spells them.
_PARAM = {
    "max_new_tokens": "max_tokens",
    "prompt_ids": "prompt",
    "stop_token_ids": "stop_token_ids",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
}


@dataclass
class Event:
    """What one step adds: text (may be empty), new token ids, and on the last event the
    finish reason and the engine's result (None when a stop string ended it first)."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    result: Any = None
    retryable: bool = False  # it ended because its rank failed (HTTP 503), not because of itself
    logprobs: tuple | None = None  # one TokenLogprob per id when the request asked, else None


def engine_errors():
    """The engine's exception types (imported when the first request arrives, not at start)."""
    from launch.engine import EngineUnavailable, QueueFull, RequestRejected

    return RequestRejected, QueueFull, EngineUnavailable


def to_api_error(exc: BaseException) -> ApiError | None:
    """The HTTP error of an engine exception: 400 (rejected: the field named), 429 with
    Retry-After (queue full), 503 with Retry-After (gang starting, restarting or stopped); None
    for anything else."""
    rejected, queue_full, unavailable = engine_errors()
    if isinstance(exc, rejected):
        field = getattr(exc, "field", None)
        return ApiError(400, str(exc), param=_PARAM.get(field, field), code="invalid_value")
    if isinstance(exc, queue_full):
        retry = max(1, math.ceil(getattr(exc, "retry_after_s", 1.0)))
        return ApiError(
            429,
            str(exc),
            kind="rate_limit_error",
            code="queue_full",
            headers={"Retry-After": str(retry)},
        )
    if isinstance(exc, unavailable):
        return unavailable_error(str(exc))
    return None


def submit(state: Any, rid: str, prompt_ids: list[int], sampling: Sampling) -> Flow:
    """Check and submit one request; returns its Flow. Raises ApiError (400/429/503)."""
    from dp_runtime.serving.request import Request, SamplingParams

    engine = state.engine
    try:
        request = Request(rid, tuple(prompt_ids), SamplingParams(**sampling.params()))
        engine.check(request)
    except ValueError as e:
        raise to_api_error(e) or ApiError(400, str(e), code="invalid_value") from e
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    try:
        engine.submit(request, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
    except Exception as e:
        err = to_api_error(e)
        if err is None:
            raise
        raise err from e
    hidden = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        hidden |= set(engine.eos_token_ids)
    text = TextStream(state.tokenizer, sampling.stop, tuple(hidden), min_tokens=sampling.min_tokens)
    return Flow(state, rid, queue, text)


class Flow:
    """The outputs of one submitted request as Events; ``close()`` aborts it if unfinished."""

    def __init__(self, state: Any, rid: str, queue: asyncio.Queue, text: TextStream):
        self._state, self.rid = state, rid
        self._queue, self._text = queue, text
        self.completion_tokens = 0
        self.cached_tokens = 0  # its prompt tokens served from the prefix cache (known at the end)
        self.logprobs: list = []  # every event's logprobs, in order (when the request asked)
        self.done = False  # the client has its finish reason
        self._engine_done = False  # the engine's last output arrived

    async def events(self) -> AsyncIterator[Event]:
        """Events until the request finishes (for the client); the last has finish_reason."""
        while not self.done:
            out = await self._queue.get()
            yield self._event(out)

    def _event(self, out: Any) -> Event:
        ids = tuple(out.new_token_ids)
        self.completion_tokens += len(ids)
        lps = getattr(out, "new_logprobs", None)
        self.logprobs.extend(lps or ())
        if out.finished:
            self._engine_done = True
            result = out.result
            self.cached_tokens = getattr(result, "cached_tokens", 0)
            reason = result.finish_reason
            delta = self._text.add(ids, finished=True, stop_by_token=reason == "stop")
            self.done = True
            self._state.metrics.observe(result, "stop" if delta.stopped else None)
            return Event(
                delta.text,
                ids,
                "stop" if delta.stopped else reason,
                result,
                bool(getattr(out, "retryable", False)),
                lps,
            )
        delta = self._text.add(ids)
        if delta.stopped:
            self.done = True
            self._abort(reason="stop")
            return Event(delta.text, ids, "stop", logprobs=lps)
        return Event(delta.text, ids, logprobs=lps)

    @property
    def text(self) -> str:
        return self._text.text

    def close(self) -> None:
        """The client left or the response is complete: abort the request on its rank if the
        engine has not finished it (it then frees its KV within a step)."""
        if not self._engine_done:
            self._abort(reason="abort" if not self.done else "stop")

    def _abort(self, reason: str) -> None:
        if self._engine_done:
            return
        self._engine_done = True
        self._state.engine.abort(self.rid)
        # The engine still sends the aborted request's last output; record it in the metrics
        # under the reason the client saw. The task is kept on the state until it ends (an
        # unreferenced task may be collected mid-await).
        task = asyncio.get_running_loop().create_task(self._drain(reason))
        self._state.tasks.add(task)
        task.add_done_callback(self._state.tasks.discard)

    async def _drain(self, reason: str) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                out = await self._queue.get()
                if out.finished:
                    self._state.metrics.observe(out.result, reason)
                    return
