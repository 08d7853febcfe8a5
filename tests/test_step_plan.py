"""plan_step and the padding rule, over tables of counts (pure functions, no process group)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from dp_runtime.config import RuntimeConfig
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.sync.padding_mode import PaddingMode, choose_padding_mode
from dp_runtime.sync.step_plan import StepPlan, plan_step
from dp_runtime.sync.step_table import MODE_CODES, LocalStepInfo, StepTable

MAX, SUM = PaddingMode.MAX_LEN, PaddingMode.SUM_LEN


def cfg(dp_size=4, **kw):
    kw.setdefault("max_running_requests", 64)
    kw.setdefault("chunked_prefill_size", 512)
    kw.setdefault("cuda_graph_max_bs", 32)
    kw.setdefault(
        "cuda_graph_bs", (1, 2, 4, 8, 16, 32) if kw.get("attn_tp_size", 1) == 1 else "auto"
    )
    return RuntimeConfig(dp_size=dp_size, hidden_size=8, **kw)


# The padding rule as a table: (aligned counts, any extend, replays a graph, override) -> mode.
@pytest.mark.parametrize(
    ("counts", "is_extend", "replays", "override", "expected"),
    [
        # rule 1: a replayed graph is MAX_LEN, whatever else holds
        ((1, 1, 30, 0), False, True, None, MAX),
        ((1, 1, 30, 0), True, True, None, MAX),
        ((1, 1, 30, 0), False, True, SUM, MAX),
        # rule 2: the override wins on eager steps
        ((5, 5, 5, 5), False, False, SUM, SUM),
        ((100, 0, 0, 1), True, False, MAX, MAX),
        # rule 3: extend with dp > 1 is SUM_LEN, even when balanced
        ((8, 8, 8, 8), True, False, None, SUM),
        ((100,), True, False, None, MAX),  # dp == 1: rule 4 (max == sum)
        # rule 4/5: max * dp <= 2 * sum -> MAX_LEN, else SUM_LEN
        ((4, 4, 4, 4), False, False, None, MAX),  # 16 <= 32
        ((8, 0, 0, 0), False, False, None, SUM),  # 32 > 16
        ((8, 8, 0, 0), False, False, None, MAX),  # 32 <= 32 (boundary is MAX_LEN)
        ((9, 7, 0, 0), False, False, None, SUM),  # 36 > 32
        ((3, 0), False, False, None, MAX),  # 6 <= 6
        ((3, 0, 0), False, False, None, SUM),  # 9 > 6
        ((7,), False, False, None, MAX),
    ],
)
def test_padding_rule_table(counts, is_extend, replays, override, expected):
    assert choose_padding_mode(counts, is_extend, replays, override) is expected


def test_skip_when_every_rank_is_empty():
    plan = plan_step(StepTable.from_counts([0, 0, 0, 0], can_run_graph=True), cfg())
    assert plan.skip
    assert plan.forward_modes == (ForwardMode.IDLE,) * 4
    assert plan.global_dp_buffer_len == 0 and plan.graph_bucket is None
    assert plan.runtime_max_tokens_per_rank == 0 and plan.local_dp_buffer_lens == (0,) * 4


def test_idle_rank_among_busy_ones():
    table = StepTable.from_locals(
        [
            LocalStepInfo(3),
            LocalStepInfo(0, forward_mode=ForwardMode.DECODE),
            LocalStepInfo(5, is_extend=True),
            LocalStepInfo(2),
        ]
    )
    plan = plan_step(table, cfg())
    assert not plan.skip
    assert plan.forward_modes == (
        ForwardMode.DECODE,
        ForwardMode.IDLE,
        ForwardMode.EXTEND,
        ForwardMode.DECODE,
    )
    assert plan.is_extend
    assert plan.padding is SUM  # extend with dp > 1
    assert plan.global_num_tokens_cpu == (3, 0, 5, 2)
    assert plan.global_dp_buffer_len == 10
    assert plan.local_dp_buffer_lens == (3, 0, 5, 2)
    assert plan.local_dp_buffer_len(1) == 0
    assert plan.runtime_max_tokens_per_rank == 5


@pytest.mark.parametrize(
    ("counts", "tp", "aligned"),
    [
        ((1, 5, 0), 4, (4, 8, 0)),
        ((4, 8, 12), 4, (4, 8, 12)),
        ((3, 2), 2, (4, 2)),
        ((3, 2), 1, (3, 2)),
    ],
)
def test_counts_align_up_to_attn_tp(counts, tp, aligned):
    plan = plan_step(StepTable.from_counts(counts), cfg(dp_size=len(counts), attn_tp_size=tp))
    assert plan.global_num_tokens_cpu == aligned
    assert plan.raw_num_tokens == counts
    assert plan.runtime_max_tokens_per_rank == max(aligned)


@pytest.mark.parametrize(
    ("counts", "bucket"),
    [
        ((1, 1, 1, 1), 1),
        ((3, 0, 1, 2), 4),
        ((4, 4, 4, 4), 4),
        ((5, 1, 1, 1), 8),
        ((17, 0, 0, 0), 32),
        ((32, 32, 32, 32), 32),
    ],
)
def test_graph_bucket_is_smallest_capture_size_at_or_above_max(counts, bucket):
    plan = plan_step(StepTable.from_counts(counts, can_run_graph=True), cfg())
    assert plan.graph_bucket == bucket
    assert plan.padding is MAX  # replay -> MAX_LEN
    assert plan.global_dp_buffer_len == bucket * 4
    assert plan.local_dp_buffer_lens == (bucket,) * 4
    assert plan.runtime_max_tokens_per_rank == bucket


def test_no_bucket_when_a_busy_rank_cannot_run_a_graph():
    infos = [LocalStepInfo(2, can_run_graph=True), LocalStepInfo(2, can_run_graph=False)] + [
        LocalStepInfo(2, can_run_graph=True)
    ] * 2
    plan = plan_step(StepTable.from_locals(infos), cfg())
    assert plan.graph_bucket is None
    assert plan.runtime_max_tokens_per_rank == 2


def test_idle_rank_flags_neither_block_a_graph_nor_make_an_extend_step():
    infos = [
        LocalStepInfo(2, can_run_graph=True),
        LocalStepInfo(0, can_run_graph=False, is_extend=True),
    ] * 2
    plan = plan_step(StepTable.from_locals(infos), cfg())
    assert plan.graph_bucket == 2 and not plan.is_extend


def test_extend_steps_take_the_extend_token_buckets():
    # Every busy rank extends (an IDLE one replays too): the bucket comes from
    # cuda_graph_extend_tokens, MAX_LEN at it; above the largest token bucket, eager.
    c = cfg(cuda_graph_extend_tokens=(16, 64, 256))
    infos = [LocalStepInfo(40, can_run_graph=True, is_extend=True), LocalStepInfo(0),
             LocalStepInfo(9, can_run_graph=True, is_extend=True), LocalStepInfo(3, can_run_graph=True, is_extend=True)]
    plan = plan_step(StepTable.from_locals(infos), c)
    assert plan.is_extend and plan.graph_bucket == 64 and plan.padding is MAX
    assert plan.local_dp_buffer_lens == (64,) * 4 and plan.runtime_max_tokens_per_rank == 64
    big = plan_step(StepTable.from_counts([300, 1, 1, 1], can_run_graph=True, is_extend=True), c)
    assert big.graph_bucket is None
    assert plan_step(StepTable.from_counts([5] * 4, can_run_graph=True, is_extend=True),
                     cfg(cuda_graph_extend_tokens=())).graph_bucket is None


def test_a_step_mixing_decode_and_extend_ranks_replays_the_extend_pieces():
    # Beside an extending rank, a decoding rank runs its rows as one-token requests of an extend
    # batch (forward_batch.decode_as_extend): the step takes an extend bucket on every rank.
    infos = [LocalStepInfo(2, can_run_graph=True), LocalStepInfo(8, can_run_graph=True, is_extend=True)] * 2
    plan = plan_step(StepTable.from_locals(infos), cfg())
    assert plan.is_extend and plan.graph_bucket == cfg().cuda_graph_extend_tokens[0]
    assert plan.forward_modes[0] is ForwardMode.DECODE and plan.forward_modes[1] is ForwardMode.EXTEND
    # one rank without a graph for its batch: eager everywhere
    infos[0] = LocalStepInfo(2)
    assert plan_step(StepTable.from_locals(infos), cfg()).graph_bucket is None


def test_no_bucket_over_largest_capture_size_or_without_sizes():
    plan = plan_step(StepTable.from_counts([33, 1, 1, 1], can_run_graph=True), cfg())
    assert plan.graph_bucket is None
    assert plan.padding is SUM and plan.global_dp_buffer_len == 36
    no_graphs = cfg(cuda_graph_max_bs=0, cuda_graph_bs=())
    assert (
        plan_step(StepTable.from_counts([1, 1, 1, 1], can_run_graph=True), no_graphs).graph_bucket
        is None
    )


def test_buckets_with_attn_tp_alignment():
    c = cfg(dp_size=2, attn_tp_size=4, cuda_graph_max_bs=32)
    plan = plan_step(StepTable.from_counts([5, 1], can_run_graph=True), c)
    assert plan.global_num_tokens_cpu == (8, 4)
    assert plan.graph_bucket == 8 and plan.global_dp_buffer_len == 16


def test_eager_max_len_sizes():
    plan = plan_step(StepTable.from_counts([4, 3, 2, 4]), cfg())
    assert plan.padding is MAX and plan.graph_bucket is None
    assert plan.global_dp_buffer_len == 16 and plan.local_dp_buffer_lens == (4,) * 4


def test_override_applies_on_eager_steps_only():
    c = cfg(dp_padding="sum_len")
    assert plan_step(StepTable.from_counts([4, 4, 4, 4]), c).padding is SUM
    replay = plan_step(StepTable.from_counts([4, 4, 4, 4], can_run_graph=True), c)
    assert replay.padding is MAX and replay.graph_bucket == 4
    c = cfg(dp_padding="max_len")
    plan = plan_step(StepTable.from_counts([100, 0, 0, 1], is_extend=True), c)
    assert plan.padding is MAX and plan.global_dp_buffer_len == 400


def test_logprob_counts_pass_through():
    infos = [
        LocalStepInfo(5, num_tokens_for_logprob=2),
        LocalStepInfo(0),
        LocalStepInfo(3),
        LocalStepInfo(1, 0),
    ]
    assert plan_step(StepTable.from_locals(infos), cfg()).global_num_tokens_for_logprob_cpu == (
        2,
        0,
        3,
        0,
    )


@pytest.mark.parametrize(
    ("infos", "words"),
    [
        (
            [LocalStepInfo(513)] + [LocalStepInfo(0)] * 3,
            ["rank 0", "num_tokens=513", "max_tokens_per_rank=512"],
        ),
        (
            [LocalStepInfo(1), LocalStepInfo(-1)] + [LocalStepInfo(0)] * 2,
            ["rank 1", "num_tokens=-1"],
        ),
        (
            [LocalStepInfo(0)] * 3 + [LocalStepInfo(2, 3)],
            ["rank 3", "num_tokens_for_logprob=3", "num_tokens=2"],
        ),
        (
            [LocalStepInfo(0)] * 2
            + [LocalStepInfo(2, forward_mode=ForwardMode.IDLE), LocalStepInfo(0)],
            ["rank 2", "IDLE", "num_tokens=2"],
        ),
        ([LocalStepInfo(0)] * 3, ["3 ranks", "dp_size is 4"]),
    ],
)
def test_reports_out_of_limits_are_refused(infos, words):
    with pytest.raises(ValueError) as info:
        plan_step(StepTable.from_locals(infos), cfg())
    for word in words:
        assert word in str(info.value)


def test_non_integer_counts_are_refused_not_truncated():
    with pytest.raises(ValueError, match=r"LocalStepInfo.num_tokens must be an int, got 2.7"):
        LocalStepInfo(2.7)
    with pytest.raises(ValueError, match=r"LocalStepInfo.num_tokens_for_logprob must be an int, got 1.5"):
        LocalStepInfo(2, 1.5)
    # A table built directly (a tool, a bug upstream of the exchange): refused by the plan.
    rows = [(1, 1, 0, 0, 1), (2.7, 2, 0, 0, 1)] + [(0, 0, 0, 0, 0)] * 2
    with pytest.raises(ValueError, match=r"rank 1 reported num_tokens=2.7; it must be an int"):
        plan_step(StepTable.from_rows(rows), cfg())


def test_unknown_forward_mode_is_refused():
    rows = [(1, 1, 0, 0, 9)] + [(0, 0, 0, 0, 0)] * 3
    with pytest.raises(ValueError, match="rank 0 reported forward mode 9"):
        plan_step(StepTable.from_rows(rows), cfg())


def test_fingerprint_is_a_function_of_every_field():
    table = StepTable.from_counts([3, 0, 5, 2], can_run_graph=True)
    a, b = plan_step(table, cfg()), plan_step(table, cfg())
    assert a == b and a.fingerprint == b.fingerprint and isinstance(a.fingerprint, int)
    assert -(2**63) <= a.fingerprint < 2**63  # fits the int64 exchange column
    changes = {
        "global_dp_buffer_len": a.global_dp_buffer_len + 1,
        "runtime_max_tokens_per_rank": 99,
        "graph_bucket": None,
        "padding": SUM,
        "skip": True,
        "is_extend": True,
        "global_num_tokens_cpu": (3, 0, 5, 3),
        "forward_modes": (ForwardMode.EXTEND,) * 4,
    }
    for name, value in changes.items():
        changed = dataclasses.replace(a, **{name: value})
        assert changed.fingerprint != a.fingerprint, name


def test_fingerprint_is_the_same_in_another_process():
    """Ranks are processes: the hash must not depend on per-process hash salting."""
    table = StepTable.from_counts([3, 0, 5, 2], can_run_graph=True)
    here = plan_step(table, cfg()).fingerprint
    code = (
        "from tests.test_step_plan import cfg;"
        "from dp_runtime.sync.step_plan import plan_step; from dp_runtime.sync.step_table import StepTable;"
        "print(plan_step(StepTable.from_counts([3, 0, 5, 2], can_run_graph=True), cfg()).fingerprint)"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=root)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=root, check=True
    )
    assert int(out.stdout.strip()) == here


def test_plan_reads_by_the_documented_names():
    plan = plan_step(StepTable.from_counts([1, 2, 3, 4]), cfg())
    for name in (
        "forward_modes",
        "global_num_tokens_cpu",
        "global_num_tokens_for_logprob_cpu",
        "padding",
        "global_dp_buffer_len",
        "local_dp_buffer_lens",
        "graph_bucket",
        "runtime_max_tokens_per_rank",
        "fingerprint",
        "skip",
        "is_extend",
    ):
        assert hasattr(plan, name)
    assert isinstance(plan, StepPlan) and plan.dp_size == 4 and "fingerprint" in plan.describe()


def test_local_step_info_defaults():
    assert LocalStepInfo(0).to_row() == (0, 0, 0, 0, MODE_CODES[ForwardMode.IDLE])
    assert LocalStepInfo(4).to_row() == (4, 4, 0, 0, MODE_CODES[ForwardMode.DECODE])
    assert LocalStepInfo(4, 1, True, True).to_row() == (4, 1, 1, 1, MODE_CODES[ForwardMode.EXTEND])
    assert sorted(MODE_CODES.values()) == list(range(len(ForwardMode)))
