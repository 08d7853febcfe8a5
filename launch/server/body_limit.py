"""The request-size limit: a body over ``max_bytes`` is a 413 with OpenAI's error object,
before any of it is parsed.

``BodyLimit(app, max_bytes)`` is pure ASGI (no BaseHTTPMiddleware: it must not buffer a
streamed response). A ``Content-Length`` over the limit is refused at once, unread; a body
without one (chunked) is counted as it arrives and refused once past the limit. Either way the
JSON parser never sees more than ``max_bytes``: a 32 MB body once froze every stream for
seconds while it parsed on the event loop. The rest of a refused body is read and dropped
(up to 64 MiB) before the 413, so a client still sending reads the 413, not a reset.
"""

from __future__ import annotations

import json
from typing import Any

from launch.server.protocol import error_body

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "BodyLimit"]

# 4 MiB: a prompt of ~500k token ids, or a chat of ~1M tokens of text, in one JSON body; far
# above any context the server accepts, far below what stalls the event loop.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DISCARD_BYTES = 64 * 1024 * 1024  # the most of a refused body read (and dropped) before the 413


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None and length > self.max_bytes:
            await self._refuse(send, length, await _discard(receive, 0))
            return
        received = 0
        refused = False

        async def counted() -> dict:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request" and not refused:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    whole = not message.get("more_body") or await _discard(receive, received)
                    await self._refuse(send, received, whole, at_least=True)
                    # The app sees a client that left: its response would have nowhere to go.
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not refused:  # after a 413 the app's own response is dropped
                await send(message)

        await self.app(scope, counted, guarded_send)

    async def _refuse(self, send: Any, size: int, whole: bool, at_least: bool = False) -> None:
        """The 413; ``whole``: the body was read to its end, so the connection may stay."""
        body = json.dumps(error_body(
            f"the request body is {'over ' if at_least else ''}{size} bytes; the limit is "
            f"{self.max_bytes} (--max-request-bytes)",
            "invalid_request_error", None, "request_too_large",
        )).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode())]
        if not whole:
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _discard(receive: Any, read: int) -> bool:
    """Read the rest of the body into nothing, up to ``DISCARD_BYTES`` in all; True when it
    ended. A client still sending when the server answers and closes gets a reset that may
    lose the 413 before it reads it; one over the cap does."""
    while read <= DISCARD_BYTES:
        message = await receive()
        if message["type"] != "http.request":
            return False
        read += len(message.get("body", b""))
        if not message.get("more_body"):
            return True
    return False


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
