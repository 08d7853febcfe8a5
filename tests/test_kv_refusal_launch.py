"""A request that fits the context but not a rank's KV cache fails alone, with its error, and
never the job: through the engine on one in-process rank and on a Ray gang (a Ray local cluster on loopback)
alike. Before: the rank's ``submit`` raised ValueError for the whole batch and the Ray launcher
refused the job, losing every other request.

Needs ``RankWorker.submit`` to hand the scheduler's refused results to ``pop_finished``."""

from __future__ import annotations

import pytest

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request, SamplingParams
from tests.support.engine_runs import run_local

# 55 KV tokens: within the context of 64, over the KV cache of 50 token slots per rank.
BIG = Request("big", [5] * 48, SamplingParams(max_new_tokens=8))
ERROR = ("request 'big' needs 55 KV tokens (prompt 48 + max_new_tokens 8 - 1); "
         "a rank's whole KV cache holds 50 (kv_cache_tokens)")


def _spec(dp: int, **kw):
    base = dict(dp_size=dp, max_running_requests=4, chunked_prefill_size=64, dtype="float32", device="cpu",
                max_context_len=64, use_cuda_graph=False)
    return RankSpec.create("tiny", **{**base, **kw})


def _good(n: int) -> list[Request]:
    return [Request(f"g{i}", [1 + i, 2, 3, 4 + i], SamplingParams(max_new_tokens=4)) for i in range(n)]


def _check(report, reference: dict[str, tuple[int, ...]], ranks: tuple[int, ...]) -> None:
    assert [r.rid for r in report.results] == ["g0", "g1", "big", *[f"g{i}" for i in range(2, 6)]]
    res = {r.rid: r for r in report.results}
    big = res.pop("big")
    assert (big.finish_reason, big.ok, big.output_ids, big.error) == ("error", False, (), ERROR)
    assert big.rank in ranks  # refused by the rank whose cache it cannot fit
    assert {rid: r.output_ids for rid, r in res.items()} == reference
    assert all(r.ok and len(r.output_ids) == 4 for r in res.values())


@pytest.fixture(scope="module")
def reference():
    return {r.rid: r.output_ids for r in run_local(_spec(1), _good(6)).results}


def test_launch_local_fails_the_request_alone(reference):
    good = _good(6)
    _check(run_local(_spec(1, kv_cache_tokens=50), [*good[:2], BIG, *good[2:]]), reference, (0,))


def test_launch_ray_fails_the_request_alone(reference):
    ray = pytest.importorskip("ray")
    from tests.support.engine_runs import run_ray

    # address="local": a private cluster even if another test left one running on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        good = _good(6)
        report = run_ray(_spec(2, kv_cache_tokens=50), [*good[:2], BIG, *good[2:]], max_restarts=0)
    finally:
        ray.shutdown()
    assert report.restarts == 0 and report.failures == ()
    _check(report, reference, (0, 1))
