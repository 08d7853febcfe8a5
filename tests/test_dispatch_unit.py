"""Dispatcher unit tests on CPU without a process group: errors, partition, packing, experts.

Errors must be raised before any communication: the ``no_comm`` fixture replaces every
communication entry point of the backends with one that fails the test.
"""

from __future__ import annotations

import logging

import pytest
import torch

import dispatcher.all_to_all as a2a_mod
import dispatcher.startup as startup_mod
import dp_runtime.sync.dp_gather as gather_mod
from dispatcher import (
    INVALID_EXPERT_ID,
    AllToAllDispatcher,
    Dispatcher,
    DispatcherConfig,
    ExpertInputs,
    ExpertPartition,
    FixedPlan,
    LocalDispatcher,
    StepPlanLike,
    SwiGLUExperts,
    make_dispatcher,
    moe_forward,
    reference_moe,
    run_local_experts,
)
from dispatcher.all_to_all import RowLayout
from dispatcher.groups import EPGroup
from tests.support.gather_buffers import gather_buffers

E, K, D = 8, 2, 16
BACKENDS = ["all_gather", "all_to_all"]


def _cfg(**kw) -> DispatcherConfig:
    base = dict(num_experts=E, top_k=K, hidden_size=D, dtype=torch.float32, max_tokens_per_rank=32)
    base.update(kw)
    return DispatcherConfig(**base)


def _make(kind: str, cfg: DispatcherConfig | None = None):
    cfg = cfg if cfg is not None else _cfg()
    extra = {"buffers": gather_buffers(cfg, EPGroup.local())} if kind == "all_gather" else {}
    return make_dispatcher(kind, cfg, device="cpu", **extra)


def _dispatch(d, x, ids, w, plan):
    return d.dispatch(x, ids, w, plan)


def _inputs(t: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K, dtype=torch.long)
    w = torch.rand(t, K, generator=g)
    return x, ids, w


@pytest.fixture
def no_comm(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("communicated before validation")

    for mod, names in ((gather_mod, ("all_gather_into", "all_gather_v", "all_to_all_v", "reduce_scatter_into",
                                     "reduce_scatter_v")),
                       (a2a_mod, ("all_to_all_rows", "exchange_counts"))):
        for name in names:
            monkeypatch.setattr(mod, name, boom)
    monkeypatch.setattr(startup_mod, "barrier_with_timeout", boom)
    monkeypatch.setattr(startup_mod, "verify_plan_agreement", boom)


# ---------------------------------------------------------------- errors before communication


@pytest.mark.parametrize("cls", BACKENDS)
def test_step_over_max_num_tokens_is_refused(cls, no_comm):
    d = _make(cls, _cfg(max_tokens_per_rank=32))
    x, ids, w = _inputs(4)
    with pytest.raises(ValueError) as err:
        d.dispatch(x, ids, w, FixedPlan.from_counts([4], runtime_max_tokens_per_rank=40))
    msg = str(err.value)
    for needle in ("runtime_max_tokens_per_rank=40", "max_num_tokens=32", "chunked_prefill_size",
                   "max_running_requests", "before communication"):
        assert needle in msg


@pytest.mark.parametrize("cls", BACKENDS)
@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("tokens_over_runtime_max", "exceed plan.runtime_max_tokens_per_rank"),
        ("tokens_differ_from_plan", "differ from plan.global_num_tokens_cpu[0]=3"),
        ("plan_wrong_length", "has 2 entries but the EP group has 1"),
        ("dtype", "dtype torch.bfloat16 does not match the dispatcher's dtype torch.float32"),
        ("hidden_size", "hidden size 8"),
        ("ids_shape", "topk_ids_TK must have shape (4, 2)"),
        ("weights_shape", "topk_weights_TK must have shape (4, 2)"),
        ("ids_float", "integer tensor"),
        ("ids_negative", "expert ids out of range: topk_ids_TK spans [-1,"),
        ("ids_too_big", f"valid ids are [0, {E})"),
        ("hidden_1d", "must be 2-D"),
    ],
)
def test_bad_steps_are_refused_before_communication(cls, case, needle, no_comm):
    d = _make(cls)
    x, ids, w = _inputs(4)
    plan = FixedPlan.from_counts([4])
    if case == "tokens_over_runtime_max":
        plan = FixedPlan((4,), 3, 0)
    elif case == "tokens_differ_from_plan":
        plan = FixedPlan.from_counts([3], 4)
    elif case == "plan_wrong_length":
        plan = FixedPlan.from_counts([4, 4])
    elif case == "dtype":
        x = x.bfloat16()
    elif case == "hidden_size":
        x = x[:, :8]
    elif case == "ids_shape":
        ids = ids[:, :1]
    elif case == "weights_shape":
        w = w[:3]
    elif case == "ids_float":
        ids = ids.float()
    elif case == "ids_negative":
        ids[0, 0] = -1
    elif case == "ids_too_big":
        ids[1, 1] = E
    elif case == "hidden_1d":
        x = x[0]
    with pytest.raises(ValueError) as err:
        d.dispatch(x, ids, w, plan)
    assert needle in str(err.value)


def test_expert_id_check_can_be_disabled():
    d = AllToAllDispatcher(_cfg(check_expert_ids=False), device="cpu")
    x, ids, w = _inputs(3)
    ids[0, 0] = E + 5  # not checked: owner_of maps it past the last rank -> scatter fails loudly
    with pytest.raises(RuntimeError):
        d.dispatch(x, ids, w, FixedPlan.from_counts([3]))


@pytest.mark.parametrize("cls", BACKENDS)
def test_combine_checks_shape_dtype_and_handle(cls):
    d = _make(cls)
    other = _make(cls)
    x, ids, w = _inputs(4)
    handle, _ = _dispatch(d, x, ids, w, FixedPlan.from_counts([4]))
    out = d.expert_output_buffer(handle)
    with pytest.raises(ValueError, match="expert_out_ND must have shape"):
        d.combine(out[:, :4], handle)
    with pytest.raises(ValueError, match="dtype"):
        d.combine(out.double(), handle)
    with pytest.raises(ValueError, match="did not return"):
        other.combine(out, handle)


def test_config_validation():
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        _cfg(top_k=9)
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        _cfg(max_tokens_per_rank=0)
    with pytest.raises(ValueError, match="floating"):
        _cfg(dtype=torch.int32)


def test_all_gather_lays_its_buffers_out_from_each_plan_it_is_handed():
    """Nobody lays the DP buffers out before a forward: each dispatch does, from its plan,
    whatever layout the service held before (another count, the other padding mode)."""
    d = _make("all_gather")
    experts = SwiGLUExperts.random(E, D, 24, seed=2)
    d.buffers.set_dp_buffer_len(3, 3, True, (3,))  # a stale layout, as a previous step left it
    for t, runtime_max, is_max_len in ((4, 4, True), (4, 7, True), (5, 9, False), (2, 2, True), (0, 3, True)):
        x, ids, w = _inputs(t, seed=t)
        handle, inputs = d.dispatch(x, ids, w, FixedPlan.from_counts([t], runtime_max, is_max_len=is_max_len))
        assert inputs.hidden_ND.shape[0] == (runtime_max if is_max_len else t)
        out = d.combine(run_local_experts(inputs, experts.local(d.partition, 0),
                                          out_ND=d.expert_output_buffer(handle)), handle)
        torch.testing.assert_close(out, reference_moe(x, ids, w, experts, E), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- world size 1 answers


@pytest.mark.parametrize("kind", ["local", "all_gather", "all_to_all"])
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize(("t", "runtime_max"), [(10, 10), (5, 12), (0, 0), (0, 4)])
def test_world_size_one_matches_reference(kind, dense, t, runtime_max):
    experts = SwiGLUExperts.random(E, D, 24, seed=3)
    d = _make(kind)
    x, ids, w = _inputs(t, seed=t)
    plan = FixedPlan.from_counts([t], runtime_max)
    out = moe_forward(d, x, ids, w, plan, experts.local(d.partition, 0), dense=dense)
    ref = reference_moe(x, ids, w, experts, E)
    assert out.shape == (t, D)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sum_len", [False, True])
def test_all_gather_gathers_into_the_dp_buffer_service(sum_len):
    d = _make("all_gather")
    experts = SwiGLUExperts.random(E, D, 24, seed=1)
    x, ids, w = _inputs(6)
    plan = FixedPlan.from_counts([6], 9, is_max_len=not sum_len)
    handle, inputs = d.dispatch(x, ids, w, plan)
    # The experts read the service's pool storage, and write their partials over it.
    assert inputs.hidden_ND.data_ptr() == d.buffers.get_global_buffer().data_ptr()
    assert inputs.hidden_ND.shape[0] == (6 if sum_len else 9)
    assert inputs.expert_ids_NK.data_ptr() == d.buffers.get_global_routing().data_ptr()
    if not sum_len:  # MAX_LEN padding rows carry invalid ids: no expert serves them
        assert (inputs.expert_ids_NK[6:] == INVALID_EXPERT_ID).all()
    assert d.expert_output_buffer(handle).data_ptr() == inputs.hidden_ND.data_ptr()
    out = d.combine(run_local_experts(inputs, experts.local(d.partition, 0), out_ND=d.expert_output_buffer(handle)),
                    handle)
    torch.testing.assert_close(out, reference_moe(x, ids, w, experts, E), rtol=1e-5, atol=1e-5)


def test_backends_satisfy_the_protocols():
    for kind in ("local", *BACKENDS):
        assert isinstance(_make(kind), Dispatcher)
    assert isinstance(FixedPlan.from_counts([1]), StepPlanLike)


def test_only_the_local_combine_is_the_identity():
    # The model folds the next layer's add+RMSNorm into the expert sum only where combine
    # returns that sum unchanged; a backend that moves or reduces rows must say it does not.
    assert [_make(kind).combine_is_identity for kind in ("local", *BACKENDS)] == [True] + [False] * len(BACKENDS)
    d = _make("local")
    x, ids, w = _inputs(3)
    handle, _ = _dispatch(d, x, ids, w, FixedPlan.from_counts([3]))
    out = d.expert_output_buffer(handle).normal_()
    assert d.combine(out, handle) is out


def test_shifted_ids_are_the_local_ids_of_own_picks_and_out_of_range_for_the_rest():
    # The model's expert kernels skip any id outside [0, L) themselves, so they take the
    # received global ids shifted by the rank's first expert instead of the remapped local ids.
    ids = torch.tensor([[0, 5], [7, 3], [4, -1]], dtype=torch.int32)  # -1: a padding row's pick
    for first in (0, 4):  # ranks 0 and 1 of E = 8 over 2 ranks, L = 4
        inputs = ExpertInputs(torch.zeros(3, 2), ids, torch.ones(3, 2), num_local_experts=4, first_expert=first)
        shifted, local = inputs.shifted_expert_ids_NK, inputs.local_expert_ids_NK
        own = local >= 0
        assert torch.equal(shifted[own], local[own]) and int(own.sum()) == {0: 2, 4: 3}[first]
        assert bool(((shifted[~own] < 0) | (shifted[~own] >= 4)).all())
    given = torch.tensor([[1, 2]], dtype=torch.int32)
    inputs = ExpertInputs(torch.zeros(1, 2), given, torch.ones(1, 2), 4, 0, given_local_ids_NK=given)
    assert inputs.shifted_expert_ids_NK is given


def test_handles_are_frozen():
    d = AllToAllDispatcher(_cfg(), device="cpu")
    x, ids, w = _inputs(3)
    handle, _ = d.dispatch(x, ids, w, FixedPlan.from_counts([3]))
    with pytest.raises(AttributeError):
        handle.num_tokens = 7


# ---------------------------------------------------------------- factory


def test_factory_rejects_unknown_kind():
    with pytest.raises(ValueError, match="unknown dispatcher kind 'nccl'"):
        make_dispatcher("nccl", _cfg(), device="cpu")


def test_factory_logs_the_dispatcher_once(caplog):
    caplog.set_level(logging.INFO, logger="dispatcher")
    d = make_dispatcher("local", _cfg(), device="cpu")
    assert isinstance(d, LocalDispatcher)
    lines = [r.getMessage() for r in caplog.records if r.name == "dispatcher"]
    assert len(lines) == 1 and "local" in lines[0]


def test_local_dispatcher_refuses_more_than_one_rank():
    with pytest.raises(ValueError, match="serves one rank; the EP group has 2"):
        LocalDispatcher(_cfg(), EPGroup(group=None, cpu_group=None, rank=0, size=2), device="cpu")


def test_flashinfer_kind_without_flashinfer_says_how_to_install():
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flashinfer is installed here")
    with pytest.raises(ImportError, match="flashinfer-python"):
        make_dispatcher("flashinfer", _cfg(), device="cpu")


# ---------------------------------------------------------------- partition, packing, experts


def test_partition_even_and_uneven():
    even = ExpertPartition(256, 4)
    assert [even.first(r) for r in range(4)] == [0, 64, 128, 192]
    assert even.owner_of(torch.tensor([0, 63, 64, 255])).tolist() == [0, 0, 1, 3]
    # FlashInfer's rule for 10 experts on 4 ranks: ranks 0-1 own 3, ranks 2-3 own 2.
    odd = ExpertPartition(10, 4)
    assert [odd.num_local(r) for r in range(4)] == [3, 3, 2, 2]
    assert [odd.first(r) for r in range(4)] == [0, 3, 6, 8]
    assert odd.owner_of(torch.arange(10)).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    local = odd.local_ids(torch.tensor([[3, 5, 6, -1]]), rank=1)
    assert local.tolist() == [[0, 2, INVALID_EXPERT_ID, INVALID_EXPERT_ID]]
    with pytest.raises(ValueError, match="every EP rank must own"):
        ExpertPartition(3, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [1, 7, 64])
def test_row_packing_round_trips(dtype, hidden):
    layout = RowLayout(hidden, 3, dtype)
    assert layout.row_bytes % 16 == 0
    x = torch.randn(5, hidden).to(dtype)
    ids = torch.randint(-1, 100, (5, 3))
    w = torch.rand(5, 3)
    h2, i2, w2 = layout.views(layout.pack(x, ids, w))
    assert torch.equal(h2, x) and torch.equal(i2, ids.int()) and torch.equal(w2, w)
    empty = layout.views(layout.pack(x[:0], ids[:0], w[:0]))
    assert [t.shape[0] for t in empty] == [0, 0, 0]


def test_run_local_experts_skips_invalid_and_nan_rows():
    experts = SwiGLUExperts.random(2, D, 8)
    x = torch.randn(4, D)
    x[3] = float("nan")  # a padded row full of garbage
    ids = torch.tensor([[0, 1], [1, -1], [-1, -1], [-1, -1]], dtype=torch.int32)
    w = torch.tensor([[0.5, 0.5], [1.0, 7.0], [3.0, 3.0], [float("nan"), 1.0]])
    inputs = ExpertInputs(x, ids, w, num_local_experts=2, first_expert=0)
    sparse = run_local_experts(inputs, experts)
    dense = run_local_experts(inputs, experts, dense=True)
    torch.testing.assert_close(sparse, dense)
    torch.testing.assert_close(sparse[0], 0.5 * experts(x[:1], 0)[0] + 0.5 * experts(x[:1], 1)[0])
    torch.testing.assert_close(sparse[1], experts(x[1:2], 1)[0])
    assert torch.equal(sparse[2:], torch.zeros(2, D))


def test_fixed_plan_fingerprint_is_stable():
    a, b = FixedPlan.from_counts([3, 0, 5]), FixedPlan.from_counts((3, 0, 5))
    assert a == b and a.runtime_max_tokens_per_rank == 5
    assert a.fingerprint != FixedPlan.from_counts([3, 0, 5], 8).fingerprint
