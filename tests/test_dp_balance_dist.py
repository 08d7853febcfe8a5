"""The DP balance every rank reports (``step_kinds.dp_balance``: tokens over the most tokens a
rank had times the ranks, summed over steps) on a real gloo group: 1 when every rank carries
the same work, 1 / world when one rank works and the others run IDLE steps beside it; the same
value on every rank (it is computed from the gathered table)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from dp_runtime.step_kinds import dp_balance

pytestmark = pytest.mark.dist


def _balance(requests_of_rank) -> list[tuple[float, float]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = RankSpec.create("tiny", dp_size=world, max_running_requests=2, chunked_prefill_size=16,
                           dtype="float32", device="cpu", max_context_len=32, dispatcher="all_to_all")
    with RankWorker(spec, rank=rank, world_size=world) as w:
        w.generate(requests_of_rank(rank))
        m = w.metrics()
    report = [None] * world
    dist.all_gather_object(report, (m["dp_balance"], m["dp_sync_wait_s"]))
    return report


def _requests(n: int, rank: int) -> list[Request]:
    return [Request(f"r{rank}-{i}", [1 + i, 2, 3, 4, 5], SamplingParams(max_new_tokens=3)) for i in range(n)]


def test_equal_work_is_balanced_and_one_busy_rank_is_one_over_world(dist_group):
    world = dist.get_world_size()
    equal = _balance(lambda rank: _requests(2, rank))
    assert all(b == 1.0 for b, _ in equal), equal
    lonely = _balance(lambda rank: _requests(2, rank) if rank == 0 else [])
    assert all(b == pytest.approx(1 / world) for b, _ in lonely), lonely
    assert all(wait >= 0 for _, wait in lonely)


def test_dp_balance_of_counters():
    assert dp_balance({}) == 1.0
    assert dp_balance({"dp_tokens": 30, "dp_max_tokens": 40}) == 0.75
