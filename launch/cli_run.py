"""`dp-runtime run` (in progress this session)."""

from __future__ import annotations

import typer


def run() -> None:
    """Not written yet."""
    raise typer.Exit(2)
