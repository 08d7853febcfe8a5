"""Per-token dynamic FP8 activations for the W8A8 GEMMs: ``x`` (M, K) in bf16/fp16 becomes e4m3
values (M, K) and one float32 scale per row and 128-column group, ``max|x| / 448`` over the
group (DeepSeek's 1x128 scheme; ``fp8_blocks.fake_quant_activations`` is the float reference).

Quantized once per GEMM input, not per output tile: the GEMM then loads a byte per activation
and multiplies on the FP8 tensor cores with no rounding work in its loop.

The scales are stored group-major, (ceil(K / 128), M) contiguous, so that a GEMM's BLOCK_M rows
read their scales of one group as one coalesced run; ``scales.t()`` is the (M, K / 128)
"outer-dim-major" operand cuBLAS's block-scaled FP8 GEMM takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dp_runtime.model.fp8_blocks import FP8_DTYPE, FP8_MAX

__all__ = ["GROUP", "quantize_act"]

GROUP = 128  # columns per activation scale: one weight block's K extent


@triton.jit
def _quantize_act_kernel(x_ptr, stride_xm, q_ptr, stride_qm, s_ptr, m, k, FP8_MAX_C: tl.constexpr,
                         BLOCK_M: tl.constexpr, GROUP_C: tl.constexpr):
    """Program (row block, group): BLOCK_M rows x one 128-column group."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    offs_k = g * GROUP_C + tl.arange(0, GROUP_C)
    ok = (offs_m < m)[:, None] & (offs_k < k)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / FP8_MAX_C
    q = (x / scale[:, None]).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows * stride_qm + offs_k[None, :], q, mask=ok)
    tl.store(s_ptr + g.to(tl.int64) * m + offs_m, scale, mask=offs_m < m)


def quantize_act(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values (M, K) e4m3, scales (ceil(K / 128), M) float32)`` of ``x`` on a CUDA device (a
    launch; capturable). ``values[m, k] * scales[k // 128, m]`` approximates ``x[m, k]``."""
    m, k = x_MK.shape
    if x_MK.stride(1) != 1:
        x_MK = x_MK.contiguous()
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x_MK.device)
    s = torch.empty((-(-k // GROUP), m), dtype=torch.float32, device=x_MK.device)
    if m and k:
        block_m = 16
        _quantize_act_kernel[(triton.cdiv(m, block_m), s.shape[0])](
            x_MK, x_MK.stride(0), q, q.stride(0), s, m, k, FP8_MAX_C=FP8_MAX, BLOCK_M=block_m,
            GROUP_C=GROUP, num_warps=4)
    return q, s
