"""The PYTHONPATH a test gives a process it starts: this checkout first, so the code under test
is imported, then what the caller's path holds (a GPU machine's bundle of ray, flashinfer and
fastapi)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["checkout_first"]


def checkout_first(root: Path | str) -> str:
    return os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
