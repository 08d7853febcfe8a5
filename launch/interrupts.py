"""Ctrl-C held back while a step must not be cut in half (starting or stopping Ray).

``ray.init`` interrupted half-way leaves a node whose processes nobody stops (and the
interpreter can crash at exit while Ray's threads are half set up); ``ray.shutdown`` interrupted
leaves agents behind. Inside ``held_sigint()`` a SIGINT is only recorded; when the block ends the
handler that was there before is back and the interrupt is raised as KeyboardInterrupt, so the
caller cleans up from a known state. A no-op outside the main thread (signal handlers live there).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["held_sigint"]


@contextmanager
def held_sigint() -> Iterator[list[int]]:
    """Record SIGINTs during the block (the yielded list holds one entry per signal), then raise
    KeyboardInterrupt after it if any came (unless the block itself raised)."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def record(signum, frame) -> None:
        got.append(signum)

    previous = signal.signal(signal.SIGINT, record)
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, previous)
    if got:
        raise KeyboardInterrupt
