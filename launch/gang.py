"""Gang: the rank actors of one launch attempt, brought up together and torn down together.

Bring-up (``Gang.launch``), in this order:

1. one placement group (``placement.create_placement_group``: one bundle per rank);
2. one RankActor per bundle, pinned to it, with no Ray-level restarts (a restart is a gang
   restart: a lone new rank could not rejoin the old process group);
3. ``where()`` on every actor, then ranks by node and GPU (``placement.assign_ranks``);
4. rank 0's actor picks a free port on its node; its node IP and that port are the rendezvous;
5. ``setup`` on every actor at once (joining the group is collective), bounded by
   ``setup_timeout_s``; the first failure ends the wait, so a rank that cannot start does not
   make the others wait for the whole timeout.

A failure raises GangSetupError carrying RankFailure records, except a deterministic setup error (a
ValueError while building a rank's worker, ranks that disagree on their spec), which raises
``launch.errors.SetupError`` (a ValueError): a new gang would fail the same way. ``kill`` ends every
actor and removes the placement group whatever state they are in; ``stop`` first closes workers and
process groups in order, then kills.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request
from launch.errors import SetupError, is_deterministic_setup_error
from launch.placement import assign_ranks, create_placement_group
from launch.process_group import DEFAULT_TIMEOUT_S
from launch.rank_actor import RankActor
from launch.rank_session import RankStatus
from launch.run_report import RankFailure

__all__ = ["UNANSWERED", "Gang", "GangOptions", "GangSetupError", "describe_error"]


class _Unanswered:
    """The outcome of a call that did not return in time (None is a legitimate return value)."""

    def __repr__(self) -> str:
        return "UNANSWERED"


UNANSWERED = _Unanswered()


@dataclass(frozen=True)
class GangOptions:
    """How a gang is placed and bounded (``device`` is ``cpu`` or ``cuda``)."""

    device: str = "cpu"
    cpus_per_rank: float = 1
    placement_timeout_s: float = 60.0
    setup_timeout_s: float = 600.0
    pg_timeout_s: float = DEFAULT_TIMEOUT_S
    rpc_timeout_s: float = 30.0
    # rank 0's graph-capture bar (the driver shows Ray's forwarded stderr)
    show_progress: bool = False
    worker_factory: Callable[[RankSpec, int, int], Any] | None = None


class GangSetupError(RuntimeError):
    def __init__(self, failures: Sequence[RankFailure]) -> None:
        self.failures = tuple(failures)
        super().__init__("; ".join(f.describe() for f in self.failures) or "gang setup failed")


def describe_error(exc: BaseException) -> tuple[str, str, str]:
    """``(kind, message, detail)`` of an exception a Ray call raised: ``died`` for a dead actor
    (message: the reason Ray gives, e.g. killed by ray.kill, or exited), else ``error`` with the
    remote exception's type and text."""
    import ray.exceptions as rex

    text = str(exc)
    if isinstance(exc, rex.RayActorError):
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        reason = lines[-1] if lines else type(exc).__name__
        return "died", reason, text
    if isinstance(exc, rex.RayTaskError) and exc.cause is not None:
        cause = exc.cause
        return "error", f"{type(cause).__name__}: {cause}", text
    return "error", f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}", text


class Gang:
    """The actors of one attempt; ``actors[r]`` is rank r (after ``launch``)."""

    def __init__(self, spec: RankSpec, options: GangOptions, attempt: int = 0) -> None:
        self.spec = spec
        self.options = options
        self.attempt = attempt
        self.world_size = spec.runtime.world_size
        self.actors: tuple[Any, ...] = ()
        self.locations: tuple[dict[str, Any], ...] = ()
        self._pg: Any = None

    # -- bring-up -------------------------------------------------------------------------------
    def launch(self) -> None:
        """Place, create, rank, rendezvous and set up every actor (see the module docstring).
        Raises GangSetupError (the caller kills the gang), or ValueError/TimeoutError from
        placement when the cluster cannot hold the gang."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        opt, n = self.options, self.world_size
        self._pg = create_placement_group(n, opt.device, cpus_per_rank=opt.cpus_per_rank,
                                          timeout_s=opt.placement_timeout_s)
        # The "progress" group answers RankActor.phase() while setup() runs in the default one;
        # the engine's waiting polls run in "outputs", beside its submits in the default one.
        remote_cls = ray.remote(concurrency_groups={"progress": 1, "outputs": 1})(RankActor)
        by_bundle = [
            remote_cls.options(
                num_cpus=opt.cpus_per_rank,
                num_gpus=1 if opt.device == "cuda" else 0,
                max_restarts=0,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i,
                    placement_group_capture_child_tasks=False,
                ),
            ).remote()
            for i in range(n)
        ]
        # Until ranks are known, a failing bundle is named by its index in the rank slot.
        self.actors = tuple(by_bundle)
        where = self._gather([a.where.remote() for a in by_bundle], opt.setup_timeout_s,
                             "placement")
        ranks = assign_ranks(where)
        order = sorted(range(n), key=lambda i: ranks[i])
        self.actors = tuple(by_bundle[i] for i in order)
        self.locations = tuple(where[i] for i in order)
        port = self._gather([self.actors[0].rendezvous_port.remote()], opt.rpc_timeout_s,
                            "rendezvous")[0]
        addr = self.locations[0]["node_ip"]
        threads = max(1, int(opt.cpus_per_rank))
        self._gather(
            [a.setup.remote(self.spec, r, n, addr, port, pg_timeout_s=opt.pg_timeout_s,
                            num_threads=threads, show_progress=opt.show_progress and r == 0,
                            worker_factory=opt.worker_factory)
             for r, a in enumerate(self.actors)],
            opt.setup_timeout_s, "setup",
        )

    def _gather(self, refs: list[Any], timeout_s: float, phase: str) -> list[Any]:
        """Results of ``refs`` (ref i belongs to rank slot i) or GangSetupError at the first
        failure, or when some are not done within ``timeout_s``."""
        import ray

        index = {ref: i for i, ref in enumerate(refs)}
        out: list[Any] = [None] * len(refs)
        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                slow = sorted(index[r] for r in pending)
                raise GangSetupError([
                    RankFailure(self.attempt, i, "setup",
                                f"{phase} did not finish within {timeout_s} s", self._ip(i))
                    for i in slow
                ])
            for ref in ready:
                i = index[ref]
                try:
                    out[i] = ray.get(ref)
                except Exception as e:
                    kind, msg, detail = describe_error(e)
                    if phase == "setup" and is_deterministic_setup_error(e):
                        # A new gang would fail the same way: no restart (exit 2 on the CLI).
                        raise SetupError(f"rank {i} could not be set up: {msg}", rank=i,
                                         detail=detail) from None
                    raise GangSetupError([
                        RankFailure(self.attempt, i, "died" if kind == "died" else "setup",
                                    f"{phase}: {msg}", self._ip(i), detail=detail)
                    ]) from None
        return out

    def _ip(self, rank: int) -> str:
        return self.locations[rank].get("node_ip", "") if rank < len(self.locations) else ""

    def node_ip(self, rank: int) -> str:
        return self._ip(rank)

    # -- lifecycle ------------------------------------------------------------------------------
    def call_each(self, method: str, args_by_rank: Sequence[tuple[Any, ...]] | None = None,
                  timeout_s: float | None = None) -> list[Any]:
        """Call ``method`` on every rank at once (rank r with ``args_by_rank[r]``); per rank: the
        value, the exception the call raised, or UNANSWERED when not back within ``timeout_s``
        (default ``rpc_timeout_s``)."""
        import ray

        timeout_s = self.options.rpc_timeout_s if timeout_s is None else timeout_s
        args = args_by_rank if args_by_rank is not None else [()] * len(self.actors)
        refs = [getattr(a, method).remote(*x) for a, x in zip(self.actors, args, strict=True)]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        done = set(ready)
        out: list[Any] = []
        for ref in refs:
            if ref not in done:
                out.append(UNANSWERED)
                continue
            try:
                out.append(ray.get(ref))
            except Exception as e:
                out.append(e)
        return out

    def submit(self, shares: Sequence[Sequence[Request]]) -> list[Any]:
        """Queue ``shares[r]`` on rank r (all before any rank starts); ``call_each``'s outcomes."""
        return self.call_each("submit", [(list(s),) for s in shares])

    def start(self) -> list[Any]:
        return self.call_each("start")

    def collect(self) -> list[RankStatus | BaseException | _Unanswered]:
        """One ``collect`` per rank, all in flight together (outcomes as in ``call_each``)."""
        return self.call_each("collect")

    def probe(self, timeout_s: float) -> list[Any]:
        """``health`` per rank: a dict, an exception (dead), or UNANSWERED."""
        return self.call_each("health", timeout_s=timeout_s)

    # -- teardown -------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 30.0) -> None:
        """Ordered teardown after a finished run: every rank closes its worker, then destroys its
        process group (all ranks together); then the actors and the placement group go."""
        import ray

        try:
            ray.wait([a.stop.remote() for a in self.actors], num_returns=len(self.actors),
                     timeout=timeout_s)
        finally:
            self.kill()

    def kill(self) -> None:
        """End every actor now (no graceful close: peers may be stuck in a collective) and remove
        the placement group. Safe to call twice and on a half-built gang."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            with contextlib.suppress(Exception):  # already dead
                ray.kill(a, no_restart=True)
        self.actors = ()
        if self._pg is not None:
            with contextlib.suppress(Exception):  # the cluster may already have removed it
                remove_placement_group(self._pg)
            self._pg = None
