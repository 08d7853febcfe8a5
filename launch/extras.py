"""The optional extras a command needs, checked before anything imports them.

``dp-runtime serve`` needs the ``[serve]`` extra; without it the first import deep in the server
would be a ``ModuleNotFoundError`` traceback. ``require_extra`` names the extra and the modules
missing in one line (a UsageError: exit 2). Only ``importlib.util.find_spec``: no module is
imported here (transformers alone takes seconds).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from launch.cli_errors import UsageError

__all__ = ["SERVE_MODULES", "missing_modules", "require_extra"]

# pyproject.toml's [serve] extra, by import name.
SERVE_MODULES = ("fastapi", "uvicorn", "prometheus_client", "transformers", "tokenizers", "jinja2")


def missing_modules(names: Sequence[str]) -> list[str]:
    """The names in ``names`` that cannot be imported here (a finder that refuses one counts)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def require_extra(extra: str, modules: Sequence[str], command: str) -> None:
    """Raise UsageError naming ``pip install 'dp-runtime[<extra>]'`` when a module of ``extra``
    does not import here."""
    missing = missing_modules(modules)
    if missing:
        raise UsageError(f"{command} needs the [{extra}] extra ({', '.join(missing)} "
                         f"{'does' if len(missing) == 1 else 'do'} not import here): "
                         f"pip install 'dp-runtime[{extra}]'")
