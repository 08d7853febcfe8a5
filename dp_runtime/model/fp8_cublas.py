"""The dense FP8 linear on cuBLAS's block-scaled FP8 GEMM (torch's ``scaled_mm`` with 1x128
activation scales and 128 x 128 weight scales: DeepSeek's scheme, on Hopper since CUDA 12.9),
the activations quantized first by ``fp8_act_quant.quantize_act``.

It is the fastest FP8 dense GEMM measured here from a few hundred rows (H200, qwen3-30b-a3b's
qkv and o, docs/BENCHMARKS.md session 25: 0.72-0.92x the bf16 GEMM from 1,024 rows, where the
Triton W8A8 tile runs 1.2-1.5x) and loses at decode sizes, where ``fp8_gemm_triton`` streams
the weight with more programs (split-K). ``cublas_takes`` says where it runs.
"""

from __future__ import annotations

import torch

from dp_runtime.model.fp8_act_quant import quantize_act
from dp_runtime.model.fp8_blocks import Fp8BlockWeight

__all__ = ["cublas_fp8_linear", "cublas_takes"]


def _scaled_mm_api():
    """torch's ``(scaled_mm, ScalingType)``, or None for a torch without block-scaled FP8."""
    try:
        from torch.nn.functional import ScalingType, scaled_mm
    except ImportError:
        return None
    if not hasattr(ScalingType, "BlockWise1x128") or not hasattr(ScalingType, "BlockWise128x128"):
        return None
    return scaled_mm, ScalingType


def cublas_takes(x: torch.Tensor, w: Fp8BlockWeight) -> bool:
    """Whether ``cublas_fp8_linear`` runs ``x @ W.T``: bf16 on a Hopper GPU (compute capability
    9.x: cuBLAS's block-scaled FP8 is Hopper's), whole 128-blocks along N and K (the shapes
    measured), a torch that has the API."""
    n, k = w.values.shape[-2:]
    return (x.is_cuda and x.dtype == torch.bfloat16 and w.values.dim() == 2
            and w.block == (128, 128) and n % 128 == 0 and k % 128 == 0 and x.shape[-1] == k
            and torch.cuda.get_device_capability(x.device)[0] == 9
            and _scaled_mm_api() is not None)


def cublas_fp8_linear(x_MK: torch.Tensor, w: Fp8BlockWeight) -> torch.Tensor:
    """``x @ dequant(W).T`` in bf16: x quantized per token and 128 columns, then one cuBLAS
    block-scaled FP8 GEMM with fp32 accumulation. Where ``cublas_takes``; capturable."""
    scaled_mm, scaling = _scaled_mm_api()
    q, s = quantize_act(x_MK)
    # cuBLAS takes the activation scales outer-dim-major, (M, K / 128) with stride (1, M): the
    # transpose of quantize_act's (K / 128, M); and W as the column-major (K, N) view of (N, K).
    return scaled_mm(q, w.values.t(), scale_a=s.t(), scale_recipe_a=scaling.BlockWise1x128,
                     scale_b=w.scales.t(), scale_recipe_b=scaling.BlockWise128x128,
                     output_dtype=torch.bfloat16)
