"""``y = x @ w.T`` for a few to a few hundred rows (decode batches of 8-256, extend steps of up to
256 tokens) as one Triton tensor-core GEMM whose grid fills the GPU.

At 64-256 rows a projection of this model is near the balance point of an H200 (about 200 bf16
FLOPs per byte): its floor is the weight's bytes over HBM bandwidth, a few microseconds. cuBLAS
picks tiles of 128+ columns for these shapes, so the fused QKV [5120, 2048] at 128 rows runs
as about 40 programs on 132 SMs, at half its floor (10 us against 4.9 on an H200,
docs/BENCHMARKS.md). Here the column tile is chosen so that there are about two programs per SM
(``_tiles``), and the programs of one column tile (its row blocks) are neighbours, so the second
reads the weight tile from L2. fp32 accumulation, output in x's dtype, no bias.

Capturable in a CUDA graph (no host sync; the only allocation is the output). The row count is
not specialized (``do_not_specialize``): eager steps of every size share one build per tile
config. CUDA tensors, or CPU ones under Triton's interpreter (``TRITON_INTERPRET=1``, the tests).

Shapes: M rows of x, N output features (rows of W), K input features.
"""

from __future__ import annotations

import os

import torch

__all__ = ["NARROW_MAX_ROWS", "check_narrow_args", "narrow_gemm", "narrow_tiles"]

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # CPU installs: the ops seam uses F.linear
    triton = None

# Past 256 rows a projection is compute-bound and cuBLAS's large tiles are the right ones.
NARROW_MAX_ROWS = 256
_DTYPES = (torch.bfloat16, torch.float16)
# About two programs per SM of an H100 / H200 (132): one wave leaves a slow SM as the tail.
_TARGET_PROGRAMS = 2 * 132


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _narrow_gemm_kernel(
        x_ptr, w_ptr, y_ptr,  # x [M, K], w [N, K] (unit stride along K), y [M, N] dense
        M, N, K, stride_xm, stride_wn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no contraction mask
        UPCAST_DOT: tl.constexpr,  # Triton's CPU interpreter only: it has no bf16 matmul
    ):
        num_m = tl.cdiv(M, BLOCK_M)
        # The row blocks of one column tile are consecutive programs: they run together, so
        # the weight tile comes from HBM once and from L2 for the others.
        pid_n = tl.program_id(0) // num_m
        pid_m = tl.program_id(0) % num_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        row_ok = offs_m < M
        # Wrapped columns keep the weight loads unmasked; their results are not stored.
        offs_wn = (offs_n % N).to(tl.int64)
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_wn[None, :] * stride_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
                w = tl.load(w_ptrs)
            else:
                k_ok = offs_k < K - kk * BLOCK_K
                a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
            if UPCAST_DOT:
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc=acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def narrow_tiles(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for M rows of a [N, K] weight.

    Rows: one block of the next power of two (16 at least: the smallest tensor-core tile) up to
    64 rows, blocks of 64 beyond (a 128-row accumulator would leave room for fewer tiles in
    flight). Columns: the widest of 128, 64, 32, 16 that still gives about two programs per SM
    (fewer when even 16 cannot: the router's 128 columns). K in chunks of 128, 4 stages: three
    tiles in flight while one is multiplied, for a kernel that streams its weight once."""
    block_m = min(64, max(16, _next_pow2(M)))
    num_m = -(-M // block_m)
    block_n = next((bn for bn in (128, 64, 32) if num_m * -(-N // bn) >= _TARGET_PROGRAMS), 16)
    block_k = max(16, min(128, _next_pow2(K)))
    return block_m, block_n, block_k, 4, 4


def check_narrow_args(x_MK: torch.Tensor, w_NK: torch.Tensor) -> None:
    """Raise ValueError, naming the value and the limit, where ``narrow_gemm`` cannot take
    ``x_MK`` and ``w_NK``. Reads only shapes, strides and dtypes: no device work."""
    if x_MK.dim() != 2 or w_NK.dim() != 2:
        raise ValueError(f"narrow_gemm: x and w must be 2-D, got x {tuple(x_MK.shape)} and w {tuple(w_NK.shape)}")
    m, k = x_MK.shape
    if m > NARROW_MAX_ROWS:
        raise ValueError(f"narrow_gemm: x has {m} rows, more than NARROW_MAX_ROWS={NARROW_MAX_ROWS}")
    if w_NK.shape[1] != k:
        raise ValueError(f"narrow_gemm: x has K={k} columns but w has K={w_NK.shape[1]}")
    if x_MK.dtype not in _DTYPES or w_NK.dtype != x_MK.dtype:
        raise ValueError(f"narrow_gemm: x and w must share a dtype of bfloat16/float16, got x {x_MK.dtype} "
                         f"and w {w_NK.dtype}")
    if x_MK.stride(1) != 1 or w_NK.stride(1) != 1:
        raise ValueError(f"narrow_gemm: x and w must be contiguous along K (stride 1), got strides "
                         f"x {x_MK.stride()} and w {w_NK.stride()}")
    if x_MK.device != w_NK.device:
        raise ValueError(f"narrow_gemm: x is on {x_MK.device} but w on {w_NK.device}")
    if not x_MK.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"narrow_gemm: needs CUDA tensors, got {x_MK.device} (TRITON_INTERPRET=1 runs it on "
                         "CPU ones)")


def narrow_gemm(x_MK: torch.Tensor, w_NK: torch.Tensor, *,
                tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """``x_MK @ w_NK.T`` (``F.linear`` without bias) for M <= NARROW_MAX_ROWS, one launch, in x's
    dtype with fp32 accumulation. ``tiles`` overrides ``narrow_tiles(M, N, K)`` (the tuning
    benchmark's sweep). M = 0 launches nothing. Raises ValueError for arguments it cannot take
    (``check_narrow_args``)."""
    check_narrow_args(x_MK, w_NK)
    if triton is None:
        raise RuntimeError("narrow_gemm: needs triton")
    m, k = x_MK.shape
    n = w_NK.shape[0]
    y_MN = torch.empty((m, n), dtype=x_MK.dtype, device=x_MK.device)
    if m == 0 or n == 0:
        return y_MN
    if k == 0:
        return y_MN.zero_()
    block_m, block_n, block_k, num_warps, num_stages = tiles or narrow_tiles(m, n, k)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _narrow_gemm_kernel[grid](
        x_MK, w_NK, y_MN, m, n, k, x_MK.stride(0), w_NK.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        UPCAST_DOT=isinstance(_narrow_gemm_kernel, InterpretedFunction),
        num_warps=num_warps, num_stages=num_stages,
    )
    return y_MN
