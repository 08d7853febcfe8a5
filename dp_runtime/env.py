"""The environment variables dp_runtime reads, all in one place, typed, prefixed ``DP_RUNTIME_``.

==============================  =====================================================  =========
variable                        meaning                                                read by
==============================  =====================================================  =========
DP_RUNTIME_DP_SYNC_EXCHANGE     ``auto`` | ``shm`` | ``gloo``: replaces an ``auto``     config
                                ``RuntimeConfig.dp_sync_exchange`` (e.g. to force the
                                general gloo path in CI)
DP_RUNTIME_SHM_DIR              directory of the same-node step-sync file              config
                                (default ``/dev/shm``)
DP_RUNTIME_EAGER_INPUT_NO_COPY  1/0: the eager runner hands the model the batch's own  config
                                tensors instead of registry views (default 0)
DP_RUNTIME_FLASHINFER_CHECKS    1/0: verify every FlashInfer plan on the host (syncs;  config
                                for debugging illegal memory accesses; default 0)
==============================  =====================================================  =========

Only ``RuntimeConfig`` resolution calls ``read_env``; everything below it gets the resolved
config, so a rank's behaviour is visible in one frozen object.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["RuntimeEnv", "read_env"]

_EXCHANGES = ("auto", "shm", "gloo")


@dataclass(frozen=True)
class RuntimeEnv:
    """The parsed ``DP_RUNTIME_*`` variables; None where a variable is unset or empty."""

    dp_sync_exchange: str | None = None
    shm_dir: str | None = None
    eager_input_no_copy: bool | None = None
    flashinfer_checks: bool | None = None


_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _flag(environ: Mapping[str, str], name: str) -> bool | None:
    raw = environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value in _TRUE | _FALSE:
        return value in _TRUE
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def read_env(environ: Mapping[str, str] | None = None) -> RuntimeEnv:
    """Parse the ``DP_RUNTIME_*`` variables of ``environ`` (default ``os.environ``).

    Raises ValueError naming the variable and its value when a value is not allowed.
    """
    environ = os.environ if environ is None else environ
    exchange = environ.get("DP_RUNTIME_DP_SYNC_EXCHANGE", "").strip().lower() or None
    if exchange is not None and exchange not in _EXCHANGES:
        raise ValueError(
            f"DP_RUNTIME_DP_SYNC_EXCHANGE={exchange!r} is not one of {', '.join(_EXCHANGES)}"
        )
    shm_dir = environ.get("DP_RUNTIME_SHM_DIR", "").strip() or None
    return RuntimeEnv(
        dp_sync_exchange=exchange,
        shm_dir=shm_dir,
        eager_input_no_copy=_flag(environ, "DP_RUNTIME_EAGER_INPUT_NO_COPY"),
        flashinfer_checks=_flag(environ, "DP_RUNTIME_FLASHINFER_CHECKS"),
    )
