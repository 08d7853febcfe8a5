"""Overlapped steps on one GPU: a replayed decode step never makes the host wait for the GPU
(torch's sync debug mode raises on any synchronising call), greedy or sampled with logprobs, and
overlap gives the tokens of step-by-step serving with graphs and FlashInfer; serve_load's
--gpu-spans times the steps of the engine's in-process rank."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.hf_reference import write_tiny_checkpoint
from tests.model_gpu_checks import prompts_for

pytestmark = pytest.mark.gpu

ATTENTION = ["sdpa"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_overlap_gpu"), head_dim=64)


def _spec(ckpt, attention: str, overlap: bool) -> RankSpec:
    return RankSpec.create(str(ckpt), dp_size=1, max_running_requests=4, chunked_prefill_size=64,
                           cuda_graph_bs=(1, 2, 4), dtype="bfloat16", device="cuda", max_context_len=96,
                           attention=attention, dispatcher="local", overlap_schedule=overlap)


# Sampled rows (temperature, top-k, top-p) and logprobs are drawn on the device too.
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9, logprobs=3)


def _requests(new: int = 12, **sampling) -> list[Request]:
    return [Request(f"p{i}", p, SamplingParams(max_new_tokens=new, seed=i, **sampling))
            for i, p in prompts_for(0, 1)]


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_replayed_decode_steps_never_wait_for_the_gpu(ckpt, attention, sampling):
    with RankWorker(_spec(ckpt, attention, True)) as w:
        w.submit(_requests(new=40, **sampling))
        for _ in range(4):  # the prompts, then decode steps until the step is steady
            w.step()
        graph_steps = w.metrics()["graph_steps"]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                plan = w.step()
                assert plan.graph_bucket is not None and not plan.is_extend
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert w.metrics()["graph_steps"] == graph_steps + 5
        w.run_until_idle()
        assert all(len(r.output_ids) == 40 for r in w.pop_finished())


@pytest.mark.parametrize("sampling", [{}, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_overlap_gives_the_tokens_of_step_by_step_serving(ckpt, attention, sampling):
    outs = []
    for overlap in (False, True):
        with RankWorker(_spec(ckpt, attention, overlap)) as w:
            outs.append({r.rid: (r.output_ids, r.logprobs) for r in w.generate(_requests(**sampling))})
            assert w.metrics()["graph_steps"] > 0
            assert w.scheduler.kv_metrics()["free_kv_slots"] == w.kv_cache.num_slots
    assert outs[0] == outs[1]


def test_step_spans_time_every_launched_step_and_give_the_methods_back(ckpt):
    # bench/gpu_spans.py: serve_load's GPU timeline of a run (each step's span, the idle gaps)
    from bench.gpu_spans import StepSpans

    with RankWorker(_spec(ckpt, "sdpa", True)) as w:
        spans = StepSpans(w)
        w.submit(_requests(new=20))
        w.run_until_idle()
        got, m = spans.take(), w.metrics()
        launched = m["graph_steps"] + m["eager_steps"]
        assert sum(k["n"] for k in got["steps"].values()) == launched > 0
        assert got["steps"]["decode"]["n"] == m["graph_steps"] - m["extend_graph_steps"]
        assert all(k["mean_ms"] > 0 for k in got["steps"].values())
        assert 0 < got["busy"] <= 1.001 and got["idle_s"] >= 0 and got["gap_max_ms"] >= got["gap_p50_ms"]
        assert spans.take() == {}  # taken: the next run starts afresh
        spans.close()
        assert "replay" not in vars(w.graphs) and "_eager" not in vars(w)
        assert all(len(r.output_ids) == 20 for r in w.pop_finished())


def test_serve_load_gpu_spans_time_the_engine_s_in_process_rank(capsys):
    # bench/serve_load.py --gpu-spans: the Engine's in-process rank built with StepSpans on it
    # (bench/load_ranks.py: a worker_factory), one rate's GPU timeline in its row.
    import json

    from tests.support.bench_scripts import load_bench

    code = load_bench("serve_load").main(["--device", "cuda", "--model", "tiny", "--num-requests", "4",
                                          "--rates", "inf", "--lengths", "random:16:8", "--warmup", "0",
                                          "--probe-tokens", "0", "--gpu-spans", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    row = json.loads(out)["rows"][0]
    assert row["completed"] == 4 and row["output_tokens"] == 32
    assert sum(k["n"] for k in row["gpu"]["steps"].values()) > 0 and 0 < row["gpu"]["busy"] <= 1.001
