"""Engine: the Python API of a serving gang, and the one thing the HTTP server talks to.

``Engine(spec, options).start()`` brings up long-lived ranks (one in this process, or a gang of
Ray actors) that serve until ``shutdown``: requests are ``submit``-ted while the ranks run, each
to the rank with the least outstanding tokens, and each request's new tokens come back once per
step through its ``on_output`` callback (``stream`` wraps that for asyncio, ``generate`` blocks).

Lifetimes: a request is *in flight* from ``submit`` until its last output (``finished``): its
rank finished it ("stop", "length"), failed it alone ("error"), or ``abort`` ended it ("abort").
When a rank fails, every request in flight gets a last output with ``retryable`` set (the server
answers 503) and, on Ray while ``max_restarts`` allows, a new gang comes up (state
``restarting``, then ``ready``); a request is never run twice.

Threads: one poller per rank waits for that rank's outputs (``RankSession.poll``) and calls the
callbacks; callbacks must be quick and must not call back into the engine while holding their
own locks. Everything a caller may call is thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dp_runtime.model.sampling_defaults import SamplingDefaults, checkpoint_sampling_defaults
from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.admission import check_request, refused_result
from dp_runtime.serving.request import Request, RequestResult
from launch.engine_cluster import EngineCluster
from launch.engine_errors import EngineUnavailable, QueueFull, RequestRejected, rejection
from launch.engine_ranks import close_ranks
from launch.engine_types import LAUNCHERS, EngineHealth, EngineOptions, EngineStats, RequestOutput
from launch.prefix_routing import prefix_router
from launch.rank_session import CLOSED, DONE, ERROR, RankStatus

__all__ = ["LAUNCHERS", "Engine", "EngineHealth", "EngineOptions", "EngineStats",
           "EngineUnavailable", "QueueFull", "RequestOutput", "RequestRejected"]

logger = logging.getLogger("launch")


@dataclass(eq=False)
class _Live:
    request: Request
    rank: int
    on_output: Callable[[RequestOutput], None]
    emitted: int = 0

    @property
    def outstanding(self) -> int:
        """Tokens still to compute: the prompt until its first token, then what may follow."""
        prompt = len(self.request.prompt_ids) if self.emitted == 0 else 0
        return prompt + self.request.sampling.max_new_tokens - self.emitted


@dataclass
class _RankView:
    metrics: dict[str, Any] = field(default_factory=dict)
    routed: int = 0


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
        self._live: dict[str, _Live] = {}
        self._views = [_RankView() for _ in range(self.world_size)]
        self._router = prefix_router(self.world_size, spec.runtime.prefix_caching)
        self._state, self._detail = "starting", ""
        self._restarts = 0
        self._ranks: Any = None
        self._pollers: list[threading.Thread] = []
        self._cluster = EngineCluster(self.options, self.world_size)  # Ray's, when it uses Ray

    @property
    def capacity(self) -> int:
        """The most requests in flight at once (``max_running_requests`` x ranks + ``max_queued``):
        past it ``submit`` raises QueueFull."""
        return self._capacity

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, on_phase: Callable[[str], None] | None = None) -> Engine:
        """Bring the ranks up and start serving; blocks until every rank is ready. Raises what
        the launch raised, or EngineUnavailable when ``shutdown`` came meanwhile (then stopped)."""
        try:
            self._cluster.connect(on_phase, self._check_starting)
            self._check_starting()
            ranks = self._launch(on_phase)
            with self._lock:
                cancelled = self._state != "starting"
                if not cancelled:
                    self._ranks, self._state = ranks, "ready"
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

    def _launch(self, on_phase: Callable[[str], None] | None) -> Any:
        from launch.engine_ranks import LocalRanks, RayRanks

        if self.options.launcher == "local":
            return LocalRanks(self.spec, on_phase=on_phase)
        from launch.gang import GangOptions

        o = self.options
        gang = GangOptions(device=self.spec.runtime.device.type, cpus_per_rank=o.cpus_per_rank,
                           setup_timeout_s=o.setup_timeout_s, rpc_timeout_s=o.rpc_timeout_s)
        return RayRanks(self.spec, gang, attempt=self._restarts, on_phase=on_phase)

    def _start_pollers(self, ranks: Any) -> None:
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
        while self._in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        for rid in list(self._live):
            self.abort(rid)
        deadline = time.monotonic() + 5.0
        while self._in_flight() and time.monotonic() < deadline:  # the aborts' results
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
        self.check(request)
        with self._lock:
            if self._state != "ready":
                detail = f": {self._detail}" if self._detail else ""
                raise EngineUnavailable(f"the engine is {self._state}{detail}")
            if request.rid in self._live:
                raise RequestRejected("rid", f"request {request.rid!r} is already in flight")
            if len(self._live) >= self._capacity:
                raise QueueFull(f"{len(self._live)} requests in flight, the limit is {self._capacity} "
                                f"(max_running_requests x ranks + max_queued)", retry_after_s=1.0)
            rank = self._pick_rank(request.prompt_ids)
            self._live[request.rid] = _Live(request, rank, on_output)
            self._views[rank].routed += 1
            self._number += 1
            confirm = self._ranks.submit(rank, [request], self._number)
        try:
            confirm()  # EngineUnavailable when its rank died under it (its poller fails over)
        except (ValueError, EngineUnavailable) as e:  # ValueError: the rank refused it
            with self._lock:
                self._live.pop(request.rid, None)
            raise (e if isinstance(e, EngineUnavailable) else rejection(str(e))) from None
        return rank

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

    async def stream(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit ``request`` and yield its outputs in this event loop; leaving early (break,
        ``aclose``, cancellation) aborts it. Raises what ``submit`` raises."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.submit(request, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request.rid)

    def generate(self, requests: Sequence[Request],
                 timeout_s: float | None = None) -> list[RequestResult]:
        """Submit ``requests`` and wait for all of them; their results in order. Raises what
        ``submit`` raises (requests already submitted are aborted) or TimeoutError."""
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
                self.submit(r, on_output)
                submitted.append(r.rid)
        except BaseException:
            for rid in submitted:
                self.abort(rid)
            raise
        if requests and not done.wait(timeout_s):
            raise TimeoutError(f"generate: {len(requests) - len(results)} of {len(requests)} requests "
                               f"unfinished after {timeout_s} s")
        return [results[r.rid] for r in requests]

    # -- outputs ----------------------------------------------------------------------------------
    def _poll_loop(self, ranks: Any, rank: int) -> None:
        while True:
            try:
                st = ranks.poll(rank, self.options.poll_timeout_s)
            except Exception as e:
                if self._ranks is ranks and self._state not in ("stopping", "stopped"):
                    self._rank_failed(ranks, rank, f"{type(e).__name__}: {e}")
                return
            self._deliver(rank, st)
            if st.state == ERROR:
                last = (st.error or "").strip().splitlines()
                self._rank_failed(ranks, rank, last[-1] if last else "its step loop raised")
                return
            if st.state in (DONE, CLOSED):
                return

    def _deliver(self, rank: int, st: RankStatus) -> None:
        outs: list[tuple[_Live, RequestOutput]] = []
        finished = {res.rid for res in st.results}
        with self._lock:
            self._views[rank].metrics = dict(st.metrics)
            logprobs = dict(st.logprobs)
            for rid, toks in st.tokens:
                live = self._live.get(rid)
                if live is not None and rid not in finished:
                    live.emitted += len(toks)
                    outs.append((live, RequestOutput(rid, toks, new_logprobs=logprobs.get(rid))))
            for res in st.results:
                live = self._live.pop(res.rid, None)
                if live is not None:
                    lps = None if res.logprobs is None else res.logprobs[live.emitted:]
                    outs.append((live, RequestOutput(res.rid, res.output_ids[live.emitted:], True, res,
                                                     new_logprobs=lps)))
        for live, out in outs:
            _call(live.on_output, out)

    def _rank_failed(self, ranks: Any, rank: int, reason: str) -> None:
        with self._lock:
            if self._ranks is not ranks:  # another poller of this gang got here first
                return
            self._ranks = None
            can_restart = self._cluster.uses_ray and self._restarts < self.options.max_restarts
            self._state = "restarting" if can_restart else "failed"
            self._detail = f"rank {rank} failed: {reason}"
        logger.error("engine: rank %d failed: %s", rank, reason)
        self._fail_in_flight(f"rank {rank} failed: {reason}")
        if hasattr(ranks, "kill"):
            ranks.kill()
        if can_restart:
            threading.Thread(target=self._restart, daemon=True, name="engine-restart").start()

    def _restart(self) -> None:
        self._restarts += 1
        try:
            ranks = self._launch(None)
        except Exception as e:
            self._set_state("failed", f"the restart failed: {type(e).__name__}: {e}")
            return
        with self._lock:
            self._ranks, self._views = ranks, [_RankView() for _ in range(self.world_size)]
            self._router = prefix_router(self.world_size, self.spec.runtime.prefix_caching)
            self._state, self._detail = "ready", ""
        self._start_pollers(ranks)

    def _fail_in_flight(self, reason: str) -> None:
        with self._lock:
            lost, self._live = list(self._live.values()), {}
        for live in lost:
            r = live.request
            res = refused_result(r, f"request {r.rid!r}: {reason}", rank=live.rank)
            _call(live.on_output, RequestOutput(r.rid, (), True, res, retryable=True))

    # -- state ------------------------------------------------------------------------------------
    def _set_state(self, state: str, detail: str = "") -> None:
        with self._lock:
            self._state, self._detail = state, detail

    def _in_flight(self) -> int:
        with self._lock:
            return len(self._live)

    def health(self) -> EngineHealth:
        with self._lock:
            return EngineHealth(self._state == "ready", self._state, self._detail)

    def stats(self) -> EngineStats:
        with self._lock:
            load, count = self._loads()
            ranks = tuple({**v.metrics, "rank": r, "outstanding_tokens": load[r], "in_flight": count[r],
                           "routed_requests": v.routed} for r, v in enumerate(self._views))
            running = sum(int(v.metrics.get("running", 0)) for v in self._views)
            return EngineStats(ranks, self._restarts, max(0, len(self._live) - running))


def _call(callback: Callable[[RequestOutput], None], out: RequestOutput) -> None:
    # A failing callback (a closed client's queue, say) must not stop the poller: the other
    # requests of the step still need their outputs.
    try:
        callback(out)
    except Exception:
        logger.exception("engine: the output callback of request %r raised", out.rid)
