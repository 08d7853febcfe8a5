"""Step exchanges: an all-gather of one small int64 row per rank, and the choice of path.

Three implementations of ``StepExchange`` (``exchange(row) -> rows of every rank``):

- ``LocalExchange``: world size 1, no process group.
- ``GlooExchange``: the general path, one ``all_gather_into_tensor`` over the DP CPU (gloo)
  group into preallocated tensors.
- ``ShmExchange`` (dp_runtime.sync.shm_exchange): the same-node fast path through shared memory.

``open_exchange(config, group)`` runs a handshake once at init (over the CPU group, with
object collectives; every rank takes part and takes the same decision):

1. gather each rank's hostname, pid, pid namespace, a nonce, and ``config.plan_fields()``;
   ranks whose config fields differ raise DPPlanMismatchError naming the field and the ranks;
2. shm is a candidate when ``dp_sync_exchange`` is "shm" or "auto" and every hostname is equal;
3. rank 0 creates the file, the others attach and check its header; the outcome of every rank
   is gathered, then rank 0 unlinks the name. Everyone attached: ShmExchange. Otherwise gloo
   ("auto"), or ValueError naming each rank's reason ("shm" was required).

Both paths return identical rows; only the transport differs.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import struct
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dp_runtime.config import RuntimeConfig
from dp_runtime.sync.collectives import all_gather_into, rank_of, world_of
from dp_runtime.sync.errors import DPPlanMismatchError, DPSyncTimeoutError
from dp_runtime.sync.shm_exchange import ShmExchange

__all__ = ["GlooExchange", "LocalExchange", "StepExchange", "open_exchange"]


class StepExchange(Protocol):
    """An all-gather of one row of ``ncols`` int64 values per rank."""

    kind: str
    rank: int
    world: int
    ncols: int

    def exchange(self, row: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Publish this rank's row; return every rank's row in rank order."""
        ...

    def close(self) -> None: ...


class LocalExchange:
    """World size 1: the row is the table."""

    kind = "local"

    def __init__(self, ncols: int) -> None:
        self.rank, self.world, self.ncols = 0, 1, ncols

    def exchange(self, row: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [tuple(row)]

    def close(self) -> None:
        pass


class GlooExchange:
    """One all-gather over a CPU (gloo) group per exchange, into preallocated buffers.

    The tensors are views of bytearrays, so rows are packed and unpacked with ``struct``
    without building tensors per step. The wait is bounded by ``timeout_s``; gloo cannot say
    which rank is missing, so the error says so.
    """

    kind = "gloo"

    def __init__(self, group: Any, ncols: int, timeout_s: float) -> None:
        self.group, self.ncols = group, ncols
        self.rank, self.world = rank_of(group), world_of(group)
        self.timeout_s = float(timeout_s)
        self._timeout = datetime.timedelta(seconds=timeout_s)
        self._row_fmt = struct.Struct(f"@{ncols}q")
        self._table_fmt = struct.Struct(f"@{ncols * self.world}q")
        self._send_bytes = bytearray(self._row_fmt.size)
        self._recv_bytes = bytearray(self._table_fmt.size)
        self._send = torch.frombuffer(self._send_bytes, dtype=torch.int64)
        self._recv = torch.frombuffer(self._recv_bytes, dtype=torch.int64)

    def exchange(self, row: tuple[int, ...]) -> list[tuple[int, ...]]:
        if len(row) != self.ncols:
            raise ValueError(f"GlooExchange: row has {len(row)} values, ncols is {self.ncols}")
        self._row_fmt.pack_into(self._send_bytes, 0, *row)
        work = all_gather_into(self._recv, self._send, group=self.group, async_op=True)
        try:
            work.wait(self._timeout)
        except RuntimeError as e:
            raise DPSyncTimeoutError(
                f"DP step sync (gloo): rank {self.rank} got no table within dp_sync_timeout_s="
                f"{self.timeout_s:g}s ({e}); a rank crashed, hangs or skipped a step (the gloo "
                f"path cannot name it; the shm path does)",
                silent_ranks=(),
                timeout_s=self.timeout_s,
            ) from e
        flat = self._table_fmt.unpack_from(self._recv_bytes)
        n = self.ncols
        return [flat[i : i + n] for i in range(0, n * self.world, n)]

    def close(self) -> None:
        pass


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _check_configs(infos: list[dict]) -> None:
    fields = infos[0]["config"].keys()
    for name in fields:
        values = {r: info["config"].get(name) for r, info in enumerate(infos)}
        if len(set(map(repr, values.values()))) > 1:
            raise DPPlanMismatchError(
                f"config field {name!r}",
                values,
                "Every rank of a DP group must run the same RuntimeConfig.",
            )


def _try_open_shm(
    config: RuntimeConfig, group: Any, rank: int, world: int, ncols: int, infos: list[dict]
) -> tuple[ShmExchange | None, list[str]]:
    """Rank 0 creates, the others attach; returns (this rank's exchange or None, each rank's
    error)."""
    nonce = infos[0]["nonce"]
    path = os.path.join(config.dp_sync_shm_dir, f"dp_runtime_step_sync_{nonce:016x}")
    same_ns = len({i["pidns"] for i in infos}) == 1 and infos[0]["pidns"] != ""
    pids = {r: i["pid"] for r, i in enumerate(infos) if r != rank} if same_ns else None
    kwargs = dict(timeout_s=config.dp_sync_timeout_s, nonce=nonce, peer_pids=pids)
    ex, error = None, ""
    if rank == 0:
        try:
            ex = ShmExchange(path, 0, world, ncols, create=True, **kwargs)
        except OSError as e:
            error = f"rank 0 could not create {path}: {e}"
    created = [None] * world
    dist.all_gather_object(created, error, group=group)  # also orders create before attach
    if created[0]:
        return None, [created[0]] * world
    if rank != 0:
        try:
            ex = ShmExchange(path, rank, world, ncols, create=False, **kwargs)
        except Exception as e:  # any failure means this rank cannot take the shm path
            error = f"rank {rank} could not attach {path}: {e}"
    errors = [None] * world
    dist.all_gather_object(errors, error, group=group)
    if ex is not None and rank == 0:
        ex.unlink()  # everyone is attached (or gave up): the name is no longer needed
    if any(errors):
        if ex is not None:
            ex.close()
        return None, [e for e in errors if e]
    return ex, []


def open_exchange(config: RuntimeConfig, group: Any = None, ncols: int = 8) -> StepExchange:
    """The step exchange of this rank over ``group`` (the DP CPU group; default the world).

    Takes the config (dp_sync_exchange, dp_sync_timeout_s, dp_sync_shm_dir, plan fields) and
    the group; returns a StepExchange of ``ncols`` columns. A collective: every rank of the
    group must call it. Raises DPPlanMismatchError when ranks' configs differ, ValueError when
    "shm" is required but not possible.
    """
    world = world_of(group)
    if world == 1:
        return LocalExchange(ncols)
    rank = rank_of(group)
    info = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "pidns": _pid_namespace(),
        "nonce": secrets.randbits(62),
        "config": config.plan_fields(),
    }
    infos: list[Any] = [None] * world
    dist.all_gather_object(infos, info, group=group)
    _check_configs(infos)

    choice = config.dp_sync_exchange
    hosts = sorted({i["host"] for i in infos})
    if choice in ("auto", "shm") and len(hosts) == 1:
        ex, errors = _try_open_shm(config, group, rank, world, ncols, infos)
        if ex is not None:
            return ex
        if choice == "shm":
            raise ValueError(
                f"dp_sync_exchange='shm' but the shm file could not be shared: {errors}"
            )
    elif choice == "shm":
        raise ValueError(
            f"dp_sync_exchange='shm' needs every rank on one node; the ranks run on {hosts}"
        )
    return GlooExchange(group, ncols, config.dp_sync_timeout_s)
