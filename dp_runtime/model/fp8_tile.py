"""The FP8-weight contraction the FP8 GEMMs share (``fused_moe_triton``'s expert tile and
``fp8_gemm_triton``'s dense linear): a BLOCK_M x BLOCK_N accumulator over K, each step's
activation tile quantized in registers.

Two forms (``QUANT_A``). W8A16, for the memory-bound sizes (decode, mixed steps): each step's
FP8 weight tile is scaled by its block's scale into the activation's dtype in registers and the
MMAs accumulate on one chain, so the weights cross HBM at a byte per value and the pipeline is
the bf16 kernel's. W8A8, for compute-bound sizes: per BLOCK_K step (BLOCK_K divides 128, so a
step lies inside one weight block) the activation
tile (bf16/fp16) gets a per-row dynamic scale ``s_a = max|a| / 448`` over the step's columns and
is rounded to e4m3; the FP8 weight tile is loaded as stored; ``tl.dot`` of the two (tensor-core
FP8 MMA) is scaled by ``s_a`` per row and the weight block's scale per column, and added in
fp32. An activation group is BLOCK_K wide (128 or 64): per-token 1x128 scales (DeepSeek's
scheme), or finer. Quantizing in the consumer rather than in a separate kernel saves a launch
and a round trip of the activation through memory; at decode sizes the redundant work (each
column tile re-quantizes the same rows) is a few instructions per loaded element.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["W8A8_MIN_ROWS", "fp8_weight_dot", "use_w8a8"]

# Rows of a GEMM call from which the W8A8 form runs by default (``use_w8a8``); fewer take
# W8A16. None: never. On an H200 (bench/fp8_kernels.py, docs/BENCHMARKS.md session 24) W8A16
# was faster for the dense projections at every size (1.3-2x) and for the experts from 256 rows
# (1.08-2.7x); W8A8 won only at 1 and 64 expert rows, by 1-5%, not worth its accuracy. The W8A8
# form's per-step rescale keeps its MMAs from chaining; its activation rounding is repeated per
# column tile.
W8A8_MIN_ROWS: int | None = None


def use_w8a8(rows: int, w8a8: bool | None = None) -> bool:
    """The form a call of ``rows`` rows runs: ``w8a8`` when given, else W8A8 from
    ``W8A8_MIN_ROWS`` rows."""
    if w8a8 is not None:
        return w8a8
    return W8A8_MIN_ROWS is not None and rows >= W8A8_MIN_ROWS


@triton.jit
def fp8_weight_dot(acc, acc_up, a_ptrs, a_mask_m, w_ptrs, up_offset, s_ptrs, s_up_ptrs, stride_sk, k_in,
             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GATED: tl.constexpr, QUANT_A: tl.constexpr):
    """``acc += A @ dequant(W)`` over the whole contraction (and with GATED ``acc_up`` from the
    weight rows ``up_offset`` elements on). QUANT_A: W8A8, A rounded to e4m3 per row and step
    and an FP8 MMA scaled after each step; else W8A16, the weight tile scaled into A's dtype in
    registers and the MMAs chained on one accumulator. ``a_ptrs`` (BLOCK_M, BLOCK_K) and
    ``w_ptrs`` (BLOCK_K, BLOCK_N) point at the first step (unit stride along K for both: they
    advance by BLOCK_K elements per step); ``a_mask_m`` masks A's rows; ``s_ptrs`` /
    ``s_up_ptrs`` (BLOCK_N,) at each column's weight-block scale of the first K block,
    ``stride_sk`` apart along K. Returns the fp32 accumulators."""
    offs_k = tl.arange(0, BLOCK_K)
    for kk in range(0, tl.cdiv(k_in, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < k_in - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=a_mask_m[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        k_block = ((kk * BLOCK_K) // 128) * stride_sk
        s_w = tl.load(s_ptrs + k_block)
        if QUANT_A:
            af = a.to(tl.float32)
            s_a = tl.maximum(tl.max(tl.abs(af), axis=1), 1e-12) / 448.0
            a_q = (af / s_a[:, None]).to(tl.float8e4nv)
            acc += tl.dot(a_q, w) * s_a[:, None] * s_w[None, :]
        else:
            acc = tl.dot(a, (w.to(tl.float32) * s_w[None, :]).to(a.dtype), acc=acc)
        if GATED:
            if EVEN_K:
                w_up = tl.load(w_ptrs + up_offset)
            else:
                w_up = tl.load(w_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
            s_up = tl.load(s_up_ptrs + k_block)
            if QUANT_A:
                acc_up += tl.dot(a_q, w_up) * s_a[:, None] * s_up[None, :]
            else:
                acc_up = tl.dot(a, (w_up.to(tl.float32) * s_up[None, :]).to(a.dtype), acc=acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up
