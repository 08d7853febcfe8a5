"""What a gang's ranks are doing while they set up, for the start-up line.

``RankPhaseWatcher(gang, on_phase)`` is a context manager around ``Gang.launch``: a thread asks
every rank actor's ``phases()`` (in the actor's ``progress`` concurrency group, so the answer comes
while ``setup`` runs) every ``interval_s`` and hands ``on_phase`` one line whenever it changes:
``summarize_phases`` of each rank's current phase (``loading weights (2)``, or ``capturing graphs
(1), loading weights (1)``). A rank that does not answer yet (its process is starting) counts as
``starting``. The watcher only reads: it never changes the gang, and a failed call is ignored.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["RankPhaseWatcher", "summarize_phases"]

# The order ranks go through them; the line lists the least advanced first.
PHASES = ("starting", "joining the process group", "loading weights", "warming up the dispatcher",
          "capturing graphs", "ready")


def summarize_phases(phases: Sequence[str]) -> str:
    """One line for the phases of every rank: ``"ranks: loading weights (2)"``, or each phase with
    its count, least advanced first (unknown names last, in the order seen)."""
    counts: dict[str, int] = {}
    for p in phases:
        counts[p] = counts.get(p, 0) + 1

    def order(name: str) -> tuple[int, int]:
        return ((PHASES.index(name), 0) if name in PHASES
                else (len(PHASES), list(counts).index(name)))

    parts = [f"{name} ({counts[name]})" for name in sorted(counts, key=order)]
    return "ranks: " + ", ".join(parts)


class RankPhaseWatcher:
    """Reports the ranks' set-up phases while the ``with`` block runs (module docstring).
    ``on_phase=None`` makes it a no-op (no thread)."""

    def __init__(self, gang: Any, on_phase: Callable[[str], None] | None,
                 interval_s: float = 0.5) -> None:
        self.gang, self.on_phase, self.interval_s = gang, on_phase, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RankPhaseWatcher:
        if self.on_phase is not None:
            self._thread = threading.Thread(target=self._watch, name="rank-phases", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _watch(self) -> None:
        import ray

        last = None
        while not self._stop.wait(self.interval_s):
            actors = self.gang.actors
            if not actors:
                continue
            try:
                refs = [a.phases.options(concurrency_group="progress").remote() for a in actors]
                ready, _ = ray.wait(refs, num_returns=len(refs),
                                    timeout=max(1.0, 2 * self.interval_s))
            except Exception:  # the gang is being torn down under us
                continue
            done = set(ready)
            phases = []
            for ref in refs:
                try:
                    phases.append(ray.get(ref)[-1] if ref in done else "starting")
                except Exception:  # a dead actor: the launcher reports it, not this line
                    phases.append("starting")
            line = summarize_phases(phases)
            if line != last and not self._stop.is_set():
                self.on_phase(line)
                last = line
