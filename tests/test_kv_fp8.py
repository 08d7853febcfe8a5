"""An FP8 e4m3 KV cache (``RuntimeConfig.kv_cache_dtype``) on CPU: the config's names and rule,
the cache's saturating store, the sizes the planner and the rank derive from a byte per
element, both attention backends reading it back in the query's dtype (FlashInfer through the
emulator, which checks the planned KV type against the cache), and a rank serving with it.

What an FP8 cache may change. e4m3 keeps 3 mantissa bits: a stored K or V element is off by at
most 2^-4 of its magnitude (half a unit in the last place). Attention over rounded keys and
values moves each output by a fraction of that, and the logits follow; they must stay close to
the model-dtype cache's, and must not be equal to them (the cache really is FP8).
"""

from __future__ import annotations

import pytest
import torch
from flashinfer_emulator import emulated_flashinfer

from dp_runtime import memory_sizing as ms
from dp_runtime.attention import FlashInferBackend, TorchSDPABackend
from dp_runtime.config import RuntimeConfig
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.kv_cache import FP8_KV_MAX, KVCache
from dp_runtime.serving.request import Request, SamplingParams
from tests.support.synthetic_batch import add_requests, decode_batch, extend_batch

FP8 = torch.float8_e4m3fn
HQ, HKV, D = 4, 2, 8


def _cache(dtype: torch.dtype, slots: int = 512) -> KVCache:
    return KVCache(num_layers=1, num_kv_heads=HKV, head_dim=D, num_slots=slots, max_reqs=8, max_context_len=64,
                   dtype=dtype, device="cpu")


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "FP8_E4M3", "float8_e4m3fn", FP8])
def test_fp8_names_resolve_and_auto_is_the_model_dtype(name):
    assert RuntimeConfig(kv_cache_dtype=name).kv_cache_dtype == FP8
    assert RuntimeConfig(dtype="float32").kv_cache_dtype == torch.float32
    assert RuntimeConfig(dtype="float32", kv_cache_dtype=name).plan_fields()["kv_cache_dtype"] == "torch.float8_e4m3fn"


@pytest.mark.parametrize("bad", ["int8", "fp8_e5m2", torch.float16])
def test_other_kv_dtypes_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        RuntimeConfig(dtype="bfloat16", kv_cache_dtype=bad)


def test_the_store_rounds_to_e4m3_and_saturates_instead_of_making_nan():
    cache = _cache(FP8)
    x = torch.tensor([[1.0, -3.3, 1000.0, -1e6, 0.01, 447.0, 449.0, 200.0]] * HKV).unsqueeze(0)
    cache.set_kv(0, torch.tensor([5]), x, -x)
    k, v = cache.k[0][5].float(), cache.v[0][5].float()
    assert cache.k[0].dtype == FP8 and not torch.isnan(k).any()
    assert k[0, 2] == FP8_KV_MAX and k[0, 3] == -FP8_KV_MAX and v[0, 2] == -FP8_KV_MAX
    assert torch.equal(k, x[0].to(FP8).float().clamp(-FP8_KV_MAX, FP8_KV_MAX))
    assert ((k - x[0]).abs() <= x[0].abs() * 2.0**-4 + 2.0**-9).where(x[0].abs() <= FP8_KV_MAX, True).all()
    assert cache.k[0][4].float().abs().sum() == 0  # other slots untouched


def test_a_byte_per_element_halves_the_bytes_per_token_and_doubles_the_slots():
    cfg = ModelConfig.preset("qwen3-30b-a3b")
    assert ms.kv_bytes_per_token(cfg, FP8) * 2 == ms.kv_bytes_per_token(cfg, torch.bfloat16) == 98_304
    budget = 16 << 30
    bf16 = ms.kv_slots_for_budget(cfg, torch.bfloat16, budget, 64, 4096)
    fp8 = ms.kv_slots_for_budget(cfg, FP8, budget, 64, 4096)
    assert fp8 in (2 * bf16, 2 * bf16 + 1, 2 * bf16 + 2)
    assert ms.kv_cache_bytes(cfg, FP8, fp8, 64, 4096) <= budget < ms.kv_cache_bytes(cfg, FP8, fp8 + 1, 64, 4096)
    assert _cache(FP8).nbytes() < _cache(torch.float32).nbytes() // 3


def test_both_backends_read_the_fp8_cache_in_the_query_dtype():
    # FlashInfer (emulated: it refuses a plan whose KV type is not the cache's) and SDPA over one
    # FP8 cache, against SDPA over float32 caches holding the same values, on an extend with
    # cached prefixes and then a decode step. The extend's ragged pass attends the new tokens'
    # own K/V as the projection gave them (FlashInfer's kernels take them directly, as SGLang's
    # extend does), so its reference holds the prefix rounded and the new tokens unrounded.
    cache, rounded, fresh = _cache(FP8), _cache(torch.float32), _cache(torch.float32)
    heads = dict(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
    fi = FlashInferBackend(cache, q_dtype=torch.float32, flashinfer_module=emulated_flashinfer(), check_indices=True,
                           **heads)
    sdpa, ref_rounded, ref_fresh = (TorchSDPABackend(c, **heads) for c in (cache, rounded, fresh))
    allocs = [KVAllocator(c) for c in (cache, rounded, fresh)]
    reqs = [add_requests(a, [0, 30, 7], seed=3) for a in allocs]  # a batch grows its requests: one list each
    for c in (rounded, fresh):
        c.k[0].copy_(cache.k[0].float())
        c.v[0].copy_(cache.v[0].float())
    g = torch.Generator().manual_seed(4)
    for kind in ("extend", "decode"):
        batches = [extend_batch(a, r, [5, 3, 6], list(range(14))) if kind == "extend"
                   else decode_batch(a, r, [1, 2, 3]) for a, r in zip(allocs, reqs, strict=True)]
        loc = batches[0].out_cache_loc
        q, k, v = (torch.randn(loc.shape[0], h, D, generator=g) for h in (HQ, HKV, HKV))
        cache.set_kv(0, loc, k, v)
        rounded.set_kv(0, loc, k.to(FP8).float(), v.to(FP8).float())
        fresh.set_kv(0, loc, k, v)
        outs = []
        for backend, batch in zip((fi, sdpa, ref_rounded, ref_fresh), (batches[0], batches[0], *batches[1:]),
                                  strict=True):
            backend.init_forward_metadata(batch)
            outs.append(backend.forward(q, k, v, 0, batch))
        got_fi, got_sdpa, want_rounded, want_fresh = outs
        assert got_fi.dtype == got_sdpa.dtype == torch.float32
        torch.testing.assert_close(got_sdpa, want_rounded, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got_fi, want_fresh if kind == "extend" else want_rounded, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(want_fresh, want_rounded, atol=1e-3)  # the rounding shows


def test_an_fp8_cache_is_refused_below_compute_capability_8_9_naming_the_gpu():
    from dp_runtime.choices import check_kv_cache_dtype

    with pytest.raises(ValueError, match=r"kv_cache_dtype float8_e4m3fn .* 8\.9 .* A100 is 8\.0"):
        check_kv_cache_dtype(FP8, "cuda", (8, 0), "A100")
    check_kv_cache_dtype(FP8, "cuda", (9, 0), "H100")
    check_kv_cache_dtype(FP8, "cpu", None)
    check_kv_cache_dtype(torch.bfloat16, "cuda", (8, 0), "A100")


def test_fp8_queries_are_refused_by_the_flashinfer_backend():
    with pytest.raises(ValueError, match="q_dtype"):
        FlashInferBackend(_cache(FP8), num_q_heads=HQ, num_kv_heads=HKV, head_dim=D,
                          flashinfer_module=emulated_flashinfer())


def _serve(kv_cache_dtype: str):
    # Every expert on every token (top_k = the tiny preset's 8 experts): a top-2 router flips an
    # expert at a near-tie of its logits, which turns a rounding of K/V into any change at all of
    # a layer's output; with all experts weighted the model is continuous in its K/V.
    spec = RankSpec.create("tiny", model_overrides={"top_k": 8}, dp_size=1, device="cpu", dtype="float32",
                           max_running_requests=4, chunked_prefill_size=32, max_context_len=96,
                           kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(5)
    reqs = [Request(f"r{i}", torch.randint(0, 256, (n,), generator=g).tolist(), SamplingParams(max_new_tokens=6))
            for i, n in enumerate((9, 30, 17, 4, 22))]
    with RankWorker(spec, keep_logits=True) as w:
        assert w.kv_cache.k[0].dtype == (FP8 if kv_cache_dtype != "auto" else torch.float32)
        out = {r.rid: r.output_ids for r in w.generate(reqs)}
        assert w.scheduler.kv_metrics()["free_kv_slots"] == w.kv_cache.num_slots
        return out, {rid: torch.stack(rows) for rid, rows in w.sampled_logits.items()}, w.metrics()


def test_a_rank_serves_with_an_fp8_cache_close_to_the_model_dtype_cache():
    want, want_logits, _ = _serve("auto")
    got, got_logits, m = _serve("fp8_e4m3")
    assert m["steps_by_kind"]["mixed"] > 0  # mixed steps read the cache too
    assert {rid: len(t) for rid, t in got.items()} == {rid: len(t) for rid, t in want.items()}
    worst = 0.0
    for rid, tokens in want.items():
        for j, (a, b) in enumerate(zip(tokens, got[rid], strict=True)):
            ref, new = want_logits[rid][j], got_logits[rid][j]
            rel = ((new - ref).norm() / ref.norm()).item()
            assert rel <= 0.15, f"{rid} token {j}: logits moved by {rel:.1%}"  # measured: 3-9%
            worst = max(worst, rel)
            if a != b:  # a near-tie parts the sequences: the reference's top-2 within the change
                top2 = ref.topk(2).values
                assert (top2[0] - top2[1]).item() <= 2 * (new - ref).abs().max().item(), f"{rid} token {j}"
                break
    assert worst > 1e-4  # the cache really rounds: the model-dtype cache's logits are not reproduced
