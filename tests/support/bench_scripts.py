"""The bench/ scripts as modules (bench/ is not a package), and the invariants every
serve_load report must hold whatever the launcher."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as a module (its ``main(argv)`` runs in this process)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    spec.loader.exec_module(mod)
    return mod


def check_serve_load_report(report: dict[str, Any], *, rates: int, per_rate: int, out_len: int,
                            world: int, max_running: int) -> None:
    """Every request answered once and without error, counts that add up, per-request times in
    order (queued <= TTFT <= latency), no rank above ``max_running`` requests at once, and the
    requests spread as the launcher spreads them (round-robin under torchrun, else the engine's
    routing, which gives equal requests to every rank alike).
    ``out_len``: every request's exact output length (``--lengths random:IN:OUT``)."""
    rows, reqs = report["rows"], report["requests"]
    assert len(rows) == rates and len(reqs) == rates * per_rate
    assert len({r["rid"] for r in reqs}) == len(reqs)
    assert report["header"]["world_size"] == world
    launcher = report["header"]["launcher"]
    for row in rows:
        assert row["requests"] == row["completed"] == per_rate and row["errors"] == 0
        if launcher != "torchrun":  # ``--lengths random:IN:OUT``: every request the same size
            assert max(row["per_rank_requests"]) - min(row["per_rank_requests"]) <= 1, row
        assert sum(row["per_rank_requests"]) == per_rate and len(row["per_rank_requests"]) == world
        assert row["output_tokens"] == per_rate * out_len
        assert abs(row["output_tok_s"] - row["output_tokens"] / row["duration_s"]) < 1e-6 * row["output_tok_s"]
        assert abs(row["request_throughput"] * row["duration_s"] - per_rate) < 1e-6
        assert row["ttft_s"]["p50"] <= row["e2e_s"]["p50"] and row["ttft_s"]["p99"] <= row["e2e_s"]["p99"]
        assert row["itl_s"]["p50"] > 0 and row["tpot_s"]["p50"] > 0
        assert len(row["max_running"]) == world
        assert 1 <= max(row["max_running"]) <= max_running
        assert max(row["max_running"]) <= row["max_concurrency"] <= world * max_running
        # waiting is counted up from the run's start: a rate's share can only be >= 0
        assert row["dp_sync_wait_s"] >= 0 and 0 < row["dp_balance"] <= 1, row
    for r in reqs:
        assert r["error"] is None and r["output_len"] == out_len, r
        assert 0 <= r["queued_s"] <= r["ttft_s"] <= r["latency_s"], r
        if launcher == "torchrun":
            assert r["rank"] == int(r["rid"].split("-")[1]) % world, r  # round-robin, in order
        else:  # the engine's routing: equal requests go to every rank alike
            assert 0 <= r["rank"] < world, r
