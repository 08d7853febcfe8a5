"""Mixed steps against decode steps at the same batch: what a step costs when it carries, beside
``--decode-rows`` running requests, the prompts of new ones (one rank, DP 1).

    python bench/mixed_step.py --decode-rows 64 --prompts 1x512,1x960,4x240 --modes graph,eager
    python bench/mixed_step.py --device cpu --model tiny --decode-rows 8 --prompts 1x32,2x16
    python bench/mixed_step.py --decode-rows 64 --prompts 1x960 --profile   # where the time goes
    python bench/mixed_step.py --decode-rows 128 --prompts 1x896 --save-routing m.pt --modes graph
    python bench/moe_layer.py --routing m.pt --extend --tune --ep 1   # the expert tiles on it

``--decode-rows`` D requests of ``--decode-context`` random prompt tokens are prefilled first;
they then decode for the whole run (``max_new_tokens`` large), so every step carries D decode
rows. For each shape ``BxN`` and mode, steps run back to back as serving runs them (overlapped:
a step launches its forward before it reads the step before's tokens): ``--iters`` times a
mixed step (B new prompts of N tokens, ``max_new_tokens`` 1, submitted just before it) then a
decode step. A step's time is from its ``step()`` return to the next one's: with overlap that
is the time until its tokens were read, i.e. its own GPU time when the GPU bounds it. Host ms:
the time inside a mixed step's ``step()`` (its scheduling and launches; the step before's tokens
are read at its end). Columns: decode ms (the decode steps' median), mixed ms, their ratio, and
the mixed step's extra ms per prompt token. ``--profile``: the top GPU kernels of a few mixed
steps and of as many decode steps (torch profiler), per step. ``--save-routing PATH``: each MoE
layer's routing of one eager mixed step of the first shape, ``[(ids_TK, weights_TK)]`` on the
CPU, decode rows first: what ``bench/moe_layer.py --routing`` replays (a mixed step's routing,
decode rows spread over every expert beside a prompt's concentrated rows, for its tile sweep).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.prefill import parse_shapes, recorded_routing
from bench.serve_load import _commit
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from launch import process_group
from launch.cli_errors import UsageError, bench_main
from launch.run_config import KV_CACHE_DTYPES


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", help="preset (qwen3-30b-a3b, tiny) or a checkpoint directory")
    p.add_argument("--layers", type=int, default=None, help="override a preset's layer count")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model's dtype) | fp8_e4m3 (FP8, scale 1)")
    p.add_argument("--decode-rows", type=int, default=64)
    p.add_argument("--decode-context", type=int, default=512, help="prompt tokens of each decoding request")
    p.add_argument("--prompts", default="1x512,1x960", help="BxN: B new prompts of N tokens per mixed step")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default="graph,eager", help="graph and/or eager, comma-separated")
    p.add_argument("--profile", action="store_true", help="top GPU kernels of the first shape's steps")
    p.add_argument("--save-routing", default=None, metavar="PATH",
                   help="save each layer's routing of one eager mixed step of the first shape (moe_layer.py --routing)")
    p.add_argument("--json", action="store_true", help="one JSON line on stdout instead of the table")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    args = p.parse_args(argv)
    args.shapes = parse_shapes(args.prompts)
    args.modes = [m for m in ("graph", "eager") if m in args.modes.split(",")]
    if not args.modes:
        raise UsageError("--modes takes graph and/or eager, comma-separated")
    for name in ("decode_rows", "decode_context", "iters"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def build_spec(args: argparse.Namespace) -> RankSpec:
    d, most = args.decode_rows, max(b * n for b, n in args.shapes)
    steps = (args.warmup + args.iters) * 2 * len(args.shapes) * len(args.modes) + 64
    context = args.decode_context + steps + 1
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device == "cuda" else "float32")
    # The decoders' prompts go in over a few steps of at most 8192 tokens: a chunk of all of them
    # at once (65536 tokens at 128 rows) would size the profiled peak, and with it shrink the KV
    # cache until the decoders' reserved growth leaves no room to admit a new prompt.
    budget = max(d + most, min(d * args.decode_context, 8192))
    return RankSpec.create(
        args.model, model_overrides={"num_layers": args.layers} if args.layers else None, device=args.device,
        dtype=dtype, max_running_requests=d + 2 * max(b for b, _ in args.shapes), chunked_prefill_size=budget,
        mixed_step_tokens=d + most, max_context_len=max(context, max(n for _, n in args.shapes) + 1),
        kv_cache_dtype=args.kv_cache_dtype,
    )


def start_decoders(worker: RankWorker, args: argparse.Namespace) -> None:
    vocab = worker.model_config.vocab_size
    g = torch.Generator().manual_seed(11)
    worker.submit([Request(f"dec-{i}", torch.randint(0, vocab, (args.decode_context,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=worker.spec.context_len - args.decode_context - 1,
                                          ignore_eos=True))
                   for i in range(args.decode_rows)])
    for _ in range(64):
        if not worker.step().is_extend:
            return
    raise RuntimeError("the decoding requests did not reach their decode steps in 64 steps")


def timed(worker: RankWorker, b: int, n: int, iters: int, tag: str) -> tuple[list[float], list[float], list[float]]:
    """(mixed step seconds, decode step seconds, host seconds of the mixed steps) over ``iters``
    mixed+decode pairs (module docstring)."""
    vocab = worker.model_config.vocab_size
    g = torch.Generator().manual_seed(1000 * b + n)
    returns, kinds, host = [], [], []
    for i in range(iters):
        worker.submit([Request(f"{tag}-{b}x{n}-{i}-{j}", torch.randint(0, vocab, (n,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=1)) for j in range(b)])
        t0 = time.perf_counter()
        plan = worker.step()
        returns.append(time.perf_counter())
        host.append(returns[-1] - t0)
        kinds.append("mixed" if plan.is_extend else "other")
        plan = worker.step()
        returns.append(time.perf_counter())
        kinds.append("decode" if not plan.is_extend else "other")
    worker.step()
    returns.append(time.perf_counter())
    if "other" in kinds:
        raise RuntimeError(f"shape {b}x{n}: a step was not the mixed/decode step expected ({kinds})")
    gaps = [b2 - a for a, b2 in itertools.pairwise(returns)]
    mixed = [t for t, k in zip(gaps, kinds, strict=True) if k == "mixed"]
    decode = [t for t, k in zip(gaps, kinds, strict=True) if k == "decode"]
    worker.pop_finished()
    return mixed, decode, host


def profiled(worker: RankWorker, b: int, n: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_kernels import busy_us, gpu_events, host_ops, top_kernels

    out = {}
    for kind in ("mixed", "decode"):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(3):
                if kind == "mixed":
                    worker.submit([Request(f"prof-{i}-{j}", [1 + j] * n, SamplingParams(max_new_tokens=1))
                                   for j in range(b)])
                worker.step()
            worker.wait_tokens()
            torch.cuda.synchronize()
        events = gpu_events(prof)
        out[kind] = dict(gpu_busy_us=busy_us(events) / 3, top=[(k, c / 3, us / 3) for k, c, us in top_kernels(events, 15)],
                         cpu_ops=host_ops(prof, 8))
        if kind == "mixed":
            worker.step()  # the decode step after, out of the decode profile
    worker.pop_finished()
    return out


def save_routing(worker: RankWorker, b: int, n: int, path: str) -> int:
    """One eager mixed step of ``b`` new prompts of ``n`` tokens beside the decode rows, its
    routing saved to ``path`` (module docstring; recorded for that step only,
    ``prefill.recorded_routing``); then its decode step. Returns the layers saved."""
    vocab = worker.model_config.vocab_size
    g = torch.Generator().manual_seed(7)
    worker.submit([Request(f"routing-{j}", torch.randint(0, vocab, (n,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=1)) for j in range(b)])
    with recorded_routing(worker) as routed:
        plan = worker.step()
    worker.step()
    worker.pop_finished()
    if not plan.is_extend:
        raise RuntimeError(f"shape {b}x{n}: the step with the new prompts was not a mixed step")
    torch.save(routed, path)
    return len(routed)


def run(args: argparse.Namespace) -> dict:
    process_group.resolve_device(args.device)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    spec = build_spec(args)
    rows, profile = [], None
    with RankWorker(spec, rank=0, world_size=1, show_progress=not args.json) as worker:
        start_decoders(worker, args)
        for (b, n), mode in itertools.product(args.shapes, args.modes):
            worker.graph_enabled = mode == "graph"
            before = worker.metrics()
            timed(worker, b, n, args.warmup, "warm")
            mixed, decode, host = timed(worker, b, n, args.iters, "t")
            m = worker.metrics()
            graphed = m["extend_graph_steps"] > before["extend_graph_steps"]
            mixed_ms, decode_ms = statistics.median(mixed) * 1e3, statistics.median(decode) * 1e3
            rows.append(dict(shape=f"{b}x{n}", mode=mode if graphed else "eager", decode_ms=decode_ms,
                             mixed_ms=mixed_ms, host_ms=statistics.median(host) * 1e3, ratio=mixed_ms / decode_ms,
                             us_per_prompt_token=1e3 * (mixed_ms - decode_ms) / (b * n)))
            if args.profile and profile is None and args.device == "cuda":
                profile = dict(shape=f"{b}x{n}", mode=rows[-1]["mode"], **profiled(worker, b, n))
        if args.save_routing:
            save_routing(worker, *args.shapes[0], args.save_routing)
        m = worker.metrics()
    header = dict(date=str(datetime.date.today()), commit=_commit(),
                  command=" ".join(sys.argv), device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                  model=args.model, layers=args.layers, decode_rows=args.decode_rows,
                  decode_context=args.decode_context, iters=args.iters, attention=m["attention"],
                  mixed_step_tokens=spec.runtime.mixed_step_tokens, kv_cache_dtype=m["kv_cache_dtype"])
    return dict(header=header, rows=rows, profile=profile)


def print_table(report: dict) -> None:
    h = report["header"]
    print(f"date {h['date']}  {h['device']}  commit {h['commit']}\ncommand: {h['command']}\nmodel {h['model']}, "
          f"{h['decode_rows']} decode rows of {h['decode_context']}+ tokens, attention {h['attention']}, "
          f"KV {h['kv_cache_dtype']}, "
          f"median of {h['iters']}")
    print(f"{'prompts':>8} {'mode':>6} {'decode ms':>10} {'mixed ms':>9} {'ratio':>6} {'host ms':>8} {'us/prompt tok':>14}")
    for r in report["rows"]:
        print(f"{r['shape']:>8} {r['mode']:>6} {r['decode_ms']:>10.2f} {r['mixed_ms']:>9.2f} {r['ratio']:>6.2f} "
              f"{r['host_ms']:>8.2f} {r['us_per_prompt_token']:>14.2f}")
    prof = report.get("profile")
    if prof:
        from bench.gpu_kernels import print_top

        for kind in ("mixed", "decode"):
            p = prof[kind]
            print(f"-- {kind} step ({prof['shape']} {prof['mode']}), per step: GPU busy {p['gpu_busy_us'] / 1e3:.2f} ms")
            print_top([(k, round(c), us) for k, c, us in p["top"]])
            for name, count, us in p["cpu_ops"]:
                print(f"   host {name}: {count} calls, {us / 3:.0f} us/step")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
