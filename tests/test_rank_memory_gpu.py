"""Memory measured, never guessed (dp_runtime/rank_memory.py), on one GPU: the profiled peak of
the largest step bounds what serving then allocates, the graphs fit their reserve, and a
configuration whose KV cache cannot hold one request is refused at start with the numbers."""

from __future__ import annotations

import pytest
import torch

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams

pytestmark = pytest.mark.gpu


def _spec(**kw):
    base = dict(device="cuda", dtype="bfloat16", max_running_requests=16, chunked_prefill_size=512,
                max_context_len=256)
    return RankSpec.create("tiny", **{**base, **kw})


@pytest.mark.parametrize("caching", [False, True], ids=["plain", "prefix-caching"])
def test_serving_stays_within_the_profiled_peak_and_graphs_within_their_reserve(caching):
    # cuBLAS's workspace made before the rank: the profile's peak must bound serving without it
    # (a process's first GEMM makes it, and in a fresh process it hid a 4x shortfall: the profile
    # spread its tokens over 16 short requests, and SDPA's scores grow with the longest request).
    # With prefix caching the later prompts start with an earlier one's tokens: extends after a
    # cached prefix (the profile's third shape).
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    with RankWorker(_spec(prefix_caching=caching)) as w:
        mem = w.memory_report()
        assert mem["activation_peak"] > 0 and 0 < mem["graph_pool"] <= mem["graph_reserve"], mem
        # torch held at least the weights and the pool when the rank sized its cache
        assert mem["allocator_cache"] >= 0 and mem["cuda_context"] > 0, mem
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        # Prompts that fill the 512-token budget in one step, then decode together; drawn the
        # costliest way (a full-vocabulary top-p from a biased copy, every logprob alternative),
        # half of them.
        g = torch.Generator().manual_seed(0)
        costly = SamplingParams(max_new_tokens=24, temperature=1.0, top_p=0.9, logprobs=20, ignore_eos=True,
                                logit_bias=tuple((t, 1.0) for t in range(0, 200, 2)))
        shared = torch.randint(1, 200, (100,), generator=g).tolist() if caching else []
        reqs = [Request(f"r{i}", (shared + torch.randint(1, 200, (n,), generator=g).tolist())[:230],
                        costly if i % 2 else SamplingParams(max_new_tokens=24))
                for i, n in enumerate((200, 180, 120, 12, 230, 64, 90, 17))]
        # with the cache, in two waves: the later prompts find the first two's prefix cached
        results = w.generate(reqs[:2]) + w.generate(reqs[2:]) if caching else w.generate(reqs)
        torch.cuda.synchronize()
        grew = torch.cuda.max_memory_allocated() - base
    assert all(r.ok and len(r.output_ids) == 24 for r in results)
    assert (sum(r.cached_tokens for r in results) > 0) == caching
    assert 0 < grew <= mem["activation_peak"], (grew, mem)


def test_a_kv_cache_too_small_for_one_request_is_refused_at_start_with_the_numbers():
    with pytest.raises(RuntimeError, match=r"gives \d+ KV slots; one request of max_context_len=256 needs more"):
        RankWorker(_spec(kv_mem_fraction=1e-9))
