"""Where the GPU's time goes in a serving run (``serve_load.py --gpu-spans``): each step's GPU
span and the GPU's idle gaps between steps, from CUDA events recorded around the step's launch.

A step's launch is bracketed by two events on the rank's stream (the decode graphs' replay, the
extend pieces' replay, or an eager forward). The GPU reaches the first when it is done with the
step before, or when the host records it, whichever is later: so the time from one step's end
event to the next one's start event is the time the GPU waited for the host, and the time
between a step's own two events is what the step took on the GPU (gaps between its pieces
included). Overlapped steps launch ahead of the GPU, so the gaps should be near zero; what they
add up to is what host work costs the run.

``serve_load.py`` adds the decode-only bound from the run's own decode steps (``running / mean
decode span``, at the run's contexts, where the decode probe's prompts are short) and the
efficiency against it.

Bench-only: it wraps the worker's launch methods on the instance and restores them on ``close``.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StepSpans"]


class StepSpans:
    """Records the GPU span of every step ``worker`` launches from now on (module docstring)."""

    def __init__(self, worker: Any) -> None:
        self._worker = worker
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._wrapped: list[tuple[Any, str]] = []
        for owner, attr, kind in ((worker.graphs, "replay", "decode"), (worker.extend_graphs, "replay", "extend"),
                                  (worker, "_eager", "eager")):
            if owner is not None:
                setattr(owner, attr, self._timed(getattr(owner, attr), kind))
                self._wrapped.append((owner, attr))

    def _timed(self, launch: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = launch(*args, **kwargs)
            end.record()
            self._events.append((kind, start, end))
            return out

        return run

    def take(self) -> dict[str, Any]:
        """The steps recorded since the last ``take``, summed up (ms unless said), and forget
        them: per kind of launch the count and the mean and median GPU span; the idle gaps
        between consecutive steps (their sum in s, median, p99 and largest in ms); ``busy``: the
        spans' share of the time from the first step's start to the last one's end."""
        events, self._events = self._events, []
        if not events:
            return {}
        events[-1][2].synchronize()
        spans: dict[str, list[float]] = {}
        for kind, start, end in events:
            spans.setdefault(kind, []).append(start.elapsed_time(end))
        gaps = sorted(max(0.0, a[2].elapsed_time(b[1])) for a, b in itertools.pairwise(events))
        wall = events[0][1].elapsed_time(events[-1][2])
        busy = sum(sum(v) for v in spans.values())

        def at(q: float) -> float:
            return gaps[min(len(gaps) - 1, int(q * len(gaps)))] if gaps else 0.0

        return dict(
            steps={k: dict(n=len(v), mean_ms=statistics.fmean(v), p50_ms=statistics.median(v))
                   for k, v in spans.items()},
            idle_s=sum(gaps) / 1e3, gap_p50_ms=at(0.5), gap_p99_ms=at(0.99), gap_max_ms=gaps[-1] if gaps else 0.0,
            busy=busy / wall if wall > 0 else None,
        )

    def close(self) -> None:
        """Put the worker's own launch methods back."""
        for owner, attr in self._wrapped:
            delattr(owner, attr)  # the instance attribute goes; the class's method shows again
        self._wrapped = []
