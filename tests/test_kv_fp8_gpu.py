"""An FP8 e4m3 KV cache on a GPU: the fused q/k prologue stores what the torch store stores, the
Triton decode kernel and FlashInfer read it back (q in bf16, the cache upcast), and a rank with
graphs serves with it: its tokens and logits are those of the same rank run eager, and close to a
bf16 cache's (the CPU file, tests/test_kv_fp8.py, says how close and why).

An e4m3 value is exactly a bf16 value (3 mantissa bits, an exponent range inside bf16's), so the
kernels' upcast loses nothing: reading an FP8 cache is reading a bf16 cache of the rounded
values, and the bf16 tolerances of tests/test_triton_decode.py apply unchanged."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from dp_runtime.attention.triton_decode import triton_decode_attention
from dp_runtime.model.layers import RotaryEmbedding
from dp_runtime.model.qk_norm_rope import qk_norm_rope_store, qk_norm_rope_store_reference
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.kv_cache import FP8_KV_MAX
from dp_runtime.serving.request import Request, SamplingParams
from tests.hf_reference import write_tiny_checkpoint

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def _decode_case(lens, seed=0, hq=32, hk=4, d=128):
    g = torch.Generator().manual_seed(seed)
    slots = sum(lens) + 7
    k = (3 * torch.randn(slots, hk, d, generator=g)).to(FP8)
    v = (3 * torch.randn(slots, hk, d, generator=g)).to(FP8)
    q = torch.randn(len(lens), hq, d, generator=g).bfloat16()
    indices = torch.randperm(slots, generator=g)[:sum(lens)].to(torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    return [t.cuda() for t in (q, k, v, indptr, indices)]


def _reference(q, k, v, indptr, indices, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[1]
    for b in range(q.shape[0]):
        rows = indices[indptr[b]:indptr[b + 1]].long().cpu()
        kb = k.cpu().double()[rows].repeat_interleave(group, dim=1)
        vb = v.cpu().double()[rows].repeat_interleave(group, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].cpu().double(), kb) * scale
        out[b] = torch.einsum("ht,thd->hd", torch.softmax(s, dim=-1), vb)
    return out


@pytest.mark.parametrize("lens", [[1, 7, 128, 129, 300], [100] * 64, [(i * 37) % 600 + 1 for i in range(96)]])
def test_triton_decode_reads_an_fp8_cache_as_its_bf16_values(lens):
    q, k, v, indptr, indices = _decode_case(lens)
    scale = 1 / math.sqrt(128)
    got = triton_decode_attention(q, k, v, indptr, indices, scale)
    assert got.dtype == torch.bfloat16
    ref = _reference(q, k, v, indptr, indices, scale)
    # tests/test_triton_decode.py's bound: P rounded to bf16, the output rounded to bf16
    bound = (2.0**-8 + 1e-3) * v.float().abs().max().item() + 2.0**-8 * ref.abs()
    assert bool(((got.double().cpu() - ref).abs() <= bound).all())
    # The kernel on the cache's bf16 copy (bf16 dots) meets the same bound: the FP8 path's fp16
    # dots round P finer, so both are within the bf16 rounding of P of each other.
    same = triton_decode_attention(q, k.bfloat16(), v.bfloat16(), indptr, indices, scale)
    assert bool(((same.double().cpu() - ref).abs() <= bound).all())
    assert ((got.float() - same.float()).abs() <= 2 * (2.0**-8 + 1e-3) * v.float().abs().max()).all()


@pytest.mark.skipif(not HAS_FLASHINFER, reason="needs flashinfer")
def test_flashinfer_decode_and_paged_prefill_read_the_fp8_cache_like_the_triton_kernel():
    import flashinfer

    lens = [(i * 37) % 300 + 1 for i in range(40)]
    q, k, v, indptr, indices = _decode_case(lens, seed=3)
    paged = (k.unsqueeze(1), v.unsqueeze(1))
    want = triton_decode_attention(q, k, v, indptr, indices, 1 / math.sqrt(128))
    ws = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    ones = torch.ones(len(lens), dtype=torch.int32)
    kw = dict(q_data_type=torch.bfloat16, kv_data_type=FP8)
    dec = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    dec.plan(indptr.cpu(), indices, ones, 32, 4, 128, 1, **kw)
    torch.testing.assert_close(dec.run(q, paged), want, atol=2e-2, rtol=2e-2)
    pre = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    qo = torch.arange(len(lens) + 1, dtype=torch.int32)
    pre.plan(qo, indptr.cpu(), indices, ones, 32, 4, 128, 1, causal=False, **kw)
    torch.testing.assert_close(pre.run(q, paged), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("t", [1, 64, 300])
def test_the_fused_prologue_stores_what_the_torch_store_stores(t):
    hq, hkv, d = 32, 4, 128
    g = torch.Generator().manual_seed(t)
    qkv = (200 * torch.randn(t, (hq + 2 * hkv) * d, generator=g)).bfloat16().cuda()  # V past +-448 too
    qn = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16().cuda()
    kn = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16().cuda()
    rot = RotaryEmbedding(d, 64, 10000.0, "cuda")
    pos = torch.randint(0, 64, (t,), generator=g).cuda()
    loc = torch.randperm(3 * t + 4, generator=g)[:t].cuda()
    kc, vc, kc_ref, vc_ref = (torch.zeros(3 * t + 4, hkv, d, dtype=FP8, device="cuda") for _ in range(4))
    geo = dict(num_heads=hq, num_kv_heads=hkv, head_dim=d, eps=1e-6)
    q, k = qk_norm_rope_store(qkv, qn, kn, rot.cos_sin_PD, pos, loc, kc, vc, **geo)
    q_ref, k_ref = qk_norm_rope_store_reference(qkv, qn, kn, rot, pos, loc, kc_ref, vc_ref, **geo)
    assert q.dtype == k.dtype == torch.bfloat16  # the step's own q/k stay in the model's dtype
    for got, want in ((q, q_ref), (k, k_ref)):  # within a bf16 ulp of the head's largest (test_qk_norm_rope.py)
        ulp = want.float().abs().amax(-1, keepdim=True).clamp_min(1e-3) * 2.0**-7
        assert bool(((got.float() - want.float()).abs() <= ulp).all())
    assert torch.equal(vc.view(torch.uint8), vc_ref.view(torch.uint8))  # V: one rounding, the same
    assert vc[loc].float().abs().max().item() == FP8_KV_MAX and not torch.isnan(vc.float()).any()
    # K: the norm's sum order may move the bf16 value by an ulp (tests/test_qk_norm_rope.py),
    # which may move its e4m3 rounding by one e4m3 ulp (2^-3 of the value's power of two).
    diff = (kc[loc].float() - kc_ref[loc].float()).abs()
    assert bool((diff <= kc_ref[loc].float().abs() * 2.0**-3 + 2.0**-9).all())
    assert (diff > 0).float().mean().item() < 0.01


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    # every expert on every token: continuous in K/V (tests/test_kv_fp8.py, _serve)
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_fp8_gpu"), head_dim=64, num_experts_per_tok=8)


def _serve(ckpt, attention, kv_cache_dtype, graphs):
    spec = RankSpec.create(str(ckpt), dp_size=1, max_running_requests=3, chunked_prefill_size=16,
                           cuda_graph_bs=(1, 2, 3), cuda_graph_extend_tokens=(8, 16) if graphs else (),
                           use_cuda_graph=graphs, dtype="bfloat16", device="cuda", max_context_len=96,
                           attention=attention, dispatcher="local", kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(9)
    reqs = [Request(f"p{i}", torch.randint(0, 256, (n,), generator=g).tolist(), SamplingParams(max_new_tokens=10))
            for i, n in enumerate((4, 21, 9, 37, 15, 28))]
    with RankWorker(spec, keep_logits=True) as w:
        assert w.kv_cache.k[0].dtype == (FP8 if kv_cache_dtype == "fp8" else torch.bfloat16)
        tokens = {r.rid: r.output_ids for r in w.generate(reqs)}
        logits = {rid: torch.stack(rows) for rid, rows in w.sampled_logits.items()}
        assert w.scheduler.kv_metrics()["free_kv_slots"] == w.kv_cache.num_slots
        return tokens, logits, w.metrics()


def _agree(want, want_logits, got, got_logits, rel_limit):
    """Logits within ``rel_limit`` (relative norm) while the sequences agree; a parting only at
    a near-tie of the reference's top two. Returns the largest relative change."""
    worst = 0.0
    for rid, tokens in want.items():
        for j, (a, b) in enumerate(zip(tokens, got[rid], strict=True)):
            ref, new = want_logits[rid][j], got_logits[rid][j]
            rel = ((new - ref).norm() / ref.norm()).item()
            assert rel <= rel_limit, f"{rid} token {j}: logits moved by {rel:.1%}"
            worst = max(worst, rel)
            if a != b:
                top2 = ref.topk(2).values
                assert (top2[0] - top2[1]).item() <= 2 * (new - ref).abs().max().item(), f"{rid} token {j}"
                break
    return worst


@pytest.mark.parametrize("attention", ["sdpa"] + (["flashinfer"] if HAS_FLASHINFER else []))
def test_a_rank_with_graphs_serves_an_fp8_cache_as_it_does_eager_and_close_to_bf16(ckpt, attention):
    eager, eager_logits, _ = _serve(ckpt, attention, "fp8", graphs=False)
    graphs, graph_logits, m = _serve(ckpt, attention, "fp8", graphs=True)
    bf16, bf16_logits, _ = _serve(ckpt, attention, "auto", graphs=True)
    assert m["graph_steps"] > m["extend_graph_steps"] > 0 and m["steps_by_kind"]["mixed"] > 0
    _agree(eager, eager_logits, graphs, graph_logits, rel_limit=0.02)  # bf16 reorderings only
    assert _agree(bf16, bf16_logits, graphs, graph_logits, rel_limit=0.15) > 1e-3
