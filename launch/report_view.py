"""How a run's summary looks to people (a rich table) and to programs (one JSON line), and the
progress bar over finished requests."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from launch.run_report import PollEvent, RunSummary

__all__ = ["json_line", "poll_progress", "summary_table"]


def _ms(s: float) -> str:
    return "-" if math.isnan(s) else f"{s * 1e3:.1f} ms"


def summary_table(summary: RunSummary) -> Table:
    """The run's numbers as a two-column table."""
    t = Table(title=f"dp-runtime run: {summary.launcher}, {summary.world_size} rank(s), {summary.device}",
              show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    per_rank = ", ".join(f"{r}: {n}" for r, n in sorted(summary.per_rank_requests.items()))
    rows = [
        ("requests", str(summary.requests)),
        ("output tokens", str(summary.output_tokens)),
        ("wall time", f"{summary.wall_s:.2f} s (setup {summary.setup_s:.2f} s, steps {summary.run_s:.2f} s)"),
        ("throughput", f"{summary.throughput_tok_s:.1f} tok/s"),
        ("TTFT p50 / p99", f"{_ms(summary.ttft_p50_s)} / {_ms(summary.ttft_p99_s)}"),
        ("latency p50 / p99", f"{_ms(summary.latency_p50_s)} / {_ms(summary.latency_p99_s)}"),
        ("requests per rank", per_rank),
        ("restarts", str(summary.restarts)),
    ]
    for name, value in rows:
        t.add_row(name, value)
    for failure in summary.failures:
        t.add_row("[red]failure[/red]", failure)
    return t


def json_line(obj: dict[str, Any]) -> str:
    """One line of JSON (NaN written as null), so a program can pick it out of mixed logs."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str)


@contextmanager
def poll_progress(console: Console, total: int, enabled: bool = True):
    """A progress bar over finished requests; yields the ``on_poll`` callback that advances it
    (a no-op when ``enabled`` is False).

    The bar appears at the first poll, i.e. once the ranks are set up, so it does not fight the
    ranks' own graph-capture bar on the same terminal.
    """
    if not enabled:
        yield _noop
        return
    columns = (TextColumn("[bold]requests"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeElapsedColumn())
    bar = Progress(*columns, console=console, transient=False)
    task = bar.add_task("", total=total)

    def on_poll(event: PollEvent) -> None:
        if not bar.live.is_started:
            bar.start()
        note = f"restart {event.attempt}" if event.attempt else ""
        bar.update(task, completed=event.finished, description=note)

    try:
        yield on_poll
    finally:
        if bar.live.is_started:
            bar.stop()


def _noop(event: PollEvent) -> None:
    return None
