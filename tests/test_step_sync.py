"""DPStepSync over the shared-memory exchange, one thread per rank (no torchrun): identical plans,
fingerprint mismatches raised on every rank, verify(), the unusable state after an error."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest
from dp_sync_helpers import open_ranks, run_ranks, shm_path_fixture  # noqa: F401 (fixture)

from dp_runtime.config import RuntimeConfig
from dp_runtime.sync.errors import DPPlanMismatchError, DPSyncError
from dp_runtime.sync.exchange import LocalExchange
from dp_runtime.sync.step_plan import plan_step
from dp_runtime.sync.step_sync import NCOLS, DPStepSync
from dp_runtime.sync.step_table import LocalStepInfo, StepTable

WORLD = 3


def cfg():
    return RuntimeConfig(
        dp_size=WORLD,
        hidden_size=8,
        max_running_requests=32,
        chunked_prefill_size=64,
        dp_sync_timeout_s=10,
    )


def counts_of(step):
    rng = random.Random(1000 + step)
    return [rng.choice([0, 0, 1, 2, 5, 31, 64]) for _ in range(WORLD)]


def local_of(step, rank):
    n = counts_of(step)[rank]
    rng = random.Random(step * 7 + rank)
    return LocalStepInfo(n, can_run_graph=rng.random() < 0.7, is_extend=n > 8)


def test_every_rank_gets_the_plan_of_the_whole_table(shm_path):
    c = cfg()
    syncs = [DPStepSync(c, exchange=ex) for ex in open_ranks(shm_path, WORLD, ncols=NCOLS)]
    steps = 200

    def rank(r):
        return [syncs[r].sync(local_of(s, r)) for s in range(steps)]

    out = run_ranks([lambda r=r: rank(r) for r in range(WORLD)])
    for r in range(WORLD):
        assert not isinstance(out[r], BaseException), out[r]
        assert out[r] == out[0]
    for s, plan in enumerate(out[0]):
        expected = plan_step(StepTable.from_locals(local_of(s, r) for r in range(WORLD)), c)
        assert plan == expected and plan.fingerprint == expected.fingerprint
    assert any(p.skip for p in out[0]) and any(p.graph_bucket for p in out[0])
    assert {p.padding.name for p in out[0] if not p.skip} == {"MAX_LEN", "SUM_LEN"}
    run_ranks([lambda r=r: syncs[r].verify() for r in range(WORLD)])


def tampering(rank, at_call):
    """A plan function that makes ``rank`` compute a different plan at its ``at_call``-th call."""
    calls = [0]

    def plan_fn(table, config):
        plan = plan_step(table, config)
        calls[0] += 1
        if calls[0] == at_call:
            plan = dataclasses.replace(
                plan, runtime_max_tokens_per_rank=plan.runtime_max_tokens_per_rank + 1
            )
        return plan

    return plan_fn


def test_mismatch_raises_on_every_rank_at_the_next_step(shm_path):
    c = cfg()
    exs = open_ranks(shm_path, WORLD, ncols=NCOLS)
    syncs = [
        DPStepSync(c, exchange=ex, plan_fn=tampering(1, 3) if r == 1 else plan_step)
        for r, ex in enumerate(exs)
    ]

    def rank(r):
        for s in range(10):
            try:
                syncs[r].sync(local_of(s, r))
            except DPPlanMismatchError as e:
                return s, e
        return None

    start = time.monotonic()
    out = run_ranks([lambda r=r: rank(r) for r in range(WORLD)])
    assert time.monotonic() - start < 10
    for r in range(WORLD):
        step, err = out[r]
        assert step == 3  # the plan of step 2 (the 3rd call) differed; step 3 compares it
        assert err.field == "previous plan fingerprint"
        assert err.ranks == (1,)
        assert set(err.values) == {0, 1, 2} and err.values[0] == err.values[2] != err.values[1]
        assert "ranks [1]" in str(err)
        # unusable afterwards, without joining an exchange (which would hang)
        with pytest.raises(DPSyncError, match="unusable after an earlier error"):
            syncs[r].sync(LocalStepInfo(0))


def test_verify_compares_the_latest_plan_now(shm_path):
    c = cfg()
    exs = open_ranks(shm_path, WORLD, ncols=NCOLS)
    syncs = [
        DPStepSync(c, exchange=ex, plan_fn=tampering(2, 2) if r == 2 else plan_step)
        for r, ex in enumerate(exs)
    ]

    def rank(r):
        syncs[r].sync(local_of(0, r))
        syncs[r].verify()  # step 0 agrees
        syncs[r].sync(local_of(1, r))  # rank 2 diverges here
        syncs[r].verify()

    out = run_ranks([lambda r=r: rank(r) for r in range(WORLD)])
    for r in range(WORLD):
        assert isinstance(out[r], DPPlanMismatchError) and out[r].ranks == (2,), out[r]


def test_verify_against_sync_is_a_kind_mismatch(shm_path):
    exs = open_ranks(shm_path, 2, ncols=NCOLS)
    c = cfg().replace(dp_size=2, ep_size="auto")
    syncs = [DPStepSync(c, exchange=ex) for ex in exs]
    out = run_ranks([lambda: syncs[0].verify(), lambda: syncs[1].sync(LocalStepInfo(1))])
    for r in range(2):
        assert isinstance(out[r], DPPlanMismatchError) and out[r].field.startswith(
            "exchange kind"
        ), out[r]


def test_world_size_must_match_dp_size():
    with pytest.raises(ValueError, match=r"group has 1 ranks, config\.dp_size is 3"):
        DPStepSync(cfg(), exchange=LocalExchange(NCOLS))
    with pytest.raises(ValueError, match="has 5 columns, needs 8"):
        DPStepSync(RuntimeConfig(), exchange=LocalExchange(5))


def test_world_one_needs_no_process_group():
    sync = DPStepSync(RuntimeConfig(hidden_size=8))
    assert sync.exchange_kind == "local" and sync.rank == 0 and sync.dp_size == 1
    plan = sync.sync(LocalStepInfo(3, can_run_graph=True))
    assert plan.graph_bucket == 4 and plan.global_dp_buffer_len == 4
    sync.verify()
    assert sync.steps == 2
