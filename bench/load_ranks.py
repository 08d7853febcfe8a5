"""The ranks a serving benchmark drives (``serve_load.py``, and ``serve_http.py``'s ``ranks``
path), each taking a rate's requests in turn:

- ``EngineRanks``: one ``launch.engine.Engine``, the same that ``dp-runtime serve`` and ``run``
  drive (one in-process rank, or a gang of Ray rank actors), started once and kept for every
  rate. A rate's requests go in together (``Engine.submit_many``: one message per rank), each
  routed as the engine routes every request (the rank left with the least outstanding tokens;
  cache-aware with prefix caching at DP > 1) and carrying its ``arrival_s``; the ranks time
  them (``RequestResult``), so no client or event loop runs beside the ranks.
- ``TorchrunRank``: this process's rank of a torchrun job. torchrun has no driver by design
  (docs/launch.md), so each process runs its own ``RankSession`` on its round-robin share,
  collectively, and rank 0 gathers the results.

Both give ``run(requests)`` (the results; None on torchrun ranks other than 0), ``metrics`` (rank
0's ``RankWorker.metrics()`` after the latest run), ``all_metrics`` (every rank's), ``gpu`` (with
``spans``: the latest run's steps on the GPU, ``bench/gpu_spans.py``), ``agree`` and ``close``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request, RequestResult
from launch.workload import split_round_robin

__all__ = ["EngineRanks", "TorchrunRank"]

# How long the ranks' counters must stay still, with nothing queued or running, before a run's
# metrics are read: each rank's poller refreshes them at least every poll (50 ms), so a rank
# that finished its share early still reports the IDLE steps it joined after.
SETTLED_S = 0.15


class EngineRanks:
    """The ranks of one Engine (module docstring). ``launcher``: ``local`` (world size 1, in this
    process) or ``ray`` (Ray connected, or a private cluster the engine starts and stops).
    A rank that fails fails the run (no gang restart: a benchmark reports what it measured); a
    rank is hung only after an hour without a step."""

    def __init__(self, spec: RankSpec, launcher: str, show_progress: bool, spans: bool = False,
                 ray_address: str | None = None) -> None:
        from launch.engine import Engine, EngineOptions

        self._spans: list[Any] = []  # the in-process rank's StepSpans (with ``spans``)
        factory = _spans_factory(show_progress, self._spans) if spans else None
        # A step that JIT-builds a kernel (FlashInfer's, in a warm-up's first steps) may run for
        # minutes on a machine without the build cached: not a hang for a benchmark.
        options = EngineOptions(launcher=launcher, ray_address=ray_address, max_queued=1 << 20,
                                max_restarts=0, hang_timeout_s=3600.0, sampling_defaults="none",
                                show_progress=show_progress, worker_factory=factory)
        self.engine = Engine(spec, options).start()
        self.world = spec.runtime.world_size
        self.metrics: dict[str, Any] = {}
        self.all_metrics: list[dict[str, Any]] = []
        self.gpu: dict[str, Any] | None = None

    def run(self, requests: list[Request]) -> list[RequestResult]:
        """Every request through the ranks, submitted together; their results (any order)."""
        ended: dict[str, Any] = {}
        lock, done = threading.Lock(), threading.Event()

        def on_output(out: Any) -> None:
            if out.finished:
                with lock:
                    ended[out.rid] = out
                    if len(ended) == len(requests):
                        done.set()

        if requests:
            self.engine.submit_many(requests, on_output)
        # The engine gives every request a last output, a failed rank's too (retryable).
        while requests and not done.wait(1.0):
            if self.engine.health().state in ("stopped", "stopping"):
                raise RuntimeError(f"the engine stopped: {self.engine.health().detail}")
        lost = [o.rid for o in ended.values() if o.retryable]
        if lost:
            message = (f"{len(lost)} of {len(requests)} requests lost to a rank failure: "
                       f"{self.engine.health().detail}")
            print(f"error: {message}", file=sys.stderr, flush=True)
            raise RuntimeError(message)
        self.all_metrics = self._settled_metrics()
        self.metrics = self.all_metrics[0]
        self.gpu = self._spans[0].take() if self._spans else None
        return [o.result for o in ended.values()]

    def _settled_metrics(self) -> list[dict[str, Any]]:
        """Every rank's metrics once its counters stopped moving with nothing left (SETTLED_S)."""
        def snapshot() -> list[dict[str, Any]]:
            return [dict(m) for m in self.engine.stats().ranks]

        def key(ms: list[dict[str, Any]]) -> tuple:
            return tuple((m.get("steps"), m.get("skipped_steps"), m.get("running"),
                          m.get("waiting")) for m in ms)

        before = snapshot()
        while True:
            time.sleep(SETTLED_S)
            now = snapshot()
            idle = all(not m.get("running") and not m.get("waiting") for m in now)
            if idle and key(now) == key(before):
                return now
            before = now

    @staticmethod
    def agree(value: Any) -> Any:
        return value  # one driver: nothing to agree on

    def close(self) -> None:
        self.engine.shutdown(drain_timeout_s=0)


def _spans_factory(show_progress: bool, box: list[Any]) -> Any:
    """An ``EngineOptions.worker_factory``: the real RankWorker, its steps timed on the GPU from
    its construction on (``StepSpans``, put in ``box``); the in-process launcher only."""
    def make(spec: RankSpec, rank: int, world: int) -> Any:
        from bench.gpu_spans import StepSpans
        from dp_runtime.rank_worker import RankWorker

        worker = RankWorker(spec, rank=rank, world_size=world, show_progress=show_progress)
        box.append(StepSpans(worker))
        return worker

    return make


class TorchrunRank:
    """This process's rank of a torchrun job: a RankSession whose ``run`` submits this rank's
    round-robin share and steps until every rank is done. Collective; the results come back on
    rank 0 only (None elsewhere)."""

    def __init__(self, spec: RankSpec, rank: int, world: int, show_progress: bool,
                 spans: bool = False) -> None:
        from bench.gpu_spans import StepSpans
        from launch.rank_session import RankSession

        self.rank, self.world = rank, world
        self.session = RankSession(spec, rank, world, show_progress=show_progress)
        # --gpu-spans: each run's steps on the GPU (bench/gpu_spans.py), in ``gpu`` after it
        self.spans, self.gpu = (StepSpans(self.session._worker) if spans else None), None
        self.metrics: dict[str, Any] = {}
        self.all_metrics: list[dict[str, Any]] = []  # every rank's, on rank 0

    def run(self, requests: list[Request]) -> list[RequestResult] | None:
        self.session.submit(split_round_robin(requests, self.world)[self.rank])
        st = self.session.run()
        self.gpu = self.spans.take() if self.spans else None
        if st.state != "done":
            message = f"rank {self.rank}: the step loop raised:\n{st.error}"
            # Shown now: the teardown on the way out may block on a peer, and then the raised
            # error would never be printed.
            print(f"error: {message}", file=sys.stderr, flush=True)
            raise RuntimeError(message)
        self.metrics = dict(st.metrics)
        mine = (list(st.results), self.metrics)
        parts = [mine]
        if self.world > 1:
            parts = [None] * self.world if self.rank == 0 else None
            dist.gather_object(mine, parts, dst=0)
        if self.rank != 0:
            return None
        self.all_metrics = [m for _, m in parts]
        return [r for p, _ in parts for r in p]

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (collective)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        self.session.close()
