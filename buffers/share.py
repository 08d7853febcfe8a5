"""Move every tensor of an object into the pool, so runners that build such objects share storage.

``share_input_buffers_in(obj, pool, user)`` walks a dataclass or ``SimpleNamespace``: each
tensor field is declared in the pool under its (dotted) name, the pool is materialized, the
tensor's data is copied into its pool view and the field is rebound to that view. Nested dicts
and dataclasses/namespaces are walked with dotted names (``extra.mrope_positions``). ``None`` is
left alone; any other leaf is a TypeError naming the field, because silently keeping a private
buffer is exactly the memory-times-N waste the pool exists to prevent.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import torch

from buffers.pool import BufferPool

__all__ = ["share_input_buffers_in"]


def _children(obj: Any, path: str) -> list[tuple[str, Any]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, SimpleNamespace):
        return list(vars(obj).items())
    if isinstance(obj, dict):
        for key in obj:
            if not isinstance(key, str):
                raise TypeError(f"share_input_buffers_in: dict key {key!r} "
                                f"under {path or '<root>'!r} is not a str")
        return list(obj.items())
    raise TypeError(
        f"share_input_buffers_in: {path or '<root>'!r} is a {type(obj).__name__}; "
        "expected a dataclass instance, SimpleNamespace or dict"
    )


def _set(obj: Any, key: str, value: torch.Tensor) -> None:
    if isinstance(obj, dict):
        obj[key] = value
    else:
        setattr(obj, key, value)


def _walk(obj: Any, prefix: str, out: list[tuple[Any, str, str, torch.Tensor]]) -> None:
    for key, value in _children(obj, prefix.rstrip(".")):
        name = prefix + key
        if value is None:
            continue
        if isinstance(value, torch.Tensor):
            out.append((obj, key, name, value))
        elif isinstance(value, (dict, SimpleNamespace)) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            _walk(value, name + ".", out)
        else:
            raise TypeError(
                f"share_input_buffers_in: field {name!r} is a {type(value).__name__}; "
                "only tensors, None, dicts, dataclasses and namespaces can be pooled"
            )


def share_input_buffers_in(obj: Any, pool: BufferPool, user: str) -> list[str]:
    """Rebind every tensor field of ``obj`` (recursively) to a view of ``pool``; return the names.

    Data is preserved: each tensor's values are copied into its pool view. All leaves are
    checked and declared at once, so an error leaves ``obj`` and ``pool`` untouched.
    """
    leaves: list[tuple[Any, str, str, torch.Tensor]] = []
    _walk(obj, "", leaves)
    pool.declare_all([(name, tuple(t.shape), t.dtype, t.device) for _, _, name, t in leaves], user)
    pool.materialize()
    with torch.inference_mode(False):
        for parent, key, name, tensor in leaves:
            view = pool.view(name, tuple(tensor.shape))
            view.copy_(tensor)
            _set(parent, key, view)
    return [name for _, _, name, _ in leaves]
