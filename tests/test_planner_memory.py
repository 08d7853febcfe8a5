"""The planner's memory estimates against hand arithmetic and the rank's own functions: the
forward's peak, the profile step, the graphs' pool, the KV rule, the overheads, and the plan
against a measured H100 rank (CPU, no GPU; docs/planner.md).

Expected numbers are computed here by hand from the model's published shapes, not by calling
the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from dp_runtime import memory_estimates as me
from dp_runtime import memory_sizing as ms
from dp_runtime.model.model_config import ModelConfig
from launch.planner import (
    GIB,
    GPUS,
    PlanInput,
    compare_measured,
    plan_capacity,
)

QWEN = ModelConfig.preset("qwen3-30b-a3b")
BF16 = torch.bfloat16
H100 = GPUS["h100"].mem_bytes


def test_forward_estimate_by_hand():
    tiny = ModelConfig.preset("tiny")  # H 64, 4 q / 2 kv heads of 16, 8 experts of 32, top-2, V 256
    t, r, e = 16, 4, 2
    attention = t * (3 * 64 + 3 * (4 + 2) * 16) * e
    # residual + normed input + the local expert output; weights and ids, alignment slots; the
    # Triton path's SwiGLU and down-projection rows (bf16)
    moe = t * 64 * e * 3 + t * 2 * (4 + 4) + t * 2 * 4 + t * 2 * (32 + 64) * e
    head = 2 * t * 64 * e + 2 * r * 64 * e + r * 256 * (e + 4)
    assert ms.dtype_bytes(BF16) == e
    assert me.forward_peak_bytes_estimate(tiny, BF16, t, r) == max(attention, moe, head)
    # all_gather: its experts run on every DP rank's rows, written over the gathered buffer
    n = 3 * t
    moe3 = t * 64 * e * 2 + t * 2 * 8 + n * 2 * 4 + n * 2 * (32 + 64) * e
    assert me.forward_peak_bytes_estimate(tiny, BF16, t, r, dispatcher="all_gather", dp_size=3,
                                          ep_size=3) == max(attention, moe3, head)
    # fp32 takes the torch path: the (N, K, H) outputs and their fp32 copy
    moe32 = t * 64 * 4 * 3 + t * 2 * 8 + t * 2 * 4 + max(t * 2 * (64 + 64) * 4, t * 2 * 64 * 12)
    head32 = 2 * t * 64 * 4 + 2 * r * 64 * 4 + r * 256 * 8
    assert me.forward_peak_bytes_estimate(tiny, torch.float32, t, r) == max(attention // e * 4, moe32, head32)


def test_largest_step_estimate_is_the_profile_steps_parts():
    rt = PlanInput(max_running_requests=64).rank_spec().runtime
    tokens, requests = ms.largest_step_tokens(rt, 4096)
    assert (tokens, requests) == (8192, 64)
    fi = (256 << 20) + 4 * (8 << 20) + 32768 * 4  # FlashInfer's eager workspace and wrappers
    want = (me.forward_peak_bytes_estimate(QWEN, BF16, 8192, 64) + fi + me.CUBLAS_WORKSPACE_BYTES
            + ms.kv_cache_bytes(QWEN, BF16, 1, 64, 4096) + ms.graph_input_bytes(rt, decode_graphs=False))
    assert me.largest_step_bytes_estimate(QWEN, rt, 4096, attention="flashinfer", dispatcher="local") == want
    sdpa = me.largest_step_bytes_estimate(QWEN, rt, 4096, attention="sdpa", dispatcher="local")
    assert sdpa == want - fi


def test_graph_pool_estimate_by_hand():
    tiny = ModelConfig.preset("tiny")
    kw = dict(max_running_requests=8, context_len=64, attention="flashinfer")
    assert me.graph_pool_bytes_estimate(tiny, BF16, capture_sizes=(), extend_tokens=(16,), **kw) == 0
    cublas, wrapper, fi = me.CUBLAS_WORKSPACE_BYTES, 8 << 20, 256 << 20
    # decode: the graph workspace and fixed indptr / last-page / indices, the largest bucket's
    # fp32 logits, a wrapper per bucket (all below the Triton threshold of 64), the stream's cuBLAS
    decode = fi + (2 * 8 + 1 + 8 * 64) * 4 + 8 * 256 * 4 + 3 * wrapper + cublas
    # no extend buckets: the working set is the largest decode bucket's forward, its phases summed
    phases = me.forward_phase_bytes(tiny, BF16, 8, 8)
    assert max(phases) == me.forward_peak_bytes_estimate(tiny, BF16, 8, 8)
    assert me.graph_pool_bytes_estimate(tiny, BF16, capture_sizes=(1, 4, 8), extend_tokens=(), **kw) == (
        decode + sum(phases))
    # extend: one attention output for every layer (32 x 4 x 16 bf16, in a 2 MiB segment); a
    # second bucket's logits (8 rows, bf16 and fp32); the stream's cuBLAS; the working set of the
    # largest bucket's forward (its q/k/v and logits among it: the pieces and buckets keep none)
    extend = (2 << 20) + 8 * 256 * (2 + 4) + cublas + sum(me.forward_phase_bytes(tiny, BF16, 32, 8))
    assert me.graph_pool_bytes_estimate(tiny, BF16, capture_sizes=(1, 4, 8), extend_tokens=(16, 32), **kw) == (
        decode + extend)
    # a bucket more costs nothing here: not its tokens' q/k/v in every layer, nor its logits
    more = me.graph_pool_bytes_estimate(tiny, BF16, capture_sizes=(1, 4, 8), extend_tokens=(16, 24, 32), **kw)
    assert more == decode + extend
    sdpa = dict(kw, attention="sdpa")  # indices and a mask, no workspace, no wrappers
    assert me.graph_pool_bytes_estimate(tiny, BF16, capture_sizes=(1, 4, 8), extend_tokens=(), **sdpa) == (
        8 * 64 * 5 + 8 * 256 * 4 + cublas + sum(phases))
    # buckets from 64 up decode with the Triton kernel: no wrapper
    big = me.graph_pool_bytes_estimate(tiny, BF16, capture_sizes=(32, 64, 128), extend_tokens=(), **dict(
        kw, max_running_requests=128))
    assert big == (fi + (2 * 128 + 1 + 128 * 64) * 4 + 128 * 256 * 4 + 1 * wrapper + cublas
                   + sum(me.forward_phase_bytes(tiny, BF16, 128, 128)))
    assert me.graph_reserve_bytes(1000) == 1250


def test_graphs_off_have_no_pool_and_no_decode_registry():
    on = plan_capacity(PlanInput(dispatcher="all_gather", max_running_requests=64))
    off = plan_capacity(PlanInput(dispatcher="all_to_all", use_cuda_graph=False, max_running_requests=64))
    assert on.cuda_graphs and on.components.graph_pool_bytes > 0
    assert not off.cuda_graphs and off.components.graph_pool_bytes == 0
    assert off.dispatcher == "all_to_all"


def test_kv_is_sized_by_the_ranks_rule():
    """What the rank holds when it sizes its KV cache, less the largest step's peak and the
    graphs' reserve, times kv_mem_fraction: the budget the rank's own functions turn into slots."""
    plan = plan_capacity(PlanInput(max_running_requests=32))
    c, kv, gpu = plan.components, plan.kv, H100
    held = c.weights_bytes + c.dp_buffers_bytes + c.dispatcher_workspace_bytes + c.graph_inputs_bytes
    held += c.penalty_counts_bytes + c.allocator_cache_bytes + c.nccl_bytes + c.cuda_context_bytes
    assert plan.graph_reserve_bytes == math.ceil(1.25 * c.graph_pool_bytes)
    budget = int((gpu - held - c.activation_peak_bytes - plan.graph_reserve_bytes) * 0.85)
    assert kv.slots == (budget - 33 * 4096 * 4) // 98_304 - 1
    assert c.kv_cache_bytes == ms.kv_cache_bytes(QWEN, BF16, kv.slots, 32, 4096)
    assert plan.headroom_bytes == gpu - held - c.activation_peak_bytes - plan.graph_reserve_bytes - c.kv_cache_bytes
    # the headroom is what the 15% left, and the reserve's margin is free too
    assert plan.free_bytes == plan.headroom_bytes + plan.graph_reserve_bytes - c.graph_pool_bytes
    assert kv.requests_at_full_context == kv.slots // 4096 and kv.needed_slots == 32 * 4096
    leaner = plan_capacity(PlanInput(max_running_requests=32, kv_mem_fraction=0.5))
    assert leaner.kv.slots < kv.slots and leaner.headroom_bytes > plan.headroom_bytes


def test_the_graphs_reserve_and_largest_step_are_one_function_for_rank_and_planner():
    from dp_runtime.rank_memory import graph_reserve_bytes

    for mrr in (64, 256):
        inp = PlanInput(max_running_requests=mrr)
        plan, spec = plan_capacity(inp), inp.rank_spec()
        assert plan.graph_reserve_bytes == graph_reserve_bytes(spec, True, "flashinfer")
        assert plan.components.activation_peak_bytes == me.largest_step_bytes_estimate(
            spec.model_config(), spec.runtime, spec.context_len, attention="flashinfer", dispatcher="local")
    assert graph_reserve_bytes(inp.rank_spec(), False, "flashinfer") == 0


def test_overheads():
    assert plan_capacity(PlanInput(max_running_requests=8)).components.nccl_bytes == 0
    assert ms.nccl_communicators(2, 2) == 1 and ms.nccl_communicators(4, 2) == 2
    assert ms.nccl_overhead_bytes(4, 2) == 2 * ms.NCCL_COMMUNICATOR_BYTES
    assert plan_capacity(PlanInput(max_running_requests=8)).components.cuda_context_bytes == ms.CUDA_CONTEXT_BYTES


def test_allocator_cache_is_the_rope_table_and_a_cublas_workspace():
    # torch's segment rule: <= 1 MiB -> 2 MiB, < 10 MiB -> 20 MiB, else rounded up to 2 MiB
    mib = 1 << 20
    assert [ms.allocator_segment_bytes(n) for n in (1, mib, mib + 1, 10 * mib - 1, 10 * mib, 10 * mib + 1)] == [
        2 * mib, 2 * mib, 20 * mib, 20 * mib, 10 * mib, 12 * mib]
    # qwen3-30b-a3b: a 40960 x 128 fp32 RoPE table (20 MiB), 32 MiB of cuBLAS workspace, 2 MiB slack
    assert QWEN.max_positions * QWEN.head_dim * 4 == 20 * mib
    assert me.allocator_cache_bytes(QWEN) == 54 * mib
    assert plan_capacity(PlanInput(dp_size=2, max_running_requests=8)).components.allocator_cache_bytes == 54 * mib


def test_the_plan_matches_the_session_15_measurement():
    """docs/BENCHMARKS.md, session 15: qwen3-30b-a3b, DP 1, context 4096, 64 running, one H100
    (79.178 GiB total), in GiB as the rank's memory_report gave them once the extend pieces gave
    their q/k/v and the buckets their logits back to the pool (graph_pool 2.806 -> 0.641 GiB, the
    KV cache 14.755 -> 17.066). The rank sized that cache with the graphs' reserve of 0.754 GiB;
    the estimate's second-logits term (fitted to this run) makes it 0.821, 0.057 GiB of KV less
    (-0.3%). That rank had no penalty tables; one with them holds their 65 x 151,936 x (4 + 1)
    bytes (0.046 GiB: float32 counts, bool marks) before sizing, and so that much less KV (taken
    off the measured value here, times kv_mem_fraction: it comes off the memory the fraction is
    taken of)."""
    table = 65 * 151_936 * (4 + 1) * 0.85 / GIB
    want = dict(weights=56.871, kv_cache=17.066 - table, graph_pool=0.641, activation_peak=0.753, allocator_cache=0.053,
                cuda_context=0.671)
    plan = plan_capacity(PlanInput(dp_size=1, ep_size=1, max_running_requests=64, context_len=4096,
                                   gpu_mem_bytes=round(79.178 * GIB)))
    rows = {r.component: r for r in compare_measured(plan, {k: round(v * GIB) for k, v in want.items()})}
    for name in want:
        assert abs(rows[name].error_pct) < 5, (name, rows[name])
    assert abs(rows["kv_cache"].error_pct) < 0.5, rows["kv_cache"]


def test_the_draw_phase_matches_the_session_17_measurement():
    """docs/BENCHMARKS.md, session 17 (81e2ee0, one H200): the profile's costliest draw sorted
    64 rows at a time and raised activation_peak from 0.754 to 0.788 GiB at 64 running and from
    0.755 to 0.976 at 256, without a logit_bias (bias_chunk 0). With that chunk the estimate
    gives both within 5%; with the chunks the code sorts and biases in now (sampling.SORT_CHUNK,
    ROW_CHUNK) the draw stays under the forward's peak."""
    for running, measured in ((64, 0.788), (256, 0.976)):
        rt = PlanInput(max_running_requests=running).rank_spec().runtime
        tokens, requests = ms.largest_step_tokens(rt, 4096)
        forward = me.forward_peak_bytes_estimate(QWEN, BF16, tokens, requests)
        rest = me.largest_step_bytes_estimate(QWEN, rt, 4096, attention="flashinfer", dispatcher="local") - forward
        then = rest + me.draw_phase_bytes(QWEN, BF16, requests, sort_chunk=64, bias_chunk=0)
        assert abs(then / GIB - measured) / measured < 0.05, (running, then / GIB)
        assert me.draw_phase_bytes(QWEN, BF16, requests) < forward


def test_the_draw_phase_counts_the_penalty_counts_beside_the_adjusted_copy():
    """The penalties' C x V float32 counts (gathered from the count table), or the repetition
    penalty's marks, masks and float32 factor (7 bytes an element), live beside the adjusted
    copy until the chunk is drawn from (adjusted_rows): with today's chunks a top-p sort's 16
    rows x 48 bytes stay the larger, so the estimate only moves where an adjusted chunk outgrows
    the sort. The profile's draw reads one-row tables of its own (V x (4 + 1))."""
    r, v, e = 256, QWEN.vocab_size, 2
    logits = r * v * (e + 4)
    assert me.draw_phase_bytes(QWEN, BF16, r) == logits + v * 5 + v * (64 * 4 + 16 * 48)
    assert me.draw_phase_bytes(QWEN, BF16, r, sort_chunk=1, bias_chunk=128) == logits + v * 5 + v * 128 * (4 + 7)
    assert me.draw_phase_bytes(QWEN, BF16, r, bias_chunk=0) == logits + v * 16 * 48  # no bias, no penalty


def test_the_penalty_count_table_is_held_at_sizing():
    """(max_running_requests + 1) rows of V float32 counts and V bool marks, built on meta by the
    class the rank allocates; the plan holds them before the KV cache: the cache gets that much
    less (times kv_mem_fraction)."""
    for running in (64, 256):
        rt = PlanInput(max_running_requests=running).rank_spec().runtime
        assert ms.penalty_count_bytes(rt, QWEN.vocab_size) == (running + 1) * 151_936 * (4 + 1)
    assert ms.penalty_count_bytes(rt, QWEN.vocab_size) / GIB == pytest.approx(0.1818, abs=1e-4)
    plan = plan_capacity(PlanInput(max_running_requests=64))
    assert plan.components.penalty_counts_bytes / GIB == pytest.approx(0.0460, abs=1e-4)
    assert plan.components.as_dict()["penalty_counts"] == plan.components.penalty_counts_bytes
