"""The engine's hands on its ranks: one RankSession in this process (``local``) or a gang of Ray
rank actors (``ray``), behind one small interface the engine drives.

Every call takes the driver's message number (``dp_runtime/serve_loop.py``): ``send`` gives the
named rank its message and every other rank a bare wake with the same number, in one critical
section of the engine, so each rank receives the numbers in the order they were drawn. Ray keeps
the calls of one caller to one actor in order (they run in the actor's default group, one at a
time); ``poll`` runs in the actor's ``outputs`` group, so a waiting poll holds up no submit.

Bring-up (``launch_with_retries``): a gang that fails to set up is tried again while the
engine's ``max_restarts`` allows; a rank no gang could build (SetupError) is not retried.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request
from launch.engine_errors import EngineUnavailable
from launch.engine_types import EngineOptions
from launch.errors import SetupError
from launch.gang_faults import classify, gang_failed
from launch.rank_session import RankSession, RankStatus
from launch.run_report import RankFailure

__all__ = ["LocalRanks", "RayRanks", "close_ranks", "launch_ranks", "launch_with_retries",
           "node_name"]

logger = logging.getLogger("launch")


def node_name(location: dict[str, Any]) -> str:
    """A rank's node as people name it: ``IP (hostname)`` from ``RankActor.where``."""
    ip, host = location.get("node_ip", ""), location.get("hostname", "")
    return f"{ip} ({host})" if ip and host else ip or host


def launch_ranks(spec: RankSpec, options: EngineOptions, attempt: int,
                 on_phase: Callable[[str], None] | None) -> Any:
    """The ranks of one attempt, up and serving: LocalRanks or RayRanks by ``options.launcher``.
    Raises what bringing them up raised (``gang.GangSetupError``, SetupError, ...)."""
    o = options
    if o.launcher == "local":
        return LocalRanks(spec, on_phase=on_phase, show_progress=o.show_progress,
                          worker_factory=o.worker_factory)
    from launch.gang import GangOptions

    gang = GangOptions(device=spec.runtime.device.type, cpus_per_rank=o.cpus_per_rank,
                       placement_timeout_s=o.placement_timeout_s, setup_timeout_s=o.setup_timeout_s,
                       pg_timeout_s=o.pg_timeout_s, rpc_timeout_s=o.rpc_timeout_s,
                       show_progress=o.show_progress, worker_factory=o.worker_factory)
    return RayRanks(spec, gang, attempt=attempt, on_phase=on_phase)


def launch_with_retries(spec: RankSpec, options: EngineOptions, attempt: int,
                        on_phase: Callable[[str], None] | None,
                        failures: list[RankFailure]) -> tuple[Any, int]:
    """``(ranks, attempt)``: ranks that came up at ``attempt`` or a later one. A gang that fails
    to set up has its failures added to ``failures`` and is tried again while ``attempt`` stays
    within ``options.max_restarts`` (Ray only: an in-process rank is not retried). Raises
    GangFailedError past that, SetupError (a rank no new gang could build) at once."""
    from launch.gang import GangSetupError

    while True:
        try:
            return launch_ranks(spec, options, attempt, on_phase), attempt
        except SetupError:
            raise
        except GangSetupError as e:
            failures.extend(classify(e.failures))
            for f in e.failures:
                logger.warning("engine: rank failure: %s", f.describe())
            if options.launcher != "ray" or attempt >= options.max_restarts:
                raise gang_failed(failures, attempt, options.max_restarts) from None
            attempt += 1
            logger.warning("engine: starting a new gang (restart %d of %d)", attempt,
                           options.max_restarts)


def _reraise(error: BaseException) -> None:
    raise error


def _accepted() -> None:
    return None


class LocalRanks:
    """World size 1 in this process: the session's serving loop runs in its own thread."""

    def __init__(self, spec: RankSpec, on_phase: Callable[[str], None] | None = None, *,
                 show_progress: bool = False,
                 worker_factory: Callable[..., Any] | None = None) -> None:
        import socket

        self.world_size = 1
        # This machine's hostname (no DNS lookup for its IP: a machine whose hostname does not
        # resolve would wait seconds for it).
        self.nodes = (socket.gethostname(),)
        self._session = RankSession(spec, 0, 1, on_phase=on_phase, show_progress=show_progress,
                                    worker_factory=worker_factory)
        self._session.serve()

    def submit(self, rank: int, requests: Sequence[Request], number: int) -> Callable[[], Any]:
        """Queue ``requests`` on ``rank``; returns a callable that raises the rank's refusal
        (ValueError) or EngineUnavailable when the rank is gone."""
        try:
            self._session.submit(requests, number)
        except ValueError as e:
            return functools.partial(_reraise, e)
        return _accepted

    def abort(self, rank: int, rids: Sequence[str], number: int) -> None:
        self._session.abort(rids, number)

    def wake_all(self, number: int, stop: bool = False) -> None:
        self._session.wake(number, stop)

    def poll(self, rank: int, timeout_s: float) -> RankStatus:
        return self._session.poll(timeout_s)

    def close(self, timeout_s: float) -> None:
        self._session.close(timeout_s)


class RayRanks:
    """A gang of Ray rank actors (``launch/gang.py``), each serving. Ray must be initialised.
    ``on_phase`` hears the start-up phases (placing, then what the ranks are doing)."""

    def __init__(self, spec: RankSpec, gang_options: Any, attempt: int = 0,
                 on_phase: Callable[[str], None] | None = None) -> None:
        from launch.gang import Gang
        from launch.rank_phases import RankPhaseWatcher

        self.world_size = n = spec.runtime.world_size
        self._gang = Gang(spec, gang_options, attempt)
        if on_phase is not None:
            on_phase(f"placing {n} rank{'s' if n > 1 else ''}"
                     + (f" (restart {attempt})" if attempt else ""))
        try:
            with RankPhaseWatcher(self._gang, on_phase):
                self._gang.launch()
            for outcome in self._gang.call_each("serve"):
                if isinstance(outcome, BaseException):
                    raise outcome
        except BaseException:
            self._gang.kill()
            raise
        self.node_ips = tuple(loc.get("node_ip", "") for loc in self._gang.locations)
        self.nodes = tuple(node_name(loc) for loc in self._gang.locations)

    @property
    def actors(self) -> tuple[Any, ...]:
        return self._gang.actors

    def probe(self, timeout_s: float) -> list[Any]:
        """``Gang.probe``: each rank's health, the exception its call raised, or UNANSWERED."""
        return self._gang.probe(timeout_s)

    def _actor(self, rank: int) -> Any:
        return self._gang.actors[rank]

    def submit(self, rank: int, requests: Sequence[Request], number: int) -> Callable[[], Any]:
        import ray

        ref = self._actor(rank).submit.remote(list(requests), number)
        self._wake_others(rank, number)

        def confirm() -> Any:
            try:
                return ray.get(ref)
            except ray.exceptions.RayActorError as e:  # the rank died: a restart, not a 500
                raise EngineUnavailable(f"rank {rank} did not take the request ({e}); the gang "
                                        f"is failing over") from None

        return confirm

    def abort(self, rank: int, rids: Sequence[str], number: int) -> None:
        self._actor(rank).abort.remote(list(rids), number)
        self._wake_others(rank, number)

    def _wake_others(self, rank: int, number: int) -> None:
        for r, actor in enumerate(self._gang.actors):
            if r != rank:
                actor.wake.remote(number)

    def wake_all(self, number: int, stop: bool = False) -> None:
        for actor in self._gang.actors:
            actor.wake.remote(number, stop)

    def poll(self, rank: int, timeout_s: float) -> RankStatus:
        import ray

        ref = self._actor(rank).poll.options(concurrency_group="outputs").remote(timeout_s)
        return ray.get(ref, timeout=timeout_s + self._gang.options.rpc_timeout_s)

    def close(self, timeout_s: float) -> None:
        self._gang.stop(timeout_s)

    def kill(self) -> None:
        self._gang.kill()


def close_ranks(ranks: LocalRanks | RayRanks, timeout_s: float) -> None:
    """Wait for ranks told to stop; a gang that does not stop in time is killed."""
    try:
        ranks.close(timeout_s=timeout_s)
    except Exception as e:
        logger.warning("engine: ranks did not stop cleanly: %s", e)
        if hasattr(ranks, "kill"):
            ranks.kill()
