"""The engine's hands on its ranks: one RankSession in this process (``local``) or a gang of Ray
rank actors (``ray``), behind one small interface the engine drives.

Every call takes the driver's message number (``dp_runtime/serve_loop.py``): ``send`` gives the
named rank its message and every other rank a bare wake with the same number, in one critical
section of the engine, so each rank receives the numbers in the order they were drawn. Ray keeps
the calls of one caller to one actor in order (they run in the actor's default group, one at a
time); ``poll`` runs in the actor's ``outputs`` group, so a waiting poll holds up no submit.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request
from launch.engine_errors import EngineUnavailable
from launch.rank_session import RankSession, RankStatus

__all__ = ["LocalRanks", "RayRanks", "close_ranks"]

logger = logging.getLogger("launch")


def _reraise(error: BaseException) -> None:
    raise error


def _accepted() -> None:
    return None


class LocalRanks:
    """World size 1 in this process: the session's serving loop runs in its own thread."""

    def __init__(self, spec: RankSpec, on_phase: Callable[[str], None] | None = None) -> None:
        self.world_size = 1
        self.nodes = ("local",)
        self._session = RankSession(spec, 0, 1, on_phase=on_phase)
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

        self.world_size = spec.runtime.world_size
        self._gang = Gang(spec, gang_options, attempt)
        try:
            if on_phase is not None:
                on_phase(f"placing {self.world_size} rank{'s' if self.world_size > 1 else ''}"
                         + (f" (restart {attempt})" if attempt else ""))
            with RankPhaseWatcher(self._gang, on_phase):  # the ranks' set-up phases, as `run`'s
                self._gang.launch()
            for outcome in self._gang.call_each("serve"):
                if isinstance(outcome, BaseException):
                    raise outcome
        except BaseException:
            self._gang.kill()
            raise
        self.nodes = tuple(loc.get("node_ip", "") for loc in self._gang.locations)

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
