"""Interrupts (Ctrl-C, SIGTERM) while Ray starts or stops, and SIGTERM as an exception.

``ray.init`` interrupted half-way leaves a node whose processes nobody stops (and the
interpreter can crash at exit while Ray's threads are half set up); ``ray.shutdown`` interrupted
leaves agents behind. Inside ``held_interrupts()`` a SIGINT, and a SIGTERM where a Python handler
takes it (``sigterm_raises``), is only recorded; when the block ends the handlers that were there
before are back and each recorded signal is given to its own, so the caller cleans up from a
known state (Ctrl-C: KeyboardInterrupt). A no-op outside the main thread (signal handlers live
there).

``sigterm_raises()``: within it SIGTERM raises ``Terminated`` (a KeyboardInterrupt: every path
that stops what it started on Ctrl-C does so on SIGTERM too), what a command that must stop its
ranks and its Ray cluster on a supervisor's SIGTERM asks for (``dp-runtime run``). It yields
the SIGTERMs that came: Ray turns an exception a signal handler raises inside its blocking calls
into a plain KeyboardInterrupt, so the type alone cannot tell the caller which signal it was.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Terminated", "held_interrupts", "interrupt_error", "sigterm_raises"]


class Terminated(KeyboardInterrupt):
    """SIGTERM came (``sigterm_raises``)."""


@contextmanager
def sigterm_raises() -> Iterator[list[int]]:
    """SIGTERM raises Terminated in the main thread during the block; the yielded list gets one
    entry per SIGTERM (module docstring)."""
    came: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield came
        return

    def terminate(signum: int, frame: object) -> None:
        came.append(signum)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield came
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupt_error(signals: list[int]) -> KeyboardInterrupt:
    """The exception for the interrupts ``held_interrupts`` recorded: Terminated for a SIGTERM,
    else KeyboardInterrupt."""
    return Terminated() if signal.SIGTERM in signals else KeyboardInterrupt()


@contextmanager
def held_interrupts() -> Iterator[list[int]]:
    """Record SIGINT, and SIGTERM where a Python handler takes it, during the block (the yielded
    list holds one entry per signal); after it, unless the block itself raised, give each to the
    handler that was there before (SIGINT's default raises KeyboardInterrupt). Restoring the
    handlers also takes SIGTERM back from a C++ handler installed meanwhile (Ray's core worker
    installs one that prints a stack dump)."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return

    def record(signum, frame) -> None:
        got.append(signum)

    held = [signal.SIGINT] + ([signal.SIGTERM] if callable(signal.getsignal(signal.SIGTERM))
                              else [])
    previous = {sig: signal.signal(sig, record) for sig in held}
    try:
        yield got
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for sig in dict.fromkeys(got):  # each once, in the order they came
        handler = previous[sig]
        if sig == signal.SIGINT and not callable(handler):
            raise KeyboardInterrupt
        if callable(handler):
            handler(sig, None)
