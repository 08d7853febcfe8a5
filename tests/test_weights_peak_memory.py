"""A preset's random weights in FP8 are built one tensor at a time: the host's peak while a model
is built is its FP8 storage plus one float tensor, never the model dtype's copy of all its
layers, and an EP rank holds only its own experts while it builds. Measured, not assumed: a fresh
process builds a toy of the qwen3-235b-a22b preset (its block-aligned shapes, 16 layers) on the
CPU in bf16 with ``--quantization fp8``, and reads its own peak resident memory (Linux's VmHWM)
around the build. The same code path builds a GPU rank (``rank_parts.load_model``: random
weights drawn on the rank's device, one tensor at a time, quantized into storage allocated
FP8), so qwen3-235b-a22b at EP 2 peaks near its 114 GiB of FP8 weights, not the ~230 GB of
bf16 that would not fit an H200.

The EP rank is described to the model by its dispatcher alone (an all-to-all dispatcher's
EPGroup without a process group: building the model reads its rank and size, and no collective
runs), so one process stands for rank 0 of 2 without a peer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Block-aligned for FP8 (q 512 and kv 128 rows, experts of 256 rows), big enough that a bf16
# copy of every layer (~220 MB) stands far above the FP8 storage (~110 MB) and allocator noise.
SHAPES = dict(vocab_size=1024, hidden_size=512, num_layers=16, num_heads=4, num_kv_heads=1,
              head_dim=128, num_experts=16, top_k=2, moe_intermediate_size=256,
              intermediate_size=256, max_position_embeddings=512)

SCRIPT = r"""
import json, sys
import torch
from dispatcher import AllToAllDispatcher, DispatcherConfig, EPGroup
from dp_runtime import memory_sizing as ms
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.model.quant_config import with_quantization
from dp_runtime.model.qwen3_moe import Qwen3MoeModel
from dp_runtime.model.weights import iter_random

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

def build(cfg, rank, size):
    ep = EPGroup(group=None, cpu_group=None, rank=rank, size=size)
    dcfg = DispatcherConfig(num_experts=cfg.num_experts, top_k=cfg.top_k,
                            hidden_size=cfg.hidden_size, dtype=torch.bfloat16,
                            max_tokens_per_rank=8)
    weights = iter_random(cfg, rank, size, torch.bfloat16, "cpu")
    return Qwen3MoeModel(cfg, weights, attention=None, dtype=torch.bfloat16, device="cpu",
                         dispatcher=AllToAllDispatcher(dcfg, ep, device="cpu"))

shapes, rank, size = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
float_cfg = ModelConfig.preset("qwen3-235b-a22b", **shapes)
cfg = with_quantization(float_cfg, "fp8")
# one layer first: the kernels' code is paged in before the baseline (the model is dropped at once)
build(with_quantization(ModelConfig.preset("qwen3-235b-a22b", **dict(shapes, num_layers=1)), "fp8"),
      0, 1)
try:  # the peak back to the present (Linux >= 4.0), so a warm-up's high mark cannot count
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
base = status("VmRSS")
model = build(cfg, rank, size)
print(json.dumps(dict(peak=status("VmHWM") - base, fp8=model.weight_bytes(),
                      local_experts=model.num_local_experts,
                      bf16=ms.weight_bytes_per_rank(float_cfg, torch.bfloat16, rank, size))))
"""


def _build(rank: int, size: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(SHAPES), str(rank), str(size)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_fp8_weights_are_built_one_tensor_at_a_time_and_an_ep_rank_holds_its_experts_only():
    whole = _build(0, 1)
    # The float copy of every layer would peak at bf16 + FP8 bytes; one tensor at a time peaks at
    # the FP8 storage plus the largest float temporary (the 1024 x 512 embedding, a few MB).
    assert whole["fp8"] < 0.55 * whole["bf16"], whole
    assert 0.9 * whole["fp8"] < whole["peak"] < whole["fp8"] + 24 * 2**20, whole
    half = _build(0, 2)
    # Rank 0 of EP 2 builds half of every layer's experts (about 56% of the whole model's bytes
    # with the shared attention and embeddings) and never holds the others'.
    assert half["local_experts"] == 8 and half["fp8"] < 0.6 * whole["fp8"], (half, whole)
    assert 0.9 * half["fp8"] < half["peak"] < half["fp8"] + 24 * 2**20, (half, whole)
    assert half["peak"] < 0.6 * whole["fp8"], (half, whole)
