"""`dp-runtime bench` (in progress this session)."""

from __future__ import annotations

import typer


def bench() -> None:
    """Not written yet."""
    raise typer.Exit(2)
