"""The fused q/k norm + RoPE + KV store kernel against the separate torch ops.

Without a GPU the kernel runs in Triton's CPU interpreter (tests/conftest.py sets
TRITON_INTERPRET), whose fp32 -> bf16 casts truncate instead of rounding to nearest: there the
comparison allows two bf16 units in the last place (of the head's largest element). On a GPU
(``-m gpu``) one unit: the kernel rounds at the same points as the separate ops, but sums the
squares of the norm in another order (and may fuse a multiply-add), which moves the fp32 value
by a few fp32 ulps and, rarely, the bf16 result by one.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dp_runtime.model.layers import RotaryEmbedding
from dp_runtime.model.model_config import YarnScaling
from dp_runtime.model.qk_norm_rope import qk_norm_rope_store, qk_norm_rope_store_reference
from tests.support.triton_builds import compiled_variants


def _case(t, hq, hkv, d, *, dtype, device, norm=True, yarn=None, seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(t, width + (16 if strided else 0), generator=g).to(dtype)
    qkv = qkv[:, :width] if strided else qkv  # a row stride wider than the row, as a fused GEMM's slice
    qn = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if norm else None
    kn = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype) if norm else None
    rot = RotaryEmbedding(d, 64, 10000.0, "cpu", yarn=yarn)
    pos = torch.randint(0, 64, (t,), generator=g)
    slots = 3 * t + 4
    loc = torch.randperm(slots, generator=g)[:t]
    caches = [torch.full((slots, hkv, d), float("nan")).to(dtype) for _ in range(4)]
    move = {"device": device}
    args = [x.to(**move) if x is not None else None for x in (qkv, qn, kn)]
    rot.cos_sin_PD = rot.cos_sin_PD.to(device)
    return args, rot, pos.to(device), loc.to(device), [c.to(device) for c in caches]


def _check(device, tol_ulps, **kw):
    (qkv, qn, kn), rot, pos, loc, (kc, vc, kc_ref, vc_ref) = _case(device=device, **kw)
    geo = dict(num_heads=kw["hq"], num_kv_heads=kw["hkv"], head_dim=kw["d"], eps=1e-6)
    q, k = qk_norm_rope_store(qkv, qn, kn, rot.cos_sin_PD, pos, loc, kc, vc, **geo)
    q_ref, k_ref = qk_norm_rope_store_reference(qkv, qn, kn, rot, pos, loc, kc_ref, vc_ref, **geo)
    for got, want in ((q, q_ref), (k, k_ref), (kc[loc], kc_ref[loc])):
        diff = (got.float() - want.float()).abs()
        # a unit in the last place of the head's largest element: rotation mixes the halves, so
        # a truncated input shows up in outputs near zero at the scale of the inputs
        ulp = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3) * 2.0 ** -7
        assert bool((diff <= tol_ulps * ulp).all()), f"max diff {diff.max().item()}"
    assert torch.equal(vc[loc], vc_ref[loc])  # V is copied, never rounded
    untouched = torch.ones(kc.shape[0], dtype=torch.bool, device=kc.device)
    untouched[loc] = False
    assert torch.isnan(kc[untouched].float()).all()  # only the step's slots were written


@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(1, 4, 2, 8), (7, 8, 2, 16), (5, 4, 4, 32)])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_the_separate_ops(t, hq, hkv, d, norm):
    _check("cpu", 2, t=t, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, norm=norm)


def test_strided_rows_yarn_and_float32():
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=16)
    _check("cpu", 2, t=6, hq=4, hkv=2, d=16, dtype=torch.bfloat16, strided=True, yarn=yarn)
    _check("cpu", 1e-3, t=3, hq=2, hkv=1, d=8, dtype=torch.float32)


@pytest.mark.parametrize("norm", [True, False])
def test_token_blocks_of_prefill_steps(norm, monkeypatch):
    # Large steps take 16 tokens per program; 37 tokens leave a partial last block whose masked
    # rows must write nothing (the NaN-filled cache checks the slots outside the step).
    from dp_runtime.model import qk_norm_rope

    monkeypatch.setattr(qk_norm_rope, "_BLOCK_T_FROM", 1)
    _check("cpu", 2, t=37, hq=4, hkv=2, d=16, dtype=torch.bfloat16, norm=norm)


def test_no_tokens_is_no_launch():
    q, k = qk_norm_rope_store(torch.empty(0, 64), None, None, torch.zeros(4, 8), torch.empty(0, dtype=torch.long),
                              torch.empty(0, dtype=torch.long), torch.empty(1, 2, 8), torch.empty(1, 2, 8),
                              num_heads=4, num_kv_heads=2, head_dim=8, eps=1e-6)
    assert q.shape == (0, 4, 8) and k.shape == (0, 2, 8)


@pytest.mark.gpu
@pytest.mark.parametrize(("t", "hq", "hkv", "d"), [(1, 32, 4, 128), (64, 32, 4, 128), (300, 16, 2, 64), (2100, 32, 4, 128)])
def test_within_one_bf16_ulp_on_the_gpu(t, hq, hkv, d):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _check("cuda", 1, t=t, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16)
    yarn = YarnScaling(factor=4.0, original_max_position_embeddings=16)
    _check("cuda", 1, t=t, hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, yarn=yarn, strided=True)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [(3, 1, 16, 17, 63), (64, 128, 1030, 1041, 2048)],
                         ids=["one-token-programs", "token-blocks"])
def test_one_build_serves_every_token_count(counts):
    # Triton specializes an integer argument on == 1 and on divisibility by 16 unless told not
    # to: a prompt whose length fell in a class no earlier step had would build the kernel again
    # inside its own step (about a second of its time to first token).
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dp_runtime.model.qk_norm_rope import _qk_norm_rope_store_kernel

    _check("cuda", 1, t=counts[0], hq=32, hkv=4, d=128, dtype=torch.bfloat16)
    built = compiled_variants(_qk_norm_rope_store_kernel)
    for t in counts[1:]:
        _check("cuda", 1, t=t, hq=32, hkv=4, d=128, dtype=torch.bfloat16)
    assert compiled_variants(_qk_norm_rope_store_kernel) == built
