"""Engine: the Python API of a serving gang, and the one thing the HTTP server talks to.

``Engine(spec, options).start()`` brings up long-lived ranks (one in this process, or a gang of
Ray actors) that serve until ``shutdown``: requests are ``submit``-ted while the ranks run, each
to the rank with the least outstanding tokens, and each request's new tokens come back once per
step through its ``on_output`` callback (``stream`` wraps that for asyncio, ``generate`` blocks).

Lifetimes: a request is *in flight* from ``submit`` until its last output (``finished``): its
rank finished it ("stop", "length"), failed it alone ("error"), or ``abort`` ended it ("abort").
When a rank fails (dies, raises, stops answering, or hangs: ``gang_faults``), every request in
flight gets a last output with ``retryable`` set (the server answers 503; ``dp-runtime run``
submits it again) and, on Ray while ``max_restarts`` allows, a new gang comes up (state
``restarting``, then ``ready``); a request is never run twice. A gang that fails to set up is
retried under the same budget; past it the engine is ``failed`` (``start`` raises
GangFailedError). An engine starts once: a second ``start`` is refused.

Threads: one poller per rank waits for its outputs (``RankSession.poll``) and calls the callbacks,
which must be quick and not call into the engine under their own locks. All calls are thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dp_runtime.model.sampling_defaults import SamplingDefaults, checkpoint_sampling_defaults
from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.admission import check_request, refused_result
from dp_runtime.serving.request import Request
from launch.engine_calls import generate_requests, stream_request
from launch.engine_cluster import EngineCluster
from launch.engine_errors import EngineUnavailable, QueueFull, RequestRejected, rejection
from launch.engine_live import Live, RankView, batch_refusal, call_quietly, take_outputs
from launch.engine_ranks import close_ranks, launch_with_retries
from launch.engine_types import LAUNCHERS, EngineHealth, EngineOptions, EngineStats, RequestOutput
from launch.gang_faults import HangWatch, gang_failed, name_failures, poll_failure
from launch.prefix_routing import prefix_router
from launch.rank_session import CLOSED, DONE, ERROR, RankStatus
from launch.run_report import GangFailedError, RankFailure

__all__ = ["LAUNCHERS", "Engine", "EngineHealth", "EngineOptions", "EngineStats",
           "EngineUnavailable", "QueueFull", "RequestOutput", "RequestRejected"]

logger = logging.getLogger("launch")


class Engine:
    """See the module docstring. Facts for the server: ``model_name``, ``model_dir`` (None for a
    preset), ``context_len``, ``vocab_size``, ``eos_token_ids``, ``world_size``, and
    ``sampling_defaults``: what a front door gives the sampling fields a request leaves unset (the
    checkpoint's generation_config.json; none with ``EngineOptions.sampling_defaults`` none)."""

    def __init__(self, spec: RankSpec, options: EngineOptions | None = None) -> None:
        self.spec, self.options = spec, options or EngineOptions()
        if self.options.launcher == "local" and spec.runtime.world_size != 1:
            raise ValueError(f"the local launcher runs world size 1, the spec has "
                             f"{spec.runtime.world_size} (use launcher='ray')")
        mc = spec.model_config()
        self.world_size = spec.runtime.world_size
        self.vocab_size, self.context_len = mc.vocab_size, spec.context_len
        self.eos_token_ids = spec.eos_token_ids
        self.model_dir = None if spec.is_preset else spec.model
        self.model_name = spec.model.rstrip("/").rsplit("/", 1)[-1]  # a preset's name is its own
        self.sampling_defaults = SamplingDefaults()
        if self.options.sampling_defaults == "model" and self.model_dir is not None:
            # Read before any rank starts: a bad value is a ModelConfigError naming the file.
            self.sampling_defaults = checkpoint_sampling_defaults(self.model_dir)
        self._capacity = (spec.runtime.max_running_requests * self.world_size
                          + self.options.max_queued)
        self._lock = threading.Lock()  # guards all below; messages are drawn and sent under it
        self._number = 0
        self._live: dict[str, Live] = {}
        self._views = [RankView() for _ in range(self.world_size)]
        self._router = prefix_router(self.world_size, spec.runtime.prefix_caching)
        self._state, self._detail = "starting", ""
        self._restarts = 0
        self._failures: list[RankFailure] = []
        self._naming = False  # a rank failure's verdict is being made (``EngineHealth.settled``)
        self._setup_s = 0.0
        self._nodes: tuple[str, ...] = ()  # where the ranks of the latest gang run
        self._ranks: Any = None
        self._pollers: list[threading.Thread] = []
        self._hangs = HangWatch(self.world_size, self.options.hang_timeout_s)
        self._cluster = EngineCluster(self.options, self.world_size)  # Ray's, when it uses Ray
        self._started = False
        self._on_phase: Callable[[str], None] | None = None

    @property
    def capacity(self) -> int:
        """The most requests in flight at once (``max_running_requests`` x ranks + ``max_queued``):
        past it ``submit`` raises QueueFull."""
        return self._capacity

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, on_phase: Callable[[str], None] | None = None) -> Engine:
        """Bring the ranks up and start serving; blocks until every rank is ready. A gang that
        fails to set up is retried while ``max_restarts`` allows. Raises what the launch raised:
        GangFailedError (restarts used up), SetupError (a rank no gang could build), ...; or
        EngineUnavailable when ``shutdown`` came meanwhile; the engine is then stopped (its ranks
        and a Ray cluster it started). Raises RuntimeError, touching nothing, on an engine that
        was started before."""
        with self._lock:
            if self._started:
                raise RuntimeError(f"Engine.start: this engine was started already "
                                   f"(state {self._state!r}); an engine starts once: "
                                   f"create a new Engine")
            self._started, self._on_phase = True, on_phase
        try:
            self._cluster.connect(on_phase, self._check_starting)
            self._check_starting()
            ranks = self._launch_gang()
            with self._lock:
                cancelled = self._state != "starting"
                if not cancelled:
                    self._ranks, self._state, self._nodes = ranks, "ready", tuple(ranks.nodes)
            if cancelled:  # shutdown came while the ranks started: they stop here
                self._close_ranks(ranks)
                self._check_starting()
        except BaseException:
            failed = self.health().state == "starting"  # else a shutdown asked: no failure
            self._cluster.stop()  # here, never beside a start using Ray in another thread
            self._set_state(*(("failed", "start-up failed") if failed else ("stopped",)))
            raise
        self._start_pollers(ranks)
        return self

    def _check_starting(self) -> None:
        if self.health().state != "starting":
            raise EngineUnavailable("the engine was shut down while it started")

    def _launch_gang(self) -> Any:
        """A gang that is up (``launch_with_retries``: failed tries are recorded as restarts)."""
        t = time.perf_counter()
        try:
            ranks, self._restarts = launch_with_retries(self.spec, self.options, self._restarts,
                                                        self._on_phase, self._failures)
        finally:
            self._setup_s += time.perf_counter() - t
        return ranks

    def _may_restart(self) -> bool:
        return self._cluster.uses_ray and self._restarts < self.options.max_restarts

    def _start_pollers(self, ranks: Any) -> None:
        self._hangs = HangWatch(self.world_size, self.options.hang_timeout_s)
        self._pollers = [threading.Thread(target=self._poll_loop, args=(ranks, r), daemon=True,
                                          name=f"engine-poll-{r}") for r in range(self.world_size)]
        for t in self._pollers:
            t.start()

    def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Stop taking requests, let those in flight finish for up to ``drain_timeout_s``
        (default ``options.drain_timeout_s``), abort the rest, then stop the ranks (and the Ray
        cluster the engine started). Idempotent."""
        with self._lock:
            if self._state in ("stopped", "stopping"):
                return
            starting = self._state == "starting"
            ranks, self._state = self._ranks, "stopping"
        if starting:  # start() runs in another thread: it stops what it brought up, then raises
            return
        timeout = self.options.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        deadline = time.monotonic() + timeout
        while len(self._live) and time.monotonic() < deadline:
            time.sleep(0.01)
        for rid in list(self._live):
            self.abort(rid)
        deadline = time.monotonic() + 5.0
        while len(self._live) and time.monotonic() < deadline:  # the aborts' results
            time.sleep(0.01)
        if ranks is not None:
            self._close_ranks(ranks)
        for t in self._pollers:
            t.join(timeout=5.0)
        self._fail_in_flight("the engine stopped")
        self._cluster.stop()
        self._set_state("stopped")

    def _close_ranks(self, ranks: Any) -> None:
        with self._lock:
            self._number += 1
            ranks.wake_all(self._number, stop=True)
        close_ranks(ranks, timeout_s=30.0)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests ---------------------------------------------------------------------------------
    def check(self, request: Request) -> None:
        """The door's rules (``admission.check_request``: ids, sampling, context) without
        submitting; RequestRejected naming the field, the limit and the value."""
        problem = check_request(request, self.vocab_size, self.context_len)
        if problem is not None:
            raise rejection(problem)

    def submit(self, request: Request, on_output: Callable[[RequestOutput], None]) -> int:
        """Queue ``request`` on the rank with the least outstanding tokens; returns that rank.
        ``on_output`` is called from a poller thread (module docstring). Raises RequestRejected
        (bad field, or an rid already in flight), QueueFull, EngineUnavailable."""
        return self.submit_many([request], on_output)[0]

    def submit_many(self, requests: Sequence[Request],
                    on_output: Callable[[RequestOutput], None]) -> list[int]:
        """``submit`` for several requests, routed in turn (each counting those before it), in one
        message per rank (on Ray one call per rank: requests that arrive together reach the ranks
        together); their ranks. All or none: after a raise none is in flight (what a rank took
        is aborted; ``on_output`` may hear that)."""
        reqs = list(requests)
        for r in reqs:
            self.check(r)
        with self._lock:
            if refusal := batch_refusal(reqs, self._state, self._detail, self._live,
                                        self._capacity):
                raise refusal
            ranks, by_rank = [], {}
            for r in reqs:
                ranks.append(rank := self._pick_rank(r.prompt_ids))
                self._live[r.rid] = Live(r, rank, on_output, time.monotonic() + r.arrival_s)
                self._views[rank].routed += 1
                by_rank.setdefault(rank, []).append(r)
            sent = []
            for rank, group in by_rank.items():
                self._number += 1
                sent.append((group, self._ranks.submit(rank, group, self._number)))
        refusals = []
        for group, confirm in sent:
            try:
                confirm()  # EngineUnavailable when its rank died under it (its poller fails over)
            except (ValueError, EngineUnavailable) as e:  # ValueError: the rank refused them
                with self._lock:
                    for r in group:
                        self._live.pop(r.rid, None)
                refusals.append(e if isinstance(e, EngineUnavailable) else rejection(str(e)))
        if refusals:
            for r in reqs:
                self.abort(r.rid)
            raise refusals[0] from None
        return ranks

    def _pick_rank(self, prompt: Sequence[int]) -> int:
        """The rank left with the least outstanding tokens (``prefix_routing.py``)."""
        return self._router.route(prompt, self._loads()[0], [v.routed for v in self._views])

    def _loads(self) -> tuple[list[int], list[int]]:
        """Each rank's outstanding tokens and requests in flight (under the lock)."""
        load, count = [0] * self.world_size, [0] * self.world_size
        for live in self._live.values():
            load[live.rank] += live.outstanding
            count[live.rank] += 1
        return load, count

    def abort(self, rid: str) -> bool:
        """End ``rid`` now (finish_reason "abort"; its rank frees its KV within a step). False
        when it is not in flight."""
        with self._lock:
            live = self._live.get(rid)
            if live is None or self._ranks is None:
                return False
            self._number += 1
            self._ranks.abort(live.rank, [rid], self._number)
        return True

    # The waiting forms of submit (engine_calls.py): ``stream(request)``, an async iterator of the
    # request's outputs; ``generate(requests, timeout_s=None)``, their results in order.
    stream = stream_request
    generate = generate_requests

    # -- outputs ----------------------------------------------------------------------------------
    def _poll_loop(self, ranks: Any, rank: int) -> None:
        while True:
            try:
                st = ranks.poll(rank, self.options.poll_timeout_s)
            except Exception as e:
                if self._ranks is ranks and self._state not in ("stopping", "stopped"):
                    self._rank_failed(ranks, rank, *poll_failure(e))
                return
            self._deliver(rank, st)
            if st.state == ERROR:
                last = [ln.strip() for ln in (st.error or "").splitlines() if ln.strip()]
                self._rank_failed(ranks, rank, "error",
                                  last[-1] if last else "its step loop raised", st.error or "")
                return
            if st.state in (DONE, CLOSED):
                return
            with self._lock:  # every rank steps while some request in flight has arrived
                due = any(live.due <= time.monotonic() for live in self._live.values())
            hung = self._hangs.hung(rank, st.steps, due)
            if hung is not None and self._ranks is ranks:
                self._rank_failed(ranks, rank, "hung", hung,
                                  also_hung=self._hangs.stopped_with(rank))
                return

    def _deliver(self, rank: int, st: RankStatus) -> None:
        with self._lock:
            self._views[rank].metrics = dict(st.metrics)
            outs = take_outputs(self._live, st)
        for live, out in outs:
            call_quietly(live.on_output, out)

    def _rank_failed(self, ranks: Any, rank: int, kind: str, reason: str, detail: str = "",
                     also_hung: Sequence[tuple[int, str]] = ()) -> None:
        """A rank of the live gang failed: refuse new requests, end those in flight (retryable),
        name every failed rank (a probe finds the dead ones), kill the gang, and restart it
        while ``max_restarts`` allows."""
        failure = RankFailure(self._restarts, rank, kind, reason, detail=detail)
        # Ranks whose counters stopped with this one's are named with it at once (a rank stuck in
        # a step holds its peers in a collective; which poller notices first is chance).
        known = [failure] + [RankFailure(self._restarts, r, "hung", msg)
                             for r, msg in also_hung if r != rank]
        with self._lock:
            if self._ranks is not ranks:  # another poller of this gang got here first
                return
            self._ranks, can_restart = None, self._may_restart()
            # The failure is named at once (a reader of health and stats sees it before the
            # probe below names the others and, with no restart left, the whole verdict).
            self._state = "restarting" if can_restart else "failed"
            self._detail = "; ".join(f"rank {f.rank} {f.kind}: {f.message}" for f in known)
            self._failures.extend(known)
            self._naming = True
        logger.error("engine: rank %d %s: %s", rank, kind, reason)
        self._fail_in_flight(f"rank {rank} failed: {reason}")
        failures = name_failures(ranks, failure, self.options.probe_timeout_s, also_hung)
        for f in failures:
            logger.warning("engine: rank failure: %s", f.describe())
        if hasattr(ranks, "kill"):
            ranks.kill()
        else:
            with contextlib.suppress(Exception):  # an in-process rank whose loop raised
                ranks.close(timeout_s=5.0)
        with self._lock:
            self._failures = [f for f in self._failures if all(f is not k for k in known)]
            self._failures.extend(failures)
            self._naming = False
            if not can_restart:
                self._detail = str(gang_failed(self._failures, self._restarts,
                                               self.options.max_restarts))
        if can_restart:
            threading.Thread(target=self._restart, daemon=True, name="engine-restart").start()

    def _restart(self) -> None:
        self._restarts += 1
        logger.warning("engine: restarting the gang (restart %d of %d)", self._restarts,
                       self.options.max_restarts)
        try:
            ranks = self._launch_gang()
        except Exception as e:  # a shutdown meanwhile keeps its own state
            detail = (str(e) if isinstance(e, GangFailedError)
                      else f"the restart failed: {type(e).__name__}: {e}")
            with self._lock:
                if self._state == "restarting":
                    self._state, self._detail = "failed", detail
            return
        with self._lock:
            if self._state != "restarting":  # shut down meanwhile
                ranks.kill() if hasattr(ranks, "kill") else None
                return
            self._ranks, self._views = ranks, [RankView() for _ in range(self.world_size)]
            self._nodes = tuple(ranks.nodes)
            self._router = prefix_router(self.world_size, self.spec.runtime.prefix_caching)
            self._state, self._detail = "ready", ""
        self._start_pollers(ranks)

    def _fail_in_flight(self, reason: str) -> None:
        with self._lock:
            lost, self._live = list(self._live.values()), {}
        for live in lost:
            r = live.request
            res = refused_result(r, f"request {r.rid!r}: {reason}", rank=live.rank)
            call_quietly(live.on_output, RequestOutput(r.rid, (), True, res, retryable=True))

    # -- state ------------------------------------------------------------------------------------
    def _set_state(self, state: str, detail: str = "") -> None:
        with self._lock:
            self._state, self._detail = state, detail

    def health(self) -> EngineHealth:
        with self._lock:
            return EngineHealth(self._state == "ready", self._state, self._detail, not self._naming)

    def stats(self) -> EngineStats:
        with self._lock:
            load, count = self._loads()
            ranks = tuple({**v.metrics, "rank": r, "outstanding_tokens": load[r],
                           "in_flight": count[r], "routed_requests": v.routed}
                          for r, v in enumerate(self._views))
            running = sum(int(v.metrics.get("running", 0)) for v in self._views)
            return EngineStats(ranks, self._restarts, max(0, len(self._live) - running),
                               tuple(self._failures), self._nodes, self._setup_s)

    def rank_handles(self) -> tuple[Any, ...]:
        """The live gang's rank actors by rank (Ray; else ()): for tests and tools that kill one."""
        with self._lock:
            return tuple(getattr(self._ranks, "actors", ()))
