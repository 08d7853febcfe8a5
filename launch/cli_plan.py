"""`dp-runtime plan` (in progress this session)."""

from __future__ import annotations

import typer


def plan() -> None:
    """Not written yet."""
    raise typer.Exit(2)
