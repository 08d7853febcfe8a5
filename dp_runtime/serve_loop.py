"""The step loops that drive a RankWorker: ``run_until_idle`` (a batch job: until every rank is
idle) and ``serve_until_stopped`` (a server's long-lived ranks, until they are told to stop).

Serving:

A rank steps while any rank has work (``RankWorker.step`` is the collective; an IDLE rank joins
it with zero rows). When a step was skipped on every rank, the ranks sleep, and wake together:

- The driver (the engine) numbers everything it tells the ranks, submits, aborts and the stop
  alike, from one counter, and tells every rank each number (``Wake.bump``): the rank that got
  the request with it, and the others a bare wake. So every rank eventually sees every number.
- After a skipped step the ranks take one collective: the smallest number any rank has seen,
  E, whether any rank was told to stop, and how long until the earliest queued request
  arrives (``Request.arrival_s``). Every rank then waits for a number above E (or that
  arrival). Every rank waits for the same condition, so all of them step again, none alone:
  a rank that already saw E + 1 goes on at once and blocks in the next step's sync until the
  others have seen it too, which the driver guarantees.
- Stop is honoured only at that agreed point, on every rank together. Draining (finishing or
  aborting the requests in flight) is the driver's job before it sends the stop.

Sleeping ranks take no step and no collective: an idle server costs nothing but a blocked
thread per rank.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
import torch.distributed as dist

from dp_runtime.sync.rank_groups import min_over_ranks

__all__ = ["Wake", "agree_after_skip", "run_until_idle", "serve_until_stopped"]


class Wake:
    """The numbers a driver has sent this rank (module docstring); thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._seen = 0
        self._stop = False

    def bump(self, number: int, *, stop: bool = False) -> None:
        """The driver's message ``number`` reached this rank (``stop``: it asks the ranks to
        stop once idle)."""
        with self._cond:
            self._seen = max(self._seen, int(number))
            self._stop = self._stop or stop
            self._cond.notify_all()

    def seen(self) -> tuple[int, bool]:
        with self._cond:
            return self._seen, self._stop

    def wait_past(self, number: int, timeout_s: float | None) -> None:
        """Sleep until a message above ``number`` arrives, or ``timeout_s`` (None: no limit)."""
        with self._cond:
            self._cond.wait_for(lambda: self._seen > number or self._stop, timeout_s)


def agree_after_skip(seen: int, stop: bool, arrival_in: float | None,
                     cpu_group: Any) -> tuple[int, bool, float | None]:
    """One collective after a skipped step: ``(smallest number seen, any rank stopping,
    seconds until the earliest arrival or None)`` over the ranks of ``cpu_group`` (the values
    themselves without a group)."""
    if cpu_group is None:
        return seen, stop, arrival_in
    t = torch.tensor([float(seen), -float(stop), math.inf if arrival_in is None else arrival_in],
                     dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_group)
    wait = t[2].item()
    return int(t[0].item()), t[1].item() < 0, None if math.isinf(wait) else wait


def serve_until_stopped(worker: Any, wake: Wake) -> int:
    """Step ``worker`` until every rank was told to stop and was idle (module docstring); a
    collective on every rank. New tokens and results reach ``worker.outputs`` once per step.
    Returns the number of steps taken."""
    worker.outputs.stream_tokens = True
    steps = 0
    while True:
        plan = worker.step()
        steps += 1
        if not plan.skip:
            continue
        seen, stop = wake.seen()
        agreed, stopping, arrival_in = agree_after_skip(seen, stop, worker.next_arrival_in(),
                                                        worker.cpu_group)
        if stopping:
            break
        wake.wait_past(agreed, arrival_in)
    worker.wait_tokens()
    return steps


def run_until_idle(worker: Any, stop: threading.Event | None = None,
                   max_steps: int | None = None) -> int:
    """Step ``worker`` until a step in which every rank had nothing and no rank has a request
    still to arrive (a collective; every rank returns after the same step). While requests are
    yet to arrive somewhere, every rank sleeps until the earliest of them after such a step.
    ``stop`` (checked between steps) must be set on every rank alike. Returns the number of
    steps taken."""
    n = 0
    stop = stop if stop is not None else threading.Event()
    while not stop.is_set():
        plan = worker.step()
        n += 1
        if max_steps is not None and n >= max_steps:
            break
        if plan.skip:
            # Every rank's queue, in one collective taken after a skip, which every rank sees
            # alike (0: a request arrived since its scheduler looked; None: every queue is empty).
            wait = min_over_ranks(worker.next_arrival_in(), worker.cpu_group)
            if wait is None:
                break
            stop.wait(wait)
    worker.wait_tokens()  # the last step's tokens are this call's results
    return n
