"""Overlapped steps (RuntimeConfig.overlap_schedule): the scheduler runs one step ahead of the
tokens it has read, and the results are those of step-by-step serving."""

from __future__ import annotations

import pytest
import torch

from dp_runtime.config import RuntimeConfig
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.hf_reference import write_tiny_checkpoint
from tests.support.small_scheduler import small_scheduler

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen3_moe_overlap"))


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 19, 33, 8, 12, 26)]


def _serve(ckpt, overlap: bool, requests: list[Request], graphs: bool = False):
    spec = RankSpec.create(str(ckpt), dp_size=1, max_running_requests=3, chunked_prefill_size=16, dtype="float32",
                           device="cpu", max_context_len=128, overlap_schedule=overlap, use_cuda_graph=graphs)
    with RankWorker(spec) as w:
        results = w.generate(requests)
        # every slot came back (free, or the prefix cache's to evict)
        assert w.scheduler.kv_metrics()["free_kv_slots"] == w.kv_cache.num_slots
        assert not w.scheduler.running and not w.scheduler.waiting
        return results, w.metrics()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-runner"])
def test_overlapped_steps_give_the_tokens_of_step_by_step_serving(ckpt, graphs):
    prompts = _prompts()
    plain = [Request(f"r{i}", p, SamplingParams(max_new_tokens=6 + i)) for i, p in enumerate(prompts)]
    base, _ = _serve(ckpt, False, plain, graphs)
    # Stop each even request at its 3rd greedy token; a seeded top-p request draws on the host.
    reqs = []
    for i, (p, res) in enumerate(zip(prompts, base, strict=True)):
        stop = (res.output_ids[2],) if i % 2 == 0 else ()
        reqs.append(Request(f"r{i}", p, SamplingParams(max_new_tokens=6 + i, stop_token_ids=stop)))
    reqs.append(Request("sampled", prompts[1], SamplingParams(max_new_tokens=5, temperature=0.8, top_p=0.9, seed=3)))
    step_by_step, m_off = _serve(ckpt, False, reqs, graphs)
    overlapped, m_on = _serve(ckpt, True, reqs, graphs)
    for a, b in zip(step_by_step, overlapped, strict=True):
        assert (a.rid, a.output_ids, a.finish_reason) == (b.rid, b.output_ids, b.finish_reason)
        if a.finish_reason == "stop":
            # The overlapped scheduler had already scheduled the step after the stop token: it
            # ran for nothing and its token was dropped.
            assert b.decode_steps == a.decode_steps + 1 and b.output_ids[-1] == a.output_ids[-1]
        else:
            assert b.decode_steps == a.decode_steps
    assert [r.output_ids[: min(3, len(r.output_ids))] for r in step_by_step[:-1:2]] == \
        [tuple(r.output_ids[:3]) for r in base[::2]]
    assert m_on["generated_tokens"] == m_off["generated_tokens"] == sum(len(r.output_ids) for r in overlapped)


def test_scheduler_runs_ahead_of_its_tokens_without_passing_max_new_tokens():
    s = small_scheduler()
    s.submit([Request("a", [3, 4, 5], SamplingParams(max_new_tokens=3))])
    first = s.next_step()  # the prompt; its first token is in flight
    assert first.is_extend and first.samples == (True,)
    s.last_tokens[first.batch.req_pool_indices] = 11  # what the worker's sampling writes on the device
    second = s.next_step()  # decoded before the first token was recorded: its input comes from the table
    assert not second.is_extend and second.batch.input_ids.tolist() == [11]
    assert second.batch.positions.tolist() == [3]
    s.last_tokens[second.batch.req_pool_indices] = 12
    third = s.next_step()
    assert third.batch.input_ids.tolist() == [12] and third.batch.positions.tolist() == [4]
    assert s.next_step() is None  # 0 recorded + 3 in flight: its last token is already scheduled
    assert s.advance(first, [11]) == [] and s.advance(second, [12]) == []
    (done,) = s.advance(third, [13])
    assert done.output_ids == (11, 12, 13) and done.finish_reason == "length" and done.decode_steps == 2
    assert s.allocator.num_free_slots == s.cache.num_slots


def test_a_token_after_a_stop_is_dropped_and_its_slot_freed():
    s = small_scheduler()
    s.submit([Request("a", [3, 4], SamplingParams(max_new_tokens=8, stop_token_ids=(9,)))])
    first = s.next_step()
    second = s.next_step()  # scheduled before the host knows the first token is a stop token
    (done,) = s.advance(first, [9])
    assert done.output_ids == (9,) and done.finish_reason == "stop"
    assert s.advance(second, [5]) == []  # the step in flight ran for nothing
    assert s.allocator.num_free_slots == s.cache.num_slots and s.next_step() is None


def test_overlap_schedule_must_be_a_bool():
    with pytest.raises(ValueError, match=r"overlap_schedule must be a bool \(got overlap_schedule='yes'\)"):
        RuntimeConfig(overlap_schedule="yes")
