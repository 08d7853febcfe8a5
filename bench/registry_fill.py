"""Host and device cost of one registry fill: ours beside a slot-by-slot loop, in one run.

    python bench/registry_fill.py [--device cuda] [--iters 2000]

The registry is the decode registry with mrope positions and DP counts (10 slots). The loop is
what engines do per step: for every slot, one copy_ of the live rows and one fill_ of the tail,
slicing each step. Host time is the time to enqueue one fill (no synchronisation inside the
timed loop); device time is the GPU time of one fill's kernels and copies from the profiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from buffers import Axis, BufferPool, build_decode_registry


@dataclasses.dataclass
class Batch:
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    mrope_positions: torch.Tensor
    global_num_tokens_cpu: list[int]
    global_num_tokens_for_logprob_cpu: list[int]
    num_token_non_padded: torch.Tensor | None = None
    global_num_tokens_gpu: torch.Tensor | None = None
    global_num_tokens_for_logprob_gpu: torch.Tensor | None = None


def make_batch(bs: int, device: str) -> Batch:
    r = lambda hi: torch.randint(1, hi, (bs,), device=device)  # noqa: E731
    return Batch(
        bs, r(1000), r(4000), r(10000), r(256), r(4000), torch.randint(1, 4000, (bs,)),
        torch.randint(1, 4000, (3, bs), device=device), [bs, bs + 3], [bs, bs + 3],
    )


def loop_fill(reg, batch, raw, padded, host_counts):
    """The slot-by-slot baseline: one copy_ and one pad per slot, slices made every step."""
    for slot in reg.slots.values():
        buf = reg.buffer(slot.name)
        if slot.computed:
            continue
        src = slot.read(batch)
        if slot.dim == 1:
            buf[:, :raw].copy_(src)
            if padded > raw:
                buf[:, raw:padded].zero_()
        else:
            buf[:raw].copy_(src)
            if padded > raw and slot.padding.kind in ("zero", "fill"):
                buf[raw:padded].fill_(slot.padding.value or 0)
    reg.buffer("num_token_non_padded").fill_(raw)
    for name, field in (("global_num_tokens_gpu", "global_num_tokens_cpu"), ("global_num_tokens_for_logprob_gpu", "global_num_tokens_for_logprob_cpu")):
        reg.buffer(name).copy_(host_counts(tuple(getattr(batch, field))), non_blocking=True)


def host_us(fn, iters: int, device: str) -> float:
    """Median over 5 rounds of the mean host time of one call (no sync inside a round)."""
    rounds = []
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - t) / iters * 1e6)
        if device == "cuda":
            torch.cuda.synchronize()
    return statistics.median(rounds)


def device_profile(fn, device: str, iters: int = 50) -> tuple[float, float]:
    """(device us per call, device operations per call) from the profiler; NaN on CPU."""
    if device != "cuda":
        return float("nan"), float("nan")
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in events)
    return total / iters, len(events) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--sizes", default="1:1,5:8,60:64,250:256")
    args = ap.parse_args()
    dev = args.device
    reg = build_decode_registry(256, dev, BufferPool(), dp_size=2, mrope=True)
    slots = len(reg.names())
    cache: dict = {}

    def host_counts(key):
        t = cache.get(key)
        if t is None:
            t = torch.tensor(key, dtype=torch.int32)
            cache[key] = t.pin_memory() if dev == "cuda" else t
        return t

    rows = []
    for pair in args.sizes.split(","):
        raw, padded = (int(x) for x in pair.split(":"))
        batch = make_batch(raw, dev)
        ours = lambda batch=batch, raw=raw, padded=padded: reg.fill(batch, raw, padded)  # noqa: E731
        loop = lambda batch=batch, raw=raw, padded=padded: loop_fill(reg, batch, raw, padded, host_counts)  # noqa: E731
        for fn in (ours, loop):
            for _ in range(50):
                fn()
        # correctness: both give the same buffers
        loop()
        want = {n: reg.buffer(n).clone() for n in reg.names()}
        ours()
        for n in reg.names():
            assert torch.equal(reg.buffer(n), want[n]), n
        h_ours, h_loop = host_us(ours, args.iters, dev), host_us(loop, args.iters, dev)
        (d_ours, k_ours), (d_loop, k_loop) = device_profile(ours, dev), device_profile(loop, dev)
        rows.append((raw, padded, h_ours, h_loop, d_ours, d_loop, k_ours, k_loop))

    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(f"\nregistry fill, {slots} slots ({sum(1 for s in reg.slots.values() if s.axis is not Axis.NONE)} on a batch axis), {name}, torch {torch.__version__}")
    print(f"{'raw':>4} {'pad':>4} | {'host us ours':>12} {'loop':>8} {'x':>6} | {'dev us ours':>11} {'loop':>7} | {'ops ours':>8} {'loop':>5}")
    for raw, padded, h_o, h_l, d_o, d_l, k_o, k_l in rows:
        print(f"{raw:>4} {padded:>4} | {h_o:>12.1f} {h_l:>8.1f} {h_l / h_o:>5.1f}x | {d_o:>11.1f} {d_l:>7.1f} | {k_o:>8.1f} {k_l:>5.1f}")


if __name__ == "__main__":
    main()
