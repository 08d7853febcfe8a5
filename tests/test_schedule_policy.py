"""The mixed steps' own token budget, the admission order (fcfs / lof), the KV slot ring, and
serve_load's ideal occupancy: scheduler-level behaviour on a real KV cache (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from bench.load_summary import ideal_occupancy
from bench.load_workload import Lengths, make_requests
from dp_runtime.config import RuntimeConfig
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.kv_cache import KVCache
from dp_runtime.serving.request import Request, SamplingParams
from dp_runtime.serving.scheduler import Scheduler


def _cache(slots: int = 256, max_reqs: int = 8) -> KVCache:
    return KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_slots=slots, max_reqs=max_reqs,
                   max_context_len=64, dtype=torch.float32, device="cpu")


def _req(rid: str, prompt_len: int, new: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=new))


def _rids(step) -> list[str]:
    return [r.request.rid for r in step.reqs]


def test_a_mixed_step_keeps_to_its_own_budget_and_a_lone_prefill_to_the_chunk():
    s = Scheduler(KVAllocator(_cache()), max_running_requests=4, chunked_prefill_size=16, mixed_step_tokens=6)
    s.submit([_req("a", 3, 8), _req("b", 2, 8)])
    first = s.next_step()  # nothing to decode: the chunk's budget (16) holds both prompts
    assert first.kind == "extend" and first.num_new == (3, 2)
    s.submit([_req("c", 12, 4)])
    second = s.next_step()  # two decode rows + 4 of c's tokens: the mixed budget of 6
    assert second.kind == "mixed" and second.num_new == (1, 1, 4) and second.num_tokens == 6
    third = s.next_step()
    assert third.kind == "mixed" and third.num_new == (1, 1, 4)


def test_longest_output_first_admits_the_most_new_tokens_first_and_fcfs_in_arrival_order():
    lens = {"a": 4, "b": 30, "c": 9, "d": 30, "e": 1}
    order = {}
    for policy in ("fcfs", "lof"):
        s = Scheduler(KVAllocator(_cache()), max_running_requests=2, chunked_prefill_size=64, policy=policy)
        s.submit([_req(rid, 2, n) for rid, n in lens.items()])
        order[policy] = _rids(s.next_step())
    assert order["fcfs"] == ["a", "b"]
    assert order["lof"] == ["b", "d"]  # the two longest, in arrival order between equals


def test_longest_output_first_waits_for_arrivals_and_names_a_bad_policy():
    s = Scheduler(KVAllocator(_cache()), max_running_requests=4, chunked_prefill_size=64, policy="lof")
    s.submit([_req("now", 2, 3), Request("later", [1, 2], SamplingParams(max_new_tokens=50), arrival_s=60.0)])
    assert _rids(s.next_step()) == ["now"]  # "later" has the longest output but has not arrived
    with pytest.raises(ValueError, match=r"policy must be one of \('fcfs', 'lof'\), got 'sjf'"):
        Scheduler(KVAllocator(_cache()), max_running_requests=4, chunked_prefill_size=64, policy="sjf")


def test_the_slot_ring_hands_out_the_oldest_free_slots_across_its_wrap():
    alloc = KVAllocator(_cache(slots=10))
    a = alloc.alloc_slots(7, on_host=True)
    assert a.tolist() == [1, 2, 3, 4, 5, 6, 7] and alloc.num_free_slots == 3
    alloc.free_slots(a[:5])  # appended after 8, 9, 10, wrapping the ring
    b = alloc.alloc_slots(6, on_host=True)
    assert b.tolist() == [8, 9, 10, 1, 2, 3] and alloc.num_free_slots == 2
    alloc.free_slots(torch.cat([b, a[5:]]))
    assert alloc.num_free_slots == 10
    assert sorted(alloc.alloc_slots(10, on_host=True).tolist()) == list(range(1, 11))
    with pytest.raises(ValueError, match="asked for 1 KV slots, 0 of 10 are free"):
        alloc.alloc_slots(1)
    with pytest.raises(ValueError, match="freeing 11 slots with 0 of 10 already free"):
        alloc.free_slots(torch.arange(1, 12))


def test_config_resolves_the_mixed_budget_to_the_largest_extend_graph_and_checks_both_fields():
    assert RuntimeConfig(chunked_prefill_size=8192, max_running_requests=64).mixed_step_tokens == 1024
    assert RuntimeConfig(chunked_prefill_size=8192, cuda_graph_extend_tokens=()).mixed_step_tokens == 8192
    assert RuntimeConfig(chunked_prefill_size=100, max_running_requests=8).mixed_step_tokens == 64
    with pytest.raises(ValueError, match=r"mixed_step_tokens must be an int in \[1, chunked_prefill_size\].*"
                                         r"mixed_step_tokens=9000, chunked_prefill_size=8192"):
        RuntimeConfig(mixed_step_tokens=9000)
    with pytest.raises(ValueError, match=r"schedule_policy must be one of \('fcfs', 'lof'\).*'sjf'"):
        RuntimeConfig(schedule_policy="sjf")


def test_ideal_occupancy_is_full_for_equal_requests_and_lof_beats_fcfs_on_a_closed_mix():
    same = [_req(f"r{i}", 4, 10) for i in range(8)]
    # Two waves of four: each request gives a token in its prefill step and 9 decode steps.
    assert ideal_occupancy(same, 4, 64, 64, "fcfs") == pytest.approx(1.0)
    mix = make_requests(96, math.inf, Lengths.parse("sharegpt"), "poisson", 100, 0, "t")
    fcfs, lof = (ideal_occupancy(mix, 16, 8192, 1024, p) for p in ("fcfs", "lof"))
    assert 0 < fcfs < lof <= 1
