"""Benchmark: the per-step DP sync (shm vs gloo exchange) and dp_gather against a raw all-gather.

Run from the repository root::

    torchrun --nproc-per-node N bench/dp_sync.py                 # cuda if available
    torchrun --nproc-per-node 2 bench/dp_sync.py --device cpu    # gloo, small sizes
    python bench/dp_sync.py --device cpu                         # world size 1, no group

Part 1, per step: ``sync`` (one exchange + ``plan_step``) + ``set_from_plan`` on the buffer
service, timed on every rank with ``perf_counter_ns`` over random decode/prefill counts
(seeded alike on every rank). Reported: the median and p99 of the slowest rank, for the shm
path and the gloo path of the same run, and their ratio. (Ranks run in lockstep, so a step's
time includes waiting for the slowest peer, as it does in the runtime.)

Part 2, dp_gather of ``n`` tokens per rank on every rank (the same bytes as a raw
``all_gather_into_tensor`` of ``[n, hidden]`` per rank, which is timed in the same run):
MAX_LEN (copy into the rank's slot + in-place all-gather), SUM_LEN (uneven all-gather on CUDA)
and the graph-safe SUM_LEN by device counts. Bandwidth is the gathered buffer's bytes over the
time (nccl-tests' "algbw"); "% raw" is raw time / mode time.

Rank 0 prints the tables last.
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import statistics
import sys
import time
from pathlib import Path

# Run as a script from the repository root: make the packages importable without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from buffers.pool import BufferPool
from dp_runtime.config import RuntimeConfig
from dp_runtime.sync.collectives import all_gather_into, rank_of, world_of
from dp_runtime.sync.dp_buffer import DPBufferService, dp_buffer_layout
from dp_runtime.sync.dp_gather import dp_gather
from dp_runtime.sync.step_sync import DPStepSync
from dp_runtime.sync.step_table import LocalStepInfo

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--steps", type=int, default=5000, help="timed steps of part 1 per path")
    p.add_argument("--warmup", type=int, default=500)
    p.add_argument("--hidden", type=int, help="default 4096 on cuda, 256 on cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="default bf16 on cuda, fp32 on cpu")
    p.add_argument(
        "--max-tokens", type=int, help="largest tokens/rank of part 2 (default 8192 cuda, 256 cpu)"
    )
    p.add_argument(
        "--iters", type=int, help="timed iterations per size in part 2 (default 50 cuda, 20 cpu)"
    )
    return p.parse_args()


def init(device_kind: str) -> tuple[object, torch.device]:
    """The default process group (None at world size 1 without torchrun) and this rank's device."""
    device = torch.device("cpu")
    if device_kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    if (
        "WORLD_SIZE" in os.environ
        and int(os.environ["WORLD_SIZE"]) > 1
        and not dist.is_initialized()
    ):
        backend = "cpu:gloo,cuda:nccl" if device_kind == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=300))
    return (dist.group.WORLD if dist.is_initialized() else None), device


def gather_floats(value: float) -> list[float]:
    """Every rank's ``value`` (object all-gather over the CPU group; [value] at world 1)."""
    if world_of() == 1:
        return [value]
    out: list = [None] * world_of()
    dist.all_gather_object(out, value)
    return out


def step_reports(steps: int, world: int, rank: int, max_tokens: int) -> list[LocalStepInfo]:
    """Random decode steps (1..256 tokens, some idle ranks) with a prefill chunk every 16th step."""
    out = []
    for s in range(steps):
        rng = random.Random(s * 1009 + 17)
        if s % 16 == 0:
            counts = [rng.choice([0, max_tokens // 2, max_tokens]) for _ in range(world)]
            extend = True
        else:
            counts = [rng.choice([0, 1, 7, 32, 100, 256]) for _ in range(world)]
            extend = False
        n = counts[rank]
        out.append(
            LocalStepInfo(n, can_run_graph=not extend and n <= 256, is_extend=extend and n > 0)
        )
    return out


def bench_sync(args, group, device, hidden, dtype) -> list[tuple[str, float, float, float]]:
    world, rank = world_of(group), rank_of(group)
    max_tokens = 1024
    paths = ["shm", "gloo"] if world > 1 else ["auto"]
    rows = []
    reports = step_reports(args.warmup + args.steps, world, rank, max_tokens)
    for path in paths:
        config = RuntimeConfig(
            dp_size=world,
            hidden_size=hidden,
            dtype=dtype,
            device=device,
            max_running_requests=256,
            chunked_prefill_size=max_tokens,
            dp_sync_exchange=path,
            dp_sync_timeout_s=60,
        )
        try:
            sync = DPStepSync(config, group)
        except ValueError as e:  # shm impossible (ranks on several nodes): report and go on
            if rank == 0:
                print(f"[dp_sync bench] path {path}: {e}", flush=True)
            continue
        service = DPBufferService(config, BufferPool(), rank, group=group, device=device)
        total_ns, set_ns = [], []
        clock = time.perf_counter_ns
        for i, local in enumerate(reports):
            t0 = clock()
            plan = sync.sync(local)
            t1 = clock()
            service.set_from_plan(plan)
            t2 = clock()
            if i >= args.warmup:
                total_ns.append(t2 - t0)
                set_ns.append(t2 - t1)
        sync.verify()
        total_ns.sort()
        med = statistics.median(total_ns) / 1e3
        p99 = total_ns[int(0.99 * (len(total_ns) - 1))] / 1e3
        med_set = statistics.median(set_ns) / 1e3
        meds, p99s, sets = gather_floats(med), gather_floats(p99), gather_floats(med_set)
        rows.append((sync.exchange_kind, max(meds), max(p99s), max(sets)))
        sync.close()
    return rows


def timed(fn, iters: int, device: torch.device, group) -> float:
    """Seconds per call of ``fn`` (after 3 warm-up calls), the slowest rank's."""
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
    else:
        if world_of(group) > 1:
            dist.barrier(group)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        seconds = (time.perf_counter() - t0) / iters
    return max(gather_floats(seconds))


def bench_gather(args, group, device, hidden, dtype) -> list[tuple]:
    world, rank = world_of(group), rank_of(group)
    max_n = args.max_tokens or (8192 if device.type == "cuda" else 256)
    iters = args.iters or (50 if device.type == "cuda" else 20)
    sizes = [1 << i for i in range(max_n.bit_length()) if (1 << i) <= max_n]
    full_global = torch.zeros(max_n * world, hidden, dtype=dtype, device=device)
    full_raw = torch.zeros(max_n * world, hidden, dtype=dtype, device=device)
    full_local = torch.randn(max_n, hidden, device=device).to(dtype)
    rows = []
    for n in sizes:
        g = n * world
        glob, raw_out, local = full_global[:g], full_raw[:g], full_local[:n]
        counts = [n] * world
        max_lay = dp_buffer_layout(
            g, n, True, counts, rank=rank, dp_size=world, max_tokens_per_rank=max_n
        )
        sum_lay = dp_buffer_layout(
            g, n, False, counts, rank=rank, dp_size=world, max_tokens_per_rank=max_n
        )

        def raw(raw_out=raw_out, local=local):
            if world > 1:
                all_gather_into(raw_out, local, group=group)
            else:
                raw_out.copy_(local)

        t_raw = timed(raw, iters, device, group)
        t_max = timed(
            lambda glob=glob, local=local, lay=max_lay: dp_gather(glob, local, lay, group),
            iters,
            device,
            group,
        )
        t_sum = timed(
            lambda glob=glob, local=local, lay=sum_lay: dp_gather(glob, local, lay, group),
            iters,
            device,
            group,
        )
        nbytes = g * hidden * dtype.itemsize
        rows.append((n, nbytes, t_raw, t_max, t_sum))
    return rows


def main() -> None:
    args = parse_args()
    group, device = init(args.device)
    hidden = args.hidden or (4096 if device.type == "cuda" else 256)
    dtype = (
        _DTYPES[args.dtype]
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    world = world_of(group)
    sync_rows = bench_sync(args, group, device, hidden, dtype)
    gather_rows = bench_gather(args, group, device, hidden, dtype)
    if rank_of(group) == 0:
        backend = "NCCL" if device.type == "cuda" else ("gloo" if world > 1 else "no group")
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(
            f"\n== DP step sync: sync + plan_step + set_dp_buffer_len, world={world}, {args.steps} steps "
            f"(slowest rank) =="
        )
        print(f"{'path':<6} {'median_us':>10} {'p99_us':>10} {'set_us':>8}")
        for kind, med, p99, set_us in sync_rows:
            print(f"{kind:<6} {med:>10.1f} {p99:>10.1f} {set_us:>8.1f}")
        by_kind = {r[0]: r for r in sync_rows}
        if "shm" in by_kind and "gloo" in by_kind:
            print(
                f"gloo / shm (median): {by_kind['gloo'][1] / by_kind['shm'][1]:.1f}x; "
                f"(p99): {by_kind['gloo'][2] / by_kind['shm'][2]:.1f}x"
            )
        print(
            f"\n== dp_gather vs raw all_gather_into_tensor, world={world}, hidden={hidden} "
            f"{str(dtype).removeprefix('torch.')}, {where}, {backend} =="
        )
        print("GB/s = gathered buffer bytes / time; %raw = raw time / time")
        head = (
            f"{'tok/rank':>8} {'MiB':>8} {'raw_us':>9} {'raw_GB/s':>9} {'max_len_us':>10} {'%raw':>5} "
            f"{'sum_len_us':>10} {'%raw':>5}"
        )
        print(head)
        for n, nbytes, t_raw, t_max, t_sum in gather_rows:
            print(
                f"{n:>8} {nbytes / 2**20:>8.2f} {t_raw * 1e6:>9.1f} {nbytes / t_raw / 1e9:>9.2f} "
                f"{t_max * 1e6:>10.1f} {100 * t_raw / t_max:>5.0f} {t_sum * 1e6:>10.1f} {100 * t_raw / t_sum:>5.0f}"
            )
        sys.stdout.flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
