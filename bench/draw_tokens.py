"""A step's draw alone (``dp_runtime/serving/sampling.draw_tokens``, with the logprobs of the rows
that ask): GPU time between two events around it and the host time to launch it, per sampling
config at each batch size, with the ratio to the greedy argmax. What a sampled step adds to a
decode step, and where a top-p without top-k (a vocabulary sort) stands against the rest.

    python bench/draw_tokens.py                                   # 64 and 256 rows, qwen3's vocabulary
    python bench/draw_tokens.py --rows 128 --configs greedy,t1,t1p0.9 --iters 50

Configs: ``greedy``; ``tT`` temperature T; ``...kK`` with top-k K; ``...pP`` with top-p P;
``...mM`` with min-p M; ``...b`` with a 100-token logit_bias; ``...l`` with 20 logprobs. Every row of a config samples
the same way, seeded by its row. Logits are random normal float32 (scale 3), fresh per config.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from dp_runtime.serving.logprobs import logprob_rows
from dp_runtime.serving.request import SamplingParams
from dp_runtime.serving.sampling import draw_tokens

_CONFIG = re.compile(r"^(greedy|t(?P<t>[0-9.]+)(k(?P<k>\d+))?(p(?P<p>[0-9.]+))?(m(?P<m>[0-9.]+))?(?P<b>b)?(?P<l>l)?)$")


def parse_config(name: str, seed: int) -> SamplingParams:
    m = _CONFIG.match(name)
    if m is None:
        raise SystemExit(f"--configs: {name!r} is not greedy or tT[kK][pP][mM][b][l]")
    if name == "greedy":
        return SamplingParams(seed=seed)
    return SamplingParams(temperature=float(m["t"]), top_k=int(m["k"] or 0), top_p=float(m["p"] or 1.0),
                          min_p=float(m["m"] or 0.0), seed=seed,
                          logit_bias=tuple((7 * j, 1.0) for j in range(100)) if m["b"] else (),
                          logprobs=20 if m["l"] else None)


def time_draw(logits: torch.Tensor, params: list[SamplingParams], iters: int) -> tuple[float, float]:
    """(GPU us, host us) per draw, medians over ``iters``."""
    asked = [i for i, p in enumerate(params) if p.logprobs is not None]

    def once(step: int) -> None:
        drawn = draw_tokens(logits, params, [step] * len(params))
        if asked:
            logprob_rows(logits, drawn.ids_B, asked, [20] * len(asked))

    for s in range(3):
        once(s)
    torch.cuda.synchronize()
    gpu, host = [], []
    for s in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # the GPU busy while the host launches: host time alone
        start.record()
        t0 = time.perf_counter()
        once(3 + s)
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    return sorted(gpu)[iters // 2], sorted(host)[iters // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="64,256")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--configs", default="greedy,t1,t1k50,t0.7p0.9,t0.7k50p0.9,t1m0.05,t1b,t1l")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/draw_tokens.py times CUDA draws: it needs a GPU")
    torch.manual_seed(0)
    out = []
    for rows in (int(r) for r in args.rows.split(",")):
        base = None
        for name in args.configs.split(","):
            params = [parse_config(name, seed=i) for i in range(rows)]
            logits = torch.randn(rows, args.vocab, device="cuda") * 3
            gpu_us, host_us = time_draw(logits, params, args.iters)
            base = gpu_us if name == "greedy" else base
            out.append(dict(rows=rows, config=name, gpu_us=round(gpu_us, 1), host_us=round(host_us, 1),
                            gpu_vs_greedy=round(gpu_us / base, 2) if base else None))
    if args.json:
        print(json.dumps(dict(device=torch.cuda.get_device_name(), vocab=args.vocab, rows=out)))
        return 0
    print(f"{torch.cuda.get_device_name()}, vocab {args.vocab}; us per draw (medians of {args.iters})")
    print(f"{'rows':>5} {'config':>14} {'GPU us':>9} {'host us':>9} {'x greedy':>9}")
    for r in out:
        ratio = "" if r["gpu_vs_greedy"] is None else f"{r['gpu_vs_greedy']:.2f}"
        print(f"{r['rows']:>5} {r['config']:>14} {r['gpu_us']:>9.1f} {r['host_us']:>9.1f} {ratio:>9}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
