"""Prefix caching on one GPU (bf16, SDPA and FlashInfer, eager and graphs with extend pieces):
requests sharing a prefix longer than a prefill chunk, one after another and all at once, on a
cache roomy or small enough to evict, give the tokens and logits of serving without the cache
up to bf16 near-ties (the rule of test_mixed_steps_gpu), with the reused prefix reported and
not prefilled again; the extend steps after a cached prefix run through the paths (FlashInfer
prefix + ragged, extend graphs) that chunked prefill uses."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.hf_reference import write_tiny_checkpoint
from tests.support.greedy_match import assert_same_greedy

pytestmark = pytest.mark.gpu

ATTENTION = ["sdpa"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
NEW = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_prefix_gpu"), head_dim=64)


def _requests() -> list[Request]:
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(0, 256, (40,), generator=g).tolist()
    tails = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 1, 12, 5)]
    tails[3] = tails[0]  # p3 repeats p0's prompt: all but its last token cached
    return [Request(f"p{i}", shared + t, SamplingParams(max_new_tokens=NEW)) for i, t in enumerate(tails)]


def _serve(ckpt, attention: str, graphs: bool, caching: bool, together: bool, slots: int | None = None):
    spec = RankSpec.create(str(ckpt), dp_size=1, max_running_requests=3, chunked_prefill_size=16,
                           cuda_graph_bs=(1, 2, 3), cuda_graph_extend_tokens=(8, 16) if graphs else (),
                           use_cuda_graph=graphs, dtype="bfloat16", device="cuda", max_context_len=96,
                           attention=attention, dispatcher="local", prefix_caching=caching,
                           kv_cache_tokens=slots)
    reqs = _requests()
    with RankWorker(spec, keep_logits=True) as w:
        res = w.generate(reqs) if together else [w.generate([q])[0] for q in reqs]
        logits = {rid: torch.stack(rows) for rid, rows in w.sampled_logits.items()}
        m = w.metrics()
        assert m["free_kv_slots"] == w.kv_cache.num_slots  # idle: every cached slot evictable
        return {r.rid: r for r in res}, logits, m


@pytest.mark.parametrize("together", [False, True], ids=["one_by_one", "together"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_cached_prefixes_give_the_tokens_of_serving_without(ckpt, attention, graphs, together):
    plain, plain_logits, m_off = _serve(ckpt, attention, graphs, False, together)
    got, logits, m_on = _serve(ckpt, attention, graphs, True, together)
    assert_same_greedy({k: r.output_ids for k, r in plain.items()}, plain_logits,
                       {k: r.output_ids for k, r in got.items()}, logits)
    hits = sum(r.cached_tokens for r in got.values())
    assert hits > 0 and m_on["prefix_hit_tokens"] == hits
    assert m_on["prefill_tokens"] == m_off["prefill_tokens"] - hits
    if not together:
        assert [got[f"p{i}"].cached_tokens for i in range(4)] == [0, 40, 40, 44]
    if graphs:
        assert m_on["extend_graph_steps"] > 0


@pytest.mark.parametrize("attention", ATTENTION)
def test_a_small_cache_evicts_and_serves_the_same_tokens(ckpt, attention):
    # 160 slots, fewer than the 3 running requests may need (168): cached prefixes are evicted.
    plain, plain_logits, _ = _serve(ckpt, attention, True, False, True, slots=160)
    got, logits, m = _serve(ckpt, attention, True, True, True, slots=160)
    assert_same_greedy({k: r.output_ids for k, r in plain.items()}, plain_logits,
                       {k: r.output_ids for k, r in got.items()}, logits)
    assert all(r.finish_reason == "length" for r in got.values()) and m["prefix_cached_tokens"] <= 160
