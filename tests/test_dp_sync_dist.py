"""DP step sync, gather and scatter across real ranks (gloo, CPU tensors), both exchange paths.

Run: ``torchrun --nproc-per-node 2 -m pytest -m dist -p no:cacheprovider tests/test_dp_sync_dist.py``
(and with 3). Every rank seeds its random counts identically, so each rank knows the whole
table and can check the plan and the gathered buffer of every step.

A failing check inside a loop of collectives is recorded, not raised: a rank that left the loop
early would leave the others blocked in the next collective. Ranks compare outcomes at the end
(one object all-gather), so they all pass or all fail together.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from buffers.pool import BufferPool
from dp_runtime.config import RuntimeConfig
from dp_runtime.sync.dp_buffer import DPBufferService, dp_buffer_layout
from dp_runtime.sync.dp_gather import (
    dp_gather,
    dp_reduce_scatter,
    dp_scatter,
)
from dp_runtime.sync.errors import DPPlanMismatchError, DPSyncTimeoutError
from dp_runtime.sync.padding_mode import PaddingMode
from dp_runtime.sync.step_plan import plan_step
from dp_runtime.sync.step_sync import DPStepSync
from dp_runtime.sync.step_table import LocalStepInfo, StepTable
from tests.support.dp_step import DPRankStep

pytestmark = pytest.mark.dist

D = 8
PATHS = ["shm", "gloo"]


def cfg(world, exchange="auto", **kw):
    kw.setdefault("max_running_requests", 32)
    kw.setdefault("chunked_prefill_size", 64)
    kw.setdefault("dp_sync_timeout_s", 30.0)
    return RuntimeConfig(
        dp_size=world, hidden_size=D, dtype="float32", device="cpu", dp_sync_exchange=exchange, **kw
    )


def counts_of(step, world):
    rng = random.Random(7919 * step + world)
    if rng.random() < 0.1:
        return [0] * world  # every rank empty: a skipped step
    return [rng.choice([0, 0, 1, 2, 3, 7, 16, 33, 64]) for _ in range(world)]


def local_of(step, rank, world):
    n = counts_of(step, world)[rank]
    rng = random.Random(step * 131 + rank)
    return LocalStepInfo(n, can_run_graph=n <= 32 and rng.random() < 0.8, is_extend=n > 16)


def rows_of(step, rank, n):
    """Rank ``rank``'s hidden rows at ``step``: small integers, exact in float32 sums."""
    base = torch.arange(n * D, dtype=torch.float32).view(n, D) % 97
    return base + 100 * rank + 1000 * (step % 7) + 1


def agree(ok: bool, what: str, group=None) -> None:
    """Assert ``ok`` on every rank at once: all ranks pass or all fail (no rank left waiting)."""
    oks = [None] * dist.get_world_size(group)
    dist.all_gather_object(oks, (ok, what), group=group)
    bad = [(r, w) for r, (o, w) in enumerate(oks) if not o]
    assert not bad, f"failed on ranks: {bad}"


def test_both_exchange_paths_give_the_same_plans(dist_group):
    world, rank = dist.get_world_size(), dist.get_rank()
    shm, gloo = (
        DPStepSync(cfg(world, "shm"), dist_group),
        DPStepSync(cfg(world, "gloo"), dist_group),
    )
    assert (shm.exchange_kind, gloo.exchange_kind) == ("shm", "gloo")
    problems = []
    for step in range(300):
        local = local_of(step, rank, world)
        a, b = shm.sync(local), gloo.sync(local)
        expected = plan_step(
            StepTable.from_locals(local_of(step, r, world) for r in range(world)), shm.config
        )
        if not (a == b == expected and a.fingerprint == b.fingerprint == expected.fingerprint):
            problems.append(step)
    shm.verify()
    gloo.verify()
    prints = [None] * world
    dist.all_gather_object(prints, (shm.last_plan.fingerprint, gloo.last_plan.fingerprint))
    shm.close()
    gloo.close()
    agree(not problems and len(set(prints)) == 1, f"steps {problems[:5]}, fingerprints {prints}")


def test_auto_takes_the_shm_path_on_one_node(dist_group):
    world = dist.get_world_size()
    forced = os.environ.get("DP_RUNTIME_DP_SYNC_EXCHANGE", "").strip().lower()
    with DPStepSync(cfg(world, "auto"), dist_group) as sync:
        assert sync.exchange_kind == (forced if forced in ("shm", "gloo") else "shm")
        sync.verify()


@pytest.mark.parametrize("exchange", PATHS)
@pytest.mark.parametrize("padding", [None, "max_len", "sum_len"])
@pytest.mark.parametrize("reduce", [False, True], ids=["scatter", "reduce_scatter"])
def test_gather_then_scatter_round_trips(dist_group, exchange, padding, reduce):
    world, rank = dist.get_world_size(), dist.get_rank()
    config = cfg(world, exchange, dp_padding=padding)
    sync = DPStepSync(config, dist_group)
    step_runner = DPRankStep(sync, DPBufferService(config, BufferPool(), rank, group=dist_group))
    problems, modes = [], set()
    weight = float(sum(range(1, world + 1)))
    for step in range(40):
        counts = counts_of(step, world)
        x = rows_of(step, rank, counts[rank])

        def compute(global_GD, plan, step=step, counts=counts):
            expected = torch.zeros_like(global_GD)
            for r, n in enumerate(counts):
                start = r * plan.local_dp_buffer_len(r) if plan.is_max_len else sum(counts[:r])
                expected[start : start + n] = rows_of(step, r, n)
            if not torch.equal(global_GD, expected):
                problems.append(("gathered", step))
            return global_GD * (rank + 1) if reduce else global_GD * 2

        res = step_runner.run(
            local_of(step, rank, world), x if counts[rank] else None, compute, reduce=reduce
        )
        if res.plan.skip:
            continue
        modes.add(res.plan.padding)
        if (
            padding is not None
            and res.plan.graph_bucket is None
            and res.plan.padding.name.lower() != padding
        ):
            problems.append(("override ignored", step))
        want = x * (weight if reduce else 2)
        if not torch.equal(res.out_TD, want):
            problems.append(("returned", step))
    sync.verify()
    sync.close()
    agree(not problems, str(problems[:5]))
    if padding is None:
        assert modes == {PaddingMode.MAX_LEN, PaddingMode.SUM_LEN}


@pytest.mark.parametrize("is_max_len", [True, False], ids=["max_len", "sum_len"])
def test_gather_functions_with_zero_token_ranks(dist_group, is_max_len):
    world, rank = dist.get_world_size(), dist.get_rank()
    problems = []
    for counts in (
        [0] * (world - 1) + [5],
        [3] + [0] * (world - 1),
        [0, 2] + [1] * (world - 2),
        [4] * world,
    ):
        loc = max(counts) if is_max_len else counts[rank]
        g = loc * world if is_max_len else sum(counts)
        lay = dp_buffer_layout(
            g, loc, is_max_len, counts, rank=rank, dp_size=world, max_tokens_per_rank=64
        )
        out = torch.full((g, D), float("nan"))
        dp_gather(out, rows_of(0, rank, counts[rank]), lay, dist_group)
        for r, n in enumerate(counts):
            if not torch.equal(out[lay.offsets[r] : lay.offsets[r] + n], rows_of(0, r, n)):
                problems.append(("gather", counts, r))
        if not torch.equal(dp_scatter(out, lay), rows_of(0, rank, counts[rank])):
            problems.append(("scatter", counts))
        partial = out * (rank + 1)
        summed = dp_reduce_scatter(partial, lay, dist_group, out_TD=torch.empty(64, D))
        if not torch.equal(summed, rows_of(0, rank, counts[rank]) * sum(range(1, world + 1))):
            problems.append(("reduce_scatter", counts))
    agree(not problems, str(problems))


def tampering(bad_rank, at_call):
    calls = [0]

    def plan_fn(table, config):
        plan = plan_step(table, config)
        calls[0] += 1
        if calls[0] == at_call and dist.get_rank() == bad_rank:
            plan = dataclasses.replace(plan, global_dp_buffer_len=plan.global_dp_buffer_len + 1)
        return plan

    return plan_fn


@pytest.mark.parametrize("exchange", PATHS)
def test_a_diverging_rank_makes_every_rank_raise(dist_group, exchange):
    world, rank = dist.get_world_size(), dist.get_rank()
    bad = world - 1
    sync = DPStepSync(cfg(world, exchange), dist_group, plan_fn=tampering(bad, 4))
    outcome, start = None, time.monotonic()
    for step in range(10):
        try:
            sync.sync(local_of(step, rank, world))
        except DPPlanMismatchError as e:
            outcome = (step, e.field, e.ranks, round(time.monotonic() - start, 3))
            break
    sync.close()
    outcomes = [None] * world
    dist.all_gather_object(outcomes, outcome)  # the group is still usable: nobody is stuck
    for got in outcomes:
        assert got is not None, outcomes
        step, field, ranks, seconds = got
        assert (step, field, ranks) == (4, "previous plan fingerprint", (bad,)), outcomes
        assert seconds < 10


@pytest.mark.parametrize("exchange", PATHS)
def test_verify_catches_a_mismatch_on_the_last_step(dist_group, exchange):
    world, rank = dist.get_world_size(), dist.get_rank()
    bad = world - 1
    sync = DPStepSync(cfg(world, exchange), dist_group, plan_fn=tampering(bad, 3))
    for step in range(3):
        sync.sync(local_of(step, rank, world))
    try:
        sync.verify()
        outcome = None
    except DPPlanMismatchError as e:
        outcome = e.ranks
    sync.close()
    outcomes = [None] * world
    dist.all_gather_object(outcomes, outcome)
    assert outcomes == [(bad,)] * world


def test_config_mismatch_is_refused_at_init(dist_group):
    world, rank = dist.get_world_size(), dist.get_rank()
    config = cfg(world, max_running_requests=32 if rank != 1 else 16)
    try:
        DPStepSync(config, dist_group).close()
        outcome = None
    except DPPlanMismatchError as e:
        outcome = (e.field, e.ranks)
    outcomes = [None] * world
    dist.all_gather_object(outcomes, outcome)
    assert outcomes == [("config field 'max_running_requests'", (1,))] * world


def test_a_silent_rank_is_named_within_the_timeout(dist_group):
    """shm path: rank 1 skips a step; every other rank raises naming it, after ~timeout."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sync = DPStepSync(cfg(world, "shm", dp_sync_timeout_s=1.0), dist_group)
    sync.sync(LocalStepInfo(1))
    outcome, start = None, time.monotonic()
    if rank != 1:
        try:
            sync.sync(LocalStepInfo(1))
        except DPSyncTimeoutError as e:
            outcome = (e.silent_ranks, round(time.monotonic() - start, 2))
    sync.close()
    outcomes = [None] * world
    dist.all_gather_object(outcomes, outcome)
    for r, got in enumerate(outcomes):
        if r == 1:
            assert got is None
        else:
            assert got is not None and got[0] == (1,) and 0.9 < got[1] < 10, outcomes


def test_ranks_on_several_hosts_take_the_gloo_path(dist_group, monkeypatch):
    world, rank = dist.get_world_size(), dist.get_rank()
    monkeypatch.setattr("dp_runtime.sync.exchange.socket.gethostname", lambda: f"node{rank % 2}")
    with DPStepSync(cfg(world, "auto"), dist_group) as sync:
        kind = sync.exchange_kind
        sync.sync(LocalStepInfo(rank))
    try:
        DPStepSync(cfg(world, "shm"), dist_group)
        refused = None
    except ValueError as e:
        refused = str(e)
    assert kind == "gloo"
    assert refused is not None and "needs every rank on one node" in refused and "node1" in refused


def test_a_rank_that_cannot_attach_makes_every_rank_fall_back(dist_group, monkeypatch):
    import dp_runtime.sync.exchange as exchange_module

    world = dist.get_world_size()
    real = exchange_module.ShmExchange
    shm_dir = cfg(world).dp_sync_shm_dir

    def ours():
        return {f for f in os.listdir(shm_dir) if f.startswith("dp_runtime_step_sync_")}

    before = ours()

    def flaky(path, r, *args, **kwargs):
        if r == world - 1:
            raise OSError("simulated: no shared /dev/shm here")
        return real(path, r, *args, **kwargs)

    monkeypatch.setattr(exchange_module, "ShmExchange", flaky)
    with DPStepSync(cfg(world, "auto"), dist_group) as sync:
        kind = sync.exchange_kind
        sync.sync(LocalStepInfo(1))
    try:
        DPStepSync(cfg(world, "shm"), dist_group)
        refused = None
    except ValueError as e:
        refused = str(e)
    assert kind == "gloo"
    assert refused is not None and "simulated" in refused
    agree(True, "")  # a barrier: rank 0 unlinks after the others gave up attaching
    leftovers = ours() - before
    assert not leftovers, leftovers
