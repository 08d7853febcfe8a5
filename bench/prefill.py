"""Prefill throughput of the rank worker and its MFU: the qwen3-30b-a3b preset (random weights),
one 8192-token prompt, 8 x 1024 and 64 x 128 by default (on CPU an eighth of the lengths:
1 x 1024, 8 x 128, 64 x 16), each one extend step.

    python bench/prefill.py                                       # one GPU (DP 1)
    torchrun --standalone --nproc-per-node 2 bench/prefill.py     # two GPUs (DP 2, EP 2)
    python bench/prefill.py --device cpu --model tiny             # CPU smoke test
    dp-runtime bench prefill --nproc 2                            # the same, through the CLI

A shape ``BxN`` is B prompts of N random tokens. Every rank runs the same shape at once (DP 2:
twice the tokens), ``--warmup`` then ``--iters`` times: submit the B requests with
``max_new_tokens=1`` and take one ``RankWorker.step`` (DP sync, the extend forward, sampling:
the host waits for the tokens), which finishes them all, since the prefill budget
(``chunked_prefill_size``) is the largest shape's token count. A step that does not finish
them is an error, not a row.

Columns: step ms (median; the slowest rank's), host ms (median time until ``step()`` returned,
every launch made: near step ms, the host bounds the step), stream ms (``--stream``: median
time per step of back-to-back extend steps, overlapped as serving runs them), tokens/s over every rank, tokens/s per GPU,
TFLOP/s per GPU, and MFU: the step's FLOPs on one rank (``dp_runtime.model.flops``: projections,
causal attention counted per position, router, the top-k experts' GEMMs, LM head on the sampled
rows) over the step time and the GPU's dense bf16 peak (``launch.gpu_specs``; ``--peak-tflops``
for another GPU). With EP the experts of a rank's tokens run on every rank; the count assumes
the routed work is spread evenly, which uniform random routing gives on average.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from dp_runtime.model.flops import forward_flops
from dp_runtime.model.model_config import PRESETS, ModelConfig
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from launch import process_group
from launch.cli_errors import UsageError, bench_main
from launch.gpu_specs import gpu_spec_for_device


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"1x8192,8x1024"`` -> ``[(1, 8192), (8, 1024)]`` (prompts x tokens each)."""
    out = []
    for part in text.split(","):
        try:
            b, n = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise UsageError(f"--shapes takes BxN items (B prompts of N tokens), comma-separated; got {part!r}") from None
        if b < 1 or n < 1:
            raise UsageError(f"--shapes: B and N must be >= 1, got {part!r}")
        out.append((b, n))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def fail(msg: str) -> None:
        raise UsageError(msg)

    p.error = fail  # type: ignore[method-assign]
    p.add_argument("--model", default="qwen3-30b-a3b", help="preset (qwen3-30b-a3b, tiny) or a checkpoint directory")
    p.add_argument("--layers", type=int, default=None, help="override a preset's layer count")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--shapes", default=None,
                   help="BxN: B prompts of N tokens, comma-separated (default 1x8192,8x1024,64x128; CPU 1x1024,8x128,64x16)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dispatcher", default="auto")
    p.add_argument("--attention", default="auto")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU (default: by GPU name)")
    p.add_argument("--json", action="store_true", help="one JSON line on stdout instead of the table")
    p.add_argument("--modes", default="eager",
                   help="graph,eager: each shape with extend graphs (token buckets up to "
                        "cuda_graph_extend_tokens; larger steps stay eager) and without, side by side")
    p.add_argument("--stream", action="store_true",
                   help="also time each shape as a stream of back-to-back extend steps (overlapped, as serving "
                        "runs them and serve_step.py times decode): column stream ms; twice the running requests")
    p.add_argument("--profile", action="store_true",
                   help="the top GPU kernels of one more step of the first shape and mode (torch profiler), "
                        "and the experts such a step touches per layer")
    p.add_argument("--save-routing", default=None, metavar="PATH",
                   help="with --profile: save each layer's routing of that shape's step (moe_layer.py --routing)")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    args = p.parse_args(argv)
    args.shapes = parse_shapes(args.shapes or ("1x8192,8x1024,64x128" if args.device == "cuda" else "1x1024,8x128,64x16"))
    args.modes = [m for m in ("graph", "eager") if m in args.modes.split(",")]
    if not args.modes:
        raise UsageError("--modes takes graph and/or eager, comma-separated")
    if args.save_routing and not args.profile:
        raise UsageError(f"--save-routing {args.save_routing}: saves the profiled step's routing; give --profile too")
    if args.iters < 1 or args.warmup < 0:
        raise UsageError(f"--iters must be >= 1 and --warmup >= 0, got {args.iters} and {args.warmup}")
    return args


def build_spec(args: argparse.Namespace, world: int) -> RankSpec:
    cfg = ModelConfig.preset(args.model) if args.model in PRESETS else ModelConfig.from_dir(args.model)
    longest = max(n for _, n in args.shapes)
    overrides = {"num_layers": args.layers} if args.layers else {}
    if args.model in PRESETS and longest + 1 > cfg.max_position_embeddings:
        overrides["max_position_embeddings"] = longest + 1  # random weights: only the RoPE table grows
    budget = max(b * n for b, n in args.shapes)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if args.device == "cuda" else "float32")
    # --stream: the step before's prompts still run (their tokens unread) when the next ones are
    # admitted, so twice the requests and their KV must fit.
    inflight = 2 if args.stream else 1
    return RankSpec.create(
        args.model, model_overrides=overrides or None, dp_size=world, device=args.device, dtype=dtype,
        max_running_requests=inflight * max(b for b, _ in args.shapes), chunked_prefill_size=budget,
        dispatcher=args.dispatcher, attention=args.attention, max_context_len=longest + 1,
        kv_cache_tokens=inflight * budget + longest,
    )


def timed_prefill(worker: RankWorker, b: int, n: int, iters: int, rank: int, tag: str,
                  host: list[float] | None = None) -> list[float]:
    """Seconds of each of ``iters`` extend steps that prefill ``b`` prompts of ``n`` tokens;
    ``host`` (when given) gets the seconds until ``step()`` returned, every launch made: close
    to the step's time when the host, not the GPU, bounds it."""
    vocab = worker.model_config.vocab_size
    g = torch.Generator().manual_seed(1000 * b + n)
    times = []
    for i in range(iters):
        worker.submit([Request(f"{tag}{b}x{n}-{i}-{rank}-{j}", torch.randint(0, vocab, (n,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=1)) for j in range(b)])
        t0 = time.perf_counter()
        plan = worker.step()
        if host is not None:
            host.append(time.perf_counter() - t0)
        worker.wait_tokens()  # the step ends with its first tokens on the host
        times.append(time.perf_counter() - t0)
        done = worker.pop_finished()
        if not plan.is_extend or len(done) != b or worker.has_work:
            raise RuntimeError(f"shape {b}x{n}: one step finished {len(done)} of {b} prompts (is the prefill "
                               f"budget {worker.spec.runtime.chunked_prefill_size} below {b * n}?)")
    return times


def streamed_prefill(worker: RankWorker, b: int, n: int, iters: int, rank: int, tag: str) -> list[float]:
    """Seconds per step of ``iters`` extend steps run back to back as a serving loop runs them:
    ``b`` new prompts of ``n`` tokens submitted before each step, and each ``step()`` launches
    its forward before it reads the step before's tokens (overlap), so a step's host work runs
    while the GPU still works on the step before. A step's time is from one ``step()``'s return
    to the next's (the submit included). serve_step.py times decode steps the same way, so the
    two compare; the first step, with nothing before it to hide behind, is not counted."""
    vocab = worker.model_config.vocab_size
    g = torch.Generator().manual_seed(7000 * b + n)
    times, last = [], None
    for i in range(iters + 1):
        worker.submit([Request(f"{tag}{b}x{n}-{i}-{rank}-{j}", torch.randint(0, vocab, (n,), generator=g).tolist(),
                               SamplingParams(max_new_tokens=1)) for j in range(b)])
        plan = worker.step()
        now = time.perf_counter()
        if not plan.is_extend:
            raise RuntimeError(f"shape {b}x{n}: streamed step {i} was not an extend step")
        if last is not None:
            times.append(now - last)
        last = now
    worker.wait_tokens()
    done = worker.pop_finished()
    if len(done) != b * (iters + 1) or worker.has_work:
        raise RuntimeError(f"shape {b}x{n}: {iters + 1} streamed steps finished {len(done)} of {b * (iters + 1)} prompts")
    return times


@contextlib.contextmanager
def recorded_routing(worker: RankWorker) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Inside: the worker's steps run eager with each MoE layer's routing appended to the list
    yielded, ``(ids_TK, weights_TK)`` on the CPU (the form ``moe_layer.py --routing`` replays);
    graphs and the route function are restored on exit (hooks do not run inside graphs)."""
    from dp_runtime.model.expert_path import recording_routes

    model, graphed = worker.model, worker.graph_enabled
    path, routed = model.experts, []
    model.experts = recording_routes(path, lambda weights_TK, ids_TK: routed.append((ids_TK.cpu(), weights_TK.cpu())))
    worker.graph_enabled = False
    try:
        yield routed
    finally:
        model.experts, worker.graph_enabled = path, graphed


def experts_touched(worker: RankWorker, b: int, n: int, rank: int, save: str | None = None) -> tuple[float, float]:
    """Mean distinct local experts per MoE layer in one eager step of ``b`` x ``n`` (random
    prompts, as the timed steps): the expert bytes that step must read, in units of one expert;
    and the mean 64-row blocks those experts' picks fill (what the extend GEMMs launch on).
    ``save``: a file for each layer's routing, ``[(ids_TK, weights_TK)]`` on the CPU, which
    ``moe_layer.py --routing`` replays (``recorded_routing``, for that one step only)."""
    with recorded_routing(worker) as routed:
        timed_prefill(worker, b, n, 1, rank, "experts")
    if not routed:
        return 0.0, 0.0
    if save:
        torch.save(routed, save)
    counts = [torch.bincount(ids.flatten().long()) for ids, _ in routed]
    return (statistics.mean(int((c > 0).sum()) for c in counts),
            statistics.mean(int(((c + 63) // 64).sum()) for c in counts))


def profiled_prefill(worker: RankWorker, b: int, n: int, rank: int, save: str | None = None) -> dict:
    """One more step of ``b`` x ``n`` under the torch profiler: GPU busy time and top kernels,
    the host ops by self time and the Python functions of another step (cProfile), and the
    experts a step of that shape touches per layer."""
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_kernels import (
        busy_us,
        gpu_events,
        host_ops,
        idle_gaps,
        python_functions,
        top_kernels,
    )

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        timed_prefill(worker, b, n, 1, rank, "prof")
        wall_us = (time.perf_counter() - t0) * 1e6
    events = gpu_events(prof)
    gaps = idle_gaps(prof)
    py_funcs = python_functions(lambda: timed_prefill(worker, b, n, 1, rank, "cprof"))
    touched, blocks = experts_touched(worker, b, n, rank, save)
    return dict(shape=f"{b}x{n}", mode="graph" if worker.graph_enabled else "eager", wall_us=wall_us,
                gpu_busy_us=busy_us(events), activities=len(events), gaps=gaps, top=top_kernels(events, 15),
                cpu_ops=host_ops(prof), py_funcs=py_funcs, experts_per_layer=touched, blocks64_per_layer=blocks)


def run(args: argparse.Namespace) -> dict | None:
    process_group.resolve_device(args.device)  # ValueError for cuda without a GPU
    world = int(os.environ.get("WORLD_SIZE", "1"))
    own_group = False
    if world > 1 and not dist.is_initialized():
        process_group.init_from_env(device=args.device)
        own_group = True
    elif args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    rank = dist.get_rank() if world > 1 else 0
    try:
        spec = build_spec(args, world)
        cfg = spec.model_config()
        t0 = time.perf_counter()
        with RankWorker(spec, rank=rank, world_size=world, show_progress=rank == 0 and not args.json) as worker:
            build_s = time.perf_counter() - t0
            rows, profile = [], None
            for (b, n), mode in itertools.product(args.shapes, args.modes):
                worker.graph_enabled = mode == "graph"
                before = worker.metrics()["extend_graph_steps"]
                if args.warmup:
                    timed_prefill(worker, b, n, args.warmup, rank, "warm")
                host: list[float] = []
                ms = statistics.median(timed_prefill(worker, b, n, args.iters, rank, "t", host)) * 1e3
                stream_ms = None
                if args.stream:
                    stream_ms = statistics.median(streamed_prefill(worker, b, n, args.iters, rank, "s")) * 1e3
                graphed = worker.metrics()["extend_graph_steps"] - before
                rows.append(dict(shape=f"{b}x{n}", mode=mode if graphed else "eager", prompts=b, prompt_len=n,
                                 step_ms=ms, host_ms=statistics.median(host) * 1e3, stream_ms=stream_ms))
                if args.profile and profile is None and args.device == "cuda":  # the first shape and mode
                    profile = profiled_prefill(worker, b, n, rank, args.save_routing)
            m = worker.metrics()
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, [(r["step_ms"], r["stream_ms"]) for r in rows])
            for i, r in enumerate(rows):
                r["step_ms"] = max(ms[i][0] for ms in every)  # ranks step together; the slowest bounds
                if r["stream_ms"] is not None:
                    r["stream_ms"] = max(ms[i][1] for ms in every)
    finally:
        if own_group:
            process_group.destroy_process_group()
    if rank != 0:
        return None
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    known = gpu_spec_for_device(gpu) if args.device == "cuda" else None
    peak = args.peak_tflops or (known.bf16_dense_tflops if known else None)
    for r in rows:
        flops = forward_flops(cfg, [(0, r["prompt_len"])] * r["prompts"])
        s = r["step_ms"] / 1e3
        tokens = r["prompts"] * r["prompt_len"]
        r.update(tokens_per_rank=tokens, tok_s=world * tokens / s, tok_s_per_gpu=tokens / s,
                 tflops_per_rank=flops.total / 1e12, tflop_s_per_gpu=flops.total / s / 1e12,
                 attention_flops_pct=100 * flops.attention / flops.total,
                 mfu_pct=None if peak is None else 100 * flops.total / s / (peak * 1e12))
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    header = dict(date=str(datetime.date.today()), commit=commit, command=" ".join(sys.argv), device=gpu,
                  world_size=world, model=args.model, layers=args.layers, dtype=str(spec.runtime.dtype).replace("torch.", ""),
                  dispatcher=m["dispatcher"], attention=m["attention"], peak_tflops=peak, iters=args.iters,
                  build_s=build_s)
    return dict(header=header, rows=rows, profile=profile)


def print_table(report: dict) -> None:
    h = report["header"]
    layers = f" ({h['layers']} layers)" if h["layers"] else ""
    peak = f"peak {h['peak_tflops']:g} TFLOP/s per GPU" if h["peak_tflops"] else "no peak known: no MFU"
    print(f"date {h['date']}  {h['device']} x{h['world_size']}  commit {h['commit']}\ncommand: {h['command']}\n"
          f"model {h['model']}{layers} {h['dtype']}, random weights; dispatcher {h['dispatcher']}, attention "
          f"{h['attention']}; {peak}; median of {h['iters']}; build {h['build_s']:.0f} s")
    print(f"{'shape':>8} {'mode':>6} {'step ms':>9} {'host ms':>8} {'stream ms':>10} {'tok/s':>10} {'tok/s/GPU':>10} "
          f"{'TFLOP/s/GPU':>12} {'MFU':>7} {'attn FLOPs':>11}")
    for r in report["rows"]:
        mfu = "-" if r["mfu_pct"] is None else f"{r['mfu_pct']:.1f}%"
        stream = "-" if r.get("stream_ms") is None else f"{r['stream_ms']:.2f}"
        print(f"{r['shape']:>8} {r['mode']:>6} {r['step_ms']:>9.2f} {r['host_ms']:>8.2f} {stream:>10} {r['tok_s']:>10.0f} "
              f"{r['tok_s_per_gpu']:>10.0f} "
              f"{r['tflop_s_per_gpu']:>12.3g} {mfu:>7} {r['attention_flops_pct']:>10.1f}%")
    prof = report.get("profile")
    if prof:
        from bench.gpu_kernels import print_gaps, print_host, print_top

        print(f"profile of one {prof['shape']} {prof['mode']} step (rank 0): {prof['activities']} GPU activities, "
              f"GPU busy {prof['gpu_busy_us'] / 1e3:.1f} ms of {prof['wall_us'] / 1e3:.1f} ms; "
              f"{prof['experts_per_layer']:.1f} local experts touched per MoE layer, "
              f"their picks in {prof['blocks64_per_layer']:.1f} blocks of 64 rows")
        print_gaps(prof["gaps"])
        print_top(prof["top"])
        print_host(prof["cpu_ops"], prof["py_funcs"])


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
