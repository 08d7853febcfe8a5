"""The FP8 kernels on a GPU against their references (docs/model.md, "FP8 weights").

Both forms of ``fp8_tile`` are tested. Tolerances, stated once: an output element may differ
from its form's exact reference by 2% of the output's largest magnitude (fp32 accumulation
order, bf16 rounding of the output and, in W8A16, of the scaled weight tile). W8A16's exact
reference is the float one (the dequantized weight times the activation); W8A8's rounds the
activation per 1x128 group as ``fp8_act_quant.quantize_act`` does (``fake_quant_activations``). Against the float
reference the relative error of the whole output (Frobenius) stays under 2% for W8A16 and 6%
for W8A8 (e4m3 keeps 3 mantissa bits); the fused MoE's two GEMMs, under 3% and 8%.
"""

from __future__ import annotations

import pytest
import torch

from dp_runtime.model.fp8_blocks import Fp8BlockWeight, fake_quant_activations

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 tensor cores need sm89+", allow_module_level=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("w8a8", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("m", [1, 17, 65, 1024])
@pytest.mark.parametrize(("n", "k"), [(5120, 2048), (2048, 4096), (192, 200), (256, 64)])
def test_fp8_linear_matches_the_references(m, n, k, w8a8):
    from dp_runtime.model.fp8_gemm_triton import fp8_block_linear

    g = torch.Generator(device="cuda").manual_seed(m * 7 + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    w = Fp8BlockWeight.quantize(torch.randn(n, k, device="cuda", generator=g) * k ** -0.5)
    y = fp8_block_linear(x, w, w8a8=w8a8)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    deq = w.dequantize()
    exact = (fake_quant_activations(x) if w8a8 else x.float()) @ deq.T
    assert (y.float() - exact).abs().max().item() <= 0.02 * exact.abs().max().item()
    assert _rel(y, x.float() @ deq.T) < (0.06 if w8a8 else 0.02)


@pytest.mark.parametrize(("m", "k"), [(1, 2048), (300, 768), (33, 200)])
def test_quantize_act_rounds_as_the_reference(m, k):
    """``quantize_act``'s values times its scales are ``fake_quant_activations`` (a value at a
    rounding boundary may land one e4m3 step away: the kernel's fp32 division is not IEEE's)."""
    from dp_runtime.model.fp8_act_quant import quantize_act

    x = torch.randn(m, k, device="cuda", generator=torch.Generator(device="cuda").manual_seed(k))
    x = (x * torch.linspace(0.01, 30, k, device="cuda")).to(torch.bfloat16)
    q, s = quantize_act(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k) and s.shape == (-(-k // 128), m)
    got = q.float() * s.t().repeat_interleave(128, dim=1)[:, :k]
    ref = fake_quant_activations(x)
    assert (got == ref).float().mean().item() > 0.999
    assert ((got - ref).abs() <= ref.abs() / 8 + 1e-30).all()  # at most one e4m3 step (2^-3)
    amax = torch.nn.functional.pad(x.float(), (0, -k % 128)).view(m, -1, 128).abs().amax(-1)
    torch.testing.assert_close(s.t(), amax / 448, rtol=1e-6, atol=0)


def test_w8a8_linear_takes_no_rows_and_strided_rows():
    from dp_runtime.model.fp8_gemm_triton import fp8_block_linear

    w = Fp8BlockWeight.quantize(torch.randn(256, 384, device="cuda"))
    assert fp8_block_linear(torch.empty(0, 384, device="cuda", dtype=torch.bfloat16), w).shape == (0, 256)
    x = torch.randn(8, 2 * 384, device="cuda").to(torch.bfloat16)[:, :384]  # row stride 768
    torch.testing.assert_close(fp8_block_linear(x, w), fp8_block_linear(x.contiguous(), w))
    with pytest.raises(ValueError, match="K=100"):
        fp8_block_linear(torch.randn(2, 100, device="cuda", dtype=torch.bfloat16), w)


def _experts(num_local, hidden, inter, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(num_local, 2 * inter, hidden, device="cuda", generator=g) * hidden ** -0.5
    w2 = torch.randn(num_local, hidden, inter, device="cuda", generator=g) * inter ** -0.5
    return Fp8BlockWeight.quantize(w13), Fp8BlockWeight.quantize(w2)


@pytest.mark.parametrize("w8a8", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("extend", [False, True], ids=["decode", "extend"])
@pytest.mark.parametrize("n", [1, 300, 1024])
@pytest.mark.parametrize(("hidden", "inter"), [(2048, 768), (192, 128)])
def test_fused_fp8_experts_match_the_float_reference(n, extend, hidden, inter, w8a8):
    """Decode, mixed and prefill row counts (the unaligned and both aligned layouts), picks of
    other ranks (ids outside [0, L)), hidden 192 (K not a multiple of 128)."""
    from dp_runtime.model.experts import local_expert_sum
    from dp_runtime.model.fused_moe_triton import fused_local_expert_sum

    num_local, top_k = 16, 8
    w13, w2 = _experts(num_local, hidden, inter, seed=n)
    g = torch.Generator(device="cuda").manual_seed(n + 1)
    x = torch.randn(n, hidden, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.randint(-4, num_local + 4, (n, top_k), device="cuda", generator=g, dtype=torch.int32)
    weights = torch.rand(n, top_k, device="cuda", generator=g)
    out = fused_local_expert_sum(x, ids, weights, w13, w2, extend=extend, w8a8=w8a8)
    ref = local_expert_sum(x.float(), ids, weights, w13.dequantize(), w2.dequantize(), use_grouped_mm=False)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert _rel(out, ref) < (0.08 if w8a8 else 0.03)
    # The same kernels on the dequantized bf16 weights land as close: FP8 adds only rounding.
    bf16 = fused_local_expert_sum(x, ids, weights, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16),
                                  extend=extend)
    assert _rel(out, bf16) < (0.08 if w8a8 else 0.03)


@pytest.mark.parametrize("form", ["w8a16", "w8a8"])
def test_fp8_model_on_gpu_follows_the_dequantized_reference(tmp_path, monkeypatch, form):
    """A tiny FP8 checkpoint served in bf16 on the GPU (FP8 kernels) against transformers on its
    dequantized float32 twin. W8A16 (the weights' rounding only): logits within 0.1 (relative)
    and the twin's first greedy tokens. W8A8, the default, also rounds every GEMM input per
    token and 128 columns: transformers on the twin with that rounding emulated in float32
    (forward hooks applying ``fake_quant_activations``) lands 0.066 / 0.105 / 0.116 from the
    twin on these prompts and turns the first one's token 188 into 193, a near-tie (top-two gap
    0.06 of the logits' spread); an H200 measured 0.1095 and 193 on it. So W8A8 is held to 0.15
    and to the twin's token where its top two logits are clearly apart."""
    pytest.importorskip("transformers")
    from dp_runtime.model import fp8_tile
    from dp_runtime.rank_spec import RankSpec
    from dp_runtime.rank_worker import RankWorker
    from dp_runtime.serving.request import Request, SamplingParams
    from tests.fp8_checkpoint import write_fp8_pair
    from tests.hf_reference import greedy_reference, load_reference

    if form == "w8a16":
        monkeypatch.setattr(fp8_tile, "W8A8_MIN_ROWS", None)
    _, fp8, deq = write_fp8_pair(tmp_path)
    hf = load_reference(deq)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 19, 40)]
    spec = RankSpec.create(str(fp8), max_running_requests=4, chunked_prefill_size=64, dtype="bfloat16",
                           device="cuda", max_context_len=128, attention="sdpa")
    with RankWorker(spec, keep_logits=True) as w:
        m = w.metrics()
        assert (m["experts"], m["quantization"]) == ("triton", "fp8")
        res = w.generate([Request(f"r{i}", p, SamplingParams(max_new_tokens=4)) for i, p in enumerate(prompts)])
        rels = []
        for r, p in zip(res, prompts, strict=True):
            tokens, logits = greedy_reference(hf, p, 4)
            ours = torch.stack(w.sampled_logits[r.rid]).float().cpu()
            rels.append(_rel(ours[0], logits[0]))
            top2 = logits[0].topk(2).values
            if form == "w8a16" or (top2[0] - top2[1]).item() > 0.8 * logits[0].std().item():
                assert r.output_ids[0] == tokens[0]
        assert max(rels) < (0.1 if form == "w8a16" else 0.15), rels
