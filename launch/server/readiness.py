"""The door's answer while the engine cannot serve: 503 with ``Retry-After``, never a hang.

The server listens before the engine has started (a load balancer sees ``/health`` 503
``starting`` from the moment the port is bound). While the engine's state is not ``ready``
(``starting``, ``restarting`` after a rank failed, ``stopping`` on a drain, ``stopped``,
``failed``) every route but ``/health`` and ``/metrics`` answers 503 ``service_unavailable``
naming the state, with ``Retry-After``; so does a request the engine refuses for the same
reason (``EngineUnavailable``: the state changed between the check and the submit) or loses
with its rank.
"""

from __future__ import annotations

from typing import Any

from launch.server.protocol import ApiError

__all__ = ["ALWAYS_OPEN", "RETRY_AFTER_S", "unavailable", "unavailable_error"]

ALWAYS_OPEN = frozenset({"/health", "/metrics"})  # they report the state itself
RETRY_AFTER_S = 5  # a start or a gang restart takes seconds to minutes: no point asking sooner


def unavailable_error(message: str) -> ApiError:
    """A 503 saying ``message``, with Retry-After."""
    return ApiError(503, message, kind="service_unavailable", code="engine_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def unavailable(engine: Any) -> ApiError | None:
    """The 503 for a request arriving now, or None while the engine serves."""
    h = engine.health()
    if h.ok:
        return None
    detail = f": {h.detail}" if h.detail else ""
    return unavailable_error(f"the engine is {h.state}{detail}; retry later")
