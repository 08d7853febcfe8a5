"""RankSession: one rank's RankWorker plus the background thread that drives its step loop.

The same object serves every launcher: the Ray rank actor holds one, the local (world size 1)
launcher holds one in-process, and the torchrun entry drives the same worker. The launcher talks
to it only between steps (submit, start, collect, stop); the step loop itself never waits on
the launcher, because a Ray round trip (~2 ms) must not be paid per step.

States: ``ready`` (built, not started) -> ``running`` (``run_until_idle`` in the thread) ->
``done`` (it returned: every rank was idle) or ``error`` (it raised; the traceback is kept, and
logged at once on the ``launch`` logger) -> ``closed``. ``submit`` + ``start`` may follow ``done``
for another round of work.

Serving (the engine): ``serve`` runs ``serve_loop.serve_until_stopped`` instead, in state
``running`` until every rank was told to stop (``wake(n, stop=True)``) and was idle. Then
``submit`` and ``abort`` are taken while the loop runs, each with the driver's message number
(serve_loop's ``Wake``), and ``poll`` waits for the step's outputs instead of the caller
sleeping a fixed interval.

Progress for hang detection is ``metrics()["steps"]``, reported by every ``collect``.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serve_loop import Wake, serve_until_stopped
from dp_runtime.serving.request import Request, RequestResult, TokenLogprob

__all__ = ["RankSession", "RankStatus"]

logger = logging.getLogger("launch")

READY, RUNNING, DONE, ERROR, CLOSED = "ready", "running", "done", "error", "closed"


@dataclass(frozen=True)
class RankStatus:
    """What ``collect`` returns: the rank's state, its step counter, results finished since the
    previous collect, the traceback when the loop raised, the worker's metrics, and ``loop_s``:
    seconds the latest step loop has run (to its end once done), timed on the rank so the
    launcher's poll interval does not blur throughput; ``tokens``: new tokens by rid since the
    previous collect (serving only: ``(rid, ids)`` pairs); ``logprobs``: those tokens'
    logprobs, for requests that asked (``(rid, logprobs)`` pairs, one per new token)."""

    rank: int
    state: str
    steps: int
    results: tuple[RequestResult, ...] = ()
    error: str | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    loop_s: float = 0.0
    tokens: tuple[tuple[str, tuple[int, ...]], ...] = ()
    logprobs: tuple[tuple[str, tuple[TokenLogprob, ...]], ...] = ()


def _default_worker(spec: RankSpec, rank: int, world_size: int, show_progress: bool,
                    on_phase: Callable[[str], None] | None) -> Any:
    from dp_runtime.rank_worker import RankWorker

    return RankWorker(spec, rank=rank, world_size=world_size, show_progress=show_progress,
                      on_phase=on_phase)


class RankSession:
    """Builds the rank's worker (collective when ``world_size > 1``: every rank constructs its
    session together, after the default process group exists).

    ``show_progress``: RankWorker's progress bar while it captures graphs (stderr).
    ``on_phase(name)``: RankWorker's construction phases as they begin (loading weights, ...).
    ``worker_factory(spec, rank, world_size)`` replaces RankWorker (a test seam; it must offer
    submit / run_until_idle / pop_finished / metrics / close).
    """

    def __init__(self, spec: RankSpec, rank: int, world_size: int, *, show_progress: bool = False,
                 worker_factory: Callable[[RankSpec, int, int], Any] | None = None,
                 on_phase: Callable[[str], None] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        if worker_factory is not None:
            self._worker = worker_factory(spec, rank, world_size)
        else:
            self._worker = _default_worker(spec, rank, world_size, show_progress, on_phase)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state = READY
        self._error: str | None = None
        self._lock = threading.Lock()  # guards _state/_error between the loop thread and callers
        self._t_start = self._t_end = 0.0
        self._wake: Wake | None = None  # set while serving

    # -- lifecycle ------------------------------------------------------------------------------
    def submit(self, requests: Sequence[Request], wake: int | None = None) -> int:
        """Queue ``requests`` on this rank (before ``start``, or while serving with the driver's
        message number ``wake``); returns how many were queued. Raises ValueError (from the
        worker) for a request that can never fit."""
        if self._wake is None:
            self._require(READY, DONE, action="submit")
        self._worker.submit(list(requests))
        self.wake(wake)
        return len(requests)

    def abort(self, rids: Sequence[str], wake: int | None = None) -> None:
        """Abort the named requests on this rank (their results say "abort"); see ``submit``."""
        self._worker.abort(rids)
        self.wake(wake)

    def wake(self, number: int | None, stop: bool = False) -> None:
        """The driver's message ``number`` reached this rank (serving; ignored otherwise)."""
        if self._wake is not None and number is not None:
            self._wake.bump(number, stop=stop)

    def start(self) -> None:
        """Run ``run_until_idle`` in a background thread; returns at once."""
        self._start(lambda: self._worker.run_until_idle(stop=self._stop))

    def serve(self) -> None:
        """Run the serving loop in a background thread (module docstring); returns at once."""
        self._wake = Wake()
        wake = self._wake
        self._start(lambda: serve_until_stopped(self._worker, wake))

    def _start(self, loop: Callable[[], Any]) -> None:
        with self._lock:
            self._require(READY, DONE, action="start")
            self._state = RUNNING
            self._stop.clear()
            self._t_start = self._t_end = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, args=(loop,),
                                        name=f"rank{self.rank}-steps", daemon=True)
        self._thread.start()

    def _loop(self, loop: Callable[[], Any]) -> None:
        try:
            loop()
        except BaseException:
            error = traceback.format_exc()
            # Logged here, before the state says "error": whoever acts on that state tears the
            # job down (kills the actor, destroys the process group), and a teardown that blocks
            # or kills would otherwise leave the error unseen.
            logger.error("rank %d: the step loop raised:\n%s", self.rank, error.rstrip())
            with self._lock:
                self._state, self._error = ERROR, error
                self._t_end = time.perf_counter()
        else:
            with self._lock:
                self._state = DONE
                self._t_end = time.perf_counter()

    def run(self) -> RankStatus:
        """``start`` and wait for the loop to end (torchrun: nothing to poll); returns the final
        ``collect`` (its ``state`` is ``done`` or ``error``)."""
        self.start()
        assert self._thread is not None
        self._thread.join()
        return self.collect()

    def collect(self) -> RankStatus:
        """Results finished since the last collect, with state, step counter and metrics."""
        with self._lock:
            state, error = self._state, self._error
            loop_s = (time.perf_counter() if state == RUNNING else self._t_end) - self._t_start
        if state == CLOSED:
            return RankStatus(self.rank, state, 0)
        # Results are popped after the state was read: a loop that finished in between leaves
        # its last results for the next collect, which the launcher makes once "done" is seen.
        outputs = getattr(self._worker, "outputs", None)
        if outputs is None:  # a test's stand-in worker
            tokens, results, logprobs = {}, self._worker.pop_finished(), {}
        else:
            tokens, results, logprobs = outputs.pop()
        metrics = dict(self._worker.metrics())
        # Every step counts as progress, skipped ones too (a skip ends the loop on every rank).
        progress = int(metrics.get("steps", 0)) + int(metrics.get("skipped_steps", 0))
        return RankStatus(self.rank, state, progress, tuple(results), error, metrics, loop_s,
                          tuple(tokens.items()), tuple(logprobs.items()))

    def poll(self, timeout_s: float) -> RankStatus:
        """``collect``, after waiting up to ``timeout_s`` for a step's outputs (serving)."""
        outputs = getattr(self._worker, "outputs", None)
        if outputs is not None and self.state() == RUNNING:
            outputs.wait(timeout_s)
        return self.collect()

    def state(self) -> str:
        with self._lock:
            return self._state

    def close(self, timeout_s: float = 10.0) -> str:
        """Stop the loop (if it runs) and release the worker; returns the final state.

        Setting the stop flag on one rank alone leaves its peers blocked in the next collective
        (they time out on their own); launchers close every rank together, or kill them.
        Raises TimeoutError when the loop does not stop within ``timeout_s`` (the worker is then
        left open: it is still in use).
        """
        if self._state == CLOSED:
            return CLOSED
        self._stop.set()
        if self._wake is not None:  # a serving loop stops at its next idle point
            self._wake.bump(0, stop=True)
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"rank {self.rank}: the step loop did not stop within "
                                   f"{timeout_s} s")
        final = self._state
        self._worker.close()
        with self._lock:
            self._state = CLOSED
        return final

    def _require(self, *states: str, action: str) -> None:
        if self._state not in states:
            raise RuntimeError(f"rank {self.rank}: cannot {action} in state {self._state!r} "
                               f"(needs {' or '.join(states)})")
