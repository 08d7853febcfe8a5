"""The one-kernel Triton routing (dp_runtime/model/routing_triton.py) against the torch routing
(dp_runtime/model/routing.py): softmax, top-k, renormalisation.

Without a GPU the kernel runs in Triton's CPU interpreter (tests/conftest.py); skipped when
triton is not installed. Weights must match torch within fp32 rounding: both compute
exp(x - max) / sum in fp32 and differ in the summation order and the exp. torch calls an
accurate expf; Triton on NVIDIA GPUs multiplies by log2(e) and takes the hardware's approximate
exp2 (relative error about 2^-22, plus 2^-24 per unit of |x - max| from the multiply), which for
the top-k weights of a router stays below 2^-20. The tolerance is rtol 2^-18 (32 ulp). Ids are
compared exactly where probabilities cannot tie (fp32 logits); with bf16 logits ties are common,
so there the check is that each chosen id carries the probability torch reports at its rank.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dp_runtime.model.routing import PADDING_ID, softmax_topk
from dp_runtime.model.routing_triton import softmax_topk_triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
RTOL, ATOL = 2.0**-18, 2.0**-30


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (7, 8, 8), (64, 60, 4), (33, 128, 8)])
def test_fp32_logits_match_torch(num_tokens, num_experts, top_k, renormalize):
    g = torch.Generator(device=DEVICE).manual_seed(num_tokens * num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=g, device=DEVICE) * 3
    weights, ids = softmax_topk_triton(logits, top_k, renormalize=renormalize)
    ref_w, ref_ids = softmax_topk(logits, top_k, renormalize=renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    torch.testing.assert_close(weights, ref_w, rtol=RTOL, atol=ATOL)
    assert torch.equal(ids, ref_ids)


@pytest.mark.parametrize("renormalize", [True, False])
def test_bf16_logits_pick_a_valid_top_k(renormalize):
    g = torch.Generator(device=DEVICE).manual_seed(1)
    logits = torch.randn(64, 128, generator=g, device=DEVICE).bfloat16()
    weights, ids = softmax_topk_triton(logits, 8, renormalize=renormalize)
    ref_w, _ = softmax_topk(logits, 8, renormalize=renormalize)
    torch.testing.assert_close(weights, ref_w, rtol=RTOL, atol=ATOL)
    probs = torch.softmax(logits.float(), dim=-1)
    # The chosen experts carry the top-k probabilities (ties may swap equal ones) and are distinct.
    torch.testing.assert_close(probs.gather(1, ids.long()), torch.topk(probs, 8).values, rtol=RTOL, atol=ATOL)
    assert bool((ids.sort(1).values.diff(dim=1) > 0).all())


def test_ties_take_the_lowest_expert_first():
    logits = torch.zeros(3, 8, device=DEVICE)
    logits[1, 5] = logits[1, 2] = 1.0
    weights, ids = softmax_topk_triton(logits, 3, renormalize=False)
    assert ids.tolist()[0] == [0, 1, 2] and ids.tolist()[1] == [2, 5, 0]
    torch.testing.assert_close(weights[0], torch.full((3,), 1 / 8, device=DEVICE), rtol=RTOL, atol=ATOL)


def test_underflowed_probabilities_still_pick_real_experts():
    # 60 experts (padded to 64 lanes): all but two probabilities underflow to 0.
    logits = torch.full((2, 60), -1000.0, device=DEVICE)
    logits[:, 40] = logits[:, 7] = 0.0
    weights, ids = softmax_topk_triton(logits, 4, renormalize=True)
    assert ids.tolist() == [[7, 40, 0, 1]] * 2
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 2, device=DEVICE))


def test_no_tokens_and_strided_logits():
    empty_w, empty_ids = softmax_topk_triton(torch.empty(0, 8, device=DEVICE), 2, renormalize=True)
    assert empty_w.shape == (0, 2) and empty_ids.shape == (0, 2)
    wide = torch.randn(5, 24, device=DEVICE)
    logits = wide[:, 4:20]  # row stride 24
    weights, ids = softmax_topk_triton(logits, 4, renormalize=True)
    ref_w, ref_ids = softmax_topk(logits, 4, renormalize=True)
    torch.testing.assert_close(weights, ref_w, rtol=RTOL, atol=ATOL)
    assert torch.equal(ids, ref_ids)


@pytest.mark.parametrize("live", [0, 3, 9])
def test_rows_past_live_rows_are_padding_in_both_paths(live):
    """``live_rows`` (a device count, as a graph's ``num_token_non_padded``): rows from it on get
    the padding id and weight 0 in the kernel and in torch; the rows before it are unchanged."""
    g = torch.Generator(device=DEVICE).manual_seed(live)
    logits = torch.randn(9, 16, generator=g, device=DEVICE) * 3
    count = torch.tensor([live], dtype=torch.int32, device=DEVICE)
    full_w, full_ids = softmax_topk(logits, 4, renormalize=True)
    for fn in (softmax_topk_triton, softmax_topk):
        weights, ids = fn(logits, 4, renormalize=True, live_rows=count)
        torch.testing.assert_close(weights[:live], full_w[:live], rtol=RTOL, atol=ATOL)
        assert torch.equal(ids[:live], full_ids[:live]) and ids.dtype == torch.int32
        assert (ids[live:] == PADDING_ID).all() and (weights[live:] == 0).all()


def test_bad_top_k_and_shape_are_refused():
    with pytest.raises(ValueError, match="top_k=9"):
        softmax_topk_triton(torch.zeros(2, 8, device=DEVICE), 9, renormalize=True)
    with pytest.raises(ValueError, match="logits_TE"):
        softmax_topk_triton(torch.zeros(8, device=DEVICE), 2, renormalize=True)


@pytest.mark.gpu
def test_gpu_real_shape_matches_torch():
    g = torch.Generator(device="cuda").manual_seed(2)
    logits = torch.randn(2048, 128, generator=g, device="cuda")
    weights, ids = softmax_topk_triton(logits, 8, renormalize=True)
    ref_w, ref_ids = softmax_topk(logits, 8, renormalize=True)
    torch.testing.assert_close(weights, ref_w, rtol=RTOL, atol=ATOL)
    assert torch.equal(ids, ref_ids)
