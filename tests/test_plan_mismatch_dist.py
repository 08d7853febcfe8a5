"""A plan mismatch is DPPlanMismatchError on every rank, always (dist tier, gloo, both exchange
paths): provoked 50 times in a row, each time with a fresh group, its own failure notice
(sync/peer_failure.py) and a rank worker's error path (``on_step_error`` then re-raise).

Before: in some runs one rank raised PeerRankFailedError instead (8 of 46 runs of the CLI):
the first rank to raise published its failure, and a peer that raised the same mismatch a
moment later re-wrapped it as "peer failed"; and ``ShmExchange.abandon`` overwrote the row of
the exchange a slower peer had not read yet, so that peer saw "abandoned" instead of the table.

Run: ``torchrun --standalone --nproc-per-node 2 -m pytest -m dist -p no:cacheprovider tests/test_plan_mismatch_dist.py``
"""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
import torch.distributed as dist

from dp_runtime.config import RuntimeConfig
from dp_runtime.sync.peer_failure import FailureNotice
from dp_runtime.sync.step_plan import plan_step
from dp_runtime.sync.step_sync import DPStepSync
from dp_runtime.sync.step_table import LocalStepInfo

pytestmark = pytest.mark.dist

RUNS = 50
MISMATCH_AT = 3  # the plan of this call differs on the last rank; the next sync sees it


def _tampering(bad_rank: int):
    calls = [0]

    def plan_fn(table, config):
        plan = plan_step(table, config)
        calls[0] += 1
        if calls[0] == MISMATCH_AT and dist.get_rank() == bad_rank:
            plan = dataclasses.replace(plan, global_dp_buffer_len=plan.global_dp_buffer_len + 1)
        return plan

    return plan_fn


def _one_run(run: int, exchange: str) -> tuple[str, str]:
    """One group, one sync, one failure notice; the error each rank ends with, as a rank
    worker's step would raise it: (type name, message)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(backend="gloo")  # a fresh group store: no notice of an earlier run
    config = RuntimeConfig(dp_size=world, hidden_size=8, dtype="float32", device="cpu", max_running_requests=8,
                           chunked_prefill_size=64, dp_sync_timeout_s=20.0, dp_sync_exchange=exchange)
    sync = DPStepSync(config, group, plan_fn=_tampering(world - 1))
    notice = FailureNotice(group, abandon=sync.abandon)
    # Vary who reaches the mismatch first, run by run (same seed on every rank: same branches).
    late = random.Random(run).randrange(world)
    err: BaseException | None = None
    try:
        for step in range(MISMATCH_AT + 2):
            if rank == late and step == MISMATCH_AT:
                time.sleep(0.002 * (run % 3))
            try:
                sync.sync(LocalStepInfo(1 + rank))
            except Exception as e:
                notice.on_step_error(e, sync.steps)  # raises PeerRankFailedError when it wraps
                raise
    except Exception as e:
        err = e
    finally:
        sync.close()
    return (type(err).__name__, str(err)) if err is not None else ("none", "")


@pytest.mark.parametrize("exchange", ["shm", "gloo"])
def test_plan_mismatch_is_the_documented_error_on_every_rank_every_time(dist_group, exchange):
    world = dist.get_world_size()
    mine = [_one_run(run, exchange) for run in range(RUNS)]
    table: list = [None] * world
    dist.all_gather_object(table, mine)  # after the loop: no rank leaves early
    wrong = [(run, rank, table[rank][run]) for run in range(RUNS) for rank in range(world)
             if table[rank][run][0] != "DPPlanMismatchError"]
    assert not wrong, f"{len(wrong)} of {RUNS * world} rank-runs: {wrong[:4]}"
    assert all("DP ranks disagree on previous plan fingerprint" in table[r][0][1] for r in range(world))
