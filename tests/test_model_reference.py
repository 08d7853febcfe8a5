"""The reference model against Hugging Face transformers at world size 1, and the rank worker's
scheduling: chunked prefill, more requests than max_running_requests, KV back-pressure,
sampling and stop tokens, bad input."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dp_runtime.model.model_config import ModelConfigError
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.hf_reference import greedy_reference, load_reference, write_tiny_checkpoint

pytest.importorskip("transformers")

NEW = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe"))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11, 24, 40, 17)]


@pytest.fixture(scope="module")
def reference(ckpt, prompts):
    hf = load_reference(ckpt)
    return [greedy_reference(hf, p, NEW) for p in prompts]


def _spec(ckpt, **kw):
    base = dict(dp_size=1, max_running_requests=3, chunked_prefill_size=16, dtype="float32", device="cpu",
                max_context_len=128)
    return RankSpec.create(str(ckpt), **{**base, **kw})


def _requests(prompts, new=NEW, **sampling):
    return [Request(f"r{i}", p, SamplingParams(max_new_tokens=new, **sampling)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-runner"])
@pytest.mark.parametrize("dispatcher", ["local", "all_gather", "all_to_all"])
def test_greedy_tokens_and_logits_match_transformers(ckpt, prompts, reference, graphs, dispatcher):
    spec = _spec(ckpt, use_cuda_graph=graphs, dispatcher=dispatcher)
    with RankWorker(spec, keep_logits=True) as w:
        results = w.generate(_requests(prompts))
        m = w.metrics()
    assert (m["graph_steps"] > 0) == graphs
    assert m["extend_steps"] > len(prompts)  # the 24- and 40-token prompts were chunked by 16
    for res, (tokens, logits) in zip(results, reference, strict=True):
        assert res.output_ids == tuple(tokens), res.rid
        ours = torch.stack(w.sampled_logits[res.rid])
        torch.testing.assert_close(ours, logits, rtol=1e-4, atol=1e-4)
        assert res.finish_reason == "length" and res.rank == 0
        assert 0 <= res.queued_s <= res.ttft_s <= res.latency_s


def test_chunked_prefill_gives_the_same_tokens_as_unchunked(ckpt, prompts):
    outs = []
    for chunk in (5, 256):
        with RankWorker(_spec(ckpt, chunked_prefill_size=chunk, max_running_requests=5)) as w:
            outs.append([r.output_ids for r in w.generate(_requests(prompts))])
            assert w.metrics()["extend_steps"] >= (sum(map(len, prompts)) // chunk if chunk == 5 else 1)
    assert outs[0] == outs[1]


def test_more_requests_than_max_running_requests_all_finish(ckpt, prompts, reference):
    many = prompts * 3  # 15 requests, 2 at a time
    with RankWorker(_spec(ckpt, max_running_requests=2, cuda_graph_max_bs=2)) as w:
        results = w.generate(_requests(many))
        assert w.metrics()["finished_requests"] == len(many)
        # every slot came back (free, or the prefix cache's to evict)
        assert w.scheduler.kv_metrics()["free_kv_slots"] == w.kv_cache.num_slots
    for i, res in enumerate(results):
        assert res.output_ids == tuple(reference[i % len(prompts)][0])


def test_kv_back_pressure_admits_only_what_fits(ckpt, prompts, reference):
    # 60 slots: the 40-token prompt (47 KV tokens at its end) runs alone; nothing is overwritten.
    spec = _spec(ckpt, kv_cache_tokens=60, max_running_requests=3)
    with RankWorker(spec) as w:
        w.submit(_requests(prompts))
        most_running = 0
        while True:
            plan = w.step()
            most_running = max(most_running, len(w.scheduler.running))
            reserved = sum(r.request.max_total_tokens for r in w.scheduler.running)
            assert reserved <= 60
            if plan.skip:
                break
        results = {r.rid: r for r in w.pop_finished()}
    assert most_running >= 2
    for i, (tokens, _) in enumerate(reference):
        assert results[f"r{i}"].output_ids == tuple(tokens)


def test_request_that_can_never_fit_is_refused_with_the_limit(ckpt):
    with RankWorker(_spec(ckpt, kv_cache_tokens=50)) as w:
        with pytest.raises(ValueError, match=r"needs 135 KV tokens.*max_context_len is 128"):
            w.submit([Request("long", [1] * 128, SamplingParams(max_new_tokens=8))])
        # One the rank's KV cache cannot hold fails alone (its result), the others are queued.
        (big,) = w.scheduler.submit([Request("big", [1] * 50, SamplingParams(max_new_tokens=8))])
        assert (big.rid, big.finish_reason, big.rank, big.output_ids) == ("big", "error", 0, ())
        assert big.error == ("request 'big' needs 57 KV tokens (prompt 50 + max_new_tokens 8 - 1); "
                             "a rank's whole KV cache holds 50 (kv_cache_tokens)")
        assert not w.has_work
        w.submit([Request("a", [1, 2, 3])])
        with pytest.raises(ValueError, match="'a' is already queued"):
            w.submit([Request("b", [1]), Request("a", [4])])
        assert w.scheduler.num_waiting == 1  # all or nothing: "b" was not queued either


def test_stop_token_ends_a_request(ckpt, prompts, reference):
    first = reference[0][0][0]
    with RankWorker(_spec(ckpt)) as w:
        (res,) = w.generate([Request("s", prompts[0], SamplingParams(max_new_tokens=8, stop_token_ids=(first,)))])
    assert res.output_ids == (first,) and res.finish_reason == "stop"


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy(ckpt, prompts, reference):
    runs = []
    for _ in range(2):
        with RankWorker(_spec(ckpt)) as w:
            runs.append([r.output_ids for r in w.generate(_requests(prompts, temperature=1.5, seed=7))])
    assert runs[0] == runs[1]
    assert runs[0] != [tuple(t) for t, _ in reference]  # temperature 1.5 leaves greedy somewhere
    with RankWorker(_spec(ckpt)) as w:
        tiny_p = [r.output_ids for r in w.generate(_requests(prompts, temperature=1.0, top_p=1e-6))]
    assert tiny_p == [tuple(t) for t, _ in reference]


def test_missing_checkpoint_and_mismatched_spec_are_clear_errors(tmp_path, ckpt):
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        RankSpec.create(str(tmp_path), dtype="float32", device="cpu")
    spec = _spec(ckpt)
    with pytest.raises(ValueError, match="dp_size=1 but world_size=2"):
        RankWorker(spec, world_size=2)
    with pytest.raises(ValueError, match=r"runtime\.hidden_size=32 but model"):
        dataclasses.replace(spec, runtime=spec.runtime.replace(hidden_size=32))


def test_mixtral_checkpoint_matches_transformers(tmp_path, prompts):
    ckpt = write_tiny_checkpoint(tmp_path, family="mixtral")
    hf = load_reference(ckpt)
    assert type(hf).__name__ == "MixtralForCausalLM"
    with RankWorker(_spec(ckpt), keep_logits=True) as w:
        assert w.model_config.family == "mixtral" and not w.model_config.qk_norm
        results = w.generate(_requests(prompts))
    for res, prompt in zip(results, prompts, strict=True):
        tokens, logits = greedy_reference(hf, prompt, NEW)
        assert res.output_ids == tuple(tokens), res.rid
        torch.testing.assert_close(torch.stack(w.sampled_logits[res.rid]), logits, rtol=1e-4, atol=1e-4)


def test_unsupported_model_type_is_named():
    from dp_runtime.model.model_config import ModelConfig

    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        ModelConfig.from_hf({"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
                             "num_attention_heads": 1, "num_experts_per_tok": 1})


def test_memory_report_matches_the_planners_sizing_functions():
    """The planner predicts with the functions the worker allocates with: on CPU the exact
    components must agree to the byte (graph inputs to the few bytes of packed counters)."""
    from dp_runtime import memory_sizing as ms

    spec = RankSpec.create("tiny", dp_size=1, max_running_requests=8, chunked_prefill_size=64, dtype="float32",
                           device="cpu", max_context_len=64, use_cuda_graph=True, cuda_graph_bs=(1, 2, 4, 8))
    with RankWorker(spec) as w:
        m = w.memory_report()
        slots = w.kv_cache.num_slots
    cfg, rt = spec.model_config(), spec.runtime
    assert m["weights"] == ms.weight_bytes_per_rank(cfg, rt.dtype)
    assert m["kv_cache"] == ms.kv_cache_bytes(cfg, rt.dtype, slots, 8, 64)
    assert w.dispatcher_kind == "local" and m["dp_buffers"] == ms.dp_buffer_bytes(rt, "local", cfg.top_k) == 0
    # with the gather-style dispatcher the service holds gathered storage, and the planner knows it
    spec_ag = dataclasses.replace(spec, dispatcher="all_gather")
    with RankWorker(spec_ag) as w:
        got = w.memory_report()["dp_buffers"]
        assert w.dispatcher_kind == "all_gather"
    assert got == ms.dp_buffer_bytes(rt, "all_gather", cfg.top_k) > 0
    assert abs(m["graph_inputs"] - ms.graph_input_bytes(rt, decode_graphs=True)) <= 128
