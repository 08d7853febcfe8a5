"""How a run looks to people (a start-up line, a progress bar over requests and tokens, a rich
table) and to programs (one JSON line).

Text that comes from the user or a rank (a request's error, a failure message, a path) is
escaped before rich renders it: rich would read ``[gpu]`` in ``pip install 'dp-runtime[gpu]'``
as markup and drop it.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from launch.run_report import PollEvent, RunSummary

__all__ = ["SHOWN_ERRORS", "RunProgress", "json_line", "progress_counts", "summary_table"]

SHOWN_ERRORS = 5  # failed requests listed in the table; --json lists them all


def _ms(s: float) -> str:
    return "-" if math.isnan(s) else f"{s * 1e3:.1f} ms"


def summary_table(summary: RunSummary) -> Table:
    """The run's numbers as a two-column table."""
    t = Table(title=f"dp-runtime run: {summary.launcher}, {summary.world_size} rank(s), "
                    f"{summary.device}", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    per_rank = ", ".join(f"{r}: {n}" for r, n in sorted(summary.per_rank_requests.items()))
    graphs = summary.graphs if isinstance(summary.graphs, str) or summary.graphs is None else (
        "on" if summary.graphs else "off")
    rest = summary.wall_s - summary.ray_start_s - summary.setup_s - summary.run_s
    served = str(summary.requests) if not summary.failed else (
        f"{summary.requests} ({summary.served} served, [red]{summary.failed} failed[/red])")
    rows = [
        ("requests", served),
        ("output tokens", str(summary.output_tokens)),
        ("wall time", f"{summary.wall_s:.2f} s"),
        *([("  start Ray", f"{summary.ray_start_s:.2f} s")] if summary.ray_start_s else []),
        ("  set up ranks", f"{summary.setup_s:.2f} s"),
        ("  steps", f"{summary.run_s:.2f} s"),
        ("  imports, checks, teardown", f"{max(rest, 0.0):.2f} s"),
        ("throughput", f"{summary.throughput_tok_s:.1f} tok/s (of step time)"),
        ("TTFT p50 / p99", f"{_ms(summary.ttft_p50_s)} / {_ms(summary.ttft_p99_s)}"),
        ("latency p50 / p99", f"{_ms(summary.latency_p50_s)} / {_ms(summary.latency_p99_s)}"),
        ("requests per rank", per_rank),
        *([("rank nodes", escape(_nodes(summary.nodes)))] if summary.nodes else []),
        ("dispatcher / attention / graphs",
         f"{summary.dispatcher or '-'} / {summary.attention or '-'} / {graphs or '-'}"),
        ("KV cache dtype", summary.kv_cache_dtype or "-"),
        ("restarts", str(summary.restarts)),
    ]
    for name, value in rows:
        t.add_row(name, value)
    for failure in summary.failures:
        t.add_row("[red]rank failure[/red]", escape(failure))
    for err in summary.errors[:SHOWN_ERRORS]:
        t.add_row("[red]failed request[/red]", escape(err.describe()))
    if summary.failed > SHOWN_ERRORS:
        t.add_row("[red]failed request[/red]",
                  f"... and {summary.failed - SHOWN_ERRORS} more (--json lists all)")
    return t


def _nodes(nodes: dict[int, str]) -> str:
    """``all on 10.0.0.1`` when every rank ran on one node, else ``0: 10.0.0.1, 1: 10.0.0.2``."""
    distinct = set(nodes.values())
    if len(distinct) == 1:
        return f"all on {distinct.pop()}"
    return ", ".join(f"{r}: {ip or '?'}" for r, ip in sorted(nodes.items()))


def json_line(obj: dict[str, Any]) -> str:
    """One line of JSON (NaN written as null), so a program can pick it out of mixed logs."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str)


class RunProgress:
    """What a person sees on stderr while a run starts and runs: the start-up phase (starting
    Ray, placing ranks, what the ranks are doing), then requests and output tokens.

    On a terminal: one live line (a spinner with the phase, then a bar over output tokens with
    ``requests f/n  tokens t/m``), updated at every poll. Elsewhere (CI logs, pipes): a plain
    line per phase and a progress line at most every ``line_interval_s`` and at the end. Use
    ``phase`` and ``poll`` as a launcher's ``on_phase``/``on_poll``; ``close`` ends the display.
    ``enabled=False`` makes every method a no-op (``--json``).
    """

    def __init__(self, console: Console, total_requests: int, *, enabled: bool = True,
                 line_interval_s: float = 2.0) -> None:
        self.console, self.total, self.enabled = console, total_requests, enabled
        self.line_interval_s = line_interval_s
        self._live = enabled and console.is_terminal
        self._bar: Progress | None = None
        self._task = None
        self._last_phase: str | None = None
        self._last_line = ""
        self._last_line_t = -math.inf
        self._last_event: PollEvent | None = None
        if self._live:
            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[counts]}"), TimeElapsedColumn(),
                                 console=console, transient=False)
            self._task = self._bar.add_task("starting", total=None, counts="")
            self._bar.start()

    def phase(self, text: str) -> None:
        if not self.enabled or text == self._last_phase:
            return
        self._last_phase = text
        if self._bar is None and self._last_event is not None:
            self._flush_line()
        if self._bar is not None:
            self._bar.update(self._task, description=escape(text))
        else:
            self.console.print(f"dp-runtime: {escape(text)}", highlight=False, soft_wrap=True)

    def poll(self, event: PollEvent) -> None:
        if not self.enabled:
            return
        self._last_event = event
        counts = progress_counts(event)
        if self._bar is not None:
            note = f"running (restart {event.attempt})" if event.attempt else "running"
            self._bar.update(self._task, description=note, total=event.total_tokens or None,
                             completed=event.tokens, counts=counts)
            return
        now = time.monotonic()
        if counts != self._last_line and now - self._last_line_t >= self.line_interval_s:
            self._print_line(counts, now)

    def _print_line(self, counts: str, now: float) -> None:
        self.console.print(f"dp-runtime: {counts}", highlight=False, soft_wrap=True)
        self._last_line, self._last_line_t = counts, now

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self.enabled and self._last_event is not None:
            self._flush_line()

    def _flush_line(self) -> None:
        counts = progress_counts(self._last_event)
        if counts != self._last_line:
            self._print_line(counts, time.monotonic())


def progress_counts(event: PollEvent) -> str:
    """``requests 3/16  tokens 120/256`` (the token total is every request's max_new_tokens, an
    upper bound when stop tokens end requests early)."""
    text = f"requests {event.finished}/{event.total}"
    if event.total_tokens:
        text += f"  tokens {event.tokens}/{event.total_tokens}"
    return text
