"""A batch of requests through the Engine, as `dp-runtime run` drives it (``engine_run``), on
one in-process rank or a Ray gang: the tests' reference runs and launcher checks."""

from __future__ import annotations

from launch.engine_run import run_requests
from launch.engine_types import EngineOptions

# Bounds that fail a broken test in seconds, not minutes.
FAST = dict(rpc_timeout_s=20.0, setup_timeout_s=60.0, pg_timeout_s=30.0)


def run_local(spec, requests, **kw):
    """``requests`` on one in-process rank; the RunReport."""
    return run_requests(
        spec, requests, EngineOptions(launcher="local", sampling_defaults="none"), **kw
    )


def run_ray(spec, requests, *, on_poll=None, on_phase=None, **options):
    """``requests`` on a Ray gang (Ray initialised by the caller); ``options`` are EngineOptions
    fields over FAST."""
    opts = EngineOptions(launcher="ray", sampling_defaults="none", **{**FAST, **options})
    return run_requests(
        spec, requests, opts, on_poll=on_poll, on_phase=on_phase, poll_interval_s=0.05
    )
