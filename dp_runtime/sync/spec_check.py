"""The whole RankSpec compared across ranks once, when a worker starts, before anything else
talks to the peers.

Ranks that disagree on their spec fail in ways that name nothing: different dispatchers wait
for each other in different collectives (a hang in dispatcher warm-up), different seeds or
weights give wrong tokens silently. So the worker calls ``check_rank_specs(spec, group)`` as
the first collective of its build: one ``all_gather_object`` of a small dict of plain values
(``spec_fields``); every rank gets the same table, so every rank raises the same
RankSpecMismatchError naming the first field that differs, each rank's value, the ranks that
differ from the majority, and any other fields that differ too. No rank is left inside a
collective when they raise.

What is compared: every RankSpec field (dispatcher, attention, use_cuda_graph, seed, the KV
sizing fields, the resolved context length, model_overrides), every RuntimeConfig field (the
device by type only: ranks run on different GPUs of one kind), and a model fingerprint: the
preset name or "checkpoint", the ModelConfig, and for a checkpoint a digest of every tensor's
name, dtype and shape read from the safetensors headers (a few KB per shard; no tensor data).
The checkpoint's path is not compared: nodes may mount it at different places.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from dp_runtime.sync.collectives import world_of
from dp_runtime.sync.errors import DPPlanMismatchError

if TYPE_CHECKING:
    from dp_runtime.rank_spec import RankSpec

__all__ = ["RankSpecMismatchError", "check_rank_specs", "checkpoint_digest", "compare_spec_fields",
           "spec_fields"]

_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a header


class RankSpecMismatchError(DPPlanMismatchError):
    """Ranks were started with different RankSpecs (``field``: the first that differs)."""


def checkpoint_digest(directory: str | Path) -> str:
    """A short digest of the tensors (name, dtype, shape) of every ``*.safetensors`` file in
    ``directory``, from the file headers alone; a file that cannot be read contributes its name
    and the reason, so a rank with a broken shard differs from the others."""
    h = hashlib.sha256()
    files = sorted(Path(directory).glob("*.safetensors"))
    for f in files:
        h.update(f.name.encode())
        try:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                if n > _MAX_HEADER_BYTES:
                    raise ValueError(f"header of {n} bytes")
                header = json.loads(fh.read(n))
            entries = sorted((k, v["dtype"], tuple(v["shape"])) for k, v in header.items()
                             if k != "__metadata__")
            h.update(repr(entries).encode())
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            h.update(f"unreadable: {type(e).__name__}: {e}".encode())
    return f"{len(files)} shards, sha256 {h.hexdigest()[:16]}"


def spec_fields(spec: RankSpec) -> dict[str, str]:
    """The values every rank must agree on, by name (``RankSpec.<field>``,
    ``RuntimeConfig.<field>``, ``model ...``), as repr strings."""
    out: dict[str, str] = {}
    for f in dataclasses.fields(spec):
        if f.name in ("runtime", "model"):
            continue
        out[f"RankSpec.{f.name}"] = repr(getattr(spec, f.name))
    out["RankSpec.max_context_len (resolved)"] = repr(spec.context_len)
    rt = spec.runtime
    for f in dataclasses.fields(rt):
        value = getattr(rt, f.name)
        if f.name == "device":
            value = getattr(value, "type", value)
        out[f"RuntimeConfig.{f.name}"] = repr(value)
    out["model (preset or checkpoint)"] = spec.model if spec.is_preset else "checkpoint"
    out["model config"] = repr(dataclasses.asdict(spec.model_config()))
    if not spec.is_preset:
        out["model weights (tensor names, dtypes, shapes)"] = checkpoint_digest(spec.model)
    return out


def compare_spec_fields(table: list[dict[str, str]]) -> None:
    """Raise RankSpecMismatchError when the ranks' ``spec_fields`` (``table[r]`` for rank r)
    differ; the same table gives the same error on every rank."""
    names = list(table[0])
    for t in table[1:]:
        names += [n for n in t if n not in names]
    differing = [n for n in names if len({t.get(n, "<missing>") for t in table}) > 1]
    if not differing:
        return
    first = differing[0]
    values = {r: t.get(first, "<missing>") for r, t in enumerate(table)}
    others = f" Also differing: {differing[1:]}." if differing[1:] else ""
    raise RankSpecMismatchError(
        first, values, "Every rank must be started with the same RankSpec (and the same model "
                       "files)." + others
    )


def check_rank_specs(spec: RankSpec, group: Any = None) -> None:
    """Compare ``spec`` (with its model fingerprint) across the ranks of ``group`` (a CPU/gloo
    group; None: a worker of world size 1, nothing to compare, even when a default group
    exists). A collective: every rank calls it once, before any other collective of its
    worker. Raises RankSpecMismatchError on every rank alike when they differ."""
    if group is None or world_of(group) == 1:
        return
    mine = spec_fields(spec)
    table: list[Any] = [None] * world_of(group)
    dist.all_gather_object(table, mine, group=group)
    compare_spec_fields(table)
