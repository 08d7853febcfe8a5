"""The body of one output tile of the fused MoE's expert GEMMs (``fused_moe_triton``): the
contraction over one expert's weights and the epilogue, for a block of picks that are all that
expert's; and the order in which a grid walks the tiles.

``SPLIT_M`` blocks: a block of BLOCK_M row slots runs as two halves of BLOCK_M / 2. The lower
half always holds picks (a block in use starts with one); when the upper half holds none (an
expert's picks fill at most half of its last block), its loads and MMAs are left out. So
BLOCK_M = 128 reads an expert of 65-128 picks' weight tiles once, where two 64-row blocks read
them twice, and an expert of up to 64 picks costs what a 64-row block does. At ~64 picks an
expert (a 1024-row mixed step), the 64-row blocks' second reads made the SMs read twice the
weights from L2, the busier unit (docs/BENCHMARKS.md, session 23).
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["expert_tile", "tile_coords"]


@triton.jit
def tile_coords(tile, num_blocks, num_n, GROUP_M: tl.constexpr):
    """(block, column tile) of a tile index. GROUP_M blocks (consecutive blocks are mostly one
    expert's) take the same column tile one after another, so that weight tile is read from HBM
    once and then hit in L2."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _weight_tiles(w_ptrs, up_offset, k_ok, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                  UPCAST_DOT: tl.constexpr):
    """One contraction step's weight tile, and with GATED the matching up tile (else the same)."""
    if EVEN_K:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
    if UPCAST_DOT:
        w = w.to(tl.float32)
    w_up = w
    if GATED:
        if EVEN_K:
            w_up = tl.load(w_ptrs + up_offset)
        else:
            w_up = tl.load(w_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
        if UPCAST_DOT:
            w_up = w_up.to(tl.float32)
    return w, w_up


@triton.jit
def _row_tile(a_ptrs, row_ok, k_ok, EVEN_K: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One contraction step's rows (masked rows and columns read as 0)."""
    if EVEN_K:
        a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
    else:
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if UPCAST_DOT:
        a = a.to(tl.float32)
    return a


@triton.jit
def _epilogue(acc, acc_up, pick, row_ok, offs_n, n_out, c_ptr, stride_cm, topk_weights_ptr,
              GATED: tl.constexpr):
    """SwiGLU (GATED) or the routing weight, then the store by pick."""
    if GATED:
        out = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up, in fp32
    else:
        weight = tl.load(topk_weights_ptr + pick, mask=row_ok, other=0.0).to(tl.float32)
        out = acc * weight[:, None]
    c_ptrs = c_ptr + pick.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < n_out))


@triton.jit
def expert_tile(a_ptr, stride_am, w_ptr, stride_we, stride_wn, stride_wk, c_ptr, stride_cm,
                topk_weights_ptr, sorted_ptr, num_picks, n_out, k_in, pid_m, pid_n, expert,
                A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
                UPCAST_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SPLIT_M: tl.constexpr):
    """The BLOCK_M x BLOCK_N output tile (``pid_m``, ``pid_n``) of block ``pid_m``, whose picks
    are all ``expert``'s: the contraction and the epilogue, stored by pick (SPLIT_M: in two
    halves, the upper one left out when it holds no pick; module docstring)."""
    ROWS: tl.constexpr = BLOCK_M // 2 if SPLIT_M else BLOCK_M
    slots = pid_m * BLOCK_M + tl.arange(0, ROWS)
    pick = tl.load(sorted_ptr + slots)
    row_ok = pick < num_picks
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Wrapped column indices keep the weight loads in bounds without a mask; the extra columns
    # are dropped at the store.
    offs_wn = offs_n % n_out
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pick // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None] * stride_wk
    up_offset = n_out * stride_wn  # GATED: up rows follow the gate rows in w13
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    upper = False
    if SPLIT_M:
        upper = tl.load(sorted_ptr + pid_m * BLOCK_M + ROWS) < num_picks
    if upper:
        # Both halves on each weight tile: the tiles are read once for BLOCK_M rows.
        pick_hi = tl.load(sorted_ptr + slots + ROWS)
        row_ok_hi = pick_hi < num_picks
        a_ptrs_hi = a_ptr + (pick_hi // A_ROW_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        acc_hi = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        acc_up_hi = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(k_in, BLOCK_K)):
            k_ok = offs_k < k_in - kk * BLOCK_K
            w, w_up = _weight_tiles(w_ptrs, up_offset, k_ok, GATED, EVEN_K, UPCAST_DOT)
            a = _row_tile(a_ptrs, row_ok, k_ok, EVEN_K, UPCAST_DOT)
            a_hi = _row_tile(a_ptrs_hi, row_ok_hi, k_ok, EVEN_K, UPCAST_DOT)
            acc = tl.dot(a, w, acc=acc)
            acc_hi = tl.dot(a_hi, w, acc=acc_hi)
            if GATED:
                acc_up = tl.dot(a, w_up, acc=acc_up)
                acc_up_hi = tl.dot(a_hi, w_up, acc=acc_up_hi)
            a_ptrs += BLOCK_K
            a_ptrs_hi += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        _epilogue(acc_hi, acc_up_hi, pick_hi, row_ok_hi, offs_n, n_out, c_ptr, stride_cm,
                  topk_weights_ptr, GATED)
    else:
        for kk in range(0, tl.cdiv(k_in, BLOCK_K)):
            k_ok = offs_k < k_in - kk * BLOCK_K
            w, w_up = _weight_tiles(w_ptrs, up_offset, k_ok, GATED, EVEN_K, UPCAST_DOT)
            a = _row_tile(a_ptrs, row_ok, k_ok, EVEN_K, UPCAST_DOT)
            acc = tl.dot(a, w, acc=acc)
            if GATED:
                acc_up = tl.dot(a, w_up, acc=acc_up)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
    _epilogue(acc, acc_up, pick, row_ok, offs_n, n_out, c_ptr, stride_cm, topk_weights_ptr, GATED)
