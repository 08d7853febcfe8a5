"""The environment variables graph/ reads, each through one typed function (read in one place).

To be merged into the project's single env module by its owner; until then nothing else in
graph/ reads ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["EAGER_INPUT_NO_COPY", "eager_input_no_copy"]

EAGER_INPUT_NO_COPY = "DP_RUNTIME_EAGER_INPUT_NO_COPY"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})


def _flag(name: str, environ: Mapping[str, str] | None) -> bool:
    raw = (os.environ if environ is None else environ).get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def eager_input_no_copy(environ: Mapping[str, str] | None = None) -> bool:
    """``DP_RUNTIME_EAGER_INPUT_NO_COPY``: the eager runner hands the model the batch's own
    tensors instead of registry views (default off). ``environ`` defaults to ``os.environ``."""
    return _flag(EAGER_INPUT_NO_COPY, environ)
