"""``plan`` for Qwen3-235B-A22B (the ``qwen3-235b-a22b`` preset) on H200s: which (dp, ep,
weight format) fit with room for KV, from the sizing functions the ranks allocate with."""

from __future__ import annotations

import torch

from dp_runtime import memory_sizing as ms
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.model.quant_config import with_quantization
from launch.gpu_specs import gpu_spec
from launch.planner import PlanInput, plan_capacity

H200 = gpu_spec("H200")


def _plan(dp: int, quantization: str, mrr: int = 64):
    return plan_capacity(PlanInput(model="qwen3-235b-a22b", dp_size=dp, ep_size=dp, quantization=quantization,
                                   gpu_mem_bytes=H200.mem_bytes, gpu_name=H200.name, max_running_requests=mrr))


def test_the_presets_weights_by_hand():
    cfg = ModelConfig.preset("qwen3-235b-a22b")
    h, i, e, layers = 4096, 1536, 128, 94
    attn = (64 * 128 + 2 * 4 * 128) * h + h * 64 * 128
    per_layer = attn + e * h + e * 3 * h * i + 2 * h + 2 * 128
    total = 2 * 151936 * h + h + layers * per_layer
    assert ms.weight_bytes_per_rank(cfg, torch.bfloat16) == 2 * total  # about 438 GiB
    # FP8: a byte per value and a float32 scale per 128x128 block of every quantized GEMM
    fp8 = ms.weight_bytes_per_rank(with_quantization(cfg, "fp8"), torch.bfloat16)
    gemm = layers * (attn + e * 3 * h * i)
    scales = layers * (((64 * 128 + 2 * 4 * 128) // 128) * 32 + 32 * 64 + e * (2 * 12 * 32 + 32 * 12))
    assert fp8 == 2 * total - gemm + 4 * scales


def test_dep4_fits_in_fp8_with_kv_room_and_dep2_fits_less():
    dep4 = _plan(4, "fp8")
    assert dep4.fits and dep4.local_experts == 32
    assert dep4.largest_max_running_requests >= 64  # requests at the full 4096-token context
    dep2 = _plan(2, "fp8")
    assert not dep2.fits and 0 < dep2.largest_max_running_requests < 64
    assert "max_running_requests 64 x 4096 tokens needs 262144" in dep2.reason


def test_bf16_needs_more_gpus_and_one_gpu_holds_neither():
    assert _plan(4, "none").largest_max_running_requests < _plan(4, "fp8").largest_max_running_requests
    one = _plan(1, "fp8")
    assert not one.fits and one.reason.startswith("weights alone are")
