"""The engine's value types: what a request's outputs carry, how an engine is launched, and what
it reports (``launch/engine.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dp_runtime.options import DEFAULTS
from dp_runtime.serving.request import RequestResult, TokenLogprob
from launch.run_report import RankFailure

__all__ = ["LAUNCHERS", "SAMPLING_DEFAULTS", "EngineHealth", "EngineOptions", "EngineStats",
           "RequestOutput"]

LAUNCHERS = ("local", "ray")
SAMPLING_DEFAULTS = ("model", "none")  # where unset request fields get their values (EngineOptions)


@dataclass(frozen=True)
class RequestOutput:
    """New tokens of one request since its previous output; the last has ``finished`` set and
    the ``result`` (finish_reason, error, timings). ``retryable``: it ended because its rank
    failed, not because of the request (HTTP 503, not 500). ``new_logprobs``: one entry per new
    token when the request asked for logprobs (``SamplingParams.logprobs``), else None."""

    rid: str
    new_token_ids: tuple[int, ...]
    finished: bool = False
    result: RequestResult | None = None
    retryable: bool = False
    new_logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class EngineOptions:
    """``launcher``: ``local`` (world size 1 in this process) or ``ray`` (connects to
    ``ray_address``, or starts a private local cluster it stops at shutdown).
    ``max_queued``: requests in flight beyond what the ranks can run at once
    (``max_running_requests`` per rank) before ``submit`` raises QueueFull.
    ``poll_timeout_s``: the longest a poller waits for a step's outputs before it looks again.
    ``sampling_defaults``: ``model``, the checkpoint's generation_config.json gives the
    sampling fields a request leaves unset (``Engine.sampling_defaults``); ``none``, it gives
    none (a front door then uses OpenAI's).
    ``max_restarts``: gang restarts after a rank fails (Ray), or fails to set up, before the
    engine gives up (state ``failed``). ``hang_timeout_s``: a rank whose step counter has not
    moved for that long while requests are due is hung (``gang_faults.HangWatch``).
    ``ray_num_cpus``: the private local cluster's CPUs (default max(ranks, cores)).
    ``show_progress``: rank 0's graph-capture bar; ``log_to_driver`` / ``log_level``: the Ray
    ranks' output forwarded to this process, at this project's log level
    (``ray_cluster.connect_ray``). ``worker_factory``: replaces RankWorker in the ranks (a test
    seam that injects faults into real workers)."""

    launcher: str = "local"
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    max_queued: int = 1024
    poll_timeout_s: float = 0.05
    drain_timeout_s: float = 30.0
    max_restarts: int = DEFAULTS.max_restarts
    hang_timeout_s: float = DEFAULTS.hang_timeout_s
    cpus_per_rank: float = 1
    setup_timeout_s: float = 600.0
    placement_timeout_s: float = 60.0
    pg_timeout_s: float = 300.0
    rpc_timeout_s: float = 30.0
    probe_timeout_s: float = 5.0
    sampling_defaults: str = "model"
    show_progress: bool = False
    log_to_driver: bool = True
    log_level: str | None = None
    worker_factory: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"EngineOptions.launcher must be one of {LAUNCHERS}, "
                             f"got {self.launcher!r}")
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise ValueError(f"EngineOptions.sampling_defaults must be one of {SAMPLING_DEFAULTS}, "
                             f"got {self.sampling_defaults!r}")
        if self.max_queued < 0 or self.max_restarts < 0:
            raise ValueError(f"EngineOptions.max_queued and max_restarts must be >= 0, got "
                             f"{self.max_queued} and {self.max_restarts}")
        for name in ("poll_timeout_s", "drain_timeout_s", "setup_timeout_s", "rpc_timeout_s",
                     "cpus_per_rank", "hang_timeout_s", "placement_timeout_s", "pg_timeout_s",
                     "probe_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"EngineOptions.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineHealth:
    ok: bool
    state: str  # starting | ready | restarting | stopping | stopped | failed
    detail: str = ""
    # False while a rank failure's verdict is being made (the probe naming the other ranks):
    # ``detail`` names the first failed rank only until then.
    settled: bool = True


@dataclass(frozen=True)
class EngineStats:
    """Per rank: the rank's last reported metrics (running, waiting, kv_slots, free_kv_slots,
    steps, generated_tokens, prefill_tokens, ...) with the engine's own ``outstanding_tokens``,
    ``in_flight`` and ``routed_requests`` (the routing rule's inputs and choices).
    ``failures``: every rank failure so far (``gang_faults``), ``restarts`` the gangs started
    after one; ``nodes``: where each rank of the live gang runs (``IP (hostname)``);
    ``setup_s``: seconds spent bringing gangs up (the first and every restart)."""

    ranks: tuple[dict[str, Any], ...]
    restarts: int
    queued: int
    failures: tuple[RankFailure, ...] = ()
    nodes: tuple[str, ...] = ()
    setup_s: float = 0.0
