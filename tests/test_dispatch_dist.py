"""All-gather and all-to-all dispatchers on CPU with gloo, one process per rank (torchrun).

    torchrun --nproc-per-node 2 -m pytest -m dist -p no:cacheprovider tests/test_dispatch_dist.py
    torchrun --nproc-per-node 4 -m pytest -m dist -p no:cacheprovider tests/test_dispatch_dist.py

Every rank builds every rank's tokens from the same seed, so each can compute the global reference
(every expert on every token, locally) and compare its own slice, in float32 with a tight tolerance.
"""

from __future__ import annotations

import datetime
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dp_runtime.sync.dp_gather as gather_mod
from dispatcher import (
    AllToAllDispatcher,
    DispatcherConfig,
    DispatcherStartupError,
    EPGroup,
    ExpertPartition,
    FixedPlan,
    SwiGLUExperts,
    flashinfer_dispatch_verdict,
    make_dispatcher,
    moe_forward,
    reference_moe,
    run_local_experts,
)
from tests.support.gather_buffers import gather_buffers

pytestmark = pytest.mark.dist

E, K, D, INTER = 16, 3, 32, 24
KINDS = ["all_gather", "all_to_all"]


def _cfg(**kw) -> DispatcherConfig:
    base = dict(num_experts=E, top_k=K, hidden_size=D, dtype=torch.float32, max_tokens_per_rank=64)
    base.update(kw)
    return DispatcherConfig(**base)


def _make(kind: str, cfg: DispatcherConfig, ep: EPGroup):
    extra = {"buffers": gather_buffers(cfg, ep)} if kind == "all_gather" else {}
    return make_dispatcher(kind, cfg, ep=ep, device="cpu", **extra)


def _moe(d, x, ids, w, plan, fn, *, dense: bool = False):
    return moe_forward(d, x, ids, w, plan, fn, dense=dense)


def _global_step(counts, seed, routing="random", ep_size=1, k=K):
    """Every rank's tokens and routing (identical on all ranks for the same seed)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(counts)
    x = torch.randn(total, D, generator=g)
    w = torch.rand(total, k, generator=g)
    if total == 0:
        ids = torch.zeros(0, k, dtype=torch.long)
    elif routing == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(total)])
    elif routing == "skewed":
        # Every token to the last rank's experts (which must be >= k of them).
        part = ExpertPartition(E, ep_size)
        first, count = part.first(ep_size - 1), part.num_local(ep_size - 1)
        ids = torch.stack([first + torch.randperm(count, generator=g)[:k] for _ in range(total)])
    else:
        raise ValueError(routing)
    return x, ids, w


def _mine(t: torch.Tensor, counts, rank):
    start = sum(counts[:rank])
    return t[start: start + counts[rank]]


@pytest.fixture(scope="module")
def ep(dist_group):
    return EPGroup.from_torch(dist_group)


@pytest.fixture(scope="module")
def experts():
    return SwiGLUExperts.random(E, D, INTER, seed=7)


def _scenario_counts(name: str, world: int, rank_seed: int = 0):
    if name == "uniform":
        return [5] * world, None
    if name == "random":
        g = torch.Generator().manual_seed(100 + rank_seed)
        return torch.randint(1, 12, (world,), generator=g).tolist(), None
    if name == "zero_ranks":
        counts = [0 if r % 2 == 0 else 4 + r for r in range(world)]
        return counts, max(counts) + 3  # padded beyond the largest rank
    if name == "all_zero":
        return [0] * world, 0
    raise ValueError(name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scenario", ["uniform", "random", "zero_ranks", "all_zero"])
@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_matches_global_reference(ep, experts, kind, scenario, routing):
    d = _make(kind, _cfg(), ep)
    counts, runtime_max = _scenario_counts(scenario, ep.size)
    x, ids, w = _global_step(counts, seed=11, routing=routing, ep_size=ep.size)
    ref = reference_moe(x, ids, w, experts, E)
    local_fn = experts.local(d.partition, ep.rank)
    for dense, sum_len in ((False, False), (True, False), (False, True)):
        plan = FixedPlan.from_counts(counts, runtime_max, is_max_len=not sum_len)
        out = _moe(d, _mine(x, counts, ep.rank), _mine(ids, counts, ep.rank), _mine(w, counts, ep.rank),
                   plan, local_fn, dense=dense)
        assert out.shape == (counts[ep.rank], D)
        torch.testing.assert_close(out, _mine(ref, counts, ep.rank), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_many_steps_with_changing_plans(ep, experts, kind):
    d = _make(kind, _cfg(), ep)
    d.warmup()
    local_fn = experts.local(d.partition, ep.rank)
    for step in range(6):
        g = torch.Generator().manual_seed(step)
        counts = torch.randint(0, 9, (ep.size,), generator=g).tolist()
        # Odd steps SUM_LEN: the all-gather dispatcher lays its buffers out from each plan.
        plan = FixedPlan.from_counts(counts, max(counts) + step % 3, is_max_len=step % 2 == 0)
        x, ids, w = _global_step(counts, seed=step)
        ref = reference_moe(x, ids, w, experts, E)
        out = _moe(d, _mine(x, counts, ep.rank), _mine(ids, counts, ep.rank),
                   _mine(w, counts, ep.rank), plan, local_fn)
        torch.testing.assert_close(out, _mine(ref, counts, ep.rank), rtol=1e-5, atol=1e-5)


def test_all_to_all_sends_each_token_once_per_destination_rank(ep):
    d = AllToAllDispatcher(_cfg(), ep, device="cpu")
    t = 4
    # Token 0 picks three experts of rank 0; token 1 one expert on each of up to three ranks.
    part = d.partition
    ids = torch.tensor([[0, 1, 2], [0, part.first(1 % ep.size), part.first(2 % ep.size)], [0, 1, 2], [3, 2, 1]])
    x, w = torch.randn(t, D), torch.rand(t, K)
    plan = FixedPlan.uniform(ep.size, t)
    handle, inputs = d.dispatch(x, ids, w, plan)
    distinct_ranks_token1 = len({0, 1 % ep.size, 2 % ep.size})
    assert sum(handle.send_counts) == 3 + distinct_ranks_token1
    assert handle.send_counts[0] == t
    # Rank 0 receives each token of every rank exactly once.
    if ep.rank == 0:
        assert inputs.num_rows == t * ep.size
    d.combine(d.expert_output_buffer(handle).zero_(), handle)


def test_all_gather_and_all_to_all_agree(ep, experts):
    counts = [3 + 2 * r for r in range(ep.size)]
    counts[-1] = 0
    plan = FixedPlan.from_counts(counts)
    x, ids, w = _global_step(counts, seed=5)
    outs = []
    for kind in ("all_gather", "all_to_all"):
        d = _make(kind, _cfg(), ep)
        outs.append(_moe(d, _mine(x, counts, ep.rank), _mine(ids, counts, ep.rank),
                         _mine(w, counts, ep.rank), plan, experts.local(d.partition, ep.rank)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sum_len", [False, True])
def test_all_gather_moves_what_the_padding_mode_says(ep, experts, monkeypatch, sum_len):
    """The gathers and the combine hand torch.distributed exactly the rows the layout names:
    SUM_LEN the live rows only (sum of the counts), MAX_LEN every rank's padded slot; and the
    experts read the service's pool storage (same data pointer), nowhere else."""
    moved = []
    real = gather_mod.all_to_all_v

    def spy(out, inp, out_splits, in_splits, group=None):
        moved.append((sum(out_splits), sum(in_splits)))
        real(out, inp, out_splits, in_splits, group)

    monkeypatch.setattr(gather_mod, "all_to_all_v", spy)
    real_gather = gather_mod.all_gather_into

    def spy_gather(out, inp, group=None, async_op=False):
        moved.append((out.shape[0], inp.shape[0] * ep.size))
        return real_gather(out, inp, group=group, async_op=async_op)

    monkeypatch.setattr(gather_mod, "all_gather_into", spy_gather)
    d = _make("all_gather", _cfg(), ep)
    d.warmup()
    counts = [1 + 2 * r for r in range(ep.size)]
    padded = max(counts) + 3
    plan = FixedPlan.from_counts(counts, padded, is_max_len=not sum_len)
    x, ids, w = _global_step(counts, seed=4)
    mine = (_mine(x, counts, ep.rank), _mine(ids, counts, ep.rank), _mine(w, counts, ep.rank))
    moved.clear()
    handle, inputs = d.dispatch(*mine, plan)
    assert inputs.hidden_ND.data_ptr() == d.buffers.get_global_buffer().data_ptr()
    assert inputs.expert_ids_NK.data_ptr() == d.buffers.get_global_routing().data_ptr()
    gathered = sum(counts) if sum_len else padded * ep.size
    assert inputs.num_rows == gathered
    out = d.combine(run_local_experts(inputs, experts.local(d.partition, ep.rank),
                                      out_ND=d.expert_output_buffer(handle)), handle)
    torch.testing.assert_close(out, _mine(reference_moe(x, ids, w, experts, E), counts, ep.rank),
                               rtol=1e-5, atol=1e-5)
    if ep.size == 1:
        assert moved == []  # one rank: copies, no collective
        return
    # hidden and routing gathers: every rank receives `gathered` rows of each
    assert [m[0] for m in moved[:2]] == [gathered, gathered]
    # combine: each rank is sent its live rows by every rank, and sends each peer only the peer's
    assert moved[2] == (counts[ep.rank] * ep.size, sum(counts))


@pytest.mark.parametrize("kind", KINDS)
def test_refused_step_leaves_the_group_usable(ep, experts, kind):
    d = _make(kind, _cfg(max_tokens_per_rank=8), ep)
    counts = [4] * ep.size
    x, ids, w = _global_step(counts, seed=3)
    mine = (_mine(x, counts, ep.rank), _mine(ids, counts, ep.rank), _mine(w, counts, ep.rank))
    with pytest.raises(ValueError, match="max_num_tokens=8"):
        d.dispatch(*mine, FixedPlan.from_counts(counts, 9))
    # Another rank holding more tokens than the runtime max: refused on every rank, from the plan.
    bad = list(counts)
    bad[(ep.rank + 1) % ep.size] = 6
    with pytest.raises(ValueError, match="below the largest rank's tokens"):
        d.dispatch(*mine, FixedPlan((*bad,), 5, 0) if ep.size > 1 else FixedPlan((4,), 3, 0))
    out = _moe(d, *mine, FixedPlan.from_counts(counts), experts.local(d.partition, ep.rank))
    torch.testing.assert_close(out, _mine(reference_moe(x, ids, w, experts, E), counts, ep.rank),
                               rtol=1e-5, atol=1e-5)


def test_first_step_detects_plan_disagreement(ep):
    d = AllToAllDispatcher(_cfg(), ep, device="cpu")
    counts = [2] * ep.size
    x, ids, w = _global_step(counts, seed=1)
    plan = FixedPlan(tuple(counts), 2, fingerprint=1000 + ep.rank)  # each rank a different fingerprint
    if ep.size == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(ValueError, match="EP ranks disagree on the step plan"):
        d.dispatch(_mine(x, counts, ep.rank), _mine(ids, counts, ep.rank), _mine(w, counts, ep.rank), plan)


def test_slow_peer_fails_on_the_host_with_a_clear_error(ep):
    if ep.size == 1:
        pytest.skip("needs two ranks")
    # A throwaway gloo group: a failed monitored_barrier aborts its connections.
    scratch = dist.new_group(ranks=list(range(ep.size)), backend="gloo")
    slow_ep = EPGroup(group=ep.group, cpu_group=scratch, rank=ep.rank, size=ep.size)
    d = AllToAllDispatcher(_cfg(first_step_timeout_s=0.5), slow_ep, device="cpu")
    start = time.monotonic()
    if ep.rank == 1:
        time.sleep(2.0)
    with pytest.raises(DispatcherStartupError) as err:
        d.warmup()
    msg = str(err.value)
    assert "within 0.5 s" in msg and "first_step_timeout_s" in msg
    if ep.rank == 0:
        assert "Rank 1" in msg or "Ranks 1" in msg  # torch's report names the late rank
        assert time.monotonic() - start < 10
    dist.monitored_barrier(ep.cpu_group, timeout=datetime.timedelta(seconds=60))


def test_flashinfer_verdict_on_cpu_is_no_and_says_why(ep):
    ok, why = flashinfer_dispatch_verdict(ep, torch.device("cpu"))
    assert not ok and ("not CUDA" in why or "world size 1" in why)


# ---------------------------------------------------------------- FlashInfer wrapper, emulated


@pytest.fixture
def emulated_flashinfer(monkeypatch):
    """FlashInferDispatcher over a CPU emulator of MoeAlltoAll (tests/moe_alltoall_emulator.py):
    our wrapper's logic runs for real; FlashInfer's kernels are replaced by gloo collectives."""
    sys.path.insert(0, str(Path(__file__).parent))
    import moe_alltoall_emulator as emu

    import dispatcher.flashinfer_a2a as fa

    api = fa._FlashInferApi(MoeAlltoAll=emu.MoeAlltoAll, Mapping=emu.Mapping, MnnvlConfig=emu.MnnvlConfig,
                            TorchDistBackend=emu.TorchDistBackend)
    monkeypatch.setattr(fa, "import_flashinfer_moe_a2a", lambda: api)
    monkeypatch.setattr(fa, "check_cuda_device", lambda device: None)
    return fa.FlashInferDispatcher


FI_K = 4  # a top-k FlashInfer's combine is built for


@pytest.mark.parametrize("scenario", ["uniform", "random", "zero_ranks", "all_zero"])
@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_flashinfer_wrapper_matches_reference_emulated(ep, experts, emulated_flashinfer, scenario, routing):
    d = emulated_flashinfer(_cfg(top_k=FI_K), ep, device="cpu")
    assert d.workspace_bytes_per_rank() == d.moe_alltoall.workspace_size_per_rank
    counts, runtime_max = _scenario_counts(scenario, ep.size)
    plan = FixedPlan.from_counts(counts, runtime_max)
    x, ids, w = _global_step(counts, seed=13, routing=routing, ep_size=ep.size, k=FI_K)
    ref = reference_moe(x, ids, w, experts, E)
    local_fn = experts.local(d.partition, ep.rank)
    mine = (_mine(x, counts, ep.rank), _mine(ids, counts, ep.rank), _mine(w, counts, ep.rank))
    for dense in (False, True):
        out = moe_forward(d, *mine, plan, local_fn, dense=dense)
        torch.testing.assert_close(out, _mine(ref, counts, ep.rank), rtol=1e-5, atol=1e-5)
        if plan.runtime_max_tokens_per_rank > 0:
            assert d.moe_alltoall.last_in_workspace is True  # experts wrote into the workspace
    # Outputs in a tensor of our own: combine stages them (payload_in_workspace=False).
    handle, inputs = d.dispatch(*mine, plan)
    own = run_local_experts(inputs, local_fn)
    torch.testing.assert_close(d.combine(own, handle), _mine(ref, counts, ep.rank), rtol=1e-5, atol=1e-5)
    if plan.runtime_max_tokens_per_rank > 0:
        assert d.moe_alltoall.last_in_workspace is False


def test_flashinfer_wrapper_handle_discipline_emulated(ep, emulated_flashinfer):
    d = emulated_flashinfer(_cfg(top_k=FI_K), ep, device="cpu")
    counts = [3] * ep.size
    x, ids, w = _global_step(counts, seed=2, k=FI_K)
    mine = (_mine(x, counts, ep.rank), _mine(ids, counts, ep.rank), _mine(w, counts, ep.rank))
    plan = FixedPlan.from_counts(counts)
    handle, _ = d.dispatch(*mine, plan)
    with pytest.raises(RuntimeError, match="dispatch called twice without combine"):
        d.dispatch(*mine, plan)
    d.combine(d.expert_output_buffer(handle).zero_(), handle)
    with pytest.raises(ValueError, match="is not the dispatch in flight"):
        d.combine(torch.zeros(ep.size * 3, D), handle)
    with pytest.raises(ValueError, match="supports top_k in"):
        emulated_flashinfer(_cfg(top_k=3), ep, device="cpu")
