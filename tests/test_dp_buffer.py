"""The DP buffer service: argument checks, layouts, views of pool storage, world-size-1 data path."""

from __future__ import annotations

import pytest
import torch

from buffers.pool import BufferPool
from dp_runtime.config import RuntimeConfig
from dp_runtime.sync.dp_buffer import DPBufferService, dp_buffer_layout
from dp_runtime.sync.padding_mode import PaddingMode
from dp_runtime.sync.step_plan import plan_step
from dp_runtime.sync.step_sync import DPStepSync
from dp_runtime.sync.step_table import LocalStepInfo, StepTable
from tests.support.dp_step import DPRankStep

D = 8


def cfg(dp_size=3, **kw):
    kw.setdefault("max_running_requests", 16)
    kw.setdefault("chunked_prefill_size", 32)
    return RuntimeConfig(dp_size=dp_size, hidden_size=D, dtype="float32", device="cpu", **kw)


def layout(g, loc, is_max, counts, rank=0, dp=3, limit=32):
    return dp_buffer_layout(
        g, loc, is_max, counts, rank=rank, dp_size=dp, max_tokens_per_rank=limit
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((6, 2, True, (1, 2)), ["has 2 entries", "dp_size is 3"]),
        ((6, 2, True, (1, -1, 2)), ["global_num_tokens_cpu[1]=-1", "max_tokens_per_rank=32"]),
        ((99, 33, True, (33, 0, 0)), ["global_num_tokens_cpu[0]=33", "max_tokens_per_rank=32"]),
        ((7, 2, True, (1, 2, 2)), ["global_dp_buffer_len=7", "2 * 3 = 6"]),
        ((3, 1, True, (1, 2, 0)), ["local_dp_buffer_len=1", "max(global_num_tokens_cpu)=2"]),
        ((99, 33, True, (3, 2, 0)), ["global_dp_buffer_len=99", "max_global_tokens=96"]),
        ((9, 3, False, (1, 2, 3)), ["global_dp_buffer_len=9", "sum(global_num_tokens_cpu)=6"]),
        ((6, 2, False, (1, 2, 3)), ["local_dp_buffer_len=2", "global_num_tokens_cpu[0]=1"]),
        ((-1, 0, False, (0, 0, 0)), ["global_dp_buffer_len=-1"]),
        # Non-integers are refused, not truncated (2.7 tokens once read as 2).
        ((6, 2, True, (1, 2.7, 2)), ["global_num_tokens_cpu[1] must be an int, got 2.7"]),
        ((6.0, 2, True, (1, 2, 2)), ["global_dp_buffer_len must be an int, got 6.0"]),
        ((6, 2.5, True, (1, 2, 2)), ["local_dp_buffer_len must be an int, got 2.5"]),
        ((6, 2, True, (1, True, 2)), ["global_num_tokens_cpu[1] must be an int, got True"]),
    ],
)
def test_inconsistent_arguments_name_value_and_limit(args, words):
    with pytest.raises(ValueError) as info:
        layout(*args)
    for word in words:
        assert word in str(info.value)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="rank 3 is not in"):
        layout(3, 1, True, (1, 1, 1), rank=3)


def test_max_len_offsets_are_slot_starts():
    lay = layout(12, 4, True, (4, 0, 3), rank=2)
    assert lay.padding is PaddingMode.MAX_LEN and lay.is_max_len
    assert lay.offsets == (0, 4, 8) and lay.offset == 8 and lay.num_tokens == 3


def test_sum_len_offsets_are_prefix_sums():
    lay = layout(7, 0, False, (4, 0, 3), rank=1)
    assert lay.padding is PaddingMode.SUM_LEN
    assert lay.offsets == (0, 4, 4) and lay.offset == 4 and lay.num_tokens == 0


def test_service_allocates_the_configured_maximum_once():
    c = cfg()
    pool = BufferPool()
    svc = DPBufferService(c, pool, rank=1)
    report = {e.name: e for e in pool.report()}
    assert report["dp_global_hidden"].numel == c.max_global_tokens * D
    assert report["dp_local_hidden"].numel == c.max_tokens_per_rank * D
    base_g = pool.view("dp_global_hidden", (c.max_global_tokens, D)).untyped_storage().data_ptr()
    base_l = pool.view("dp_local_hidden", (c.max_tokens_per_rank, D)).untyped_storage().data_ptr()
    for g, loc, is_max, counts in [
        (12, 4, True, (4, 1, 0)),
        (5, 1, False, (4, 1, 0)),
        (96, 32, True, (32, 32, 32)),
        (0, 0, True, (0, 0, 0)),
    ]:
        svc.set_dp_buffer_len(g, loc, is_max, counts)
        assert svc.get_global_buffer().shape == (g, D)
        assert svc.get_local_buffer().shape == (loc, D)
        # views of the pool's storage, from its start: never a new allocation
        assert svc.get_global_buffer().untyped_storage().data_ptr() == base_g
        assert svc.get_local_buffer().untyped_storage().data_ptr() == base_l
        assert svc.get_global_buffer().storage_offset() == 0
    assert pool.total_bytes() == (c.max_global_tokens + c.max_tokens_per_rank) * D * 4


def test_service_offsets_and_counts():
    svc = DPBufferService(cfg(), BufferPool(), rank=2)
    svc.set_dp_buffer_len(7, 3, False, [4, 0, 3])
    assert svc.offsets == (0, 4, 4) and svc.offset == 4
    assert svc.global_num_tokens == (4, 0, 3)
    assert svc.global_dp_buffer_len == 7 and svc.local_dp_buffer_len == 3 and not svc.is_max_len
    svc.set_dp_buffer_len(12, 4, True, [4, 0, 3])
    assert svc.offsets == (0, 4, 8) and svc.offset == 8 and svc.is_max_len


def test_service_refuses_over_the_configured_maximum():
    svc = DPBufferService(cfg(), BufferPool(), rank=0)
    with pytest.raises(ValueError, match="max_tokens_per_rank=32"):
        svc.set_dp_buffer_len(99, 33, True, (33, 0, 0))
    with pytest.raises(ValueError, match="has 2 entries"):
        svc.set_dp_buffer_len(3, 2, False, (1, 2))


def test_set_from_plan_matches_the_plan():
    """The layout is derived from what a dispatcher reads of a plan (counts,
    ``runtime_max_tokens_per_rank``, ``is_max_len``); it must be the one ``plan_step`` sized."""
    c = cfg(cuda_graph_bs=(1, 2, 4, 8), cuda_graph_max_bs=8)
    cases = [((3, 5, 0), True, False), ((2, 2, 2), False, False), ((9, 0, 0), False, False),
             ((3, 1, 0), False, True), ((0, 0, 0), False, False), ((1, 7, 2), False, True)]
    for rank in range(c.dp_size):
        svc = DPBufferService(c, BufferPool(), rank=rank)
        for counts, is_extend, graph in cases:
            plan = plan_step(StepTable.from_counts(counts, can_run_graph=graph, is_extend=is_extend), c)
            lay = svc.set_from_plan(plan)
            assert lay.global_dp_buffer_len == plan.global_dp_buffer_len
            assert lay.local_dp_buffer_len == plan.local_dp_buffer_len(rank)
            assert lay.padding is plan.padding and lay.global_num_tokens == plan.global_num_tokens_cpu
            assert svc.get_global_buffer().shape[0] == plan.global_dp_buffer_len


def test_a_plan_is_laid_out_again_after_another_layout():
    """The same plan object is laid out once (an identity check in every later layer), but
    never kept once another layout came in between."""
    c = cfg()
    svc = DPBufferService(c, BufferPool(), rank=1)
    plan = plan_step(StepTable.from_counts((3, 5, 0), is_extend=True), c)  # SUM_LEN
    assert svc.set_from_plan(plan).global_dp_buffer_len == 8
    svc.set_dp_buffer_len(12, 4, True, (4, 0, 3))
    assert svc.set_from_plan(plan).global_dp_buffer_len == 8 and svc.get_global_buffer().shape[0] == 8
    other = plan_step(StepTable.from_counts((2, 2, 2)), c)  # MAX_LEN
    svc.set_from_plan(other)
    assert svc.set_from_plan(plan).offsets == (0, 3, 8)


def test_pool_conflict_is_reported():
    pool = BufferPool()
    pool.request("dp_global_hidden", (4, D), torch.float32, "cpu", user="someone")
    with pytest.raises(ValueError, match="never reallocated"):
        DPBufferService(cfg(), pool, rank=0)


def test_world_one_gather_scatter_round_trip_both_modes():
    c = RuntimeConfig(
        hidden_size=D,
        dtype="float32",
        device="cpu",
        max_running_requests=16,
        chunked_prefill_size=32,
    )
    svc = DPBufferService(c, BufferPool(), rank=0)
    x = torch.randn(5, D)
    for g, loc, is_max in [(5, 5, True), (8, 8, True), (5, 5, False)]:
        svc.set_dp_buffer_len(g, loc, is_max, (5,))
        out = svc.gather(x)
        assert torch.equal(out[:5], x) and torch.count_nonzero(out[5:]) == 0
        assert torch.equal(svc.scatter(), x)
        assert torch.equal(svc.reduce_scatter(out.clone()), x)


def test_world_one_rank_step_runs_and_skips():
    c = RuntimeConfig(
        hidden_size=D,
        dtype="float32",
        device="cpu",
        max_running_requests=16,
        chunked_prefill_size=32,
    )
    step = DPRankStep(DPStepSync(c), DPBufferService(c, BufferPool(), rank=0))
    x = torch.randn(3, D)
    res = step.run(LocalStepInfo(3), x, lambda g, plan: g * 2)
    assert not res.plan.skip and torch.equal(res.out_TD, x * 2)
    res = step.run(
        LocalStepInfo(0), None, lambda g, plan: pytest.fail("a skipped step computes nothing")
    )
    assert res.plan.skip and res.out_TD is None
    with pytest.raises(ValueError, match="hidden_TD has 2 rows"):
        step.run(LocalStepInfo(3), x[:2], lambda g, plan: g)
