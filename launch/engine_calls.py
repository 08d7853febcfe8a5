"""The engine's two waiting forms of ``submit``: a token stream for asyncio (``Engine.stream``)
and a blocking batch (``Engine.generate``). Both end what they stop waiting for: a stream left
early, or a batch past its timeout, aborts its unfinished requests, so no rank runs a request
nobody reads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from dp_runtime.serving.request import Request, RequestResult
from launch.engine_types import RequestOutput


class Engine(Protocol):
    """What these forms need of ``launch.engine.Engine``."""

    def submit(self, request: Request, on_output: Callable[[RequestOutput], None]) -> int: ...

    def abort(self, rid: str) -> bool: ...


__all__ = ["generate_requests", "stream_request"]


async def stream_request(engine: Engine, request: Request) -> AsyncIterator[RequestOutput]:
    """``Engine.stream``: submit ``request`` and yield its outputs in this event loop; leaving
    early (break, ``aclose``, cancellation) aborts it. Raises what ``submit`` raises."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
    engine.submit(request, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
    finished = False
    try:
        while not finished:
            out = await queue.get()
            finished = out.finished
            yield out
    finally:
        if not finished:
            engine.abort(request.rid)


def generate_requests(
    engine: Engine, requests: Sequence[Request], timeout_s: float | None = None
) -> list[RequestResult]:
    """``Engine.generate``: submit ``requests`` and wait for all of them; their results in order.
    Raises what ``submit`` raises (requests already submitted are aborted) or, past
    ``timeout_s``, TimeoutError after aborting the requests still unfinished (their ranks free
    them)."""
    results: dict[str, RequestResult] = {}
    done = threading.Event()

    def on_output(out: RequestOutput) -> None:
        if out.finished:
            results[out.rid] = out.result
            if len(results) == len(requests):
                done.set()

    submitted = []
    try:
        for r in requests:
            engine.submit(r, on_output)
            submitted.append(r.rid)
    except BaseException:
        for rid in submitted:
            engine.abort(rid)
        raise
    if requests and not done.wait(timeout_s):
        gave_up = [rid for rid in submitted if rid not in results]
        for rid in gave_up:
            engine.abort(rid)  # nobody waits for it any more: its rank must not run it on
        raise TimeoutError(
            f"generate: {len(gave_up)} of {len(requests)} requests unfinished after "
            f"{timeout_s} s (aborted)"
        )
    return [results[r.rid] for r in requests]
