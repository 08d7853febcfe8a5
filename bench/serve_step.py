"""Decode throughput and step latency of the rank worker: the qwen3-30b-a3b preset (random
weights), graphs on and off, side by side in one run, with each row's fraction of the HBM floor.

    python bench/serve_step.py                                   # one GPU (DP 1)
    torchrun --standalone --nproc-per-node 2 bench/serve_step.py # two GPUs (DP 2, EP 2)
    python bench/serve_step.py --layers 8 --batch-sizes 1,32     # a shorter stack, quicker
    torchrun --standalone --nproc-per-node 2 bench/serve_step.py --model tiny --device cpu \
        --batch-sizes 1,4 --dispatcher all_to_all --modes eager     # the DP 2 path on gloo, no GPU

Each rank runs its own ``bs`` requests (prompt ``--prompt-len`` tokens) to the end of their
prefill, then ``--iters`` timed decode steps through ``RankWorker.step`` (DP sync, replay or
eager forward, sampling: the host waits for the tokens every step, as serving does). The graph
and eager rows use one worker, toggling ``graph_enabled`` on every rank alike; ``--modes eager``
alone builds no graphs (the way to run ``all_to_all``, which no graph can hold).

Columns per (bs, mode): step ms (median), tokens/s per GPU (bs / step), and ``floor %``: the
HBM floor over the measured step, where the floor is the weight bytes one step must read on
this rank (attention, norms, router and LM head of every layer, plus the experts the step's
tokens route to: with uniform routing, ``L * (1 - (1 - K/E)^(bs * dp))`` of the rank's ``L``
experts per layer) divided by the device's copy bandwidth, measured here (a 1 GiB
device-to-device copy: read + write bytes over time). KV reads are left out: at the default
context (~100 tokens) they are < 1% of the weights. On ``--device cpu`` (gloo; a check that the
command and its DP path run, not a measurement) the floor is not measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from bench.gpu_kernels import (
    busy_us,
    gpu_events,
    host_ops,
    idle_gaps,
    print_gaps,
    print_host,
    print_top,
    python_functions,
    top_kernels,
)
from dp_runtime import memory_sizing
from dp_runtime.model.quant_config import QUANTIZATION_CHOICES
from dp_runtime.model.weight_groups import layer_groups
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from launch.gpu_specs import measure_copy_bandwidth
from launch.run_config import KV_CACHE_DTYPES


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b", help="preset (qwen3-30b-a3b, tiny) or a checkpoint directory")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, float32, no floor")
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    p.add_argument("--layers", type=int, default=None, help="override the preset's 48 layers")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dispatcher", default="auto")
    p.add_argument("--attention", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (bfloat16, the model's) | fp8_e4m3 (FP8, scale 1)")
    p.add_argument("--quantization", default="none", choices=QUANTIZATION_CHOICES,
                   help="fp8: the weights quantized at load to FP8 128x128 blocks")
    p.add_argument("--modes", default="graph,eager", help="graph, eager or both")
    p.add_argument("--extend-tokens", default="auto",
                   help="token buckets of extend graphs: auto (RuntimeConfig's), none, or e.g. 16,64,256")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.collect() and gc.freeze() once the worker is built (start-up objects leave the GC's scans)")
    p.add_argument("--profile", action="store_true",
                   help="kernel census of one graph-replayed step at each batch size")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    args.modes = [m for m in ("graph", "eager") if m in args.modes.split(",")]
    if not args.modes:
        p.error("--modes must name graph and/or eager")
    if args.profile and args.device != "cuda":
        p.error("--profile is a census of CUDA kernels: it needs --device cuda")
    ext = args.extend_tokens
    args.extend_tokens = ext if ext == "auto" else () if ext == "none" else tuple(int(x) for x in ext.split(","))
    return args


def touched_weight_bytes(spec: RankSpec, bs: int, dp: int, ep_rank: int) -> float:
    """Weight bytes one decode step reads on this rank (module docstring)."""
    cfg, rt = spec.model_config(), spec.runtime
    elt = memory_sizing.dtype_bytes(rt.dtype)
    total = memory_sizing.weight_bytes_per_rank(cfg, rt.dtype, ep_rank, rt.ep_size)
    sparse_layers = [i for i in range(cfg.num_layers) if cfg.is_sparse(i)]
    sparse = len(sparse_layers)
    groups = layer_groups(cfg, sparse_layers[0], ep_rank, rt.ep_size)
    local = groups["w13"].shape[0]
    expert = (groups["w13"].nbytes(elt) + groups["w2"].nbytes(elt)) / local  # FP8: values and scales
    all_experts = sparse * local * expert
    embed = cfg.vocab_size * cfg.hidden_size * elt  # rows are gathered, not read whole
    hit = 1 - (1 - cfg.top_k / cfg.num_experts) ** (bs * dp)
    return total - all_experts - embed + sparse * local * hit * expert


def timed_decode(worker: RankWorker, bs: int, args, tag: str, rank: int) -> list[float]:
    new = 1 + args.warmup + args.iters
    g = torch.Generator().manual_seed(bs)
    vocab = worker.model_config.vocab_size
    worker.submit([Request(f"{tag}{bs}-{rank}-{i}", torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=new)) for i in range(bs)])
    # Prefill every request (other ranks step along: every rank has the same bs).
    while any(not r.prefilled for r in worker.scheduler.running) or worker.scheduler.num_waiting:
        worker.step()
    times = []
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        plan = worker.step()
        dt = time.perf_counter() - t0
        if i >= args.warmup:
            times.append(dt * 1e3)
        assert not plan.skip and not plan.is_extend
    worker.run_until_idle()
    worker.pop_finished()
    return times


def kernel_census(worker: RankWorker, bs: int, args, rank: int) -> dict:
    """One graph-replayed decode step under the torch profiler: GPU activities (kernels, copies,
    memsets) per layer, GPU busy time against the step's wall time, host time (wall minus busy:
    the host waits for the step's tokens, so it works while the GPU idles), the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    # Random prompts, as timed_decode's: identical rows would all route to the same 8 experts.
    g = torch.Generator().manual_seed(10_000 + bs)
    vocab = worker.model_config.vocab_size
    worker.submit([Request(f"prof{bs}-{rank}-{i}", torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=8)) for i in range(bs)])
    while any(not r.prefilled for r in worker.scheduler.running) or worker.scheduler.num_waiting:
        worker.step()
    for _ in range(3):
        worker.step()  # warm: the profiled step is a steady-state replay
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        plan = worker.step()
        worker.wait_tokens()  # the step alone, start to tokens: its host work is not overlapped here
        wall_us = (time.perf_counter() - t0) * 1e6
    assert plan.graph_bucket is not None, "the profiled step did not replay a graph"
    # Where the host time goes: CPU-side ops by self time, and the Python functions of one more
    # step by cumulative time.
    cpu_ops = host_ops(prof)
    py_funcs = python_functions(lambda: (worker.step(), worker.wait_tokens()))
    worker.run_until_idle()
    worker.pop_finished()
    gpu = gpu_events(prof)
    busy = busy_us(gpu)
    gaps = idle_gaps(prof)
    layers = worker.model_config.num_layers
    return dict(bs=bs, layers=layers, activities=len(gpu), per_layer=len(gpu) / layers,
                memcpy=sum(1 for e in gpu if "memcpy" in e.name.lower() or "memset" in e.name.lower()),
                gpu_busy_us=busy, wall_us=wall_us, host_us=max(0.0, wall_us - busy),
                top=top_kernels(gpu), cpu_ops=cpu_ops, py_funcs=py_funcs, gaps=gaps)


def print_census(c: dict) -> None:
    print(f"kernel census, one graph-replayed step at bs {c['bs']}: {c['activities']} GPU activities "
          f"({c['memcpy']} copies/memsets) = {c['per_layer']:.1f} per layer over {c['layers']} layers; "
          f"GPU busy {c['gpu_busy_us'] / 1e3:.2f} ms of a {c['wall_us'] / 1e3:.2f} ms step; host "
          f"{c['host_us'] / 1e3:.2f} ms = {100 * c['host_us'] / max(c['gpu_busy_us'], 1):.1f}% of GPU time")
    print_gaps(c["gaps"])
    print_top(c["top"])
    print_host(c["cpu_ops"], c["py_funcs"])


def main() -> None:
    args = parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = args.device == "cuda"
    if world > 1:
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=600))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    overrides = {"num_layers": args.layers} if args.layers else None
    mrr = max(args.batch_sizes)
    spec = RankSpec.create(
        args.model, model_overrides=overrides, dp_size=world, max_running_requests=mrr,
        chunked_prefill_size=8192, cuda_graph_bs=tuple(args.batch_sizes), dtype="bfloat16" if cuda else "float32",
        device=args.device, dispatcher=args.dispatcher, attention=args.attention,
        use_cuda_graph=None if "graph" in args.modes else False, max_context_len=args.prompt_len + 64,
        kv_cache_tokens=mrr * (args.prompt_len + 64), cuda_graph_extend_tokens=args.extend_tokens,
        kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
    )
    t0 = time.perf_counter()
    worker = RankWorker(spec, rank=rank, world_size=world, show_progress=rank == 0)
    build_s = time.perf_counter() - t0
    if args.gc_freeze:
        import gc

        gc.collect()
        gc.freeze()
    bw = measure_copy_bandwidth(device) if cuda else None
    rows = []
    census = []
    for bs in args.batch_sizes:
        for mode in args.modes:
            worker.graph_enabled = mode == "graph"
            before = worker.metrics()["graph_steps"]
            times = timed_decode(worker, bs, args, mode, rank)
            replayed = worker.metrics()["graph_steps"] - before
            ms = statistics.median(times)
            floor_ms = touched_weight_bytes(spec, bs, world, rank) / bw * 1e3 if bw else None
            rows.append(dict(bs=bs, mode=mode, step_ms=ms, tok_s_per_gpu=bs / ms * 1e3,
                             floor_pct=100 * floor_ms / ms if floor_ms else None, floor_ms=floor_ms,
                             graph_steps=replayed))
            if args.profile and mode == "graph":
                census.append(kernel_census(worker, bs, args, rank))
    m = worker.metrics()
    worker.close()
    all_rows = [rows]
    if world > 1:
        all_rows = [None] * world
        dist.all_gather_object(all_rows, rows)
        dist.destroy_process_group()
    if rank != 0:
        return
    # Per (bs, mode): the slowest rank's step (ranks step together; they differ by noise).
    merged = [max(per_rank, key=lambda r: r["step_ms"]) for per_rank in zip(*all_rows, strict=True)]
    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip() or "unknown"
    gpu = f"GPU {torch.cuda.get_device_name()}" if cuda else "cpu"
    head = (f"date {datetime.date.today()}  {gpu} x{world}  torch {torch.__version__}  "
            f"commit {commit}\ncommand: {' '.join(sys.argv)} (world {world})\n"
            f"model {args.model}{f' ({args.layers} layers)' if args.layers else ''}, random "
            f"{str(spec.runtime.dtype).replace('torch.', '')} weights; "
            f"dispatcher {m['dispatcher']}, attention {m['attention']}, KV {m['kv_cache_dtype']}; "
            f"prompt {args.prompt_len}; "
            f"build {build_s:.0f} s; copy bandwidth {f'{bw / 1e12:.2f} TB/s' if bw else '-'}; iters {args.iters}")
    if args.json:
        print(json.dumps(dict(header=head, rows=merged, census=census)))
        return
    print(head)
    for c in census:
        print_census(c)
    print(f"{'bs':>5} {'mode':>6} {'step ms':>9} {'tok/s/GPU':>10} {'floor ms':>9} {'floor %':>8} {'graph/eager':>12}")
    by = {(r["bs"], r["mode"]): r for r in merged}
    for r in merged:
        both = r["mode"] == "graph" and (r["bs"], "eager") in by
        ratio = by[(r["bs"], "eager")]["step_ms"] / r["step_ms"] if both else None
        floor = f"{r['floor_ms']:>9.2f} {r['floor_pct']:>7.1f}%" if r["floor_ms"] else f"{'-':>9} {'-':>8}"
        print(f"{r['bs']:>5} {r['mode']:>6} {r['step_ms']:>9.2f} {r['tok_s_per_gpu']:>10.0f} {floor} "
              f"{'' if ratio is None else f'{ratio:.2f}x':>12}")


if __name__ == "__main__":
    main()
