"""The engine's value types: what a request's outputs carry, how an engine is launched, and what
it reports (``launch/engine.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dp_runtime.serving.request import RequestResult, TokenLogprob

__all__ = ["LAUNCHERS", "SAMPLING_DEFAULTS", "EngineHealth", "EngineOptions", "EngineStats", "RequestOutput"]

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
    none (a front door then uses OpenAI's)."""

    launcher: str = "local"
    ray_address: str | None = None
    ray_num_cpus: int | None = None
    max_queued: int = 1024
    poll_timeout_s: float = 0.05
    drain_timeout_s: float = 30.0
    max_restarts: int = 1
    cpus_per_rank: float = 1
    setup_timeout_s: float = 600.0
    rpc_timeout_s: float = 30.0
    sampling_defaults: str = "model"

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"EngineOptions.launcher must be one of {LAUNCHERS}, got {self.launcher!r}")
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise ValueError(f"EngineOptions.sampling_defaults must be one of {SAMPLING_DEFAULTS}, "
                             f"got {self.sampling_defaults!r}")
        if self.max_queued < 0 or self.max_restarts < 0:
            raise ValueError(f"EngineOptions.max_queued and max_restarts must be >= 0, got "
                             f"{self.max_queued} and {self.max_restarts}")
        for name in ("poll_timeout_s", "drain_timeout_s", "setup_timeout_s", "rpc_timeout_s", "cpus_per_rank"):
            if not getattr(self, name) > 0:
                raise ValueError(f"EngineOptions.{name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class EngineHealth:
    ok: bool
    state: str  # starting | ready | restarting | stopping | stopped | failed
    detail: str = ""


@dataclass(frozen=True)
class EngineStats:
    """Per rank: the rank's last reported metrics (running, waiting, kv_slots, free_kv_slots,
    steps, generated_tokens, prefill_tokens, ...) with the engine's own ``outstanding_tokens``,
    ``in_flight`` and ``routed_requests`` (the routing rule's inputs and choices)."""

    ranks: tuple[dict[str, Any], ...]
    restarts: int
    queued: int
