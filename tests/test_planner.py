"""The capacity planner (launch/planner.py) and the sizing functions it adds (CPU, no GPU).

Expected numbers are computed here by hand from the model's published shapes, not by calling
the function under test.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest
import torch

from buffers import BufferPool, build_decode_registry, build_prefill_registry
from dispatcher.sizing import all_to_all_buffer_bytes, flashinfer_workspace_bytes_per_rank
from dp_runtime import memory_estimates as me
from dp_runtime import memory_sizing as ms
from dp_runtime.choices import resolve_choices
from dp_runtime.config import RuntimeConfig
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.sync.padding_mode import PaddingMode
from launch.planner import (
    GIB,
    GPUS,
    MEASURED_COMPONENTS,
    SCHEMA,
    PlanInput,
    compare_measured,
    gpu_spec,
    largest_max_running_requests,
    plan_capacity,
)

QWEN = ModelConfig.preset("qwen3-30b-a3b")
BF16 = torch.bfloat16
H100 = GPUS["h100"].mem_bytes


def qwen_weight_bytes_by_hand(local_experts: int) -> int:
    """Qwen3-30B-A3B in bf16: embed + lm_head + final norm, 48 layers of attention, router and
    ``local_experts`` experts (gate, up: 768 x 2048; down: 2048 x 768)."""
    v, h, layers = 151936, 2048, 48
    q, kv, hd, e, i = 32 * 128, 4 * 128, 128, 128, 768
    per_layer = 2 * h + q * h + 2 * kv * h + h * q + 2 * hd + e * h + local_experts * 3 * i * h
    return 2 * (2 * v * h + h + layers * per_layer)


# -- arithmetic of the presets ----------------------------------------------------------------------
def test_qwen_weights_match_hand_arithmetic_and_the_brief():
    assert qwen_weight_bytes_by_hand(128) == 61_064_245_248
    assert qwen_weight_bytes_by_hand(64) == 32_073_216_000
    assert ms.weight_bytes_per_rank(QWEN, BF16, 0, 1) == 61_064_245_248
    assert ms.weight_bytes_per_rank(QWEN, BF16, 1, 2) == 32_073_216_000
    plan = plan_capacity(PlanInput(dp_size=2, max_running_requests=8))
    assert plan.components.weights_bytes == 32_073_216_000
    assert (plan.ep_rank, plan.local_experts) == (0, 64)


def test_uneven_experts_plan_the_rank_with_the_most():
    plan = plan_capacity(PlanInput(dp_size=3, max_running_requests=8))  # 128 = 43 + 43 + 42
    assert (plan.ep_rank, plan.local_experts) == (0, 43)
    assert plan.components.weights_bytes == qwen_weight_bytes_by_hand(43)
    assert plan.components.weights_bytes > ms.weight_bytes_per_rank(QWEN, BF16, 2, 3)


def test_kv_bytes_per_token_by_hand():
    assert ms.kv_bytes_per_token(QWEN, BF16) == 2 * 48 * 4 * 128 * 2 == 98_304
    tiny = ModelConfig.preset("tiny")
    assert ms.kv_bytes_per_token(tiny, torch.float32) == 2 * 2 * 2 * 16 * 4
    assert plan_capacity(PlanInput()).kv.bytes_per_token == 98_304


def test_tiny_preset_weights_by_hand():
    # tiny: vocab 256, hidden 64, 2 layers, 4 q / 2 kv heads of 16, 8 experts of 32, bf16.
    h, per_layer = 64, 2 * 64 + 64 * 64 + 2 * 32 * 64 + 64 * 64 + 2 * 16 + 8 * 64 + 8 * 3 * 32 * 64
    plan = plan_capacity(PlanInput(model="tiny", max_running_requests=4, chunked_prefill_size=64))
    assert plan.components.weights_bytes == 2 * (2 * 256 * h + h + 2 * per_layer)
    assert plan.context_len == 2048  # min(max_position_embeddings 2048, the default 4096)


def test_dp_buffers_and_padding_modes_by_hand():
    plan = plan_capacity(PlanInput(dp_size=4, max_running_requests=64, chunked_prefill_size=4096, nvlink=False))
    assert plan.dispatcher == "all_gather"
    p, hidden_row, routing_row = 4096, 2048 * 2, 8 * 8
    row = hidden_row + routing_row
    assert plan.runtime.max_tokens_per_rank == p
    # gathered hidden and routing rows for every rank, and this rank's local hidden rows
    assert plan.components.dp_buffers_bytes == 4 * p * row + p * hidden_row
    modes = {m.padding: m for m in plan.dp_buffer_modes}
    # MAX_LEN pads every rank to the longest: one full rank costs the whole buffer.
    assert modes["max_len"].one_rank_full_rows == 4 * p
    assert modes["sum_len"].one_rank_full_rows == p
    assert modes["max_len"].all_ranks_full_rows == modes["sum_len"].all_ranks_full_rows == 4 * p
    assert modes["sum_len"].one_rank_full_bytes == p * row


def test_dp_gathered_rows_follows_the_layout_rule():
    assert ms.dp_gathered_rows((5, 0, 3), PaddingMode.MAX_LEN, 8) == 15
    assert ms.dp_gathered_rows((5, 0, 3), PaddingMode.SUM_LEN, 8) == 8
    with pytest.raises(ValueError, match="max_tokens_per_rank=4"):
        ms.dp_gathered_rows((5, 0), PaddingMode.SUM_LEN, 4)


def test_dispatcher_workspace_is_dispatcher_sizing():
    plan = plan_capacity(PlanInput(dp_size=2, max_running_requests=64))  # auto + NVLink: flashinfer
    assert plan.dispatcher == "flashinfer"
    assert plan.components.dispatcher_workspace_bytes == flashinfer_workspace_bytes_per_rank(2, 8192, 2048, 8, BF16)
    assert not plan.components.dispatcher_workspace_transient
    assert plan.total_bytes == sum(plan.components.as_dict().values())


def test_transient_workspace_is_counted_once_inside_the_activation_peak():
    plan = plan_capacity(PlanInput(dispatcher="all_to_all", use_cuda_graph=False, max_running_requests=64))
    ws = all_to_all_buffer_bytes(1, 8192, 2048, 8, BF16)
    c = plan.components
    assert c.dispatcher_workspace_bytes == ws and c.dispatcher_workspace_transient
    local = me.largest_step_bytes_estimate(QWEN, plan.runtime, 4096, attention="flashinfer", dispatcher="local")
    # all_to_all's step buffers at 8192 tokens, and its expert output (8192 rows, as local's)
    assert c.activation_peak_bytes == local + ws
    assert plan.total_bytes == sum(c.as_dict().values()) - ws


def test_the_gather_dispatchers_storage_is_the_dp_buffer_services():
    """all_gather keeps no workspace of its own: its gathered rows are dp_buffers, which the
    planner sizes with the service itself (hidden, local and routing rows)."""
    base = dict(model="tiny", dp_size=2, ep_size=2, max_running_requests=16, chunked_prefill_size=64)
    ag = plan_capacity(PlanInput(dispatcher="all_gather", **base)).components
    fi = plan_capacity(PlanInput(dispatcher="flashinfer", **base)).components
    tiny = ModelConfig.preset("tiny")
    rows = 64 * 2
    assert ag.dispatcher_workspace_bytes == 0
    assert ag.dp_buffers_bytes == rows * tiny.hidden_size * 2 + 64 * tiny.hidden_size * 2 + rows * 2 * tiny.top_k * 4
    assert fi.dp_buffers_bytes == 0  # an all-to-all dispatcher: no gathered storage at all


def test_graph_inputs_are_the_per_name_maxima_of_both_registries():
    rt = RuntimeConfig(dp_size=2, hidden_size=64, max_running_requests=48, chunked_prefill_size=512, device="cpu")
    p, b = rt.max_tokens_per_rank, rt.max_running_requests
    # eager registry: input_ids, positions, out_cache_loc (P int64); req_pool_indices, seq_lens,
    # extend_seq_lens, extend_prefix_lens (mrr int64); 1 + 2*dp int32 counters. The decode
    # registry's names are all among these and smaller; seq_lens_cpu is host memory.
    assert ms.graph_input_bytes(rt) == 3 * p * 8 + 4 * b * 8 + 4 * 1
    assert ms.graph_input_bytes(rt, input_embeds=True) == ms.graph_input_bytes(rt) + p * 64 * 2
    # What one shared pool materializes (the larger registry first, as the worker builds them).
    pool = BufferPool()
    build_prefill_registry(b, p, "meta", pool, dp_size=2, register_input_embeds=False)
    build_decode_registry(rt.cuda_graph_bs[-1], "meta", pool, dp_size=2)
    shared = sum(e.nbytes for e in pool.report() if e.device.type != "cpu")
    assert ms.graph_input_bytes(rt) == shared
    # what a rank reads off its real pool at sizing (allocator_cache): the same, host slots left out
    assert ms.pool_device_bytes(pool) == shared < pool.total_bytes()


# -- verdicts ---------------------------------------------------------------------------------------
def test_qwen_on_one_h100():
    full = plan_capacity(PlanInput(max_running_requests=256))  # 256 x 4096 tokens of KV: no
    assert not full.fits and "KV cache" in full.reason and "1048576" in full.reason
    small = plan_capacity(PlanInput(max_running_requests=32))
    assert small.fits, small.reason
    assert 32 <= full.largest_max_running_requests < 256
    assert full.largest_max_running_requests == small.largest_max_running_requests


def test_qwen_on_a_24_gib_gpu_names_the_weights():
    plan = plan_capacity(PlanInput(gpu_mem_bytes=24 * GIB, max_running_requests=8))
    assert not plan.fits
    assert plan.reason.startswith("weights alone are 56.87 GiB")
    assert plan.largest_max_running_requests == 0
    assert plan.kv.slots == 0 and plan.components.kv_cache_bytes == 0 and plan.free_bytes < 0


def test_largest_is_the_boundary_of_the_rule():
    inp = PlanInput(dp_size=2)
    n = largest_max_running_requests(inp)
    assert n > 0
    assert plan_capacity(replace(inp, max_running_requests=n)).fits
    assert not plan_capacity(replace(inp, max_running_requests=n + 1)).fits
    for m in (1, n // 3, n // 2, n - 1):  # monotone below the boundary
        assert plan_capacity(replace(inp, max_running_requests=max(1, m))).fits


def test_largest_grows_with_memory_and_shrinks_with_context():
    base = PlanInput(dp_size=2)
    h100 = largest_max_running_requests(base)
    h200 = largest_max_running_requests(replace(base, gpu_mem_bytes=GPUS["h200"].mem_bytes))
    short = largest_max_running_requests(replace(base, context_len=2048))
    relaxed = largest_max_running_requests(replace(base, kv_tokens_per_request=1024))
    assert h200 > h100 and short > h100 and relaxed > short


def test_explicit_graph_sizes_bound_the_search():
    plan = plan_capacity(PlanInput(cuda_graph_bs=(1, 2, 4, 64), max_running_requests=64, context_len=32768))
    assert plan.runtime.cuda_graph_bs == (1, 2, 4, 64)
    # 64 requests at full 32k context do not fit on one H100, and fewer is not a valid config.
    assert not plan.fits and plan.largest_max_running_requests == 0


# -- inputs and rules -------------------------------------------------------------------------------
def test_invalid_combination_raises_the_runtime_config_error():
    with pytest.raises(ValueError, match="ep_size must be an int >= 1 that divides world_size"):
        plan_capacity(PlanInput(dp_size=3, ep_size=2))
    with pytest.raises(ValueError, match="exceeds context_len"):
        plan_capacity(PlanInput(context_len=1024, kv_tokens_per_request=2048))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        plan_capacity(PlanInput(context_len=10**6))
    with pytest.raises(ValueError, match="neither a preset"):
        plan_capacity(PlanInput(model="no-such-model"))


def test_model_from_config_json(tmp_path):
    tiny = ModelConfig.preset("tiny")
    hf = dict(model_type="qwen3_moe", vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size, num_hidden_layers=tiny.num_layers,
              num_attention_heads=tiny.num_heads, num_key_value_heads=tiny.num_kv_heads, head_dim=tiny.head_dim,
              num_experts=tiny.num_experts, num_experts_per_tok=tiny.top_k,
              moe_intermediate_size=tiny.moe_intermediate_size, max_position_embeddings=2048)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    kw = dict(max_running_requests=4, chunked_prefill_size=64)
    preset = plan_capacity(PlanInput(model="tiny", **kw)).components
    assert plan_capacity(PlanInput(model=str(tmp_path), **kw)).components.weights_bytes == preset.weights_bytes
    by_file = plan_capacity(PlanInput(model=str(tmp_path / "config.json"), **kw))
    assert by_file.components.weights_bytes == preset.weights_bytes


def _choices(dispatcher="auto", world=2, device="cuda", graphs=None, sizes=(1, 2), fi=(True, ""), **kw):
    base = dict(attention="auto", dtype=torch.bfloat16, head_dim=128, flashinfer_importable=True)
    base.update(kw)
    return resolve_choices(dispatcher=dispatcher, use_cuda_graph=graphs, world_size=world, device_type=device,
                           capture_sizes=sizes, flashinfer_dispatch=fi, **base)


def test_the_auto_rules_are_one_function_for_worker_and_planner():
    assert _choices().graphs and _choices(sizes=()).graphs is False
    assert _choices(graphs=False).graphs is False and _choices(device="cpu").graphs is False
    assert _choices(world=1).dispatcher == "local"
    assert _choices().dispatcher == "flashinfer"
    assert _choices(fi=(False, "no NVLink")).dispatcher == "all_gather"  # graphs need a capturable one
    assert _choices(fi=(False, "no NVLink"), graphs=False).dispatcher == "all_to_all"
    assert _choices(dispatcher="all_gather").dispatcher_reason == "configured"
    with pytest.raises(ValueError, match="cannot be captured"):
        _choices(dispatcher="all_to_all")
    with pytest.raises(ValueError, match="'local' runs only at world size 1"):
        _choices(dispatcher="local")
    assert _choices().attention == "flashinfer" and _choices(head_dim=96).attention == "sdpa"
    assert _choices(flashinfer_importable=False).attention == "sdpa"
    with pytest.raises(ValueError, match="head_dim 96"):
        _choices(attention="flashinfer", head_dim=96)
    # the planner asks the same function, with NVLink as the FlashInfer verdict
    inp = PlanInput(model="tiny", dp_size=2, ep_size=2, max_running_requests=4, chunked_prefill_size=64, nvlink=False)
    assert plan_capacity(inp).dispatcher == "all_gather"
    assert plan_capacity(dataclasses.replace(inp, nvlink=True)).dispatcher == "flashinfer"


def test_gpu_names():
    assert gpu_spec("H100").mem_bytes == round(79.1 * GIB)
    assert gpu_spec("h200 141gb") is GPUS["h200"]
    assert gpu_spec("A100_40GB").mem_bytes == round(39.39 * GIB)
    assert not gpu_spec("l40s").nvlink
    with pytest.raises(ValueError, match="known: h100"):
        gpu_spec("tpu")


# -- JSON schema ------------------------------------------------------------------------------------
def test_json_schema_keys_are_stable():
    doc = json.loads(plan_capacity(PlanInput(dp_size=2, max_running_requests=64)).to_json())
    assert doc["schema"] == SCHEMA == "dp-runtime.plan/5"
    assert set(doc) == {
        "schema", "input", "resolved", "components_bytes", "dp_buffer_modes", "kv", "gpu_mem_bytes",
        "total_bytes", "graph_reserve_bytes", "headroom_bytes", "free_bytes", "fits", "reason",
        "largest_max_running_requests",
    }
    assert set(doc["input"]) == {
        "model", "dtype", "kv_cache_dtype", "dp_size", "ep_size", "gpu", "gpu_mem_bytes", "nvlink",
        "max_running_requests", "chunked_prefill_size", "cuda_graph_bs", "context_len", "dispatcher",
        "use_cuda_graph", "kv_tokens_per_request", "kv_mem_fraction", "quantization"}
    assert set(doc["resolved"]) == {
        "world_size", "ep_size", "ep_rank", "local_experts", "dtype", "kv_cache_dtype", "dispatcher",
        "dispatcher_reason",
        "dispatcher_workspace_transient", "cuda_graphs", "cuda_graphs_reason", "cuda_graph_bs",
        "max_tokens_per_rank", "max_global_tokens", "context_len", "kv_tokens_per_request", "weights"}
    assert list(doc["components_bytes"]) == [
        "weights", "kv_cache", "dp_buffers", "dispatcher_workspace", "graph_inputs", "penalty_counts",
        "graph_pool", "activation_peak", "allocator_cache", "nccl", "cuda_context",
    ]
    assert set(doc["dp_buffer_modes"]) == {"max_len", "sum_len"}
    for mode in doc["dp_buffer_modes"].values():
        assert set(mode) == {"one_rank_full_rows", "one_rank_full_bytes", "all_ranks_full_rows",
                             "all_ranks_full_bytes"}
    assert set(doc["kv"]) == {"bytes_per_token", "slots", "tokens", "requests_at_full_context", "needed_slots"}
    assert doc["total_bytes"] == sum(doc["components_bytes"].values())  # flashinfer: persistent
    assert doc["free_bytes"] == doc["gpu_mem_bytes"] - doc["total_bytes"]
    assert doc["resolved"]["world_size"] == 2 and doc["input"]["ep_size"] is None


# -- predicted vs measured ---------------------------------------------------------------------------
def test_compare_measured():
    plan = plan_capacity(PlanInput(max_running_requests=32, dispatcher="all_gather"))
    predicted = plan.components.as_dict()
    measured = {"weights": predicted["weights"], "kv_cache": predicted["kv_cache"] * 2,
                "dp_buffers": predicted["dp_buffers"] // 2, "graph_pool": 0, "activation_peak": 0,
                "extra": 5}
    rows = {r.component: r for r in compare_measured(plan, measured)}
    assert list(rows) == list(MEASURED_COMPONENTS)
    assert rows["weights"].error_pct == 0.0
    assert rows["kv_cache"].error_pct == pytest.approx(-50.0)
    assert rows["dp_buffers"].error_pct == pytest.approx(100.0)
    assert rows["graph_inputs"].measured_bytes is None and rows["graph_inputs"].error_pct is None
    assert rows["graph_pool"].error_pct is None  # measured 0, predicted > 0: no finite error
    assert rows["dispatcher_workspace"].predicted_bytes == predicted["dispatcher_workspace"]
    zero_plan = plan_capacity(PlanInput(use_cuda_graph=False, dispatcher="all_to_all", max_running_requests=32))
    assert compare_measured(zero_plan, {"graph_pool": 0})[MEASURED_COMPONENTS.index("graph_pool")].error_pct == 0.0
