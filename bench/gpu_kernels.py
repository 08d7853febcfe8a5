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


def idle_gaps(prof, small_us: float = 4.0,
              near: tuple[str, ...] = ("Prefill", "prefill", "attention", "Attention")) -> dict:
    """Where the GPU idled in a finished ``torch.profiler.profile`` (CPU and CUDA activities),
    within the span of its CPU events: ``lead`` before the first GPU activity, ``tail`` after
    its last, and the gaps between activities, split into ``small`` ones (under ``small_us``:
    the spacing of a graph's kernels) and larger ones, of which ``near`` counts those next to a
    kernel whose name contains one of ``near`` (the eager attention between extend pieces)."""
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    t0_us, t1_us = min(e.time_range.start for e in cpu), max(e.time_range.end for e in cpu)
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in gpu_events(prof))
    out = dict(lead=0.0, tail=0.0, small_n=0, small_us=0.0, large_n=0, large_us=0.0, near_n=0, near_us=0.0)
    if not spans:
        return out
    out["lead"] = max(0.0, spans[0][0] - t0_us)
    end, prev = spans[0][1], spans[0][2]
    for a, b, name in spans[1:]:
        gap = a - end
        if gap > 0:
            if gap < small_us:
                out["small_n"] += 1
                out["small_us"] += gap
            else:
                out["large_n"] += 1
                out["large_us"] += gap
                if any(k in prev or k in name for k in near):
                    out["near_n"] += 1
                    out["near_us"] += gap
        if b > end:
            end, prev = b, name
    out["tail"] = max(0.0, t1_us - end)
    return out


def print_gaps(g: dict) -> None:
    print(f"GPU idle: lead {g['lead']:.0f} us, tail {g['tail']:.0f} us, {g['small_n']} small gaps "
          f"{g['small_us']:.0f} us, {g['large_n']} larger gaps {g['large_us']:.0f} us (next to attention: "
          f"{g['near_n']}, {g['near_us']:.0f} us)")


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


# Host ops that wait for the GPU: left out of the host time a step spends working.
HOST_WAITS = ("synchronize", "cudaMemcpy ", "cudaStreamSynchronize", "aten::item", "aten::_local_scalar_dense")


def host_ops(prof, n: int = 12) -> list[tuple[str, int, float]]:
    """``(op, calls, self us)`` of the ``n`` CPU-side ops of a profile (CPU activity on) with
    the most self time, waits for the GPU left out."""
    ops = [(a.key[:70], a.count, a.self_cpu_time_total) for a in prof.key_averages()
           if a.self_cpu_time_total > 0 and not any(w in a.key for w in HOST_WAITS)]
    return sorted(ops, key=lambda r: -r[2])[:n]


def python_functions(run: Callable[[], object], n: int = 15,
                     dirs: tuple[str, ...] = ("dp_runtime", "graph/", "buffers/", "dispatcher/")) -> list[tuple[str, float]]:
    """``(file:function, cumulative us)`` of the project's ``n`` costliest Python functions in
    one call of ``run`` under cProfile (relative numbers: cProfile adds overhead)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.runcall(run)
    stats = pstats.Stats(prof)
    funcs = sorted(((f"{k[0].split('/')[-1]}:{k[2]}", v[3]) for k, v in stats.stats.items()
                    if any(d in k[0] for d in dirs)), key=lambda r: -r[1])
    return [(name, round(t * 1e6, 1)) for name, t in funcs[:n]]


def print_host(ops: list[tuple[str, int, float]], funcs: list[tuple[str, float]]) -> None:
    print(f"{'count':>6} {'self us':>9}  host op (waits for the GPU left out)")
    for name, count, us in ops:
        print(f"{count:>6} {us:>9.1f}  {name}")
    print(f"{'cum us':>16}  Python function (cProfile of another step)")
    for name, us in funcs:
        print(f"{us:>16.1f}  {name}")


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
