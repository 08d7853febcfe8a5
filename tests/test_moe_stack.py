"""The compact MoE stack used by the graph tests and the decode benchmark: experts and layers."""

from __future__ import annotations

import pytest
import torch

from dp_runtime.model.experts import routed_experts
from dp_runtime.model.layers import RotaryEmbedding, rms_norm


def _experts(t=9, h=32, i=16, e=4, k=2, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * i**-0.5).to(dtype)
    logits = torch.randn(t, e, generator=gen)
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    return x, ids, weights, w13, w2


def _loop_reference(x, ids, weights, w13, w2):
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += weights[t, j].double() * (w2[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


def test_dense_experts_match_a_per_token_loop():
    x, ids, weights, w13, w2 = _experts()
    got = routed_experts(x, ids, weights, w13, w2, use_grouped_mm=False)
    torch.testing.assert_close(got.double(), _loop_reference(x, ids, weights, w13, w2), atol=1e-5, rtol=1e-5)


def test_grouped_mm_experts_match_dense():
    x, ids, weights, w13, w2 = _experts(t=13, h=64, i=32, e=8, k=3, dtype=torch.bfloat16)
    try:
        got = routed_experts(x, ids, weights, w13, w2, use_grouped_mm=True)
    except (RuntimeError, NotImplementedError) as e:  # no CPU grouped GEMM in this torch
        pytest.skip(f"torch._grouped_mm unavailable here: {e}")
    want = routed_experts(x, ids, weights, w13, w2, use_grouped_mm=False)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)


def test_zero_tokens():
    x, ids, weights, w13, w2 = _experts(t=0)
    assert routed_experts(x, ids, weights, w13, w2, use_grouped_mm=True).shape == (0, 32)


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
