"""One log line per distinct kernel fallback per process: a fused kernel that cannot run here is
named once, with the reason, however many models or layers ask. The set of lines already logged
is the only state, and it changes no behaviour."""

from __future__ import annotations

import logging

__all__ = ["log_fallback"]

_logged: set[str] = set()


def log_fallback(message: str) -> None:
    """Log ``message`` at WARNING on the ``dp_runtime`` logger, the first time only."""
    if message not in _logged:
        _logged.add(message)
        logging.getLogger("dp_runtime").warning(message)
