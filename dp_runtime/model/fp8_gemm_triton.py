"""The dense linear on FP8 block weights: ``y = x @ W.T`` for bf16/fp16 ``x`` (M, K) and an
Fp8BlockWeight ``W`` (N, K) with 128 x 128 block scales.

Each program owns a BLOCK_M x BLOCK_N output tile and walks K with ``fp8_tile.fp8_weight_dot``
(W8A16 by default; W8A8 takes the activations quantized by ``fp8_act_quant.quantize_act``, one
launch before the GEMM). Tiles by rows: decode sizes stream the weight with
narrow column tiles and split K (``split_k``: fp32 partial tiles summed in order by a second
launch, deterministic) so that every SM streams part of the weight; prefill sizes take 128-row
tiles grouped along M for L2 reuse. No host sync: capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dp_runtime.model.fp8_act_quant import quantize_act
from dp_runtime.model.fp8_blocks import Fp8BlockWeight
from dp_runtime.model.fp8_tile import fp8_weight_dot, use_w8a8

__all__ = ["fp8_block_linear", "fp8_linear_tiles", "split_k"]


@triton.jit(do_not_specialize=["m"])
def _fp8_linear_kernel(x_ptr, stride_xm, xs_ptr, w_ptr, stride_wn, s_ptr, stride_sn, y_ptr,
                       stride_ym, m, n, k, k_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                       QUANT_A: tl.constexpr, SPLIT_K: tl.constexpr):
    """One output tile over K, or (SPLIT_K > 1) over the ``k_split`` columns of K that
    ``program_id(1)`` owns (a multiple of 128: a split starts a scale block), its fp32 partial
    stored at plane ``program_id(1)`` of ``y`` (SPLIT_K, m, n) for ``_sum_splits_kernel``."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    k0 = tl.program_id(1) * k_split
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % n  # wrapped: weight loads stay in bounds, extra columns dropped at the store
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < m
    a_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k0 + offs_k[None, :]
    w_ptrs = w_ptr + offs_wn.to(tl.int64)[None, :] * stride_wn + k0 + offs_k[:, None]
    s_ptrs = s_ptr + (offs_wn // 128) * stride_sn + k0 // 128
    sa_ptrs = xs_ptr + (k0 // 128) * m + offs_m  # W8A8: x's scales, (K / 128, m) contiguous
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_len = tl.minimum(k - k0, k_split)
    acc, _ = fp8_weight_dot(acc, acc, a_ptrs, m_ok, sa_ptrs, m, w_ptrs, 0, s_ptrs, s_ptrs, 1, k_len,
                            BLOCK_K, EVEN_K, False, QUANT_A)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K > 1:
        y_ptrs += tl.program_id(1).to(tl.int64) * m * stride_ym
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (offs_n[None, :] < n))


@triton.jit
def _sum_splits_kernel(part_ptr, y_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """``y = sum over planes of part`` (SPLIT_K, numel) in plane order: deterministic, no
    atomics."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + i * numel + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def fp8_linear_tiles(m: int) -> dict[str, int]:
    """Launch constants by rows: narrow column tiles and deep pipelines at decode sizes (the
    weight's bytes are the cost), 128 x 64 tiles from 65 rows (W8A8 at 1,024-4,096 rows on an
    H200: 45 / 144 us for qkv against 59 / 181 with 128 x 128 tiles at 8 warps). At 64 rows
    32-column tiles: 9.0 / 11.1 us for o / qkv against 10.0 / 11.4 with 64 (bench/fp8_tune.py)."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    return dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)


# Split-K: at decode sizes a projection has few output tiles (o_proj at 64 rows: 32 tiles of 64
# columns for 132 SMs), so each of them streams a long run of K alone. Splitting K until about
# this many programs run puts every SM to work on the weight, each split at least 4 K steps.
SPLIT_K_PROGRAMS = 256
_MIN_STEPS_PER_SPLIT = 4


def split_k(m: int, n: int, k: int, tiles: dict[str, int]) -> int:
    """The K splits of an (m, n, k) call with ``tiles`` (1: none); a pure function of the
    shapes, so a captured graph and an eager call split alike."""
    programs = -(-m // tiles["BLOCK_M"]) * -(-n // tiles["BLOCK_N"])
    steps = -(-k // 128)
    if m > 64 or programs >= SPLIT_K_PROGRAMS:
        return 1
    return max(1, min(-(-SPLIT_K_PROGRAMS // programs), steps // _MIN_STEPS_PER_SPLIT))


def fp8_block_linear(x_MK: torch.Tensor, w: Fp8BlockWeight, out_MN: torch.Tensor | None = None,
                     w8a8: bool | None = None,
                     tiles: dict[str, int] | None = None) -> torch.Tensor:
    """``x @ W.T`` in x's dtype (module docstring); ``w8a8`` picks the form (None:
    ``fp8_tile.use_w8a8`` by rows). ``x`` unit-stride along K; ValueError naming the shapes for
    a K that differs from the weight's or a weight not K-contiguous. ``tiles`` overrides
    ``fp8_linear_tiles`` (a benchmark's sweep)."""
    m, k = x_MK.shape
    n = w.values.shape[0]
    if w.values.dim() != 2 or w.values.shape[1] != k:
        raise ValueError(f"fp8_block_linear: x has K={k} columns but the weight is "
                         f"{tuple(w.values.shape)}")
    if w.values.stride(1) != 1 or w.block != (128, 128):
        raise ValueError(f"fp8_block_linear: the weight must be K-contiguous in 128x128 blocks, "
                         f"got strides {w.values.stride()} blocks {w.block}")
    if x_MK.stride(1) != 1:
        x_MK = x_MK.contiguous()
    y = out_MN if out_MN is not None else x_MK.new_empty((m, n))
    if m == 0 or n == 0:
        return y
    meta = dict(tiles or fp8_linear_tiles(m))
    splits = meta.pop("SPLIT_K", None) or split_k(m, n, k, meta)
    k_split = -(-k // (128 * splits)) * 128  # whole scale blocks per split
    splits = -(-k // k_split)
    out = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=y.device)
    if splits > 1 and y.stride(0) != n:
        raise ValueError(f"fp8_block_linear: out_MN must be contiguous, got strides {y.stride()}")
    quant_a = use_w8a8(m, w8a8)
    a, a_scales = quantize_act(x_MK) if quant_a else (x_MK, w.scales)  # scales unread in W8A16
    grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), splits)
    _fp8_linear_kernel[grid](a, a.stride(0), a_scales, w.values, w.values.stride(0), w.scales,
                             w.scales.stride(0), out, n if splits > 1 else y.stride(0), m, n, k,
                             k_split, EVEN_K=k % meta["BLOCK_K"] == 0, QUANT_A=quant_a,
                             SPLIT_K=splits, **meta)
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, 1024),)](out, y, m * n, SPLIT_K=splits, BLOCK=1024)
    return y
