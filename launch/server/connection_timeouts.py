"""Stalled connections closed: uvicorn's h11 protocol with a header and a body timeout.

uvicorn times out only a connection idle between two requests (``--keep-alive-timeout``); one
that opens and sends nothing, or half a request, is held forever, and a few hundred of them use
up the process's file descriptors, locking every other client out. ``timed_h11(header_s,
body_s)`` is the protocol class for ``uvicorn.Config(http=...)`` that also closes a connection

- whose request line and headers are not complete ``header_s`` after it opened, or after the
  first byte of its next request (one deadline: sending a byte now and then does not extend it);
- whose body stops: no byte of it for ``body_s`` (re-armed by every read, so a large body on a
  slow link is fine).

Nothing is timed while the server itself holds the connection: a request being answered (a
long stream included), or reading paused by flow control.
"""

from __future__ import annotations

from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["timed_h11"]


def timed_h11(header_timeout_s: float, body_timeout_s: float) -> type:
    """The H11Protocol subclass with these timeouts (module docstring)."""

    class TimedH11Protocol(H11Protocol):
        _stall: Any = None
        _stall_kind: str | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._watch(new_connection=True)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_stall()
            super().connection_lost(exc)

        def _watch(self, new_connection: bool = False) -> None:
            """Arm, keep or cancel the stall timer for what the connection waits on now."""
            if self.transport.is_closing() or self.flow.read_paused:
                self._cancel_stall()
                return
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                self._arm("body", body_timeout_s, restart=True)
            elif state is h11.IDLE and (new_connection or self.conn.trailing_data[0]):
                self._arm("headers", header_timeout_s, restart=False)
            elif state is not h11.IDLE:  # the request is in; the server answers it
                self._cancel_stall()
            # IDLE with nothing buffered after a response: the keep-alive timeout's.

        def _arm(self, kind: str, seconds: float, restart: bool) -> None:
            if self._stall_kind == kind and not restart:
                return
            self._cancel_stall()
            self._stall_kind = kind
            self._stall = self.loop.call_later(seconds, self._stalled, kind)

        def _cancel_stall(self) -> None:
            if self._stall is not None:
                self._stall.cancel()
            self._stall, self._stall_kind = None, None

        def _stalled(self, kind: str) -> None:
            self._stall, self._stall_kind = None, None
            if self.transport.is_closing():
                return
            self.logger.info("closing a connection whose request %s stalled",
                             "headers" if kind == "headers" else "body")
            self.transport.close()

    return TimedH11Protocol
