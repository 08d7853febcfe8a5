"""The attention block's projections at decode batch sizes: F.linear (cuBLAS) against
``skinny_linear`` (dp_runtime/model/skinny_linear.py, 1-4 rows), ``stream_linear``
(dp_runtime/model/stream_linear.py, 3-256 rows) and the weight's bytes floor.

    python bench/skinny_linear.py           # M 1 2 4 8 x qkv, o_proj, router; seconds
    python bench/skinny_linear.py --tune    # + sweep the kernel's tiles at M 1 (minutes)
    python bench/skinny_linear.py --rows 4 16 64 128 256 --tune-stream 64 256
                                            # + sweep stream_linear's tilings at M 64 and 256

Shapes (Qwen3-30B-A3B, bf16, random weights): qkv [5120, 2048], o_proj [2048, 4096], router
[128, 2048]. M 8 is past SKINNY_MAX_ROWS: F.linear only, to show where cuBLAS stands there.

Timing: one CUDA graph holds ``calls`` calls, each on its own copy of the weight, at least 20 and
enough copies for 256 MB, so that every call reads its weight from HBM, not L2 (50 MB), as in a
model's step where each layer's weights are read once; x stays cached, as it does there. The graph
is replayed ``--inner`` times between two CUDA events, ``--repeats`` times; a cell is the median
microseconds per call. GB/s: the weight's bytes over that time. floor: the weight's bytes over the
measured copy bandwidth (``launch.gpu_specs.measure_copy_bandwidth``, read + write counted).
speedup: F.linear's time over the kernel's (skinny_linear where it takes M, else stream_linear).
check: ``||y - ref|| / ||ref||`` against fp32 math on the same inputs, BAD above 2^-7 (bf16
rounding is 2^-8 at most per element).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import datetime
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from bench.gpu_kernels import graph_us
from dp_runtime.model.skinny_linear import SKINNY_MAX_ROWS, _tiles, skinny_linear
from dp_runtime.model.stream_linear import (
    STREAM_MAX_ROWS,
    STREAM_MIN_ROWS,
    StreamLinear,
    StreamTiles,
    stream_tiles,
)
from launch.gpu_specs import measure_copy_bandwidth

SHAPES = {"qkv": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048)}
COLD_BYTES = 256 << 20  # weight copies per graph: five times an H200's 50 MB L2


def _weights(n: int, k: int, device) -> list[torch.Tensor]:
    copies = max(20, -(-COLD_BYTES // (n * k * 2)))
    w = (torch.randn(n, k, device=device) * k**-0.5).bfloat16()
    return [w.clone() for _ in range(copies)]


def calls_us(fn: Callable, x: torch.Tensor, ws: list[torch.Tensor], inner: int, repeats: int) -> float:
    """Median microseconds per call of ``fn(x, w)`` over ``ws``, replayed from one CUDA graph."""
    def run() -> None:
        for w in ws:
            fn(x, w)
    return graph_us(run, len(ws), repeats, inner)


def _rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = F.linear(x.float(), w.float())
    return ((y.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bench(args, device, bw: float) -> None:
    stream = StreamLinear(device)
    print(f"{'shape':>7} {'N x K':>12} {'M':>3} {'floor us':>9} {'F.linear us':>12} {'GB/s':>6} "
          f"{'kernel us':>10} {'GB/s':>6} {'floor %':>8} {'speedup':>8} {'check':>10}  "
          f"(kernel: skinny_linear at M <= {SKINNY_MAX_ROWS}, else stream_linear)")
    for name, (n, k) in SHAPES.items():
        ws = _weights(n, k, device)
        nbytes = n * k * 2
        floor = nbytes / bw * 1e6
        for m in args.rows:
            x = torch.randn(m, k, device=device).bfloat16()
            ref_us = calls_us(F.linear, x, ws, args.inner, args.repeats)
            for lib in args.blas:  # F.linear under each of torch's BLAS back ends (process-wide)
                default = torch.backends.cuda.preferred_blas_library()
                torch.backends.cuda.preferred_blas_library(lib)
                try:
                    us = calls_us(F.linear, x, ws, args.inner, args.repeats)
                    err = _rel_err(F.linear(x, ws[0]), x, ws[0])
                finally:
                    torch.backends.cuda.preferred_blas_library(default)
                print(f"{name:>7} {f'{n} x {k}':>12} {m:>3} {floor:>9.2f} {us:>12.2f} {nbytes / us / 1e3:>6.0f} "
                      f"  F.linear with {lib}: {ref_us / us:.2f}x the default, {100 * floor / us:.0f}% of floor, "
                      f"check {err:.1e}")
            cells = f"{'-':>10} {'-':>6} {'-':>8} {'-':>8} {'-':>10}"
            kernel = (skinny_linear if m <= SKINNY_MAX_ROWS
                      else stream if STREAM_MIN_ROWS <= m <= STREAM_MAX_ROWS else None)
            if kernel is not None:
                us = calls_us(kernel, x, ws, args.inner, args.repeats)
                err = _rel_err(kernel(x, ws[0]), x, ws[0])
                flag = " BAD" if err > 2.0**-7 else ""
                cells = (f"{us:>10.2f} {nbytes / us / 1e3:>6.0f} {100 * floor / us:>7.0f}% "
                         f"{ref_us / us:>7.2f}x {err:>6.1e}{flag}")
            print(f"{name:>7} {f'{n} x {k}':>12} {m:>3} {floor:>9.2f} {ref_us:>12.2f} "
                  f"{nbytes / ref_us / 1e3:>6.0f} {cells}")
        del ws


def tune(args, device, bw: float) -> None:
    """Every tile config of the sweep at M = ``--tune-rows``: the best against ``_tiles``."""
    m = args.tune_rows
    sweep = list(itertools.product((8, 16, 32, 64), (128, 256, 512), (2, 4, 8), (2, 3, 4)))
    for name, (n, k) in SHAPES.items():
        ws = _weights(n, k, device)
        x = torch.randn(m, k, device=device).bfloat16()
        floor = n * k * 2 / bw * 1e6
        results, skipped = [], 0
        for block_n, block_k, warps, stages in sweep:
            # More than 128 fp32 accumulator registers per thread per row spills: not worth a compile.
            if block_n * block_k * m > 128 * 32 * warps:
                skipped += 1
                continue
            cfg = (block_n, block_k, warps, stages)

            def fn(x_, w_, cfg=cfg):
                return skinny_linear(x_, w_, tiles=cfg)

            try:
                us = calls_us(fn, x, ws, max(1, args.inner // 4), 3)
            except (triton.runtime.errors.OutOfResources, RuntimeError) as e:  # shared memory, ...
                print(f"  {name} {cfg}: {type(e).__name__}")
                skipped += 1
                continue
            if _rel_err(fn(x, ws[0]), x, ws[0]) > 2.0**-7:
                print(f"  {name} {cfg}: BAD result")
                continue
            results.append((us, cfg))
        results.sort()
        chosen = _tiles(n, k)
        chosen_us = next((us for us, cfg in results if cfg == chosen), float("nan"))
        print(f"{name} [{n} x {k}] M {m}: floor {floor:.2f} us; {len(results)} configs timed, {skipped} skipped")
        print(f"  _tiles {chosen}: {chosen_us:.2f} us ({100 * floor / chosen_us:.0f}% of floor)")
        for us, cfg in results[:5]:
            print(f"  (BLOCK_N, BLOCK_K, warps, stages) {cfg}: {us:.2f} us ({100 * floor / us:.0f}% of floor)")
        del ws


def tune_stream(args, device, bw: float) -> None:
    """stream_linear's tilings at each M of ``--tune-stream``: the best five against
    ``stream_tiles``' pick, per shape."""
    stream = StreamLinear(device)
    sweep = [StreamTiles(64, bk, sk, 4, st)
             for bk, sk, st in itertools.product((64, 128, 256), (1, 2, 4, 8), (3, 4))]
    sweep += [StreamTiles(128, 64, sk, 8, 3) for sk in (1, 2, 4)]
    for name, (n, k) in SHAPES.items():
        ws = _weights(n, k, device)
        floor = n * k * 2 / bw * 1e6
        for m in args.tune_stream:
            x = torch.randn(m, k, device=device).bfloat16()
            chosen = stream_tiles(m, n, k)
            results, skipped = [], 0
            for cfg in dict.fromkeys([chosen, *sweep]):
                def fn(x_, w_, cfg=cfg):
                    return stream(x_, w_, tiles=cfg)
                try:
                    us = calls_us(fn, x, ws, max(1, args.inner // 4), 3)
                except (triton.runtime.errors.OutOfResources, RuntimeError):  # shared memory
                    skipped += 1
                    continue
                if _rel_err(fn(x, ws[0]), x, ws[0]) > 2.0**-7:
                    print(f"  {name} M {m} {cfg}: BAD result")
                    continue
                results.append((us, cfg))
            results.sort()
            chosen_us = next((us for us, cfg in results if cfg == chosen), float("nan"))
            print(f"{name} [{n} x {k}] M {m}: floor {floor:.2f} us; {len(results)} timed, "
                  f"{skipped} skipped; stream_tiles {tuple(chosen)}: {chosen_us:.2f} us "
                  f"({100 * floor / chosen_us:.0f}% of floor)")
            for us, cfg in results[:5]:
                print(f"  (block_n, block_k, split_k, warps, stages) {tuple(cfg)}: {us:.2f} us "
                      f"({100 * floor / us:.0f}% of floor)")
        del ws


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8], help="M values")
    p.add_argument("--inner", type=int, default=20, help="graph replays per timed sample")
    p.add_argument("--repeats", type=int, default=7, help="timed samples per cell (median)")
    p.add_argument("--blas", nargs="*", default=[], choices=["cublas", "cublaslt"],
                   help="also time F.linear with torch's preferred BLAS library set to each of these")
    p.add_argument("--tune", action="store_true", help="also sweep the kernel's tile configs")
    p.add_argument("--tune-rows", type=int, default=1, help="M of the sweep")
    p.add_argument("--tune-stream", type=int, nargs="*", default=[],
                   help="sweep stream_linear's tilings at each of these M")
    args = p.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    bw = measure_copy_bandwidth(device)
    print(f"date {datetime.date.today()}  GPU {torch.cuda.get_device_name(device)}  torch {torch.__version__}  "
          f"triton {triton.__version__}  copy bandwidth {bw / 1e12:.2f} TB/s  command: {' '.join(sys.argv)}")
    bench(args, device, bw)
    if args.tune:
        tune(args, device, bw)
    if args.tune_stream:
        tune_stream(args, device, bw)


if __name__ == "__main__":
    main()
