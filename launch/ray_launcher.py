"""launch_ray: run requests on a gang of Ray rank actors, with bounded gang restarts.

The launcher only does lifecycle; each rank drives its own step loop. Per attempt:

1. ``Gang.launch`` (placement group, actors, ranks, rendezvous, process group, workers);
2. the requests without a result are split over the ranks (round-robin) and submitted, all
   before any rank starts (a rank's first step must see every rank's work);
3. ``start`` on every rank, then every ``poll_interval_s`` one ``collect`` per rank, all in
   flight together: finished results are added to a dict by rid (a result is kept once, the
   first time it arrives), and each rank's state and step counter are checked;
4. done when every rank reports ``done`` (its loop returned) and every request has a result;
   then the gang is stopped in order (workers, process groups) and killed.

A failure (see ``run_report`` for the kinds) ends the attempt: the launcher probes every rank
once to tell the rank that failed from the peers that failed because of it, kills every actor,
removes the placement group, and, while ``max_restarts`` allows, starts a new gang (new
placement, new port) with the unfinished requests. Results already collected are kept, so no
finished request runs twice in the report and none is lost. When restarts are used up it raises
GangFailedError naming each failed rank, where it ran, and why.

Bounds: a dead actor fails its next call (``died``); a call unanswered within
``rpc_timeout_s`` is ``unresponsive``; a running rank whose step counter has not moved for
``hang_timeout_s`` is ``hung``; setup is bounded by ``setup_timeout_s`` and the process group's
collectives by ``pg_timeout_s`` (the DP step sync has its own ``dp_sync_timeout_s``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.admission import admit
from dp_runtime.serving.request import Request, RequestResult
from launch.gang import UNANSWERED, Gang, GangOptions, GangSetupError, describe_error
from launch.process_group import DEFAULT_TIMEOUT_S
from launch.rank_phases import RankPhaseWatcher
from launch.rank_session import DONE, ERROR, RUNNING, RankStatus
from launch.run_report import GangFailedError, PollEvent, RankFailure, RunReport
from launch.workload import split_round_robin

__all__ = ["LaunchOptions", "launch_ray", "node_name"]

logger = logging.getLogger("launch")

# Which failure names the culprit when several ranks fail in one poll: a dead rank explains its
# peers' errors (they time out in the collective it left), an error explains hung peers.
_PRIORITY = ("died", "setup", "error", "unresponsive", "hung")


@dataclass(frozen=True)
class LaunchOptions:
    """Bounds and sizes of a Ray launch (the device comes from ``spec.runtime.device``).

    ``show_progress``: rank 0 shows its graph-capture bar. ``worker_factory`` replaces RankWorker
    in the actors (a test seam).
    """

    max_restarts: int = 2
    cpus_per_rank: float = 1
    poll_interval_s: float = 0.25
    hang_timeout_s: float = 120.0
    rpc_timeout_s: float = 30.0
    probe_timeout_s: float = 5.0
    setup_timeout_s: float = 600.0
    placement_timeout_s: float = 60.0
    pg_timeout_s: float = DEFAULT_TIMEOUT_S
    show_progress: bool = False
    worker_factory: Callable[[RankSpec, int, int], Any] | None = None

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"LaunchOptions.max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("poll_interval_s", "hang_timeout_s", "rpc_timeout_s", "probe_timeout_s",
                     "setup_timeout_s", "placement_timeout_s", "pg_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LaunchOptions.{name} must be > 0, got {getattr(self, name)}")

    def gang_options(self, device: str) -> GangOptions:
        return GangOptions(device=device, cpus_per_rank=self.cpus_per_rank,
                           placement_timeout_s=self.placement_timeout_s, setup_timeout_s=self.setup_timeout_s,
                           pg_timeout_s=self.pg_timeout_s, rpc_timeout_s=self.rpc_timeout_s,
                           show_progress=self.show_progress, worker_factory=self.worker_factory)


def launch_ray(spec: RankSpec, requests: Sequence[Request], options: LaunchOptions | None = None, *,
               on_poll: Callable[[PollEvent], None] | None = None,
               on_phase: Callable[[str], None] | None = None) -> RunReport:
    """Run ``requests`` on ``spec.runtime.world_size`` Ray rank actors; returns the RunReport
    (results in request order, each rid once). Ray must be initialised (``ray_cluster``).

    ``on_phase(text)`` hears the start-up phases of every attempt (placing the ranks, then what
    the ranks are doing: ``rank_phases.summarize_phases``), ``on_poll`` every poll of the run.
    A request refused at the door (``admission.check_request``: token ids, sampling, context
    length) gets a result with its error and is never sent to a rank; a request that fails
    inside a step on its own comes back with its error too. Both are final: no restart runs
    them again. Raises ValueError for duplicate rids or a request a rank refuses (it would
    never fit, so a restart cannot help), SetupError (a ValueError) at once, without a
    restart, when a rank's setup fails deterministically (a ValueError while building the
    worker, or ranks that disagree on their spec), GangFailedError when ``max_restarts``
    restarts did not suffice.
    """
    return _Supervisor(spec, list(requests), options or LaunchOptions(), on_poll, on_phase).run()


class _Supervisor:
    def __init__(self, spec: RankSpec, requests: list[Request], options: LaunchOptions,
                 on_poll: Callable[[PollEvent], None] | None,
                 on_phase: Callable[[str], None] | None = None) -> None:
        # The door: refused requests are answered now (final, never sent to a rank).
        _, refused = admit(requests, spec.model_config().vocab_size, spec.context_len)
        self.spec, self.requests, self.options, self.on_poll = spec, requests, options, on_poll
        self.on_phase = on_phase
        self.max_tokens = sum(r.sampling.max_new_tokens for r in requests)
        self.tokens_before = 0  # output tokens of the results kept from earlier attempts
        self.world = spec.runtime.world_size
        self.device = spec.runtime.device.type
        self.results: dict[str, RequestResult] = {r.rid: r for r in refused}
        self.failures: list[RankFailure] = []
        self.rank_metrics: list[dict[str, Any]] = [{} for _ in range(self.world)]
        self.setup_s = self.run_s = 0.0
        self.nodes: tuple[str, ...] = ()  # per rank, of the last gang that was set up
        self.loop_s: list[float] = []  # per rank, of the current attempt

    # -- attempts -------------------------------------------------------------------------------
    def run(self) -> RunReport:
        t0 = time.perf_counter()
        for attempt in range(self.options.max_restarts + 1):
            failed = self._attempt(attempt)
            if not failed:
                return self._report(time.perf_counter() - t0, restarts=attempt)
            self.failures.extend(failed)
            primary = [f for f in failed if not f.secondary] or failed
            left = sum(r.rid not in self.results for r in self.requests)
            for f in failed:
                logger.warning("rank failure: %s", f.describe())
            if attempt < self.options.max_restarts:
                logger.warning("restarting the gang (restart %d of %d): %d of %d requests unfinished",
                               attempt + 1, self.options.max_restarts, left, len(self.requests))
        report = self._report(time.perf_counter() - t0, restarts=self.options.max_restarts)
        raise GangFailedError(
            f"the gang failed {self.options.max_restarts + 1} times (max_restarts={self.options.max_restarts}); "
            f"last: {'; '.join(f.describe() for f in primary)}; "
            f"{len(report.results)} of {len(self.requests)} requests finished",
            self.failures, report,
        )

    def _attempt(self, attempt: int) -> list[RankFailure]:
        """One gang from launch to teardown; the failures that ended it ([] on success)."""
        gang = Gang(self.spec, self.options.gang_options(self.device), attempt)
        try:
            t = time.perf_counter()
            self._phase(f"placing {self.world} rank{'s' if self.world > 1 else ''}"
                        + (f" (restart {attempt})" if attempt else ""))
            try:
                with RankPhaseWatcher(gang, self.on_phase):
                    gang.launch()
            except GangSetupError as e:
                return list(e.failures)
            self.setup_s += time.perf_counter() - t
            self.nodes = tuple(node_name(loc) for loc in gang.locations)
            self.tokens_before = sum(len(r.output_ids) for r in self.results.values())
            self._phase("running")
            pending = [r for r in self.requests if r.rid not in self.results]
            failed = self._lifecycle(gang, "submit", gang.submit(split_round_robin(pending, self.world)))
            if failed:
                return failed
            self.loop_s = [0.0] * self.world
            failed = self._lifecycle(gang, "start", gang.start()) or self._supervise(gang)
            self.run_s += max(self.loop_s, default=0.0)
            if not failed:
                gang.stop(timeout_s=self.options.rpc_timeout_s)
            return failed
        finally:
            gang.kill()

    def _lifecycle(self, gang: Gang, phase: str, outcomes: list[Any]) -> list[RankFailure]:
        """Failures among the outcomes of a submit/start call. A request refused at submit
        (ValueError on the rank) is the caller's error: raised here, not retried."""
        import ray.exceptions as rex

        found = []
        for rank, out in enumerate(outcomes):
            if isinstance(out, rex.RayTaskError) and isinstance(out.cause, ValueError):
                raise ValueError(f"rank {rank} refused its requests: {out.cause}") from None
            if out is UNANSWERED:
                found.append(self._fail(gang, rank, "unresponsive", f"{phase}() unanswered within {self.options.rpc_timeout_s} s"))
            elif isinstance(out, BaseException):
                kind, msg, detail = describe_error(out)
                found.append(self._fail(gang, rank, kind, f"{phase}(): {msg}", detail))
        return self._classify(gang, found) if found else []

    # -- polling --------------------------------------------------------------------------------
    def _supervise(self, gang: Gang) -> list[RankFailure]:
        opt = self.options
        now = time.monotonic()
        progress = [(-1, now)] * self.world  # (last step counter, when it last moved)
        while True:
            outcomes = gang.collect()
            now = time.monotonic()
            found: list[RankFailure] = []
            statuses: list[RankStatus | None] = []
            for rank, st in enumerate(outcomes):
                statuses.append(st if isinstance(st, RankStatus) else None)
                if st is UNANSWERED:
                    found.append(self._fail(gang, rank, "unresponsive", f"collect() unanswered within {opt.rpc_timeout_s} s"))
                elif isinstance(st, BaseException):
                    kind, msg, detail = describe_error(st)
                    found.append(self._fail(gang, rank, kind, msg, detail))
                else:
                    self._absorb(st)
                    if st.state == ERROR:
                        found.append(self._fail(gang, rank, "error", _last_line(st.error), st.error or ""))
                    elif st.state == RUNNING:
                        if st.steps != progress[rank][0]:
                            progress[rank] = (st.steps, now)
                        elif now - progress[rank][1] > opt.hang_timeout_s:
                            found.append(self._fail(gang, rank, "hung",
                                                    f"no step completed for {opt.hang_timeout_s} s (at step {st.steps})"))
                    elif st.state != DONE:
                        found.append(self._fail(gang, rank, "error", f"unexpected state {st.state!r} while running"))
            if self.on_poll is not None:
                live = sum(int(st.metrics.get("generated_tokens", 0)) for st in statuses if st is not None)
                self.on_poll(PollEvent(gang.attempt, len(self.results), len(self.requests), gang.actors,
                                       tuple(statuses), tokens=self.tokens_before + live,
                                       total_tokens=self.max_tokens))
            if found:
                return self._classify(gang, found)
            if all(isinstance(st, RankStatus) and st.state == DONE for st in outcomes):
                missing = [r.rid for r in self.requests if r.rid not in self.results]
                if missing:
                    # Every loop returned, so nothing is left anywhere: a runtime bug, not a fault.
                    raise RuntimeError(f"every rank finished but {len(missing)} requests have no result: {missing[:5]}")
                return []
            time.sleep(opt.poll_interval_s)

    def _phase(self, text: str) -> None:
        if self.on_phase is not None:
            self.on_phase(text)

    def _absorb(self, st: RankStatus) -> None:
        for res in st.results:
            # First arrival wins: a request resubmitted after a restart is one that had no result.
            self.results.setdefault(res.rid, res)
        self.rank_metrics[st.rank] = dict(st.metrics)
        self.loop_s[st.rank] = st.loop_s

    def _fail(self, gang: Gang, rank: int, kind: str, message: str, detail: str = "") -> RankFailure:
        return RankFailure(gang.attempt, rank, kind, message, gang.node_ip(rank), detail=detail)

    def _classify(self, gang: Gang, found: list[RankFailure]) -> list[RankFailure]:
        """Probe every rank once (a peer may have died without our having called it yet), then
        mark as secondary every failure of a kind less telling than the worst one seen."""
        seen = {f.rank for f in found}
        for rank, out in enumerate(gang.probe(self.options.probe_timeout_s)):
            if rank in seen or not isinstance(out, BaseException):
                continue
            kind, msg, detail = describe_error(out)
            if kind == "died":
                found.append(self._fail(gang, rank, kind, msg, detail))
        worst = min(_PRIORITY.index(f.kind) for f in found)
        return sorted(
            (RankFailure(f.attempt, f.rank, f.kind, f.message, f.node_ip, _PRIORITY.index(f.kind) > worst, f.detail)
             for f in found),
            key=lambda f: (f.secondary, f.rank),
        )

    def _report(self, wall_s: float, restarts: int) -> RunReport:
        order = [r.rid for r in self.requests if r.rid in self.results]
        return RunReport(
            results=tuple(self.results[rid] for rid in order), world_size=self.world, launcher="ray",
            device=self.device, wall_s=wall_s, run_s=self.run_s, setup_s=self.setup_s, restarts=restarts,
            failures=tuple(self.failures), rank_metrics=tuple(self.rank_metrics), nodes=self.nodes,
        )


def node_name(location: dict[str, Any]) -> str:
    """A rank's node as people name it: ``IP (hostname)`` from ``RankActor.where``."""
    ip, host = location.get("node_ip", ""), location.get("hostname", "")
    return f"{ip} ({host})" if ip and host else ip or host


def _last_line(text: str | None) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "the step loop raised"
