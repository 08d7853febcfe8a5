"""Where a profiled GPU step's time goes: the GPU activities of a torch profiler run, the time
the GPU was busy (the union of their intervals) and the kernels that took the most of it.
Shared by the step benchmarks' ``--profile`` options."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def gpu_events(prof) -> list:
    """The GPU activities (kernels, copies, memsets) of a finished ``torch.profiler.profile``."""
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def busy_us(events: list) -> float:
    """Microseconds in which at least one of ``events`` ran (overlaps counted once)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted((e.time_range.start, e.time_range.end) for e in events):
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy


def top_kernels(events: list, n: int = 12) -> list[tuple[str, int, float]]:
    """``(name, launches, total us)`` of the ``n`` names with the most GPU time."""
    by_name: dict[str, list[float]] = {}
    for e in events:
        by_name.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:n]
    return [(name[:90], len(d), sum(d)) for name, d in top]


def print_top(top: list[tuple[str, int, float]]) -> None:
    print(f"{'count':>6} {'total us':>9}  kernel")
    for name, count, us in top:
        print(f"{count:>6} {us:>9.1f}  {name}")


def graph_us(run: Callable[[], None], per_replay: int, repeats: int, inner: int) -> float:
    """Median microseconds of one of ``per_replay`` units (layers, calls) of ``run``, captured
    once in a CUDA graph and replayed ``inner`` times per timed sample."""
    run()  # compiles, autotunes and allocates outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(inner):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / inner / per_replay)
    del graph
    return statistics.median(samples)
