"""The FP8-weight contraction the FP8 GEMMs share (``fused_moe_triton``'s expert tile and
``fp8_gemm_triton``'s dense linear): a BLOCK_M x BLOCK_N accumulator over K.

Two forms (``QUANT_A``). W8A16, for the memory-bound sizes (decode, mixed steps): each step's
FP8 weight tile is scaled by its block's scale into the activation's dtype in registers and the
MMAs accumulate on one chain, so the weights cross HBM at a byte per value and the pipeline is
the bf16 kernel's. W8A8, for compute-bound sizes: the activations arrive already quantized
(``fp8_act_quant.quantize_act``: e4m3 values and a scale per row and 128 columns); each step
multiplies the FP8 tiles on the FP8 tensor cores and adds the product into the fp32
accumulator scaled by the row's activation scale and the column's weight-block scale (BLOCK_K
divides 128, so a step lies inside one weight block and one activation group).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["W8A8_MIN_ROWS", "fp8_weight_dot", "use_w8a8"]

# Rows of a GEMM call from which the W8A8 form runs by default (``use_w8a8``); fewer take
# W8A16. On an H200 (bench/fp8_tune.py, docs/BENCHMARKS.md session 25) W8A8 on activations
# quantized before the GEMM beat W8A16 for the experts at every row count (19.6 vs 31.0 us at 1
# row, 168 vs 179 at 64, 207 vs 256 at 256, 312 vs 471 at 1,024) and matched or beat it for the
# dense tiles but one (o_proj at 8 rows, 8.3 vs 7.7 us). Session 24's W8A8, which rounded the
# activations inside the GEMM per output tile, had lost to W8A16 almost everywhere.
W8A8_MIN_ROWS: int | None = 1


def use_w8a8(rows: int, w8a8: bool | None = None) -> bool:
    """The form a call of ``rows`` rows runs: ``w8a8`` when given, else W8A8 from
    ``W8A8_MIN_ROWS`` rows."""
    if w8a8 is not None:
        return w8a8
    return W8A8_MIN_ROWS is not None and rows >= W8A8_MIN_ROWS


@triton.jit
def fp8_weight_dot(acc, acc_up, a_ptrs, a_mask_m, sa_ptrs, stride_sak, w_ptrs, up_offset, s_ptrs,
                   s_up_ptrs, stride_sk, k_in, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   GATED: tl.constexpr, QUANT_A: tl.constexpr):
    """``acc += A @ dequant(W)`` over the whole contraction (and with GATED ``acc_up`` from the
    weight rows ``up_offset`` elements on). QUANT_A (W8A8): A is e4m3, ``sa_ptrs`` (BLOCK_M,)
    at each row's scale of the first 128-column group, ``stride_sak`` apart per group; an FP8
    MMA per step, scaled into the accumulator. Else (W8A16) the weight tile is scaled into A's
    dtype in registers and the MMAs chain on one accumulator (``sa_ptrs`` unread). ``a_ptrs``
    (BLOCK_M, BLOCK_K) and ``w_ptrs`` (BLOCK_K, BLOCK_N) point at the first step (unit stride
    along K for both: they advance by BLOCK_K elements per step); ``a_mask_m`` masks A's rows;
    ``s_ptrs`` / ``s_up_ptrs`` (BLOCK_N,) at each column's weight-block scale of the first K
    block, ``stride_sk`` apart along K. Returns the fp32 accumulators."""
    offs_k = tl.arange(0, BLOCK_K)
    for kk in range(0, tl.cdiv(k_in, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=a_mask_m[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < k_in - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=a_mask_m[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        group = (kk * BLOCK_K) // 128
        s_w = tl.load(s_ptrs + group * stride_sk)
        if QUANT_A:
            s_a = tl.load(sa_ptrs + group * stride_sak, mask=a_mask_m, other=0.0)
            acc += tl.dot(a, w) * s_a[:, None] * s_w[None, :]
        else:
            acc = tl.dot(a, (w.to(tl.float32) * s_w[None, :]).to(a.dtype), acc=acc)
        if GATED:
            if EVEN_K:
                w_up = tl.load(w_ptrs + up_offset)
            else:
                w_up = tl.load(w_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
            s_up = tl.load(s_up_ptrs + group * stride_sk)
            if QUANT_A:
                acc_up += tl.dot(a, w_up) * s_a[:, None] * s_up[None, :]
            else:
                acc_up = tl.dot(a, (w_up.to(tl.float32) * s_up[None, :]).to(a.dtype), acc=acc_up)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up
