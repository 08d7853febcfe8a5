"""Pieces of the reference model on their own: the rank-local experts (dense loop and grouped
GEMM), RMSNorm and the rotary embedding."""

from __future__ import annotations

import pytest
import torch

from dp_runtime.model.experts import local_expert_sum
from dp_runtime.model.layers import RotaryEmbedding, rms_norm


def _experts(t=9, h=32, i=16, e=4, k=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * i**-0.5).to(dtype)
    logits = torch.randn(t, e, generator=gen)
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return x, ids.to(torch.int32), weights, w13, w2


def _loop_reference(x, ids, weights, w13, w2):
    """Per token and pick, in float64; an id outside [0, L) adds nothing."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


def _grouped_or_skip(*args, **kw):
    try:
        return local_expert_sum(*args, use_grouped_mm=True, **kw)
    except (RuntimeError, NotImplementedError) as e:  # no CPU grouped GEMM in this torch
        pytest.skip(f"torch._grouped_mm unavailable here: {e}")


def test_dense_experts_match_a_per_token_loop():
    x, ids, weights, w13, w2 = _experts()
    got = local_expert_sum(x, ids, weights, w13, w2, use_grouped_mm=False)
    torch.testing.assert_close(got.double(), _loop_reference(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)


def test_grouped_mm_experts_match_dense():
    x, ids, weights, w13, w2 = _experts(t=13, h=64, i=32, e=8, k=3, dtype=torch.bfloat16)
    got = _grouped_or_skip(x, ids, weights, w13, w2)
    want = local_expert_sum(x, ids, weights, w13, w2, use_grouped_mm=False)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("grouped", [False, True])
def test_other_ranks_picks_and_padding_rows_add_nothing_even_when_nan(grouped):
    # A dispatcher marks another rank's picks and padded rows with an id outside [0, L); those
    # rows may hold NaN (uninitialised workspace). They must add exactly nothing, never leak NaN.
    dtype = torch.bfloat16 if grouped else torch.float32
    x, ids, weights, w13, w2 = _experts(t=8, h=64, i=32, e=4, k=2, dtype=dtype, seed=1)
    ids[1, 0] = -1  # one pick served elsewhere
    ids[2, 1] = 4 + 3  # a later rank's expert, as global ids shifted by this rank's first (L = 4)
    ids[5:] = -1  # padded rows
    x[5:] = float("nan")
    weights[5:] = float("nan")
    out = _grouped_or_skip(x, ids, weights, w13, w2) if grouped else local_expert_sum(
        x, ids, weights, w13, w2, use_grouped_mm=False)
    assert torch.isfinite(out).all()
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))
    want = _loop_reference(x[:5].float(), ids[:5], weights[:5], w13.float(), w2.float())
    tol = 3e-2 if grouped else 1e-5
    torch.testing.assert_close(out[:5].double(), want, atol=tol, rtol=tol)


def test_zero_rows_and_the_output_buffer():
    x, ids, weights, w13, w2 = _experts(t=0)
    assert local_expert_sum(x, ids, weights, w13, w2, use_grouped_mm=False).shape == (0, 32)
    x, ids, weights, w13, w2 = _experts(t=5)
    buf = torch.full((5, 32), float("nan"))
    out = local_expert_sum(x, ids, weights, w13, w2, use_grouped_mm=False, out_ND=buf)
    assert out is buf and torch.isfinite(buf).all()


def test_rms_norm_and_rotary():
    x = torch.randn(5, 16)
    y = rms_norm(x, torch.ones(16), 1e-6)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(5), atol=1e-4, rtol=1e-4)
    rope = RotaryEmbedding(8, 32, 10_000.0, "cpu")
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    q0, _ = rope.apply(q, k, torch.zeros(3, dtype=torch.int64))
    torch.testing.assert_close(q0, q)  # position 0 is the identity
    q5, _ = rope.apply(q, k, torch.full((3,), 5))
    torch.testing.assert_close(q5.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps norms
    # relative: <rope(q, m), rope(k, n)> depends on m - n only
    a = (rope.apply(q, k, torch.full((3,), 7))[0][:, :1] * rope.apply(q, k, torch.full((3,), 4))[1]).sum(-1)
    b = (rope.apply(q, k, torch.full((3,), 13))[0][:, :1] * rope.apply(q, k, torch.full((3,), 10))[1]).sum(-1)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_fused_kernel_that_cannot_run_is_logged_once_with_its_reason(caplog):
    """On a CUDA device where the fused kernels cannot serve the dtype, the model falls back to
    torch ops and says which kernels and why, once however often it is asked."""
    import logging

    from dp_runtime.model import fallback_log
    from dp_runtime.model.elementwise_ops import TorchOps, elementwise_ops
    from dp_runtime.model.expert_path import expert_path

    fallback_log._logged.clear()  # "once per process": start from a process that logged none
    caplog.set_level(logging.WARNING, logger="dp_runtime")
    cuda = torch.device("cuda")
    for _ in range(3):
        assert isinstance(elementwise_ops(cuda, torch.float32), TorchOps)
        assert expert_path(cuda, torch.float32, top_k=2, renormalize=True).name == "dense"
    lines = [r.getMessage() for r in caplog.records if r.name == "dp_runtime"]
    norm = [m for m in lines if "RMSNorm" in m]
    moe = [m for m in lines if "fused MoE kernels not used" in m]
    assert len(norm) == 1 and "dtype torch.float32 is not bf16/fp16" in norm[0]
    assert len(moe) == 1 and "torch.float32" in moe[0] and "run dense" in moe[0]


def test_recording_routes_hands_over_each_call_and_changes_nothing():
    from dp_runtime.model.expert_path import expert_path, recording_routes

    path = expert_path(torch.device("cpu"), torch.float32, top_k=2, renormalize=True)
    seen = []
    recorded = recording_routes(path, lambda w, ids: seen.append((w, ids)))
    assert recorded.experts is path.experts and recorded.name == path.name
    for seed in (0, 1):
        logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))
        weights, ids = recorded.route(logits)
        want_w, want_ids = path.route(logits)
        assert torch.equal(weights, want_w) and torch.equal(ids, want_ids)
        assert seen[-1][0] is weights and seen[-1][1] is ids
    assert len(seen) == 2


def test_an_expert_path_without_the_fold_refuses_add_norm():
    from dp_runtime.model.expert_path import expert_path

    path = expert_path(torch.device("cpu"), torch.float32, top_k=2, renormalize=True)
    assert not path.fuses_add_norm
    x, ids, weights, w13, w2 = _experts()
    out = path.experts(x, ids, weights, w13, w2, add_norm=None)
    torch.testing.assert_close(out.double(), _loop_reference(x, ids, weights, w13, w2), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="dense expert path does not fold"):
        path.experts(x, ids, weights, w13, w2, add_norm=(x.clone(), torch.ones(x.shape[1]), 1e-6))
