"""A linear layer on an FP8 block-quantized weight: the W8A8 Triton kernel on a CUDA GPU
(``fp8_gemm_triton``: per-token 1x128 activation scales computed in the kernel), else the
reference, ``F.linear`` on the dequantized weight (the CPU path, float32 models)."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from dp_runtime.model.fp8_blocks import Fp8BlockWeight

__all__ = ["fp8_kernel_runs", "fp8_linear"]


def fp8_kernel_runs(x: torch.Tensor) -> bool:
    """Whether the Triton W8A8 kernel takes activations like ``x``: CUDA sm89+, bf16/fp16."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and importlib.util.find_spec("triton") is not None)


def fp8_linear(x: torch.Tensor, w: Fp8BlockWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ b)`` for ``x`` (M, K) and the quantized ``W`` (N, K), in x's dtype."""
    if fp8_kernel_runs(x):
        from dp_runtime.model.fp8_gemm_triton import fp8_block_linear

        y = fp8_block_linear(x, w)
        return y if b is None else y + b
    return F.linear(x, w.dequantize(x.dtype), b)
