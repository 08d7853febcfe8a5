"""``y = x @ w.T`` for a handful of rows (decode at batch size 1-4) in one Triton kernel that
streams the weight once.

At M <= 4 a linear layer is a matrix-vector product: its time is the weight's bytes over HBM
bandwidth (the o_proj of Qwen3-30B-A3B, [2048, 4096] bf16, is 16.8 MB: 3.9 us at ~4.3 TB/s on
an H200). cuBLAS runs these shapes as a split-K GEMM plus a reduce kernel (7.0 + 1.8 us for
o_proj, 7.7 us for the fused QKV [5120, 2048] against a 4.9 us floor). Here:

- one program per ``BLOCK_N`` rows of W, no split-K (it would need a second launch to reduce);
- each program walks K in ``BLOCK_K`` chunks, loading a ``[BLOCK_N, BLOCK_K]`` tile of W
  (contiguous along K, coalesced 16-byte loads, ``evict_first``: the weight is read once per
  step and must not push the activations out of L2) and the M rows of x (a few KB, cached);
- no ``tl.dot`` (it wants M >= 16): each row of x has its own fp32 accumulator of the tile's
  shape, updated with an elementwise multiply-add (the M rows unrolled by a constexpr), and
  reduced along K once, after the loop. Reducing every chunk would put a cross-warp reduction
  (shared memory and a barrier) per row in every iteration; the price is registers: ``M *
  BLOCK_N * BLOCK_K / threads`` fp32 each, which ``_tiles`` keeps at 32 per row;
- the K loop is a ``tl.range`` with ``num_stages``: only then does Triton's pipeliner prefetch
  loads that feed no ``tl.dot`` (cp.async into shared memory), which keeps several tiles in
  flight per program, as a streaming kernel needs to approach HBM bandwidth.

fp32 accumulation, output in x's dtype (rounded once), no bias. Capturable in a CUDA graph: no
host sync, the only allocation is the output. CUDA tensors (Triton's CPU interpreter,
``TRITON_INTERPRET=1``, runs it on CPU ones for the tests).

Shapes: M rows of x, N output features (rows of W), K input features.
"""

from __future__ import annotations

import torch

from dp_runtime.model.linear_args import check_linear_args, linear_layout_ok, linear_output

__all__ = ["SKINNY_MAX_ROWS", "SKINNY_USE_ROWS", "check_skinny_args", "skinny_linear", "use_skinny"]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the ops seam uses F.linear
    triton = None

# Rows of x the kernel takes: each one costs a [BLOCK_N, BLOCK_K] fp32 accumulator in registers,
# and from about 8 rows on cuBLAS's tensor-core GEMM is as close to the floor as this gets.
SKINNY_MAX_ROWS = 4
# Rows at which the ops seam takes it. Measured on an H200 (bench/skinny_linear.py, us per call,
# cuBLAS -> skinny): o_proj 8.61 -> 6.52 at 1 row, 8.52 -> 6.79 at 2, 8.63 -> 7.59 at 4; qkv
# 7.52 -> 6.99, 7.64 -> 7.67, 8.00 -> 11.75; router 5.35 -> 3.05, 5.36 -> 3.35, 5.36 -> 3.94.
# Up to 2 rows it is never slower; at 4 the qkv shape loses by half.
SKINNY_USE_ROWS = 2

# Programs for about two waves of the 132 SMs of an H100 / H200: with one wave a slow SM is the
# whole kernel's tail; with many more, each program's fixed start-up and final reduction add up.
_TARGET_PROGRAMS = 2 * 132
# fp32 accumulator elements per thread per row of x (BLOCK_N * BLOCK_K / (32 * num_warps)):
# 4 rows x 32 leave room for the tiles in flight without spilling.
_ACC_PER_THREAD = 32


if triton is not None:
    from dp_runtime.model.pdl import pdl_entry, pdl_meta, resolve_pdl

    @triton.jit
    def _row_fma(acc, w, x_row_ptrs, mask_k, EVEN_K: tl.constexpr):
        """``acc + w * x_row`` with x's row chunk broadcast over the tile's rows."""
        if EVEN_K:
            x = tl.load(x_row_ptrs)
        else:
            x = tl.load(x_row_ptrs, mask=mask_k, other=0.0)
        return acc + w * x.to(tl.float32)[None, :]

    @triton.jit
    def _skinny_linear_kernel(
        x_ptr, w_ptr, y_ptr,  # x [M, K], w [N, K] (both unit stride along K), y [M, N] dense
        N, K, stride_xm, stride_wn,
        M: tl.constexpr,  # 1..SKINNY_MAX_ROWS: the rows are unrolled, one accumulator each
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K mask, so nothing stops 16-byte loads
        NUM_STAGES: tl.constexpr,
        PDL: tl.constexpr,  # launched with programmatic dependent launch
    ):
        pdl_entry(PDL)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # int64: N * K may pass 2^31
        acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        # tl.range with num_stages (not a plain range) is what lets the pipeliner prefetch
        # these loads: it only pipelines loads that feed no tl.dot in loops that carry it.
        for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
            ks = k0 + offs_k
            mask_k = ks < K
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None], other=0.0,
                            eviction_policy="evict_first")
            else:
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0,
                            eviction_policy="evict_first")
            w = w.to(tl.float32)
            x_ptrs = x_ptr + ks
            acc0 = _row_fma(acc0, w, x_ptrs, mask_k, EVEN_K)
            if M > 1:
                acc1 = _row_fma(acc1, w, x_ptrs + stride_xm, mask_k, EVEN_K)
            if M > 2:
                acc2 = _row_fma(acc2, w, x_ptrs + 2 * stride_xm, mask_k, EVEN_K)
            if M > 3:
                acc3 = _row_fma(acc3, w, x_ptrs + 3 * stride_xm, mask_k, EVEN_K)
        out_dtype = y_ptr.dtype.element_ty
        y_ptrs = y_ptr + offs_n  # y is dense: row m starts at m * N
        tl.store(y_ptrs, tl.sum(acc0, axis=1).to(out_dtype), mask=mask_n)
        if M > 1:
            tl.store(y_ptrs + N, tl.sum(acc1, axis=1).to(out_dtype), mask=mask_n)
        if M > 2:
            tl.store(y_ptrs + 2 * N, tl.sum(acc2, axis=1).to(out_dtype), mask=mask_n)
        if M > 3:
            tl.store(y_ptrs + 3 * N, tl.sum(acc3, axis=1).to(out_dtype), mask=mask_n)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _tiles(N: int, K: int) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for a [N, K] weight.

    Starting points, to be tuned on the GPU by ``python bench/skinny_linear.py --tune``: the
    largest BLOCK_N (of 32, 16, 8) that still gives about two waves of programs (N 2048: 8, 256
    programs; N 5120: 16, 320), BLOCK_K 512 cut so that the tile holds 4096 elements (32 fp32
    accumulator registers per thread per row at 4 warps: 8 x 512 for o_proj, 16 x 256 for qkv),
    3 stages (two tiles in flight while one is consumed).
    """
    num_warps, num_stages = 4, 3
    block_n = next((bn for bn in (32, 16) if -(-N // bn) >= _TARGET_PROGRAMS), 8)
    block_k = min(512, _ACC_PER_THREAD * 32 * num_warps // block_n)
    # Small K: one chunk of the next power of two (at least 16, Triton's smallest useful block).
    block_k = max(16, min(block_k, _next_pow2(K)))
    return block_n, block_k, num_warps, num_stages


def check_skinny_args(x_MK: torch.Tensor, w_NK: torch.Tensor) -> None:
    """Raise ValueError, naming the value and the limit, where ``skinny_linear`` cannot take
    ``x_MK`` and ``w_NK`` (``linear_args.check_linear_args``). No device work."""
    check_linear_args("skinny_linear", x_MK, w_NK, max_rows=SKINNY_MAX_ROWS,
                      max_rows_name="SKINNY_MAX_ROWS")


def use_skinny(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the ops seam runs ``F.linear(x, w, b)`` as ``skinny_linear``: Triton importable,
    1..SKINNY_USE_ROWS rows (an IDLE rank's 0 rows and anything larger go to F.linear) and the
    layout the kernel takes (``linear_args.linear_layout_ok``). Never raises."""
    return triton is not None and linear_layout_ok(x, w, b) and 1 <= x.shape[0] <= SKINNY_USE_ROWS


def skinny_linear(x_MK: torch.Tensor, w_NK: torch.Tensor, *,
                  tiles: tuple[int, int, int, int] | None = None,
                  pdl: bool | None = None) -> torch.Tensor:
    """``x_MK @ w_NK.T`` (``F.linear`` without bias) for M <= SKINNY_MAX_ROWS, one launch, in x's
    dtype with fp32 accumulation. ``tiles`` overrides ``_tiles(N, K)`` (the tuning benchmark's
    sweep); ``pdl``: programmatic dependent launch (None: where the device supports it,
    ``pdl.resolve_pdl``). M = 0 launches nothing. Raises ValueError for arguments it cannot take
    (``check_skinny_args``)."""
    check_skinny_args(x_MK, w_NK)
    if triton is None:
        raise RuntimeError("skinny_linear: needs triton")
    y_MN, done = linear_output(x_MK, w_NK)
    if done:
        return y_MN
    (m, k), n = x_MK.shape, w_NK.shape[0]
    block_n, block_k, num_warps, num_stages = tiles or _tiles(n, k)
    _skinny_linear_kernel[(triton.cdiv(n, block_n),)](
        x_MK, w_NK, y_MN, n, k, x_MK.stride(0), w_NK.stride(0),
        M=m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, NUM_STAGES=num_stages,
        num_warps=num_warps, num_stages=num_stages, **pdl_meta(resolve_pdl(pdl, x_MK, m)),
    )
    return y_MN
