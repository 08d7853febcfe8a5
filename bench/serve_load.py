"""Serving under load: a stream of arriving requests through the rank workers, measured the way
serving benchmarks (SGLang's bench_serving, vLLM's benchmark_serving) measure a server: request
throughput, output tokens/s, TTFT, ITL, TPOT and end-to-end latency percentiles, and the most
requests running at once.

    python bench/serve_load.py --device cpu --model tiny --num-requests 32 --lengths random:64:16
    python bench/serve_load.py --model qwen3-30b-a3b --device cuda --rates 1,4,16,inf      # DP 1
    torchrun --standalone --nproc-per-node 2 bench/serve_load.py --model qwen3-30b-a3b --device cuda
    python bench/serve_load.py --launcher ray --dp 2 --model qwen3-30b-a3b --device cuda  # Ray actors
    dp-runtime bench serve_load -- --device cpu --num-requests 16                           # the same

Workload (per rate; a pure function of ``--seed``): ``--num-requests`` prompts of random token
ids. Lengths (``--lengths``): ``sharegpt`` (default) draws from SHAREGPT_LIKE below, a coarse
histogram shaped like ShareGPT conversations (uniform within a bin; means about 300 prompt and
170 output tokens; a stated table, not the data set); ``random:IN:OUT[:RATIO]`` is vLLM's random
data set (uniform in ``[X*(1-RATIO), X*(1+RATIO)]``; exactly IN and OUT for RATIO 0, the
default). Every request generates exactly its output length (no stop token), greedy unless
``--temperature`` (with ``--top-p``, ``--top-k``; request i draws with seed i);
``--frequency-penalty`` / ``--presence-penalty`` / ``--repetition-penalty`` on every request.
``--shared-prefix-len N``: every prompt of every rate starts with the same N tokens (a system
prompt; the drawn prompt length follows them), the workload prefix caching serves;
``--prefix-groups G`` draws each prompt's N tokens from G distinct prefixes (many system
prompts or conversations: at DP > 1 the engine's cache-aware routing keeps a group on a rank).
Arrivals:
a Poisson process at each of ``--rates`` requests/s (``--arrival fixed``: evenly spaced;
``inf``: all at once), the first at 0. ``--concurrency C1,C2,...`` instead: for each C, C
requests a rank all at once (C x ranks in all, rate inf), one wave of C running on every rank,
all on one set of ranks started with ``--max-running-requests`` (at least the largest C): a
sweep of running counts for one model load (vLLM's ``--max-concurrency`` sweep with as many
prompts as places). ``--warmup-max-new N`` caps the warm-up requests' output at N tokens (the
warm-up builds kernels; a 1000-token output only adds decode steps).

How arrivals reach the ranks (``bench/load_ranks.py``): a rate's requests, each carrying its
``arrival_s``, are all submitted at once through the one ``Engine`` that ``dp-runtime serve``
drives (one in-process rank, or the rank actors of one Ray gang, kept for every rate), which
routes each to the rank left with the least outstanding tokens (``launch/prefix_routing.py``);
a rank's scheduler admits a request no earlier than its arrival (between steps), and every rank
steps, IDLE where it has nothing, while any rank has work. Under torchrun (no driver, by design)
each process's rank takes its round-robin share and runs ``RankWorker.run_until_idle``.
``--warmup`` requests (and on each rank one prompt of a whole prefill chunk and a few tokens
more) run first and are not reported.

Columns per rate: ``req/s`` and ``out tok/s``: finished requests and output tokens over the
duration (submit to the last token); TTFT: arrival to first token; ITL: the gaps between
consecutive tokens of a request, pooled over requests; TPOT: per request, (latency - TTFT) /
(tokens - 1); E2E: arrival to last token; ``max run``: the most requests running (admitted,
unfinished) at once on one rank (``max_concurrency`` in the JSON sums the ranks). Times are each
rank's own ``perf_counter`` from its submit (ranks are submitted to within milliseconds).

Steps and the decode-only bound (docs/serving_benchmarks.md): ``steps`` counts each rate's
steps by kind over the ranks; a decode probe at the rate's ``max run`` R times the decode step
(``bound`` = R x ranks / step, ``eff`` = out tok/s / bound). ``occ`` (occupancy): output
tokens over steps x R, the batch's fill; ``ideal`` is the occupancy the workload allows an ideal
rank under the same admission rules (``load_summary.ideal_occupancy``: every step equally long,
no KV limit), the ceiling of ``eff`` where steps run at the decode step's speed. ``--mixed both``
and ``--policy both`` (the scheduler's admission order, RuntimeConfig.schedule_policy), and
``--prefix-caching off|on|both`` (RuntimeConfig.prefix_caching; default and the flag alone: on): every
rate in each variant, on a fresh set of ranks each. With prefix caching a rank's cache lives
across the rates of a variant (the warmup's prompts share no prefix); ``cached``: the prompt
tokens served from it over all prompt tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import math
import os
import subprocess
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from bench.load_ranks import EngineRanks, TorchrunRank
from bench.load_summary import (
    STEP_KINDS,
    decode_step_s,
    dp_balance_between,
    ideal_occupancy,
    step_kinds,
    summarize_rate,
)
from bench.load_table import print_table
from bench.load_workload import (
    Lengths,
    decode_probe_requests,
    make_batches,
    parse_concurrency,
    warmup_requests,
)
from dp_runtime.config import RuntimeConfig
from dp_runtime.model.model_config import PRESETS, ModelConfig
from dp_runtime.model.quant_config import QUANTIZATION_CHOICES
from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request, SamplingParams
from launch import process_group
from launch.cli_errors import UsageError, bench_main
from launch.run_config import KV_CACHE_DTYPES, parse_mixed_step_tokens


# -- the command -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def fail(msg: str) -> None:
        raise UsageError(msg)

    p.error = fail  # type: ignore[method-assign]
    p.add_argument("--model", default="tiny", help="preset (tiny, qwen3-30b-a3b) or a checkpoint directory")
    p.add_argument("--layers", type=int, default=None, help="override a preset's layer count")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="auto", help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="auto (the model's) | fp8_e4m3")
    p.add_argument("--quantization", default="none", choices=QUANTIZATION_CHOICES,
                   help="fp8: the weights quantized at load to FP8 128x128 blocks")
    p.add_argument("--launcher", default="local", choices=("local", "ray"),
                   help="local: ranks in this process (one, or one per torchrun process); ray: rank actors")
    p.add_argument("--dp", type=int, default=1, help="DP ranks with --launcher ray (torchrun: --nproc-per-node)")
    p.add_argument("--ray-address", default=None, help="default: a private local cluster; 'auto'; or host:port")
    p.add_argument("--rates", default=None,
                   help="requests/s, comma-separated; inf: all at once (default 1,4,16,inf)")
    p.add_argument("--concurrency", default=None,
                   help="running requests a rank, comma-separated: each C runs C x ranks "
                        "requests at once, one wave (instead of --rates and --num-requests)")
    p.add_argument("--arrival", default="poisson", choices=("poisson", "fixed"))
    p.add_argument("--num-requests", type=int, default=100, help="requests per rate")
    p.add_argument("--lengths", default="sharegpt", help="sharegpt | random:IN:OUT[:RATIO]")
    p.add_argument("--warmup", type=int, default=4, help="requests run (all at once) before the first rate")
    p.add_argument("--warmup-max-new", type=int, default=None,
                   help="cap the warm-up requests' output tokens (default: as drawn)")
    p.add_argument("--max-running-requests", type=int, default=128)
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--dispatcher", default="auto")
    p.add_argument("--attention", default="auto")
    p.add_argument("--mixed", default="on", choices=("on", "off", "both"),
                   help="mixed prefill+decode steps (RuntimeConfig.mixed_steps); both: off, then on")
    p.add_argument("--mixed-step-tokens", default="auto",
                   help="the mixed steps' token budget (RuntimeConfig.mixed_step_tokens): auto or an int")
    p.add_argument("--policy", default="fcfs", choices=("fcfs", "lof", "both"),
                   help="admission order (RuntimeConfig.schedule_policy); both: fcfs, then lof")
    p.add_argument("--prefix-caching", nargs="?", const="on", default="on", choices=("off", "on", "both"),
                   help="RuntimeConfig.prefix_caching (the flag alone: on); both: off, then on")
    p.add_argument("--shared-prefix-len", type=int, default=0,
                   help="every prompt starts with the same this many tokens (then its drawn length)")
    p.add_argument("--prefix-groups", type=int, default=1,
                   help="--shared-prefix-len's prefixes: each prompt starts with one of this many, drawn")
    p.add_argument("--probe-tokens", type=int, default=32,
                   help="tokens per decode-probe request (the decode-only bound); 0: no probe")
    p.add_argument("--probe-prompt-len", type=int, default=64, help="prompt tokens of a decode-probe request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="every request's (and the probe's) sampling temperature; 0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus mass (1: off)")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: the k most likely tokens (0: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="every request's (and the probe's)")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="every request's (and the probe's)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="every request's (and the probe's); 1: off")
    p.add_argument("--json", action="store_true", help="one JSON line on stdout instead of the table")
    p.add_argument("--per-request", action="store_true", help="with --json: every request's timings too")
    p.add_argument("--gpu-spans", action="store_true",
                   help="CUDA, in-process: each rate's steps on the GPU and its idle gaps (bench/gpu_spans.py)")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    args = p.parse_args(argv)
    args.lengths = Lengths.parse(args.lengths)
    args.mixed_step_tokens = parse_mixed_step_tokens(args.mixed_step_tokens, args.chunked_prefill_size)
    args.concurrency = parse_concurrency(args.concurrency, args.rates, args.max_running_requests)
    try:
        args.rates = ([math.inf] * len(args.concurrency) if args.concurrency
                      else [float(x) for x in (args.rates or "1,4,16,inf").split(",")])
    except ValueError:
        raise UsageError(f"--rates must be numbers or inf, comma-separated; got {args.rates!r}") from None
    if not args.rates or any(not r > 0 for r in args.rates):
        raise UsageError(f"--rates must be > 0 (inf: all at once), got {args.rates}")
    if args.warmup_max_new is not None and args.warmup_max_new < 1:
        raise UsageError(f"--warmup-max-new must be >= 1, got {args.warmup_max_new}")
    for name in ("num_requests", "dp", "max_running_requests", "chunked_prefill_size"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "probe_tokens", "shared_prefix_len"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.prefix_groups < 1:
        raise UsageError(f"--prefix-groups must be >= 1, got {args.prefix_groups}")
    if args.probe_prompt_len < 1:
        raise UsageError(f"--probe-prompt-len must be >= 1, got {args.probe_prompt_len}")
    try:  # SamplingParams names the field and its rule
        args.sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                       frequency_penalty=args.frequency_penalty,
                                       presence_penalty=args.presence_penalty,
                                       repetition_penalty=args.repetition_penalty)
    except ValueError as e:
        raise UsageError(f"--temperature/--top-p/--top-k/--frequency-penalty/--presence-penalty/"
                         f"--repetition-penalty: {e}") from None
    if args.gpu_spans and (args.launcher != "local" or args.device == "cpu"):
        raise UsageError("--gpu-spans times CUDA steps in this process: it needs --launcher local and a GPU")
    return args


def _model_config(model: str) -> ModelConfig:
    return ModelConfig.preset(model) if model in PRESETS else ModelConfig.from_dir(model)


def build_spec(args: argparse.Namespace, world: int, device: str, requests: list[Request],
               mixed: bool = True, policy: str = "fcfs", caching: bool = False) -> RankSpec:
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return RankSpec.create(
        args.model, model_overrides={"num_layers": args.layers} if args.layers else None, dp_size=world,
        device=device, dtype=dtype, max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size, dispatcher=args.dispatcher, attention=args.attention,
        max_context_len=max(r.max_total_tokens for r in requests), seed=args.seed, mixed_steps=mixed,
        schedule_policy=policy, mixed_step_tokens=args.mixed_step_tokens, kv_cache_dtype=args.kv_cache_dtype,
        prefix_caching=caching, quantization=args.quantization,
    )


def run_rates(args: argparse.Namespace, ranks: Any, batches: list[tuple[float, list[Request], int | None]], world: int,
              vocab: int, rt: RuntimeConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every rate through ``ranks``, then the decode probes (module docstring); the rows and
    the per-request entries on rank 0 (empty elsewhere). Collective under torchrun."""
    rows, per_request = [], []
    mixed, policy, kv, caching = rt.mixed_steps, rt.schedule_policy, _kv_name(rt), rt.prefix_caching
    for rate, reqs, concurrency in batches:
        before, before_metrics = step_kinds(ranks.all_metrics), list(ranks.all_metrics)
        results = ranks.run(reqs)
        if results is None:
            continue
        after = step_kinds(ranks.all_metrics)
        row = summarize_rate(rate, reqs, results, world)
        steps = {k: after[k] - before[k] for k in STEP_KINDS}
        # The ideal rank ignores arrival times: a ceiling only where every request waits from the start.
        ideal = ideal_occupancy(reqs, concurrency or args.max_running_requests, rt.chunked_prefill_size,
                                rt.mixed_step_tokens, policy, mixed) if math.isinf(rate) else None
        n_steps, most = sum(steps.values()), max(row["max_running"])
        occ = row["output_tokens"] / (n_steps * most) if n_steps and most else None
        prompt_tokens = sum(r.prompt_len for r in results)
        rows.append(dict(row, concurrency=concurrency, mixed=mixed, policy=policy, kv_cache_dtype=kv, steps=steps, occupancy=occ,
                         ideal_occupancy=ideal, prefix_caching=caching, prompt_tokens=prompt_tokens,
                         cached_tokens=sum(r.cached_tokens for r in results))
                    | dp_balance_between(before_metrics, ranks.all_metrics)
                    | ({"gpu": ranks.gpu} if getattr(ranks, "gpu", None) else {}))
        arrival = {r.rid: r.arrival_s for r in reqs}
        per_request += [dict(rid=r.rid, rank=r.rank, arrival_s=arrival[r.rid], prompt_len=r.prompt_len,
                             output_len=len(r.output_ids), queued_s=r.queued_s, ttft_s=r.ttft_s,
                             latency_s=r.latency_s, error=r.error, mixed=mixed, policy=policy,
                             prefix_caching=caching, cached_tokens=r.cached_tokens) for r in results]
    # The probes' sizes are rank 0's numbers: every rank must run the same ones.
    sizes = ranks.agree(sorted({max(r["max_running"]) for r in rows}) if args.probe_tokens else [])
    step_s = {}
    for n in sizes:
        if n < 1:
            continue
        probe = decode_probe_requests(n, world, vocab, args.seed, prompt_len=args.probe_prompt_len,
                                      new_tokens=args.probe_tokens, tag=f"probe{n}", sampling=args.sampling)
        results = ranks.run(probe)
        if results is not None:
            step_s[n] = decode_step_s(results, world)
    for row in rows:
        n = max(row["max_running"])
        step = step_s.get(n)
        bound = n * world / step if step else None
        row.update(decode_step_s=step, decode_bound_tok_s=bound,
                   efficiency=row["output_tok_s"] / bound if bound and row["output_tok_s"] else None)
        # --gpu-spans: the same bound from the run's own decode steps (at the run's contexts)
        run_step = row.get("gpu", {}).get("steps", {}).get("decode", {}).get("mean_ms")
        if run_step and row["output_tok_s"]:
            row["gpu"].update(decode_bound_tok_s=n * world / (run_step / 1e3),
                              efficiency=row["output_tok_s"] * run_step / 1e3 / (n * world))
    return rows, per_request


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Every rate through the ranks; the report on rank 0 (None on the other torchrun ranks)."""
    torchrun = "WORLD_SIZE" in os.environ
    if torchrun and args.launcher == "ray":
        raise UsageError("--launcher ray starts its own ranks; do not run it under torchrun")
    mc = _model_config(args.model)
    vocab = mc.vocab_size
    ray_started = own_group = False
    if args.launcher == "ray":
        import ray

        from launch.ray_cluster import cluster_device, connect_ray

        ray_started = connect_ray(args.ray_address, num_cpus=max(args.dp, os.cpu_count() or 1), log_to_driver=not args.json)
        world, rank, device = args.dp, 0, cluster_device(args.device)
    else:
        if args.dp != 1 and not torchrun:
            raise UsageError(f"--dp {args.dp} needs --launcher ray (or torchrun --nproc-per-node {args.dp})")
        device = process_group.resolve_device(args.device)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and not dist.is_initialized():
            process_group.init_from_env(device=device)
            own_group = True
        elif device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        rank = dist.get_rank() if world > 1 else 0
    batches = make_batches(args, vocab, world)
    failed = True
    flags = {"on": (True,), "off": (False,), "both": (False, True)}
    modes = [(m, p, c) for m in flags[args.mixed]
             for p in {"fcfs": ("fcfs",), "lof": ("lof",), "both": ("fcfs", "lof")}[args.policy]
             for c in flags[args.prefix_caching]]
    rows, per_request, build_s = [], [], 0.0
    try:
        # Unreported: on every rank a whole-chunk step and an extend with a cached prefix build
        # their kernels here, not in the first rate's TTFT (warmup_requests).
        warm = warmup_requests(args.warmup, args.lengths, args.arrival, vocab, args.seed,
                               chunk=args.chunked_prefill_size, max_prompt=mc.max_positions - 1, world=world,
                               sampling=args.sampling, max_new=args.warmup_max_new)
        probe = decode_probe_requests(1, 1, vocab, args.seed, prompt_len=args.probe_prompt_len,
                                      new_tokens=max(args.probe_tokens, 1), tag="size")
        everything = [r for _, b, _ in batches for r in b] + warm + (probe if args.probe_tokens else [])
        for mixed, policy, caching in modes:
            spec = build_spec(args, world, device, everything, mixed, policy, caching)
            t0 = time.perf_counter()
            ranks = (TorchrunRank(spec, rank, world, rank == 0 and not args.json, args.gpu_spans)
                     if torchrun and world > 1 else
                     EngineRanks(spec, args.launcher, not args.json, args.gpu_spans, args.ray_address))
            build_s += time.perf_counter() - t0
            try:
                if warm:
                    ranks.run(warm)
                got, got_requests = run_rates(args, ranks, batches, world, vocab, spec.runtime)
                rows += got
                per_request += got_requests
            finally:
                ranks.close()
            m = ranks.metrics
            del ranks
            gc.collect()  # the ranks' GPU memory goes before the next set is built
            if device == "cuda":
                torch.cuda.empty_cache()
        failed = False
    finally:
        if own_group:
            # After a failure a peer may wait in a collective for this rank: abort, do not wait.
            process_group.destroy_process_group(abort=failed)
        if ray_started:
            ray.shutdown()
    if rank != 0:
        return None
    header = dict(
        date=str(datetime.date.today()), commit=_commit(), command=" ".join(sys.argv),
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu", world_size=world,
        launcher="torchrun" if torchrun else args.launcher, model=args.model, layers=args.layers,
        dtype=str(spec.runtime.dtype).replace("torch.", ""), kv_cache_dtype=_kv_name(spec.runtime),
        lengths=dataclasses.asdict(args.lengths), arrival=args.arrival,
        sampling=dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                      frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty,
                      repetition_penalty=args.repetition_penalty),
        num_requests=args.num_requests, concurrency=args.concurrency or None, max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size, dispatcher=m.get("dispatcher"), attention=m.get("attention"),
        graphs=m.get("graphs"), build_s=build_s, mixed_steps=[m for m, _, _ in modes],
        policies=[p for _, p, _ in modes], kv_slots=m.get("kv_slots"),
        prefix_caching=[c for _, _, c in modes], shared_prefix_len=args.shared_prefix_len,
        prefix_groups=args.prefix_groups, memory_gib={k: round(v / 2**30, 3) for k, v in m.get("memory", {}).items()},
    )
    out: dict[str, Any] = dict(header=header, rows=rows)
    if args.per_request:
        out["requests"] = per_request
    return out


def _kv_name(rt: RuntimeConfig) -> str:
    return str(rt.kv_cache_dtype).replace("torch.", "")


def _commit() -> str:
    return os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
        cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, print_table)


if __name__ == "__main__":
    if os.environ.get("BENCH_STACKS_AFTER_S"):  # a hung run: every thread's stack, then exit
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["BENCH_STACKS_AFTER_S"]), exit=True)
    sys.exit(main())
