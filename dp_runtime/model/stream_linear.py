"""``y = x @ w.T`` for a few rows (3..256) in one Triton launch that streams the weight once.
The ops seam takes it for the narrow projections of small decode batches (``StreamLinear.takes``:
3..16 rows, weights of up to 4096 rows: o_proj and the router).

At decode sizes a projection is bound by its weight's bytes, yet cuBLAS takes 1.4-2.3x the
bytes floor on an H100 (docs/BENCHMARKS.md, session 19: o_proj [2048, 4096] as a split-K GEMM
plus a reduce kernel, 9.9 us against 5.6; the router [128, 2048] 5.3 us against 0.2, launch and
latency). Here:

- **swap AB**: each program computes ``y.T``'s tile ``w[n-tile] @ x.T``, so the weight's rows
  are the MMA's M (64 per warpgroup on Hopper) and the few rows of x its N (any multiple of 8);
- **split-K in the same launch**: ``SPLIT_K`` programs share an n-tile, each over its own range
  of K, so that there are enough programs to keep every SM streaming (o_proj has 32 tiles of
  64 rows). Each writes its fp32 partial to a workspace, then takes a ticket from the tile's
  counter; the program that draws the last ticket adds the ``SPLIT_K`` partials in a fixed order
  (the result is the same bits every call), stores ``y`` and sets the counter back to 0 for the
  next launch. No program waits for another, so no schedule can deadlock;
- the weight is loaded ``evict_first`` (read once per step; it must not push the activations
  out of L2); x is a few hundred KB at most and stays in L2 for every program.

The counters are state: ``StreamLinear`` owns them, one int32 per n-tile, zero between launches.
Launches that share a ``StreamLinear`` must run one after another (one stream; a CUDA graph
replays them in order), which is how a model's forward runs.

fp32 accumulation, output in x's dtype (rounded once), no bias. Capturable in a CUDA graph (no
host sync; the workspace is the only allocation). Triton's CPU interpreter
(``TRITON_INTERPRET=1``) runs it on CPU tensors for the tests.

Measured (H100, session 21, ``bench/skinny_linear.py``, us per call): at 3-16 rows o_proj 8.4-8.6
against cuBLAS's 9.8-9.9 and the router 3.0-3.9 against 5.2-5.3; but qkv [5120, 2048] 9.4-12.4
against 9.6-10.0, and at 64-256 rows every shape at 0.35-1.02x cuBLAS (25-55% of the bytes
floor; a sweep of 27 tilings found none that streams there, and why is not yet measured).
Hence the seam's narrow domain.

Shapes: M rows of x, N output features (rows of w), K input features.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dp_runtime.model.linear_args import check_linear_args, linear_layout_ok, linear_output

__all__ = [
    "SEAM_MAX_N",
    "SEAM_MAX_ROWS",
    "STREAM_MAX_ROWS",
    "STREAM_MIN_ROWS",
    "StreamLinear",
    "StreamTiles",
    "stream_tiles",
]

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the ops seam uses F.linear
    triton = None

# Rows the kernel takes: x's rows are the MMA's N, up to 256 in one tile. Below 3 rows
# skinny_linear (no tensor cores, no split-K) is the faster kernel.
STREAM_MIN_ROWS = 3
STREAM_MAX_ROWS = 256
# The seam's domain (``StreamLinear.takes``), where it beat cuBLAS on an H100 (the module
# docstring): up to 16 rows, weights of up to 4096 rows (o_proj, the router; not the fused qkv).
SEAM_MAX_ROWS = 16
SEAM_MAX_N = 4096
# Programs for about one wave of an H100's 132 SMs: split-K grows until the grid has this many.
_MIN_PROGRAMS = 120
# Counters per StreamLinear, one per n-tile: weights of up to 4096 tiles (262,144 rows at 64 a
# tile; the seam's widest, 4096 rows, has 64). A wider split-K launch is refused, naming both.
_MAX_TILES = 4096


class StreamTiles(NamedTuple):
    """A launch's tiling: ``block_n`` weight rows per program, ``block_k`` of K per load,
    ``split_k`` programs per n-tile, Triton's ``num_warps`` and ``num_stages``."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


if triton is not None:
    from dp_runtime.model.pdl import pdl_entry, pdl_meta, resolve_pdl

    @triton.jit
    def _stream_linear_kernel(
        x_ptr, w_ptr, y_ptr,  # x [M, K], w [N, K] (unit stride along K), y [M, N] dense
        part_ptr,  # fp32 [SPLIT_K, n-tiles, BLOCK_N, BLOCK_M] (SPLIT_K > 1 only)
        count_ptr,  # int32 [n-tiles], zero between launches (SPLIT_K > 1 only)
        M, N, K, K_SPLIT, stride_xm, stride_wn,  # K_SPLIT: K per split, a multiple of BLOCK_K
        BLOCK_M: tl.constexpr,  # power of two >= M (>= 16)
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr,  # K == SPLIT_K * K_SPLIT: no K mask, nothing stops wide loads
        UPCAST_DOT: tl.constexpr,  # Triton's CPU interpreter only: it has no bf16 matmul
        NUM_STAGES: tl.constexpr,
        PDL: tl.constexpr,  # launched with programmatic dependent launch
    ):
        pdl_entry(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mask_m = offs_m < M
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # int64: N * K may pass 2^31
        x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm  # x.T's tile: [BLOCK_K, BLOCK_M]
        k_lo = pid_k * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        # tl.range with num_stages: the pipeliner keeps NUM_STAGES - 1 loads in flight.
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
            ks = k0 + offs_k
            if EVEN_K:
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None], other=0.0,
                            eviction_policy="evict_first")
                xt = tl.load(x_cols + ks[:, None], mask=mask_m[None, :], other=0.0)
            else:
                mask_k = ks < k_hi
                w = tl.load(w_rows + ks[None, :], mask=mask_n[:, None] & mask_k[None, :],
                            other=0.0, eviction_policy="evict_first")
                xt = tl.load(x_cols + ks[:, None], mask=mask_k[:, None] & mask_m[None, :],
                             other=0.0)
            if UPCAST_DOT:
                w = w.to(tl.float32)
                xt = xt.to(tl.float32)
            acc = tl.dot(w, xt, acc=acc)
        y_tile = y_ptr + offs_m[None, :] * N + offs_n[:, None]  # y[m, n]: the tile is y.T's
        y_mask = mask_n[:, None] & mask_m[None, :]
        out_dtype = y_ptr.dtype.element_ty
        if SPLIT_K == 1:
            tl.store(y_tile, acc.to(out_dtype), mask=y_mask)
        else:
            tile_elems = BLOCK_N * BLOCK_M
            in_tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
            split_stride = tl.num_programs(0).to(tl.int64) * tile_elems
            parts = part_ptr + pid_n.to(tl.int64) * tile_elems + in_tile
            tl.store(parts + pid_k * split_stride, acc)
            # Every thread's partial is stored before the ticket is drawn; the ticket's acq_rel
            # publishes them to (and, for the last program, acquires) the other programs'.
            tl.debug_barrier()
            ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            if ticket == SPLIT_K - 1:
                total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for s in tl.static_range(SPLIT_K):  # a fixed order: the same bits every call
                    total += tl.load(parts + s * split_stride, cache_modifier=".cg")
                tl.store(y_tile, total.to(out_dtype), mask=y_mask)
                tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next launch


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def stream_tiles(m: int, n: int, k: int) -> StreamTiles:
    """The tiling of an [m, k] x [n, k].T launch: 64 weight rows a program (one Hopper
    warpgroup's MMA), ``block_k`` so that a pipeline stage of w and x fits 32 KB, and split-K
    doubled until the grid has ``_MIN_PROGRAMS`` programs or a split would be under two loads.
    Starting points, tuned on the GPU by ``python bench/skinny_linear.py --tune-stream``."""
    block_m = max(16, _next_pow2(m))
    block_n = 64
    block_k = 128 if block_m <= 64 else 64
    block_k = max(16, min(block_k, _next_pow2(k)))
    tiles_n = -(-n // block_n)
    split_k = 1
    while tiles_n * split_k < _MIN_PROGRAMS and k // (2 * split_k) >= 2 * block_k:
        split_k *= 2
    return StreamTiles(block_n, block_k, split_k, num_warps=4, num_stages=4 if block_m <= 64 else 3)


class StreamLinear:
    """The kernel with the split-K counters it needs, for one device. A model's ops hold one;
    its launches run in stream order (see the module docstring)."""

    def __init__(self, device: torch.device | str) -> None:
        if triton is None:
            raise RuntimeError("StreamLinear: needs triton")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        # Zero between launches: each launch's last program per tile sets its counter back.
        self._counters = torch.zeros(_MAX_TILES, dtype=torch.int32, device=self.device)

    def takes(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
        """Whether the ops seam runs ``F.linear(x, w, b)`` here: no bias, CUDA on this device,
        STREAM_MIN_ROWS..SEAM_MAX_ROWS rows, a weight of up to SEAM_MAX_N rows, bf16/fp16 and the
        layout the kernel takes. Never raises."""
        return (
            linear_layout_ok(x, w, b)
            and x.device == self.device
            and STREAM_MIN_ROWS <= x.shape[0] <= SEAM_MAX_ROWS
            and w.shape[0] <= SEAM_MAX_N
        )

    def __call__(self, x_MK: torch.Tensor, w_NK: torch.Tensor, *, tiles: StreamTiles | None = None,
                 pdl: bool | None = None) -> torch.Tensor:
        """``x_MK @ w_NK.T`` (``F.linear`` without bias) for M <= STREAM_MAX_ROWS, one launch, in
        x's dtype with fp32 accumulation. ``tiles`` overrides ``stream_tiles`` (the tuning
        benchmark's sweep); ``pdl`` as ``pdl.resolve_pdl``'s. Raises ValueError for arguments
        it cannot take, naming them."""
        check_linear_args("stream_linear", x_MK, w_NK, max_rows=STREAM_MAX_ROWS,
                          max_rows_name="STREAM_MAX_ROWS")
        if x_MK.device != self.device:
            raise ValueError(f"stream_linear: x is on {x_MK.device}, its counters on {self.device}")
        y_MN, done = linear_output(x_MK, w_NK)
        if done:
            return y_MN
        (m, k), n = x_MK.shape, w_NK.shape[0]
        t = tiles or stream_tiles(m, n, k)
        block_m = max(16, _next_pow2(m))
        tiles_n = triton.cdiv(n, t.block_n)
        if t.split_k > 1 and tiles_n > self._counters.numel():
            raise ValueError(f"stream_linear: {tiles_n} tiles of {t.block_n} rows, more than the "
                             f"{self._counters.numel()} counters")
        k_split = triton.cdiv(triton.cdiv(k, t.split_k), t.block_k) * t.block_k
        splits = triton.cdiv(k, k_split)  # a split past K would have nothing to add
        part = (torch.empty((splits, tiles_n, t.block_n, block_m), dtype=torch.float32,
                            device=x_MK.device) if splits > 1 else y_MN)
        _stream_linear_kernel[(tiles_n, splits)](
            x_MK, w_NK, y_MN, part, self._counters, m, n, k, k_split, x_MK.stride(0),
            w_NK.stride(0), BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=splits,
            EVEN_K=k == splits * k_split, UPCAST_DOT=not x_MK.is_cuda, NUM_STAGES=t.num_stages,
            num_warps=t.num_warps, num_stages=t.num_stages, **pdl_meta(resolve_pdl(pdl, x_MK, m)),
        )
        return y_MN
