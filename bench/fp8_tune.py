"""Sweep the FP8 kernels' launch tiles at Qwen3-30B-A3B's shapes on one GPU and print the best
per row count beside the tiles the rules pick today (and bf16's kernel), so a rule change is
read off one run. Weights rotate over ``--copies`` distinct tensors per timed graph, so a call
reads its weight from HBM as in a model step (one dense weight would sit in L2).

    python bench/fp8_tune.py [--what moe dense] [--rows ...] [--top 3]

- moe: ``fused_local_expert_sum`` on FP8 experts (128 experts, top 8, H 2048, I 768, uniform
  routing), both forms' tiles (W8A16, W8A8 on quantized activations) at decode row counts,
  W8A8's at prefill ones (``--both``: W8A16's too);
- dense: ``fp8_block_linear`` for qkv (5120 x 2048) and o (2048 x 4096), the same split, beside
  the seam's choice (``fp8_linear``);
- scaled_mm (with dense, from 64 rows): ``fp8_cublas.cublas_fp8_linear``, cuBLAS's block-scaled
  FP8 GEMM with ``quantize_act`` before it, where ``cublas_takes`` the shapes.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_kernels import graph_us
from dp_runtime.model.elementwise_ops import decode_linear
from dp_runtime.model.fp8_blocks import Fp8BlockWeight
from dp_runtime.model.fp8_cublas import cublas_fp8_linear, cublas_takes
from dp_runtime.model.fp8_gemm_triton import fp8_block_linear, fp8_linear_tiles
from dp_runtime.model.fp8_linear import fp8_linear
from dp_runtime.model.fused_moe_triton import MoeTileConfig, fused_local_expert_sum, tile_config

DECODE_ROWS = (8, 64, 256)
# (block_m, block_n, block_k, group_m, warps, stages): W8A16 at decode sizes, W8A8 at prefill
MOE_DECODE = [(16, 64, 128, 1, 4, 4), (16, 64, 128, 1, 4, 5), (16, 128, 128, 1, 4, 3), (16, 128, 128, 1, 4, 4),
              (16, 128, 128, 1, 8, 4), (16, 256, 128, 1, 8, 3), (32, 128, 128, 1, 4, 3), (32, 128, 128, 1, 4, 4),
              (32, 64, 128, 1, 4, 4), (32, 256, 128, 1, 8, 3), (64, 128, 128, 1, 4, 3), (16, 64, 64, 1, 4, 6)]
MOE_PREFILL = [(64, 128, 128, 8, 4, 3), (64, 256, 128, 8, 8, 3), (128, 128, 128, 8, 8, 3), (128, 256, 128, 8, 8, 3),
               (128, 256, 64, 8, 8, 4), (64, 128, 64, 8, 4, 4), (128, 128, 128, 8, 4, 3), (64, 256, 128, 8, 4, 3)]
# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, SPLIT_K or 0 for the rule's)
DENSE_DECODE = [(16, 32, 128, 1, 4, 5, 0), (16, 64, 128, 1, 4, 4, 0), (16, 32, 128, 1, 4, 4, 2), (16, 32, 128, 1, 2, 4, 0),
                (16, 64, 128, 1, 4, 4, 4), (16, 128, 128, 1, 4, 3, 0), (64, 64, 128, 1, 4, 4, 0),
                (64, 32, 128, 1, 4, 4, 0), (32, 64, 128, 1, 4, 4, 0), (64, 128, 128, 1, 8, 3, 0),
                (16, 64, 64, 1, 4, 6, 0), (64, 64, 64, 1, 4, 5, 0)]
DENSE_PREFILL = [(128, 128, 128, 8, 8, 3, 1), (128, 128, 128, 8, 4, 3, 1), (128, 256, 128, 8, 8, 3, 1),
                 (64, 128, 128, 8, 4, 4, 1), (128, 64, 128, 8, 4, 4, 1), (64, 256, 128, 8, 8, 3, 1)]


def _time(fns, iters: int) -> float:
    """us per call of a list of calls (one per weight copy) replayed from one graph."""
    return graph_us(lambda: [f() for f in fns], len(fns), repeats=5, inner=iters)


def _moe(args, dev, g) -> None:
    e, k, h, i = 128, 8, 2048, 768
    layers = []
    for _ in range(args.copies):
        w13 = torch.randn(e, 2 * i, h, device=dev, generator=g).mul_(h ** -0.5)
        w2 = torch.randn(e, h, i, device=dev, generator=g).mul_(i ** -0.5)
        layers.append((Fp8BlockWeight.quantize(w13), Fp8BlockWeight.quantize(w2),
                       w13.to(torch.bfloat16), w2.to(torch.bfloat16)))
        del w13, w2
    for m in args.rows:
        x = torch.randn(m, h, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, e, (m, k), device=dev, generator=g, dtype=torch.int32)
        wts = torch.rand(m, k, device=dev, generator=g)
        decode = m <= max(DECODE_ROWS)
        def run(cfg=None, w8a8=False, bf16=False, x=x, ids=ids, wts=wts):
            return [partial(fused_local_expert_sum, x, ids, wts, *(L[2:] if bf16 else L[:2]), config=cfg,
                            config2=cfg, w8a8=None if bf16 else w8a8) for L in layers]
        base = {"bf16 rule": _time(run(bf16=True), args.iters),
                "w8a16 rule": _time(run(), args.iters), "w8a8 rule": _time(run(w8a8=True), args.iters)}
        cands = {}
        for c in (MOE_DECODE if decode else MOE_PREFILL):
            cfg = MoeTileConfig(*c)
            for form in ("w8a8", "w8a16") if decode or args.both else ("w8a8",):
                try:
                    cands[f"{form} {c}"] = _time(run(cfg, w8a8=form == "w8a8"), args.iters)
                except Exception as exc:  # a tile the GPU cannot hold (shared memory): skip it
                    print(f"moe rows {m} {form} {c}: {type(exc).__name__}: {str(exc)[:120]}")
        _report(f"moe rows {m} (rule {tile_config(m, fp8=True)})", base, cands, args.top)


def _dense(args, dev, g) -> None:
    shapes = {"qkv": (5120, 2048), "o": (2048, 4096)}
    for name, (n, kk) in shapes.items():
        ws = [torch.randn(n, kk, device=dev, generator=g).mul_(kk ** -0.5).to(torch.bfloat16)
              for _ in range(args.copies)]
        qs = [Fp8BlockWeight.quantize(w) for w in ws]
        for m in args.rows:
            x = torch.randn(m, kk, device=dev, generator=g).to(torch.bfloat16)
            decode = m <= max(DECODE_ROWS)
            base = {"bf16": _time([partial(decode_linear, x, w, None, None) for w in ws], args.iters),
                    "seam": _time([partial(fp8_linear, x, q) for q in qs], args.iters),
                    "w8a16 rule": _time([partial(fp8_block_linear, x, q, w8a8=False) for q in qs], args.iters),
                    "w8a8 rule": _time([partial(fp8_block_linear, x, q, w8a8=True) for q in qs], args.iters)}
            if m >= 64 and cublas_takes(x, qs[0]):
                base["scaled_mm"] = _time([partial(cublas_fp8_linear, x, q) for q in qs], args.iters)
            cands = {}
            for c in (DENSE_DECODE if decode else DENSE_PREFILL):
                tiles = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"), c[:6], strict=True))
                if c[6]:
                    tiles["SPLIT_K"] = c[6]
                for form in ("w8a8", "w8a16") if decode or args.both else ("w8a8",):
                    try:
                        cands[f"{form} {c}"] = _time([partial(fp8_block_linear, x, q, w8a8=form == "w8a8",
                                                              tiles=tiles) for q in qs], args.iters)
                    except Exception as exc:
                        print(f"{name} rows {m} {form} {c}: {type(exc).__name__}: {str(exc)[:120]}")
            _report(f"{name} rows {m} (rule {tuple(fp8_linear_tiles(m).values())})", base, cands, args.top)


def _report(title: str, base: dict[str, float], cands: dict[str, float], top: int) -> None:
    ref = base.get("bf16 rule", base.get("bf16"))
    print(f"== {title}: " + ", ".join(f"{k} {v:.1f} us ({v / ref:.2f}x bf16)" for k, v in base.items()), flush=True)
    for name, us in sorted(cands.items(), key=lambda kv: kv[1])[:top]:
        print(f"   {name}: {us:.1f} us ({us / ref:.2f}x bf16)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", nargs="+", default=["moe", "dense"], choices=["moe", "dense"])
    p.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256, 1024, 4096])
    p.add_argument("--copies", type=int, default=4, help="distinct weights per timed graph")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--both", action="store_true", help="W8A16 candidates at prefill sizes too")
    args = p.parse_args()
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    if "dense" in args.what:
        _dense(args, dev, g)
    if "moe" in args.what:
        _moe(args, dev, g)


if __name__ == "__main__":
    main()
