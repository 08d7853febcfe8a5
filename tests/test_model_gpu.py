"""The reference model on one GPU in bf16: transformers' greedy reference, FlashInfer and SDPA
attention, identical tokens with CUDA graphs and without."""

from __future__ import annotations

import importlib.util

import pytest

from tests.hf_reference import greedy_reference, load_reference, write_tiny_checkpoint
from tests.model_gpu_checks import NEW, compare_to_reference, prompts_for, run

pytestmark = pytest.mark.gpu

ATTENTION = ["sdpa"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])


@pytest.fixture(scope="module")
def ckpt_and_refs(tmp_path_factory):
    pytest.importorskip("transformers")
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_gpu"), head_dim=64)
    hf = load_reference(ckpt)
    return ckpt, {f"p{i}": greedy_reference(hf, p, NEW) for i, p in prompts_for(0, 1)}


@pytest.mark.parametrize("attention", ATTENTION)
def test_bf16_graphs_and_eager_agree_and_match_transformers(ckpt_and_refs, attention):
    ckpt, refs = ckpt_and_refs
    eager = run(ckpt, rank=0, world=1, graphs=False, attention=attention, dispatcher="all_gather")
    graph = run(ckpt, rank=0, world=1, graphs=True, attention=attention, dispatcher="all_gather")
    assert graph[2]["graph_steps"] > 0 and eager[2]["graph_steps"] == 0
    assert graph[2]["attention"] == attention
    assert graph[0] == eager[0]  # identical greedy tokens with graphs and without
    assert compare_to_reference(*graph[:2], refs) == []
    assert compare_to_reference(*eager[:2], refs) == []


@pytest.mark.parametrize("yarn", [False, True], ids=["rope", "yarn"])
def test_flashinfer_elementwise_ops_match_torch(yarn):
    pytest.importorskip("flashinfer")
    import torch

    from dp_runtime.model.elementwise_ops import FlashInferOps, TorchOps
    from dp_runtime.model.layers import RotaryEmbedding
    from dp_runtime.model.model_config import YarnScaling

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 6, 128, device="cuda", generator=g).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(128, device="cuda", generator=g)).to(torch.bfloat16)
    fused, ref = FlashInferOps(), TorchOps()
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6), rtol=2e-2, atol=2e-2)
    # YaRN reaches FlashInfer's kernel through the cos/sin table (frequencies and attention factor).
    scaling = YarnScaling(factor=4.0, original_max_position_embeddings=1024, attention_factor=1.1386) if yarn else None
    rotary = RotaryEmbedding(128, 4096, 1e6, "cuda", yarn=scaling)
    pos = torch.randint(0, 4096, (37,), device="cuda", generator=g)
    q, k = x[:, :4], x[:, 4:]  # strided views, as the fused QKV split gives them
    for a, b in zip(fused.rope(rotary, q, k, pos), ref.rope(rotary, q, k, pos), strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
    # An IDLE rank's eager forward has zero rows: both must return empty tensors, not fail.
    assert fused.rms_norm(x[:0], w, 1e-6).shape == (0, 6, 128)
    assert [t.shape for t in fused.rope(rotary, q[:0], k[:0], pos[:0])] == [(0, 4, 128), (0, 2, 128)]
