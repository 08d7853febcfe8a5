"""The rank-local expert sum as a Triton fused MoE: expert-aligned token blocks, two grouped
GEMMs with fused epilogues, and a deterministic sum over the top-k. Same contract as
``experts.local_expert_sum``; needs triton (``fused_moe.fused_moe_supported`` says when).

Shapes: N rows a dispatcher delivered, K picks per row, L local experts, H hidden, I expert
intermediate size. P = N*K picks, flat pick index ``p = n*K + k``; R row slots of the aligned
layout (``max_blocks * BLOCK_M``).

Four launches per call (five beyond ``moe_align.PARALLEL_PICKS`` picks, none for the alignment
of a decode step's few picks), sizes fixed by (N, K, L, tile config) on the host, counts only on
the device: no host sync, CUDA-graph capturable.

1. ``moe_align.align_picks`` (one launch, two for many picks): each expert's picks get
   consecutive row slots, padded to a multiple of BLOCK_M, so a BLOCK_M-row block belongs to one
   expert. Writes ``sorted_R`` (the pick in each slot; P in a padding slot), ``block_expert``
   (the expert of each block, -1 past the used blocks) and ``num_rows`` (slots in use). Picks
   whose local id is outside [0, L) get no slot: they are never computed and never multiplied.
2. ``_expert_gemm_kernel`` GATED: ``act[p] = silu(x[n] @ gate_e.T) * (x[n] @ up_e.T)`` -> (P, I).
   Each program multiplies its A tile with the matching gate and up tiles, so the SwiGLU is an
   epilogue and the (P, 2I) pre-activation never reaches memory.
3. ``_expert_gemm_kernel``: ``y[p] = w[p] * (act[p] @ w2_e.T)`` -> (P, H), the routing weight
   applied to the fp32 accumulator before rounding to x's dtype.
   Both GEMMs launch a program per tile of the worst case, or (``MoeTileConfig.programs_per_sm``)
   ``_expert_gemm_persistent_kernel`` on a fixed grid whose programs walk the tiles in use.
4. ``_sum_picks_kernel``: ``out[n] = sum_k y[n*K + k]`` over the valid picks, in k order, fp32.
   Each output row is reduced by one program in a fixed order (no atomics), so eager and graph
   replay agree bit for bit. Rows of invalid picks in act and y are never written and are
   skipped by a masked load, never multiplied: padding rows may hold NaN.

GEMM outputs are indexed by pick, not by slot: act and y have exactly P rows and the sum reads
a token's K terms as one contiguous (K, H) slab.

FP8 experts (``fp8_blocks.Fp8BlockWeight`` stacks for both GEMMs) run the same tiles with
``fp8_tile.fp8_weight_dot`` as the contraction: the FP8 weight tiles are scaled in registers
(W8A16, the default) or multiplied on the FP8 tensor cores with activations quantized once per
GEMM (W8A8: ``fp8_act_quant.quantize_act`` of x before GEMM1 and of act before GEMM2).

The tile configs (``MoeTileConfig`` and the rule by token count) live in ``moe_tiles`` and are
re-exported here.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from dp_runtime.model.fp8_act_quant import quantize_act
from dp_runtime.model.fp8_blocks import Fp8BlockWeight
from dp_runtime.model.fp8_tile import fp8_weight_dot, use_w8a8
from dp_runtime.model.fused_moe_checks import check_expert_args
from dp_runtime.model.moe_align import UNALIGNED_PICKS, align_picks, max_blocks, unaligned_blocks
from dp_runtime.model.moe_tiles import MoeTileConfig, gemm2_tile_config, tile_config
from dp_runtime.model.pdl import pdl_entry, pdl_meta, resolve_pdl

__all__ = ["MoeTileConfig", "align_picks", "fused_local_expert_sum", "gemm2_tile_config",
           "max_blocks", "tile_config"]


@triton.jit(do_not_specialize=["num_picks", "num_blocks"])
def _expert_gemm_kernel(
    a_ptr,  # GEMM1: x (N, H); GEMM2: act (P, I). Unit stride along the contraction.
    stride_am,
    sa_ptr,  # W8A8: A's scales (ceil(k_in / 128), rows of A) (``fp8_act_quant``)
    stride_sak,
    w_ptr,  # GEMM1: w13 (L, 2I, H); GEMM2: w2 (L, H, I)
    stride_we,
    stride_wn,
    stride_wk,
    c_ptr,  # GEMM1: act (P, I); GEMM2: y (P, H); rows indexed by pick, unit column stride
    stride_cm,
    topk_weights_ptr,  # (P,) fp32 routing weights (GEMM2 only)
    s_ptr,  # FP8: the weights' block scales (L, rows / 128, k_in / 128), fp32
    stride_se,
    stride_sn,
    stride_sk,
    sorted_ptr,
    block_expert_ptr,
    num_rows_ptr,
    num_picks,
    num_blocks,
    num_local,
    n_out,  # output columns: I (GEMM1, per half) or H (GEMM2)
    k_in,  # contraction: H (GEMM1) or I (GEMM2)
    A_ROW_DIV: tl.constexpr,  # pick -> A row: pick // K for GEMM1 (token rows), 1 for GEMM2
    GATED: tl.constexpr,  # GEMM1: gate and up tiles, SwiGLU epilogue; else weighted epilogue
    EVEN_K: tl.constexpr,  # k_in % BLOCK_K == 0: no contraction mask
    UPCAST_DOT: tl.constexpr,  # Triton's CPU interpreter only: it has no bf16 matmul
    FP8: tl.constexpr,  # FP8 block-quantized weights (``fp8_tile.fp8_weight_dot``)
    QUANT_A: tl.constexpr,  # FP8: W8A8 (else W8A16)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (``pdl``)
):
    """One program per output tile of the worst case (``num_blocks`` blocks)."""
    pdl_entry(PDL)
    pid_m, pid_n = _tile_coords(tl.program_id(0), num_blocks, tl.cdiv(n_out, BLOCK_N), GROUP_M)
    # The grid covers the worst case; blocks past the used ones exit at once.
    if pid_m * BLOCK_M >= tl.load(num_rows_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    # Unaligned blocks carry a pick's raw id: another rank's expert or a padding row is skipped.
    if (expert < 0) | (expert >= num_local):
        return
    _expert_tile(a_ptr, stride_am, sa_ptr, stride_sak, w_ptr, stride_we, stride_wn, stride_wk,
                 c_ptr, stride_cm, topk_weights_ptr, s_ptr, stride_se, stride_sn, stride_sk,
                 sorted_ptr, num_picks, n_out, k_in, pid_m, pid_n, expert, A_ROW_DIV, GATED, EVEN_K,
                 UPCAST_DOT, FP8, QUANT_A, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit(do_not_specialize=["num_picks"])
def _expert_gemm_persistent_kernel(
    a_ptr, stride_am, sa_ptr, stride_sak, w_ptr, stride_we, stride_wn, stride_wk, c_ptr, stride_cm,
    topk_weights_ptr, s_ptr, stride_se, stride_sn, stride_sk, sorted_ptr,
    block_expert_ptr, num_rows_ptr, num_picks, n_out, k_in,
    A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
    FP8: tl.constexpr, QUANT_A: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """``_expert_gemm_kernel`` on a fixed grid: program ``p`` takes the tiles in use ``p, p +
    grid, ...``. The tile loop is flattened with the contraction loop into one software
    pipeline, so a program's loads for its next tile are in flight while it finishes the
    current one: a short contraction (GEMM2's K = I = 768, 12 steps of 64) no longer pays a
    pipeline fill and drain per tile. Aligned layouts only: every block in use then belongs to
    a local expert (``align_picks`` gives other ranks' picks no slot), so no tile is skipped."""
    pdl_entry(PDL)
    num_n = tl.cdiv(n_out, BLOCK_N)
    used = tl.cdiv(tl.load(num_rows_ptr), BLOCK_M)
    for tile in tl.range(tl.program_id(0), used * num_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _tile_coords(tile, used, num_n, GROUP_M)
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        _expert_tile(a_ptr, stride_am, sa_ptr, stride_sak, w_ptr, stride_we, stride_wn, stride_wk,
                     c_ptr, stride_cm, topk_weights_ptr, s_ptr, stride_se, stride_sn, stride_sk,
                     sorted_ptr, num_picks, n_out, k_in, pid_m, pid_n, expert, A_ROW_DIV, GATED,
                     EVEN_K, UPCAST_DOT, FP8, QUANT_A, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _tile_coords(tile, num_blocks, num_n, GROUP_M: tl.constexpr):
    """(block, column tile) of a tile index. GROUP_M blocks (consecutive blocks are mostly one
    expert's) take the same column tile one after another, so that weight tile is read from HBM
    once and then hit in L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _expert_tile(a_ptr, stride_am, sa_ptr, stride_sak, w_ptr, stride_we, stride_wn, stride_wk,
                 c_ptr, stride_cm, topk_weights_ptr, s_ptr, stride_se, stride_sn, stride_sk,
                 sorted_ptr, num_picks, n_out, k_in, pid_m, pid_n, expert,
                 A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                 UPCAST_DOT: tl.constexpr, FP8: tl.constexpr, QUANT_A: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The BLOCK_M x BLOCK_N output tile (``pid_m``, ``pid_n``) of block ``pid_m``, whose picks
    are all ``expert``'s: the contraction and the epilogue, stored by pick."""
    pick = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pick < num_picks

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapped column indices keep the weight loads in bounds without a mask; the extra columns
    # are dropped at the store.
    offs_wn = offs_n % n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_row = (pick // A_ROW_DIV).to(tl.int64)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = acc
    if GATED:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_offset = n_out * stride_wn  # up rows follow the gate rows in w13
    if FP8:
        # Each column's scale row; the up rows' blocks follow the gate rows' (n_out % 128 == 0).
        s_ptrs = s_ptr + expert * stride_se + (offs_wn // 128) * stride_sn
        s_up_ptrs = s_ptr + expert * stride_se + ((offs_wn + n_out) // 128) * stride_sn
        acc, acc_up = fp8_weight_dot(acc, acc_up, a_ptrs, row_ok, sa_ptr + a_row, stride_sak,
                                     w_ptrs, up_offset, s_ptrs, s_up_ptrs, stride_sk, k_in,
                                     BLOCK_K, EVEN_K, GATED, QUANT_A)
    else:
        for kk in range(0, tl.cdiv(k_in, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs)
            else:
                k_ok = offs_k < k_in - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if UPCAST_DOT:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc=acc)
            if GATED:
                if EVEN_K:
                    w_up = tl.load(w_ptrs + up_offset)
                else:
                    w_up = tl.load(w_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
                if UPCAST_DOT:
                    w_up = w_up.to(tl.float32)
                acc_up = tl.dot(a, w_up, acc=acc_up)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk

    if GATED:
        out = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up, in fp32
    else:
        weight = tl.load(topk_weights_ptr + pick, mask=row_ok, other=0.0).to(tl.float32)
        out = acc * weight[:, None]
    c_ptrs = c_ptr + pick.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_n[None, :] < n_out))


@triton.jit
def _sum_picks_kernel(
    y_ptr,  # (P, H) weighted terms, rows indexed by pick
    ids_ptr,  # (P,) local ids: a term counts only where 0 <= id < num_local
    out_ptr,
    stride_om,
    hidden,
    num_local,
    res_ptr,  # ADD_NORM: (N, H) residual stream, updated in place
    stride_rm,
    norm_w_ptr,  # ADD_NORM: (H,) RMSNorm weight
    eps,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ADD_NORM: tl.constexpr,  # one program per row (BLOCK_H >= hidden): residual add and RMSNorm
    PDL: tl.constexpr,
):
    pdl_entry(PDL)
    n = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_row = offs < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    # Masked loads, not a branch per pick: the TOP_K loads are then in flight together (one
    # memory latency per program, not TOP_K in a row); a masked-off row is still never read.
    for k in tl.static_range(TOP_K):
        pick = n * TOP_K + k
        # The id, broadcast over the block (one address: one request per warp). Triton's CPU
        # interpreter cannot mask with a scalar condition combined with a block.
        e = tl.load(ids_ptr + pick + offs * 0)
        row_ok = in_row & (e >= 0) & (e < num_local)
        acc += tl.load(y_ptr + pick * hidden + offs, mask=row_ok, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if ADD_NORM:
        # The next layer's fused add+RMSNorm on the rounded sum: residual += sum (in fp32, then
        # rounded), out = rms_norm(residual) * w from the fp32 sum, as FlashInfer's kernel does.
        s = out.to(tl.float32) + tl.load(res_ptr + n * stride_rm + offs, mask=in_row,
                                         other=0.0).to(tl.float32)
        tl.store(res_ptr + n * stride_rm + offs, s.to(res_ptr.dtype.element_ty), mask=in_row)
        inv_rms = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / hidden + eps)
        w = tl.load(norm_w_ptr + offs, mask=in_row, other=0.0).to(tl.float32)
        out = (s * inv_rms * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + n * stride_om + offs, out, mask=in_row)


def _launch_gemm(cfg: MoeTileConfig, a, w, c, weights_P, sorted_R, block_expert, num_rows,
                 num_local: int, aligned: bool, *, n_out: int, k_in: int, a_row_div: int,
                 gated: bool, pdl: bool, w8a8: bool = False) -> None:
    """One expert GEMM of ``fused_local_expert_sum``: ``c = a @ w[e].T`` per block, GATED (GEMM1:
    ``cfg.block_n`` split into gate and up halves, SwiGLU epilogue) or weighted (GEMM2)."""
    blocks = block_expert.shape[0]
    block_n = cfg.block_n // 2 if gated else cfg.block_n
    tiles = blocks * triton.cdiv(n_out, block_n)
    fp8 = isinstance(w, Fp8BlockWeight)
    w, s = (w.values, w.scales) if fp8 else (w, weights_P)  # s: unread without FP8
    scale_strides = (s.stride(0), s.stride(1), s.stride(2)) if fp8 else (0, 0, 0)
    # W8A8: ``a`` is (e4m3 values, their scales (groups, rows)); else the scales go unread.
    a, a_scales = a if isinstance(a, tuple) else (a, weights_P)
    args = (a, a.stride(0), a_scales, a.shape[0], w, w.stride(0), w.stride(1), w.stride(2), c,
            c.stride(0), weights_P, s,
            *scale_strides, sorted_R, block_expert, num_rows, c.shape[0])  # c has a row per pick
    meta = dict(A_ROW_DIV=a_row_div, GATED=gated, EVEN_K=k_in % cfg.block_k == 0,
                UPCAST_DOT=isinstance(_expert_gemm_kernel, InterpretedFunction), FP8=fp8,
                QUANT_A=fp8 and w8a8,
                BLOCK_M=cfg.block_m,
                BLOCK_N=block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, **pdl_meta(pdl))
    if cfg.programs_per_sm and aligned:
        grid = min(tiles, cfg.programs_per_sm * _sm_count(a.device))
        _expert_gemm_persistent_kernel[(grid,)](*args, n_out, k_in, **meta)
    else:
        _expert_gemm_kernel[(tiles,)](*args, blocks, num_local, n_out, k_in, **meta)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """SMs of ``device`` (cached: eager extend steps are host-bound); Triton's CPU interpreter
    counts as one."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def fused_local_expert_sum(
    x_ND: torch.Tensor,
    local_ids_NK: torch.Tensor,
    weights_NK: torch.Tensor,
    w13_L2IH: torch.Tensor,
    w2_LHI: torch.Tensor,
    *,
    out_ND: torch.Tensor | None = None,
    config: MoeTileConfig | None = None,
    extend: bool = False,
    config2: MoeTileConfig | None = None,
    add_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    pdl: bool | None = None,
    w8a8: bool | None = None,
) -> torch.Tensor:
    """``sum_k w[n, k] * expert_{id[n, k]}(x[n])`` over the picks this rank serves: the contract
    of ``experts.local_expert_sum`` in four Triton launches.

    Takes rows ``x_ND`` (N, H), rank-local expert ids ``local_ids_NK`` (N, K; negative or >= L
    where a pick is another rank's or the row is padding: it adds nothing and is never
    computed), routing weights ``weights_NK`` (N, K, fp32), the local experts' ``w13_L2IH``
    (gate rows [0, I), up rows [I, 2I)) and ``w2_LHI``. Writes ``out_ND`` when given (else a
    new tensor) in x's dtype and returns it. ``config`` overrides ``tile_config(N, extend)`` for
    both GEMMs; ``config2`` (same ``block_m``: the blocks are shared) gives the second GEMM its
    own tiles (default ``gemm2_tile_config(N, extend)``, or ``config`` when that is given).
    N = 0 launches nothing. No host sync: capturable in a CUDA graph.

    ``add_norm=(residual_NH, weight_H, eps)`` folds the next layer's fused add+RMSNorm into the
    sum's launch: ``residual += sum`` in place and ``out = rms_norm(residual) * weight``, what
    ``FlashInferOps.add_rms_norm(sum, residual, weight, eps)`` leaves (a launch per layer fewer
    where combine is the identity: the local dispatcher).

    ``pdl``: launch with programmatic dependent launch (``pdl.resolve_pdl``: None is on where
    the device supports it). FP8 weights (Fp8BlockWeight stacks, ``fp8_tile``): ``w8a8`` picks
    W8A8 or W8A16 (None: ``fp8_tile.use_w8a8`` by rows).
    """
    check_expert_args(x_ND, local_ids_NK, weights_NK, w13_L2IH, w2_LHI, out_ND, add_norm)
    residual, norm_w, eps = add_norm if add_norm is not None else (None, None, 0.0)
    n, hidden = x_ND.shape
    top_k = local_ids_NK.shape[1]
    num_local, inter = w13_L2IH.shape[0], w13_L2IH.shape[1] // 2
    if out_ND is None:
        out_ND = x_ND.new_empty((n, hidden))
    num_picks = n * top_k
    if num_picks == 0:
        if n and add_norm is not None:
            raise ValueError("add_norm needs K >= 1 picks per row")
        return out_ND.zero_()  # K = 0 sums nothing; N = 0 has no element to write
    fp8 = isinstance(w13_L2IH, Fp8BlockWeight)
    cfg = config or tile_config(n, extend, fp8)
    cfg2 = config2 or (cfg if config else gemm2_tile_config(n, extend, fp8))
    if cfg2.block_m != cfg.block_m:
        raise ValueError(f"config2.block_m={cfg2.block_m} must equal the first GEMM's "
                         f"block_m={cfg.block_m}")
    if x_ND.stride(1) != 1:
        x_ND = x_ND.contiguous()
    ids_P = local_ids_NK.contiguous().view(-1)
    weights_P = weights_NK.contiguous().view(-1)

    pdl = resolve_pdl(pdl, x_ND, x_ND.shape[0])
    aligned = num_picks > UNALIGNED_PICKS
    if aligned:
        sorted_R, block_expert, num_rows = align_picks(ids_P, num_local, cfg.block_m, pdl=pdl)
    else:
        sorted_R, block_expert, num_rows = unaligned_blocks(ids_P, cfg.block_m)
    # W8A8 (FP8 weights only): each GEMM's input quantized once, per token and 128 columns.
    quant_a = fp8 and use_w8a8(n, w8a8)
    act_PI = x_ND.new_empty((num_picks, inter))
    _launch_gemm(cfg, quantize_act(x_ND) if quant_a else x_ND, w13_L2IH, act_PI, weights_P,
                 sorted_R, block_expert, num_rows, num_local, aligned, n_out=inter, k_in=hidden,
                 a_row_div=top_k, gated=True, pdl=pdl, w8a8=quant_a)
    y_PH = x_ND.new_empty((num_picks, hidden))
    _launch_gemm(cfg2, quantize_act(act_PI) if quant_a else act_PI, w2_LHI, y_PH, weights_P,
                 sorted_R, block_expert, num_rows, num_local, aligned, n_out=hidden, k_in=inter,
                 a_row_div=1, gated=False, pdl=pdl, w8a8=quant_a)
    # A row's norm needs the whole row in one program; a plain sum takes 1024-column pieces.
    block_h = (triton.next_power_of_2(hidden) if add_norm is not None
               else min(triton.next_power_of_2(hidden), 1024))
    if add_norm is None:
        residual = norm_w = out_ND  # unread: ADD_NORM is off
    _sum_picks_kernel[(n, triton.cdiv(hidden, block_h))](
        y_PH, ids_P, out_ND, out_ND.stride(0), hidden, num_local, residual, residual.stride(0),
        norm_w, eps,
        TOP_K=top_k, BLOCK_H=block_h, ADD_NORM=add_norm is not None, num_warps=4, **pdl_meta(pdl),
    )
    return out_ND
