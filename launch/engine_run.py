"""``run_requests``: a batch of requests through one Engine, to one RunReport (`dp-runtime run`).

The engine does the lifecycle (start, supervision of dead and hung ranks, gang restarts); this
module only submits, collects and reports:

1. the door: requests ``admission.check_request`` refuses get their result now (rank -1) and
   never reach a rank; duplicate rids are a ValueError;
2. the engine starts (a gang that fails to set up is retried under ``max_restarts``);
3. every accepted request is submitted (while the engine is ``ready`` and has room: a full
   queue waits for the next poll); a request whose last output says ``retryable`` (its rank
   failed, not the request) is submitted again once the new gang is ready. A finished result
   is final, so nothing is lost and nothing is reported twice;
4. every ``poll_interval_s`` the progress goes to ``on_poll``; when every request has a result
   the engine shuts down and the report is built from the results and ``engine.stats()``.

An engine that gives up (restarts used up) raises GangFailedError carrying the report of the
requests finished so far.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.admission import admit, refused_result
from dp_runtime.serving.request import Request, RequestResult
from launch.engine import Engine
from launch.engine_errors import EngineUnavailable, QueueFull, RequestRejected
from launch.engine_types import EngineOptions, RequestOutput
from launch.run_report import GangFailedError, PollEvent, RunReport

__all__ = ["run_requests"]


def run_requests(
    spec: RankSpec,
    requests: Sequence[Request],
    options: EngineOptions | None = None,
    *,
    on_poll: Callable[[PollEvent], None] | None = None,
    on_phase: Callable[[str], None] | None = None,
    poll_interval_s: float = 0.1,
) -> RunReport:
    """Run ``requests`` on the engine's ranks (module docstring); the RunReport has the results
    in request order, each rid once. ``on_phase`` hears the start-up phases and ``running``.
    Raises ValueError for duplicate rids, SetupError (a rank no gang could build),
    GangFailedError when the engine gave up, KeyboardInterrupt after stopping the ranks."""
    accepted, refused = admit(requests, spec.model_config().vocab_size, spec.context_len)
    batch = _Batch(requests, refused)
    engine = Engine(spec, options or EngineOptions())
    try:
        try:
            engine.start(on_phase)
        except GangFailedError as e:
            raise GangFailedError(str(e), e.failures, batch.report(engine, 0.0)) from None
        if on_phase is not None:
            on_phase("running")
        run_s = batch.drive(engine, accepted, on_poll, poll_interval_s)
        return batch.report(engine, run_s)
    finally:
        engine.shutdown(drain_timeout_s=0)


class _Batch:
    """The results by rid and the requests to submit again, shared with the engine's pollers."""

    def __init__(self, requests: Sequence[Request], refused: Sequence[RequestResult]) -> None:
        self.requests = list(requests)
        self.order = {r.rid: i for i, r in enumerate(self.requests)}
        self.results: dict[str, RequestResult] = {r.rid: r for r in refused}
        self.streamed: dict[str, int] = {}  # new tokens so far of the requests in flight
        self.again: list[Request] = []  # ended by a rank failure: to submit to the next gang
        self.max_tokens = sum(r.sampling.max_new_tokens for r in self.requests)
        self._lock = threading.Lock()

    def on_output(self, request: Request) -> Callable[[RequestOutput], None]:
        def take(out: RequestOutput) -> None:
            with self._lock:
                if not out.finished:
                    self.streamed[out.rid] = self.streamed.get(out.rid, 0) + len(out.new_token_ids)
                    return
                self.streamed.pop(out.rid, None)
                if out.retryable:
                    self.again.append(request)
                else:
                    self.results[out.rid] = out.result

        return take

    def drive(
        self,
        engine: Engine,
        accepted: Sequence[Request],
        on_poll: Callable[[PollEvent], None] | None,
        interval_s: float,
    ) -> float:
        """Submit and wait until every request has a result; returns the seconds the ranks ran
        (the time gang restarts took to set up left out)."""
        pending = deque(accepted)
        t0, setup0 = time.perf_counter(), engine.stats().setup_s
        while True:
            with self._lock:
                pending.extend(sorted(self.again, key=lambda r: self.order[r.rid]))
                self.again.clear()
                done = len(self.results) == len(self.requests)
            if done:
                break
            health = engine.health()
            if health.state == "failed" and health.settled:  # the verdict, not its first line
                stats = engine.stats()
                run_s = time.perf_counter() - t0 - (stats.setup_s - setup0)
                report = self.report(engine, run_s)
                raise GangFailedError(
                    f"{health.detail}; {len(report.results)} of {len(self.requests)} "
                    f"requests finished",
                    stats.failures,
                    report,
                )
            if health.state == "ready":
                self._submit(engine, pending)
            if on_poll is not None:
                on_poll(self.event(engine))
            time.sleep(interval_s)
        if on_poll is not None:
            on_poll(self.event(engine))
        return time.perf_counter() - t0 - (engine.stats().setup_s - setup0)

    def _submit(self, engine: Engine, pending: deque[Request]) -> None:
        while pending:
            req = pending[0]
            try:
                engine.submit(req, self.on_output(req))
            except (EngineUnavailable, QueueFull):
                return  # the next poll tries again
            except RequestRejected as e:  # a rank refused it: it can never run
                with self._lock:
                    self.results[req.rid] = refused_result(req, str(e))
            pending.popleft()

    def event(self, engine: Engine) -> PollEvent:
        with self._lock:
            tokens = sum(len(r.output_ids) for r in self.results.values()) + sum(
                self.streamed.values()
            )
            finished = len(self.results)
        return PollEvent(
            engine.stats().restarts,
            finished,
            len(self.requests),
            engine.rank_handles(),
            (),
            tokens=tokens,
            total_tokens=self.max_tokens,
        )

    def report(self, engine: Engine, run_s: float) -> RunReport:
        stats = engine.stats()
        with self._lock:
            results = tuple(self.results[r.rid] for r in self.requests if r.rid in self.results)
        return RunReport(
            results=results,
            world_size=engine.world_size,
            launcher=engine.options.launcher,
            device=engine.spec.runtime.device.type,
            wall_s=0.0,
            run_s=run_s,
            setup_s=stats.setup_s,
            restarts=stats.restarts,
            failures=stats.failures,
            rank_metrics=tuple(stats.ranks),
            nodes=stats.nodes,
        )
