"""What a run hands back: results by request, failures by rank, and the summary people read.

``RunReport`` is frozen: results in submission order (each rid exactly once), the failures seen
(which rank, what kind, why), the number of gang restarts, times, and each rank's last metrics.
``summarize`` turns it into the numbers the CLI prints (throughput, TTFT and latency
percentiles, per-rank counts); ``RunSummary.as_dict`` is the ``--json`` object.

A request that failed on its own (refused at the door, or failed inside a step: its result has
``error`` set) is not served: it is listed in ``RunSummary.errors`` (rid, rank, reason; rank -1
when no rank ran it) and left out of the TTFT and latency percentiles, which describe served
requests only (a refused request's zero times would pull them down).

Failure kinds: ``died`` (the rank's actor or process is gone), ``error`` (its step loop raised;
``detail`` holds the traceback), ``unresponsive`` (a lifecycle call went unanswered),
``hung`` (running, but no step completed within the hang timeout), ``setup`` (building the
group or the worker failed). ``secondary`` marks failures that followed another rank's
(a peer of a dead rank that timed out in a collective).

Times: ``wall_s`` is the whole run as the user waited for it (with ``ray_start_s``, starting or
joining Ray, when the CLI did that); ``setup_s`` is building the ranks (placement, process
groups, weights, graphs), ``run_s`` the step loops. The summary also names what ran:
``dispatcher``, ``attention``, ``graphs`` and ``kv_cache_dtype``, from the ranks' metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dp_runtime.serving.request import RequestResult

__all__ = ["GangFailedError", "PollEvent", "RankFailure", "RequestError", "RunReport", "RunSummary",
           "percentile", "summarize"]

FAILURE_KINDS = ("died", "error", "unresponsive", "hung", "setup")


@dataclass(frozen=True)
class RankFailure:
    """One rank's failure in one attempt (attempt 0 is the first launch)."""

    attempt: int
    rank: int
    kind: str
    message: str
    node_ip: str = ""
    secondary: bool = False
    detail: str = ""

    def describe(self) -> str:
        where = f" on {self.node_ip}" if self.node_ip else ""
        tag = " (after another rank failed)" if self.secondary else ""
        return f"attempt {self.attempt}: rank {self.rank}{where} {self.kind}{tag}: {self.message}"


class GangFailedError(RuntimeError):
    """Every allowed restart was used and the gang failed again. ``failures`` lists every
    failure of every attempt; ``report`` holds the results finished before giving up."""

    def __init__(self, message: str, failures: Sequence[RankFailure],
                 report: RunReport | None = None) -> None:
        super().__init__(message)
        self.failures = tuple(failures)
        self.report = report


@dataclass(frozen=True)
class PollEvent:
    """Handed to ``on_poll`` after every poll: progress, and the live gang's actors by rank
    (tests use them to kill a rank)."""

    attempt: int
    finished: int
    total: int
    actors: tuple[Any, ...]
    statuses: tuple[Any, ...]  # RankStatus per rank, None where the call failed
    tokens: int = 0  # output tokens so far: kept results plus what the live ranks generated
    total_tokens: int = 0  # the most there can be: every request's max_new_tokens


@dataclass(frozen=True)
class RunReport:
    results: tuple[RequestResult, ...]
    world_size: int
    launcher: str
    device: str
    wall_s: float
    run_s: float
    setup_s: float = 0.0
    restarts: int = 0
    failures: tuple[RankFailure, ...] = ()
    rank_metrics: tuple[Mapping[str, Any], ...] = ()
    ray_start_s: float = 0.0
    nodes: tuple[str, ...] = ()  # per rank, where it last ran (a node IP); () when not known

    def by_rid(self) -> dict[str, RequestResult]:
        return {r.rid: r for r in self.results}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class RequestError:
    """One request that failed on its own: its rid, the rank that ran it (-1: refused at the
    door, no rank ran it), and why."""

    rid: str
    rank: int
    reason: str

    def describe(self) -> str:
        where = "refused" if self.rank < 0 else f"rank {self.rank}"
        return f"{self.rid} ({where}): {self.reason}"


@dataclass(frozen=True)
class RunSummary:
    requests: int
    output_tokens: int
    wall_s: float
    run_s: float
    setup_s: float
    throughput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    latency_p50_s: float
    latency_p99_s: float
    per_rank_requests: dict[int, int]
    per_rank_tokens: dict[int, int]
    world_size: int
    launcher: str
    device: str
    restarts: int
    failures: tuple[str, ...] = ()
    finish_reasons: dict[str, int] = field(default_factory=dict)
    ray_start_s: float = 0.0
    dispatcher: str | None = None
    attention: str | None = None
    graphs: bool | str | None = None
    kv_cache_dtype: str | None = None
    served: int = 0
    errors: tuple[RequestError, ...] = ()
    nodes: dict[int, str] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return len(self.errors)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["failed"] = self.failed
        d["errors"] = [{"rid": e.rid, "rank": None if e.rank < 0 else e.rank, "reason": e.reason}
                       for e in self.errors]
        d["nodes"] = {str(k): v for k, v in self.nodes.items()}
        d["per_rank_requests"] = {str(k): v for k, v in self.per_rank_requests.items()}
        d["per_rank_tokens"] = {str(k): v for k, v in self.per_rank_tokens.items()}
        d["failures"] = list(self.failures)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def summarize(report: RunReport) -> RunSummary:
    """The CLI's numbers. Throughput is output tokens over ``run_s`` (step loops running; model
    build and graph capture are ``setup_s``); TTFT and latency percentiles are over the served
    requests only (module docstring)."""
    res = report.results
    tokens = sum(len(r.output_ids) for r in res)
    per_req: dict[int, int] = {r: 0 for r in range(report.world_size)}
    per_tok: dict[int, int] = {r: 0 for r in range(report.world_size)}
    reasons: dict[str, int] = {}
    for r in res:
        if r.rank >= 0:  # -1: refused at the door, run by no rank
            per_req[r.rank] = per_req.get(r.rank, 0) + 1
            per_tok[r.rank] = per_tok.get(r.rank, 0) + len(r.output_ids)
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    served = [r for r in res if r.error is None]
    errors = tuple(RequestError(r.rid, r.rank, r.error) for r in res if r.error is not None)
    ttft = [r.ttft_s for r in served]
    lat = [r.latency_s for r in served]
    return RunSummary(
        requests=len(res), output_tokens=tokens, wall_s=report.wall_s, run_s=report.run_s,
        setup_s=report.setup_s,
        throughput_tok_s=tokens / report.run_s if report.run_s > 0 else math.nan,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        latency_p50_s=percentile(lat, 50), latency_p99_s=percentile(lat, 99),
        per_rank_requests=per_req, per_rank_tokens=per_tok, world_size=report.world_size,
        launcher=report.launcher, device=report.device, restarts=report.restarts,
        failures=tuple(f.describe() for f in report.failures), finish_reasons=reasons,
        ray_start_s=report.ray_start_s, dispatcher=_chosen(report, "dispatcher"),
        attention=_chosen(report, "attention"), graphs=_chosen(report, "graphs"),
        kv_cache_dtype=_chosen(report, "kv_cache_dtype"),
        served=len(served), errors=errors, nodes=dict(enumerate(report.nodes)),
    )


def _chosen(report: RunReport, key: str) -> Any:
    """The value every rank reported for ``key`` (None when none did; the values joined by ``/``
    if ranks differ, which the cross-rank spec check should have refused)."""
    values = []
    for m in report.rank_metrics:
        if key in m and m[key] not in values:
            values.append(m[key])
    if not values:
        return None
    return values[0] if len(values) == 1 else "/".join(str(v) for v in values)
