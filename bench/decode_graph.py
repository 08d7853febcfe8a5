"""One decode step of the reference model with Qwen3-30B-A3B shapes: eager, eager no-copy, graph
replay and torch.compile(mode="reduce-overhead"), side by side in one run (one GPU).

    python bench/decode_graph.py                 # bs 1, 8, 32, 128, 256; about 4 minutes on an H100
    python bench/decode_graph.py --quick         # bs 1, 8, 32, fewer iterations
    python bench/decode_graph.py --skip-compile  # without the torch.compile peer (its compile is slow)
    CUDA_LAUNCH_BLOCKING=1 python bench/decode_graph.py --check-indices --batch-sizes 1,8   # debugging

The model: ``dp_runtime.model.qwen3_moe.Qwen3MoeModel`` of one rank (the local dispatcher, no
communication) with random weights (``iter_random``) and the ``qwen3-30b-a3b`` preset's shapes:
hidden 2048, 32 query / 4 KV heads of dim 128, 128 experts, top-8, expert size 768, vocab 151936
(``--vocab``), ``--layers`` layers (8; the real model has 48). Attention through FlashInfer (or
torch SDPA: ``--attention sdpa``), experts through torch._grouped_mm, RMSNorm and RoPE as
FlashInfer's fused kernels when flashinfer imports (what the rank worker runs). Each request has
about ``--context`` (512) tokens of KV. The rank worker's whole step (DP sync, sampling) at
these shapes is ``bench/serve_step.py --layers N``; this bench isolates the forward.

Every mode has its own attention backend instance over the one KV cache: the eager and no-copy
runners share one (both eager), the graph runner has another (its captured wrappers and their
fixed buffers), the torch.compile peer a third. No mode plans a FlashInfer wrapper, or sets
metadata, that another mode's kernels read. The first step of each mode at each batch size is
synchronized and checked, so a CUDA fault names the mode and batch size that raised it; the
torch.compile peer runs last, after every other measurement.

Columns, per batch size (median over ``--iters`` steps, CUDA events around each step, the
GPU idle at its start):

- eager / no-copy / graph / compile: step time in ms. ``eager`` goes through the registry
  (fill, view); ``no-copy`` hands the model the batch's own tensors; ``graph`` is
  ``GraphRunner.replay`` (fill, attention replay metadata, replay); ``compile`` is the model
  under torch.compile(mode="reduce-overhead", dynamic=True) with attention left eager behind
  ``torch.compiler.disable`` (a graph break per layer: FlashInfer's wrappers are not
  traceable), on its own backend (``--compile-attention``, default the model's), attention
  metadata planned eagerly. The output says what the peer ran.
- speedup: eager / graph.
- greedy: rows whose greedy token from graph replay equals eager's, of bs; rows that differ
  where eager's top-2 logit margin is within twice the row's eager-vs-graph difference are
  near-ties that no tolerance decides, counted apart (``tests/_graph_fixtures.assert_same_greedy``
  applies the same rule).
- host us, gpu ms, host %: a replayed step with the GPU kept busy (a device sleep) while the
  host enqueues it: host time to enqueue the whole step (fill + metadata + replay) vs the GPU
  time of that step alone.
- reg %: eager through the registry vs no-copy, (eager - no_copy) / no_copy.

Targets of the issue: speedup >= 3 at bs 1; host % <= 5; reg % within 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import statistics
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from enum import Enum

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from buffers import BufferPool, build_decode_registry, build_prefill_registry
from dp_runtime.attention import FlashInferBackend, TorchSDPABackend
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.serving.forward_batch import capture_batch
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.kv_cache import KVCache
from graph import EagerRunner, GraphRunner
from tests.support.local_model import local_model
from tests.support.synthetic_batch import add_requests, decode_batch


class Padding(Enum):
    MAX_LEN = 1
    SUM_LEN = 2


@dataclass(frozen=True)
class Plan:
    """What graph/ and the dispatcher read of the DP step plan; one rank, every step a graph
    step at its bucket (the rank worker's plan at DP 1)."""

    graph_bucket: int | None
    padding: Padding
    runtime_max_tokens_per_rank: int
    global_num_tokens_cpu: tuple[int, ...]

    @property
    def fingerprint(self) -> int:
        return zlib.crc32(repr((self.global_num_tokens_cpu, self.runtime_max_tokens_per_rank)).encode())


def plan_for(bucket: int) -> Plan:
    return Plan(bucket, Padding.MAX_LEN, bucket, (bucket,))


def greedy_agreement(graph_logits: torch.Tensor, eager_logits: torch.Tensor) -> tuple[int, int]:
    """(rows whose greedy tokens agree, rows that differ only at a near-tie): a differing row is
    a near-tie when eager's top-2 margin is within twice the row's largest logit difference."""
    differ = graph_logits.argmax(-1) != eager_logits.argmax(-1)
    top2 = eager_logits.topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) <= 2 * (graph_logits - eager_logits).abs().amax(dim=-1)
    return int((~differ).sum()), int((differ & near_tie).sum())


class EagerAttention:
    """The backend's forward behind a compile boundary: FlashInfer's wrappers are not traceable."""

    def __init__(self, backend) -> None:
        self.kv_cache = backend.kv_cache  # the cache the model stores K/V into, the one it reads
        self._forward = torch.compiler.disable(backend.forward)

    def forward(self, q, k, v, layer_id, batch):
        return self._forward(q, k, v, layer_id, batch)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="bs 1, 8, 32 and fewer iterations")
    p.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile peer")
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default 1,8,32,128,256)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=512, help="KV tokens per request (+-32)")
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--iters", type=int, default=None, help="timed steps per mode and bs (30; quick 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (5; quick 3)")
    p.add_argument("--attention", choices=("auto", "flashinfer", "sdpa"), default="auto")
    p.add_argument("--profile-replay", action="store_true", help="cProfile the host side of replays")
    p.add_argument(
        "--compile-attention", choices=("same", "flashinfer", "sdpa"), default="same",
        help="attention of the torch.compile peer (its own backend instance either way)",
    )
    p.add_argument(
        "--check-indices", action="store_true",
        help="FlashInfer backends verify every plan on the host (syncs: timings are not meaningful)",
    )
    args = p.parse_args()
    if args.batch_sizes is None:
        args.batch_sizes = "1,8,32" if args.quick else "1,8,32,128,256"
    args.batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    args.iters = args.iters or (10 if args.quick else 30)
    args.warmup = args.warmup or (3 if args.quick else 5)
    return args


def step_ms(fn, iters: int, warmup: int) -> list[float]:
    """GPU-event time of each of ``iters`` steps, each started on an idle GPU."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def host_vs_gpu(fn, iters: int, cycles_per_ms: float) -> tuple[float, float, int]:
    """Median host enqueue time (us) and GPU time (ms) of a step, and how many steps the host
    did not finish enqueueing within the sleep (then a sync hides in the step)."""
    host, gpu, late = [], [], 0
    sleep_ms = 20.0
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_ms * cycles_per_ms))  # the GPU is busy: the host runs ahead
        start.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        host.append((t1 - t0) * 1e6)
        gpu.append(start.elapsed_time(end))
        late += (t1 - t0) * 1e3 > 0.8 * sleep_ms
    return statistics.median(host), statistics.median(gpu), late


def describe_env(args, backend_name: str) -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        commit = "?"
    try:
        import flashinfer

        fi = flashinfer.__version__
    except ImportError:
        fi = "not installed"
    return (
        f"date {datetime.datetime.now().isoformat(timespec='seconds')}  GPU {torch.cuda.get_device_name()}  "
        f"torch {torch.__version__}  flashinfer {fi}  commit {commit}\n"
        f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}\n"
        f"model: reference Qwen3MoeModel, qwen3-30b-a3b shapes x {args.layers} layers, random bf16 weights, "
        f"vocab {args.vocab}, attention {backend_name}, context ~{args.context}, iters {args.iters} "
        f"(warm-up {args.warmup})"
    )


def profile_host(fn, what: str, iters: int = 50) -> None:
    """Where the host time of ``fn`` goes: cProfile over ``iters`` calls, top functions by
    cumulative time (the GPU is kept busy so no call waits on it)."""
    import cProfile
    import pstats

    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # long enough for the whole loop: the host never blocks
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    print(f"\nhost profile, {what}, {iters} calls (cumulative s):")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(18)


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/decode_graph.py needs a CUDA GPU")
    device = torch.device("cuda")
    dtype = torch.bfloat16
    sizes = args.batch_sizes
    max_bs = max(sizes)
    t_setup = time.perf_counter()

    max_ctx = args.context + 32 + len(sizes) + 8
    cfg = ModelConfig.preset("qwen3-30b-a3b", num_layers=args.layers, vocab_size=args.vocab)
    cache = KVCache(
        num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        num_slots=max_bs * max_ctx, max_reqs=max_bs, max_context_len=max_ctx, dtype=dtype, device=device,
    )
    allocator = KVAllocator(cache)
    heads = {"num_q_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
    backend_name = args.attention
    if backend_name == "auto":
        try:
            import flashinfer  # noqa: F401

            backend_name = "flashinfer"
        except ImportError:
            backend_name = "sdpa"

    def make_backend(name: str):
        if name == "flashinfer":
            return FlashInferBackend(cache, check_indices=args.check_indices, **heads)
        return TorchSDPABackend(cache, **heads)

    # One backend per mode (module docstring): eager + no-copy, graphs, the compile peer.
    eager_backend = make_backend(backend_name)
    graph_backend = make_backend(backend_name)
    # Decode steps only: no step has more tokens than the largest batch.
    model = local_model(cfg, eager_backend, dtype=dtype, device=device, max_tokens_per_rank=max_bs)
    graph_model = model.with_attention(graph_backend)  # the same weights
    print(describe_env(args, backend_name))
    print(f"experts via {'torch._grouped_mm' if model.use_grouped_mm else 'dense loop (no grouped GEMM here)'}; "
          f"RMSNorm and RoPE via {type(model.ops).__name__}")
    print(f"attention backends: eager/no-copy and graph replay each on their own {backend_name} instance")

    gen = torch.Generator().manual_seed(0)
    lens = (args.context + torch.randint(-32, 33, (max_bs,), generator=gen)).tolist()
    requests = add_requests(allocator, lens, seed=0, std=1.0)
    # Each batch carries its step plan, as the rank worker's do (the dispatcher reads it).
    batches = {
        bs: dataclasses.replace(
            decode_batch(allocator, requests[:bs], torch.randint(0, cfg.vocab_size, (bs,), generator=gen)),
            plan=plan_for(bs),
        )
        for bs in sizes
    }

    pool = BufferPool()
    registry = build_decode_registry(max_bs, device, pool)
    runner = GraphRunner(
        graph_model.forward, graph_backend, registry, sizes,
        capture_batch=functools.partial(capture_batch, device=device), capture_plan=plan_for,
    )

    def eager_registry(bs: int, tokens: int):
        return build_prefill_registry(bs, tokens, device, pool, register_input_embeds=False, user="eager")

    eager = EagerRunner(model.forward, eager_backend, eager_registry, no_copy=False, max_bs=max_bs,
                        max_num_tokens=max_bs)
    no_copy = EagerRunner(model.forward, eager_backend, no_copy=True)
    torch.cuda.synchronize()
    print(f"setup {time.perf_counter() - t_setup:.1f} s; capturing {sizes} (FlashInfer may JIT-compile kernels first)")
    t0 = time.perf_counter()
    runner.capture()
    print(f"capture {time.perf_counter() - t0:.1f} s, graph memory_allocated +{runner.capture_memory_bytes / 2**20:.1f} MiB")

    def first_step(label: str, bs: int, fn):
        """The first step of a mode at a batch size, synchronized: a CUDA fault names its mode."""
        try:
            out = fn()
            torch.cuda.synchronize()
            return out
        except Exception as e:
            raise RuntimeError(
                f"{label} at bs {bs} failed (the first failing mode; CUDA errors are sticky, so what "
                f"follows may fail too): {type(e).__name__}: {e}"
            ) from e

    cycles = sleep_cycles_per_ms()
    rows = []
    for bs in sizes:
        batch, plan = batches[bs], plan_for(bs)
        want = first_step("eager", bs, lambda b=batch: eager.run(b).clone())
        first_step("eager no-copy", bs, lambda b=batch: no_copy.run(b))
        got = first_step("graph replay", bs, lambda b=batch, p=plan: runner.replay(b, p).clone())
        agree, near_ties = greedy_agreement(got, want)
        del want, got
        # Interleaved rounds, so drift (clocks, other tenants) hits every mode alike.
        samples: dict[str, list[float]] = {"eager": [], "no-copy": [], "graph": []}
        for _ in range(3):
            samples["eager"] += step_ms(lambda b=batch: eager.run(b), args.iters // 3 + 1, args.warmup)
            samples["no-copy"] += step_ms(lambda b=batch: no_copy.run(b), args.iters // 3 + 1, args.warmup)
            samples["graph"] += step_ms(lambda b=batch, p=plan: runner.replay(b, p), args.iters // 3 + 1, args.warmup)
        med = {k: statistics.median(v) for k, v in samples.items()}
        host_us, gpu_ms, late = host_vs_gpu(lambda b=batch, p=plan: runner.replay(b, p), args.iters, cycles)
        rows.append([bs, med, None, host_us, gpu_ms, late, agree, near_ties])
        ties = f", {near_ties} of the others at near-ties" if near_ties else ""
        print(f"  bs {bs}: done (greedy tokens eager vs graph agree {agree}/{bs}{ties})")
        if args.profile_replay:
            profile_host(lambda b=batch, p=plan: runner.replay(b, p), f"replay bs {bs}")

    if not args.skip_compile:
        # Last, on its own backend: whatever it does cannot touch the numbers above.
        peer_name = backend_name if args.compile_attention == "same" else args.compile_attention
        compile_backend = make_backend(peer_name)
        print(
            f"compile peer: torch.compile(mode='reduce-overhead', dynamic=True) of the model's forward; attention {peer_name} "
            f"on its own backend instance, run eagerly behind torch.compiler.disable (a graph break per layer), "
            f"its metadata planned outside the compiled function"
        )
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        compiled = torch.compile(model.with_attention(EagerAttention(compile_backend)).forward,
                                 mode="reduce-overhead", dynamic=True)

        def compile_step(batch):
            compile_backend.init_forward_metadata(batch)
            torch.compiler.cudagraph_mark_step_begin()
            with torch.inference_mode():
                return compiled(batch)

        for row in rows:
            bs = row[0]
            batch = batches[bs]
            try:
                t0 = time.perf_counter()
                first_step("torch.compile peer", bs, lambda b=batch: compile_step(b))
                first = time.perf_counter() - t0
                row[2] = statistics.median(step_ms(lambda b=batch: compile_step(b), args.iters, args.warmup))
                print(f"  compile bs {bs}: first call {first:.1f} s")
            except Exception as e:  # the peer is informative, never fatal
                print(f"  compile bs {bs} failed: {type(e).__name__}: {str(e)[:300]}")
                break

    print()
    head = (f"{'bs':>4} {'eager ms':>9} {'no-copy':>9} {'graph ms':>9} {'compile':>9} {'speedup':>8} {'host us':>8} "
            f"{'gpu ms':>8} {'host %':>7} {'reg %':>6} {'greedy':>12}")
    print(head)
    print("-" * len(head))
    for bs, med, comp, host_us, gpu_ms, late, agree, near_ties in rows:
        comp_s = f"{comp:9.3f}" if comp is not None else f"{'-':>9}"
        reg = 100 * (med["eager"] - med["no-copy"]) / med["no-copy"]
        host_pct = 100 * host_us / 1e3 / gpu_ms
        flag = "  (host did not stay ahead: a sync in the step?)" if late else ""
        greedy = f"{agree}/{bs}" + (f" ({near_ties} tie)" if near_ties else "")
        print(
            f"{bs:>4} {med['eager']:9.3f} {med['no-copy']:9.3f} {med['graph']:9.3f} {comp_s} "
            f"{med['eager'] / med['graph']:7.2f}x {host_us:8.1f} {gpu_ms:8.3f} {host_pct:6.1f}% {reg:+5.1f}% "
            f"{greedy:>12}{flag}"
        )
    bs1 = next((r for r in rows if r[0] == 1), None)
    print()
    if bs1 is not None:
        speedup = bs1[1]["eager"] / bs1[1]["graph"]
        print(f"target graph >= 3x eager at bs 1: {speedup:.2f}x {'ok' if speedup >= 3 else 'MISSED'}")
    worst_host = max(100 * r[3] / 1e3 / r[4] for r in rows)
    print(f"target host overhead of a replayed step <= 5% of its GPU time: worst {worst_host:.1f}% {'ok' if worst_host <= 5 else 'MISSED'}")
    worst_reg = max(abs(100 * (r[1]['eager'] - r[1]['no-copy']) / r[1]['no-copy']) for r in rows)
    print(f"target eager through the registry within 3% of no-copy: worst {worst_reg:.1f}% {'ok' if worst_reg <= 3 else 'MISSED'}")
    decided_differ = [r[0] for r in rows if r[6] + r[7] < r[0]]
    print(f"graph and eager greedy tokens agree wherever the logits decide them: "
          f"{'ok' if not decided_differ else f'MISSED at bs {decided_differ}'}")
    runner.destroy()


if __name__ == "__main__":
    main()
