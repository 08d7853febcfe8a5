"""The ranks a serving benchmark drives (``serve_load.py``): this process's rank (alone, or one of
a torchrun job) or the rank actors of one Ray gang, each taking a rate's requests in turn."""

from __future__ import annotations

import sys
import time
from typing import Any

import torch.distributed as dist

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request, RequestResult
from launch.workload import split_round_robin

__all__ = ["InProcessRank", "RayRanks"]


class InProcessRank:
    """This process's rank (one rank alone, or one of a torchrun job): a RankSession whose
    ``run`` submits this rank's round-robin share and steps until every rank is done.
    Collective under torchrun; the results come back on rank 0 only (None elsewhere)."""

    def __init__(self, spec: RankSpec, rank: int, world: int, show_progress: bool, spans: bool = False) -> None:
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
        """Rank 0's ``value`` on every rank (collective under torchrun)."""
        if self.world == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        self.session.close()


class RayRanks:
    """The rank actors of one Ray gang, launched once and given every rate's requests in turn."""

    def __init__(self, spec: RankSpec, show_progress: bool) -> None:
        from launch.gang import Gang, GangOptions

        self.world = spec.runtime.world_size
        self.gang = Gang(spec, GangOptions(device=spec.runtime.device.type, show_progress=show_progress))
        self.metrics: dict[str, Any] = {}
        self.all_metrics: list[dict[str, Any]] = []
        try:
            self.gang.launch()
        except BaseException:
            self.gang.kill()
            raise

    def run(self, requests: list[Request]) -> list[RequestResult]:
        from launch.rank_session import RankStatus

        self._check("submit", self.gang.submit(split_round_robin(requests, self.world)))
        self._check("start", self.gang.start())
        results: list[RequestResult] = []
        while True:
            statuses = self._check("collect", self.gang.collect())
            for st in statuses:
                assert isinstance(st, RankStatus)
                results += st.results
                if st.state == "error":
                    raise RuntimeError(f"rank {st.rank}: the step loop raised:\n{st.error}")
            if all(st.state == "done" for st in statuses):
                # A loop that ended between our reading its state and its results leaves them for
                # one more collect (RankSession.collect).
                results += [r for st in self._check("collect", self.gang.collect()) for r in st.results]
                self.metrics = dict(statuses[0].metrics)
                self.all_metrics = [dict(st.metrics) for st in statuses]
                return results
            time.sleep(0.05)

    @staticmethod
    def _check(what: str, outcomes: list[Any]) -> list[Any]:
        from launch.gang import UNANSWERED

        bad = [(rank, o) for rank, o in enumerate(outcomes) if isinstance(o, BaseException) or o is UNANSWERED]
        if bad:
            raise RuntimeError(f"{what}: " + "; ".join(f"rank {rank}: {o!r}" for rank, o in bad))
        return outcomes

    @staticmethod
    def agree(value: Any) -> Any:
        return value  # one driver: nothing to agree on

    def close(self) -> None:
        self.gang.stop()
