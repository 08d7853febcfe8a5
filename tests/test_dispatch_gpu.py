"""Dispatchers on GPUs: FlashInfer MoeAlltoAll against the reference and the torch backends,
CUDA-graph capture and replay, and our workspace sizing against FlashInfer's own function.

    pytest -m gpu -p no:cacheprovider tests/test_dispatch_gpu.py                      # sizing, 1 GPU
    torchrun --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider tests/test_dispatch_gpu.py

Multi-rank tests never stop early on one rank: FlashInfer's kernels spin on the GPU when a peer
skips a dispatch, so each test runs all its steps, gathers every rank's errors over the gloo group
and fails on all ranks together. Tests that need flashinfer skip when it is missing.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dispatcher import (
    AllToAllDispatcher,
    DispatcherConfig,
    EPGroup,
    ExpertPartition,
    FixedPlan,
    SwiGLUExperts,
    flashinfer_dispatch_verdict,
    make_dispatcher,
    moe_forward,
    reference_moe,
)
from dispatcher.sizing import (
    flashinfer_aux_bytes,
    flashinfer_combine_bytes_per_token,
    flashinfer_dispatch_bytes_per_token,
    flashinfer_workspace_bytes_per_rank,
)

try:  # FlashInfer JIT-compiles its all-to-all module on first use (minutes when cold)
    import pytest_timeout  # noqa: F401

    JIT_TIMEOUT = pytest.mark.timeout(900)
except ImportError:  # no plugin, no per-test limit to lift

    def JIT_TIMEOUT(fn):
        return fn


from tests.support.gather_buffers import gather_buffers

E, K, D, INTER = 32, 4, 256, 128
MAX_TOKENS = 64
BF16_TOL = dict(rtol=3e-2, atol=3e-2)


# ---------------------------------------------------------------- sizing (one GPU)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("ep_size", "tokens", "hidden", "top_k", "dtype", "extra", "eplb"),
    [
        (2, 128, 4096, 8, torch.bfloat16, 0, 0),
        (4, 8192, 7168, 8, torch.bfloat16, 0, 0),
        (8, 1, 2048, 2, torch.float16, 0, 0),
        (3, 37, 1000, 6, torch.bfloat16, 16, 0),
        (4, 512, 4096, 8, torch.float32, 0, 0),
        (16, 1024, 7168, 22, torch.bfloat16, 0, 256),
        (1, 4096, 64, 1, torch.bfloat16, 0, 0),
    ],
)
@JIT_TIMEOUT
def test_workspace_bytes_match_flashinfer(ep_size, tokens, hidden, top_k, dtype, extra, eplb):
    pytest.importorskip("flashinfer")
    from flashinfer.comm.trtllm_moe_alltoall import (
        MoeAlltoAll,
        get_moe_alltoall_module,
        moe_a2a_get_workspace_size_per_rank,
    )

    ours = flashinfer_workspace_bytes_per_rank(ep_size, tokens, hidden, top_k, dtype, extra, eplb)
    theirs = moe_a2a_get_workspace_size_per_rank(
        ep_size, tokens, flashinfer_dispatch_bytes_per_token(hidden, top_k, dtype, extra),
        flashinfer_combine_bytes_per_token(hidden, dtype), eplb)
    assert ours == theirs
    assert flashinfer_aux_bytes(ep_size, tokens, eplb) == get_moe_alltoall_module().moe_a2a_get_aux_data_size(
        ep_size, tokens, eplb)
    if dtype in (torch.bfloat16, torch.float16):
        # FlashInfer's convenience helper assumes 16-bit hidden states: equal for bf16/fp16.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            helper = MoeAlltoAll.get_moe_workspace_size_per_rank(ep_size, top_k, tokens, hidden, extra, eplb)
        assert ours == helper


# ---------------------------------------------------------------- multi-rank helpers


@pytest.fixture(scope="module")
def ep(dist_group):
    # "cpu:gloo,cuda:nccl" world group; a gloo twin is created for barriers and handle exchange.
    return EPGroup.from_torch(dist_group)


@pytest.fixture(scope="module")
def device(dist_group):
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def experts(device):
    return SwiGLUExperts.random(E, D, INTER, dtype=torch.bfloat16, device=device, seed=7)


@pytest.fixture(scope="module")
def experts_f32(experts):
    return SwiGLUExperts(experts.gate_up_E2ID.float(), experts.down_EDI.float())


def _cfg(**kw) -> DispatcherConfig:
    base = dict(num_experts=E, top_k=K, hidden_size=D, dtype=torch.bfloat16, max_tokens_per_rank=MAX_TOKENS)
    base.update(kw)
    return DispatcherConfig(**base)


@pytest.fixture(scope="module")
def fi_dispatcher(ep, device):
    pytest.importorskip("flashinfer")
    from dispatcher.flashinfer_a2a import FlashInferDispatcher

    d = FlashInferDispatcher(_cfg(), ep, device=device)
    d.warmup()
    yield d
    torch.cuda.synchronize()
    d.close()


def _global_step(counts, seed, device, routing="random", ep_size=1):
    g = torch.Generator().manual_seed(seed)
    total = sum(counts)
    x = torch.randn(total, D, generator=g).to(torch.bfloat16)
    w = torch.rand(total, K, generator=g)
    if total == 0:
        ids = torch.zeros(0, K, dtype=torch.int32)
    elif routing == "skewed":
        part = ExpertPartition(E, ep_size)
        first, count = part.first(ep_size - 1), part.num_local(ep_size - 1)
        ids = torch.stack([first + torch.randperm(count, generator=g)[:K] for _ in range(total)])
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(total)])
    return x.to(device), ids.to(torch.int32).to(device), w.to(device)


def _mine(t, counts, rank):
    start = sum(counts[:rank])
    return t[start: start + counts[rank]]


def _steps(ep_size):
    """(counts, runtime_max, routing) per step: uniform, random, zero-token ranks with padding,
    all idle, skewed to one rank's experts, and a full-capacity step."""
    g = torch.Generator().manual_seed(42)
    rand = torch.randint(1, 40, (ep_size,), generator=g).tolist()
    zero = [0 if r % 2 == 0 else 5 + r for r in range(ep_size)]
    return [
        ([8] * ep_size, None, "random"),
        (rand, None, "random"),
        (zero, max(zero) + 7, "random"),
        ([0] * ep_size, 0, "random"),
        ([12] * ep_size, None, "skewed"),
        ([MAX_TOKENS] * ep_size, None, "random"),
        (rand, MAX_TOKENS, "skewed"),
    ]


def _fail_together(ep, errors):
    """Fail on every rank if any rank collected an error (never leave a peer inside a dispatch)."""
    everyone = ep.all_gather_object(errors)
    bad = [f"rank {r}: {e}" for r, errs in enumerate(everyone) for e in errs]
    assert not bad, "\n".join(bad)


def _compare(errors, what, actual, expected, tol):
    try:
        torch.testing.assert_close(actual.float(), expected.float(), **tol)
    except AssertionError as exc:
        errors.append(f"{what}: {str(exc).splitlines()[0:4]}")


# ---------------------------------------------------------------- multi-rank tests


@pytest.mark.gpu2
@pytest.mark.dist
@JIT_TIMEOUT
def test_auto_picks_flashinfer_on_one_nvlink_node(ep, device):
    pytest.importorskip("flashinfer")
    ok, why = flashinfer_dispatch_verdict(ep, device)
    assert ok, why


@pytest.mark.gpu2
@pytest.mark.dist
@JIT_TIMEOUT
def test_flashinfer_matches_reference_and_torch_backends(ep, device, experts, experts_f32, fi_dispatcher):
    a2a = AllToAllDispatcher(_cfg(), ep, device=device)
    ag = make_dispatcher("all_gather", _cfg(), ep=ep, device=device, buffers=gather_buffers(_cfg(), ep, device))
    local_fn = experts.local(fi_dispatcher.partition, ep.rank)
    errors: list[str] = []
    for step, (counts, runtime_max, routing) in enumerate(_steps(ep.size)):
        plan = FixedPlan.from_counts(counts, runtime_max)
        x, ids, w = _global_step(counts, seed=step, device=device, routing=routing, ep_size=ep.size)
        ref = _mine(reference_moe(x.float(), ids, w, experts_f32, E), counts, ep.rank)
        mine = (_mine(x, counts, ep.rank), _mine(ids, counts, ep.rank), _mine(w, counts, ep.rank))
        out_fi = moe_forward(fi_dispatcher, *mine, plan, local_fn)
        out_fi_dense = moe_forward(fi_dispatcher, *mine, plan, local_fn, dense=True)
        out_a2a = moe_forward(a2a, *mine, plan, local_fn)
        out_ag = moe_forward(ag, *mine, plan, local_fn)
        # SUM_LEN: NCCL's uneven all-gather and reduce-scatter
        sum_plan = FixedPlan.from_counts(counts, runtime_max, is_max_len=False)
        out_ag_sum = moe_forward(ag, *mine, sum_plan, local_fn)
        torch.cuda.synchronize()
        if out_fi.shape != (counts[ep.rank], D):
            errors.append(f"step {step}: flashinfer output shape {tuple(out_fi.shape)}")
            continue
        _compare(errors, f"step {step} flashinfer vs reference", out_fi, ref, BF16_TOL)
        _compare(errors, f"step {step} flashinfer dense vs reference", out_fi_dense, ref, BF16_TOL)
        _compare(errors, f"step {step} flashinfer vs all_to_all", out_fi, out_a2a, BF16_TOL)
        _compare(errors, f"step {step} all_gather vs reference", out_ag, ref, BF16_TOL)
        _compare(errors, f"step {step} all_gather SUM_LEN vs reference", out_ag_sum, ref, BF16_TOL)
    _fail_together(ep, errors)


@pytest.mark.gpu2
@pytest.mark.dist
@JIT_TIMEOUT
def test_flashinfer_refuses_oversized_step_before_communicating(ep, device, fi_dispatcher):
    counts = [4] * ep.size
    x, ids, w = _global_step(counts, seed=1, device=device)
    mine = (_mine(x, counts, ep.rank), _mine(ids, counts, ep.rank), _mine(w, counts, ep.rank))
    with pytest.raises(ValueError, match=f"max_num_tokens={MAX_TOKENS}"):
        fi_dispatcher.dispatch(*mine, FixedPlan.from_counts(counts, MAX_TOKENS + 1))
    # still usable: a normal step after the refused one (every rank refused it)
    handle, _ = fi_dispatcher.dispatch(*mine, FixedPlan.from_counts(counts))
    fi_dispatcher.combine(fi_dispatcher.expert_output_buffer(handle).zero_(), handle)
    torch.cuda.synchronize()


@pytest.mark.gpu2
@pytest.mark.dist
@pytest.mark.parametrize("kind", ["flashinfer", "all_gather"])
@JIT_TIMEOUT
def test_cuda_graph_replays_with_new_inputs(ep, device, experts, experts_f32, kind, request):
    if kind == "flashinfer":
        d = request.getfixturevalue("fi_dispatcher")
    else:
        d = make_dispatcher("all_gather", _cfg(), ep=ep, device=device, buffers=gather_buffers(_cfg(), ep, device))
        d.warmup()
    counts = [6 + 3 * r for r in range(ep.size)]
    counts[0] = 0 if ep.size > 2 else counts[0]  # an idle rank inside the graph when there are 3+
    plan = FixedPlan.from_counts(counts, 16)  # the captured bucket: MAX_LEN slots of 16 rows
    t = counts[ep.rank]
    static_x = torch.zeros(t, D, dtype=torch.bfloat16, device=device)
    static_ids = torch.zeros(t, K, dtype=torch.int32, device=device)
    static_w = torch.zeros(t, K, dtype=torch.float32, device=device)
    local_fn = experts.local(d.partition, ep.rank)

    def fill(seed):
        x, ids, w = _global_step(counts, seed=seed, device=device)
        static_x.copy_(_mine(x, counts, ep.rank))
        static_ids.copy_(_mine(ids, counts, ep.rank))
        static_w.copy_(_mine(w, counts, ep.rank))
        return _mine(reference_moe(x.float(), ids, w, experts_f32, E), counts, ep.rank)

    def step():
        return moe_forward(d, static_x, static_ids, static_w, plan, local_fn, dense=True)

    errors: list[str] = []
    fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            static_out = step()
    except Exception as exc:  # report on every rank, never replay alone
        errors.append(f"capture failed: {type(exc).__name__}: {exc}")
    _fail_together(ep, errors)
    for seed in (1, 2, 3):
        ref = fill(seed)
        graph.replay()
        torch.cuda.synchronize()
        _compare(errors, f"replay seed {seed}", static_out, ref, BF16_TOL)
    # eager after replay: the dispatcher state is still consistent
    eager = step()
    torch.cuda.synchronize()
    _compare(errors, "eager after replays", eager, ref, BF16_TOL)
    del graph
    _fail_together(ep, errors)
