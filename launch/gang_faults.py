"""How the engine names a gang's failures: the kind of each, which one is the culprit, and when a
running rank counts as hung. Pure but for ``probe_dead`` (one Ray call per rank).

Kinds (``run_report.FAILURE_KINDS``), the most telling first: ``died`` (the rank's actor or process
is gone), ``setup`` (building the gang failed), ``error`` (its step loop raised), ``unresponsive``
(a call went unanswered), ``hung`` (requests are due but its step counter has not moved for
``hang_timeout_s``). When several ranks fail together, every failure of a kind less telling than
the worst one seen is ``secondary``: a dead rank explains its peers' errors (they time out in the
collective it left), an error explains hung peers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from launch.run_report import GangFailedError, RankFailure

__all__ = [
    "PRIORITY",
    "HangWatch",
    "classify",
    "gang_failed",
    "name_failures",
    "poll_failure",
    "probe_dead",
]

PRIORITY = ("died", "setup", "error", "unresponsive", "hung")


def poll_failure(exc: BaseException) -> tuple[str, str, str]:
    """``(kind, message, detail)`` of a failed poll: ``unresponsive`` when Ray's wait for the
    answer ran out, ``died``/``error`` from ``gang.describe_error`` for Ray's errors, else
    ``error`` with the exception's type and text (an in-process rank)."""
    try:
        import ray.exceptions as rex
    except ImportError:
        rex = None
    if rex is not None:
        if isinstance(exc, rex.GetTimeoutError):
            return "unresponsive", "poll() unanswered in time", str(exc)
        if isinstance(exc, rex.RayError):
            from launch.gang import describe_error

            return describe_error(exc)
    return "error", f"{type(exc).__name__}: {exc}", str(exc)


def probe_dead(ranks: Any, timeout_s: float) -> list[tuple[int, str, str]]:
    """``(rank, message, detail)`` of every rank whose liveness probe says it is dead (a Ray
    gang's ``health`` call raised RayActorError); [] for ranks that cannot be probed."""
    probe = getattr(ranks, "probe", None)
    if probe is None:
        return []
    from launch.gang import describe_error

    dead = []
    for rank, out in enumerate(probe(timeout_s)):
        if isinstance(out, BaseException):
            kind, msg, detail = describe_error(out)
            if kind == "died":
                dead.append((rank, msg, detail))
    return dead


def classify(found: Sequence[RankFailure]) -> list[RankFailure]:
    """``found`` with every failure of a kind less telling than the worst one marked secondary,
    primaries first, then by rank."""
    worst = min(PRIORITY.index(f.kind) for f in found)
    return sorted(
        (
            RankFailure(
                f.attempt,
                f.rank,
                f.kind,
                f.message,
                f.node_ip,
                PRIORITY.index(f.kind) > worst,
                f.detail,
            )
            for f in found
        ),
        key=lambda f: (f.secondary, f.rank),
    )


class HangWatch:
    """Per rank, the step counter's last value and when it last moved. A rank is hung when work
    was due the whole time (every rank steps while any has work: ``serve_loop``) and its
    counter has not moved for ``hang_timeout_s``; while nothing is due (ranks asleep, or every
    request still waits for its arrival) the clock does not run."""

    def __init__(self, world_size: int, hang_timeout_s: float) -> None:
        now = time.monotonic()
        self.hang_timeout_s = hang_timeout_s
        self._last = [(-1, now)] * world_size

    def hung(self, rank: int, steps: int, work_due: bool, now: float | None = None) -> str | None:
        """The failure message when ``rank`` (at ``steps``) is hung, else None."""
        now = time.monotonic() if now is None else now
        last_steps, since = self._last[rank]
        if steps != last_steps or not work_due:
            self._last[rank] = (steps, now)
            return None
        if now - since > self.hang_timeout_s:
            return f"no step completed for {self.hang_timeout_s:g} s (at step {steps})"
        return None

    def stopped_with(self, rank: int, now: float | None = None) -> list[tuple[int, str]]:
        """``(rank, message)`` of the other ranks whose counters stopped with ``rank``'s (still for
        at least half the timeout): a rank stuck in a step holds its peers in the next collective,
        and the pollers notice them a moment apart."""
        now = time.monotonic() if now is None else now
        return [
            (r, f"no step completed for {now - since:.1f} s (at step {steps})")
            for r, (steps, since) in enumerate(self._last)
            if r != rank and now - since >= self.hang_timeout_s / 2
        ]


def name_failures(
    ranks: Any,
    failure: RankFailure,
    probe_timeout_s: float,
    also_hung: Sequence[tuple[int, str]] = (),
) -> list[RankFailure]:
    """``failure`` (its node filled in from ``ranks.node_ips``) with the ranks ``also_hung``
    and every other rank that a probe finds dead, classified (``classify``)."""
    ips = tuple(getattr(ranks, "node_ips", ()))

    def ip(rank: int) -> str:
        return ips[rank] if rank < len(ips) else ""

    f = failure
    found = [
        RankFailure(f.attempt, f.rank, f.kind, f.message, f.node_ip or ip(f.rank), detail=f.detail)
    ]
    dead = {rank: (msg, detail) for rank, msg, detail in probe_dead(ranks, probe_timeout_s)}
    for rank, (msg, detail) in sorted(dead.items()):
        if rank != f.rank:
            found.append(RankFailure(f.attempt, rank, "died", msg, ip(rank), detail=detail))
    for rank, msg in also_hung:
        if rank != f.rank and rank not in dead:
            found.append(RankFailure(f.attempt, rank, "hung", msg, ip(rank)))
    return classify(found)


def gang_failed(
    failures: Sequence[RankFailure], attempt: int, max_restarts: int
) -> GangFailedError:
    """The error of a gang that failed at ``attempt`` with no restart left, naming the primary
    failures of that attempt."""
    last = [f for f in failures if f.attempt == attempt]
    primary = [f for f in last if not f.secondary] or last
    return GangFailedError(
        f"the gang failed {attempt + 1} times (max_restarts={max_restarts}); last: "
        f"{'; '.join(f.describe() for f in primary)}",
        failures,
    )
