"""A linear layer on an FP8 block-quantized weight, by rows on a CUDA GPU: the Triton tile
(``fp8_gemm_triton``, split-K at decode sizes) up to ``CUBLAS_FROM_ROWS``, cuBLAS's
block-scaled FP8 GEMM from there (``fp8_cublas``, where it runs; else the Triton tile).
Elsewhere (CPU, float32 models) the reference: ``F.linear`` on the dequantized weight.

An FP8 form of ``skinny_linear`` (the weight streamed with FMAs, no tensor cores) was tried at 1
row and lost to the Triton tile: 11.0 against 8.6 us for qkv, 10.6 against 7.5 for o (H200,
session 25)."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from dp_runtime.model.fp8_blocks import Fp8BlockWeight

__all__ = ["CUBLAS_FROM_ROWS", "fp8_kernel_runs", "fp8_linear"]

# Rows from which cuBLAS's block-scaled FP8 GEMM takes a projection. H200, qwen3-30b-a3b's qkv
# and o (bench/fp8_tune.py, docs/BENCHMARKS.md session 25), cuBLAS against the Triton tile: at 64
# rows 10.7 vs 11.5 us (qkv) and 15.5 vs 10.1 (o); at 256, 11.8 vs 22.7 and 16.7 vs 27.2.
CUBLAS_FROM_ROWS = 65


def fp8_kernel_runs(x: torch.Tensor) -> bool:
    """Whether the FP8 kernels take activations like ``x``: CUDA sm89+, bf16/fp16."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and importlib.util.find_spec("triton") is not None)


def fp8_linear(x: torch.Tensor, w: Fp8BlockWeight, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ b)`` for ``x`` (M, K) and the quantized ``W`` (N, K), in x's dtype."""
    if not fp8_kernel_runs(x):
        return F.linear(x, w.dequantize(x.dtype), b)
    from dp_runtime.model.fp8_cublas import cublas_fp8_linear, cublas_takes
    from dp_runtime.model.fp8_gemm_triton import fp8_block_linear

    if x.shape[0] >= CUBLAS_FROM_ROWS and cublas_takes(x, w):
        y = cublas_fp8_linear(x, w)
    else:
        y = fp8_block_linear(x, w)
    return y if b is None else y + b
