"""FP8 weight kernels beside the bf16 ones at Qwen3-30B-A3B's shapes (one GPU): the expert path
of one MoE layer (128 experts, top 8, hidden 2048, intermediate 768; uniform random routing)
and the dense projections (qkv 5120x2048, o 2048x4096), in bf16 and with FP8 weights in both
forms of ``fp8_tile`` (W8A16 and W8A8), at decode, mixed and prefill row counts. Prints us per
call, the ratio to bf16, and the weight bytes' HBM floor.

    python bench/fp8_kernels.py [--rows 1 8 64 256 1024 4096] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_kernels import graph_us
from dp_runtime.model.elementwise_ops import decode_linear
from dp_runtime.model.fp8_blocks import Fp8BlockWeight
from dp_runtime.model.fp8_gemm_triton import fp8_block_linear, fp8_linear_tiles
from dp_runtime.model.fused_moe_triton import fused_local_expert_sum
from dp_runtime.model.stream_linear import StreamLinear

HBM_BYTES_PER_S = 4.2e12  # an H200's copy bandwidth (serve_step measures it per run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 2048, 4096])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    dev, g = torch.device("cuda"), torch.Generator(device="cuda").manual_seed(0)
    e, k, h, i = 128, 8, 2048, 768
    w13 = torch.randn(e, 2 * i, h, device=dev, generator=g).mul_(h ** -0.5).to(torch.bfloat16)
    w2 = torch.randn(e, h, i, device=dev, generator=g).mul_(i ** -0.5).to(torch.bfloat16)
    q13, q2 = Fp8BlockWeight.quantize(w13), Fp8BlockWeight.quantize(w2)
    dense = {"qkv": torch.randn(5120, 2048, device=dev, generator=g).to(torch.bfloat16),
             "o": torch.randn(2048, 4096, device=dev, generator=g).to(torch.bfloat16)}
    stream = StreamLinear(dev)
    rows_out = []
    for m in args.rows:
        x = torch.randn(m, h, device=dev, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, e, (m, k), device=dev, generator=g, dtype=torch.int32)
        wts = torch.rand(m, k, device=dev, generator=g)
        touched = min(e, len(set(ids.flatten().tolist())))
        cases = {
            "moe bf16": partial(fused_local_expert_sum, x, ids, wts, w13, w2),
            "moe fp8 w8a16": partial(fused_local_expert_sum, x, ids, wts, q13, q2, w8a8=False),
            "moe fp8 w8a8": partial(fused_local_expert_sum, x, ids, wts, q13, q2, w8a8=True),
        }
        floors = {"moe": touched * 3 * h * i}
        for name, w in dense.items():
            xi = torch.randn(m, w.shape[1], device=dev, generator=g).to(torch.bfloat16)
            qw = Fp8BlockWeight.quantize(w)
            cases[f"{name} bf16"] = partial(decode_linear, xi, w, None, stream)
            cases[f"{name} fp8 w8a16"] = partial(fp8_block_linear, xi, qw, w8a8=False)
            cases[f"{name} fp8 w8a8"] = partial(fp8_block_linear, xi, qw, w8a8=True)
            if m <= 64:  # the tree before split-K: one program per output tile streams all of K
                whole_k = dict(fp8_linear_tiles(m), SPLIT_K=1)
                cases[f"{name} fp8 nosplit"] = partial(fp8_block_linear, xi, qw, w8a8=False, tiles=whole_k)
            floors[name] = w.numel()
        times = {name: graph_us(fn, 1, repeats=5, inner=args.iters) for name, fn in cases.items()}
        for name, us in times.items():
            kind = name.split()[0]
            base = times[f"{kind} bf16"]
            nbytes = floors[kind] * (2 if "bf16" in name else 1)
            rows_out.append(dict(rows=m, case=name, us=round(us, 2), vs_bf16=round(us / base, 3),
                                 floor_us=round(nbytes / HBM_BYTES_PER_S * 1e6, 2)))
    if args.json:
        print(json.dumps(rows_out))
        return
    print(f"{'rows':>6} {'case':<16} {'us':>9} {'x bf16':>7} {'floor us':>9}")
    for r in rows_out:
        print(f"{r['rows']:>6} {r['case']:<16} {r['us']:>9.2f} {r['vs_bf16']:>7.3f} {r['floor_us']:>9.2f}")


if __name__ == "__main__":
    main()
