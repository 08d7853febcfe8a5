"""Telling the peers when a rank's step raises, so that they fail naming it instead of waiting in
a collective for the process group's timeout with a bare transport error.

The protocol, per worker (``FailureNotice``; one per rank, built with the worker's own CPU group):

- a rank whose step raises on its own (no peer has reported a failure) writes
  ``"<step>: <ExceptionType>: <message>"`` under ``failed/<rank>`` in the group's store (a
  PrefixStore unique to the group, so a later worker on the same job never reads a stale key),
  then abandons the step exchange (``DPStepSync.abandon``: on the shared-memory path peers
  waiting for its row see the mark at once), and re-raises its own error;
- a rank whose step raises after a peer reported a failure raises PeerRankFailedError naming
  that rank, its step and its error, chained to its own error (typically the timeout of the
  collective the failed rank never joined) -- except a DPPlanMismatchError, which every rank
  raises alike from the same table and which stays what it is on every rank.

How long a peer waits: the step exchange is bounded by ``dp_sync_timeout_s`` (shm: at once
when the failed rank marked its slots). A collective inside the forward is bounded by the
timeout of the group it runs on, so the worker's own gloo group is created with
``dp_sync_timeout_s`` as its timeout (not the default group's, 300 s). An NCCL device group
keeps its own timeout: a peer blocked in an NCCL kernel waits for NCCL's watchdog.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from dp_runtime.sync.collectives import rank_of, world_of
from dp_runtime.sync.errors import DPPlanMismatchError, DPSyncError

__all__ = ["FailureNotice", "PeerRankFailedError"]

_MAX_MESSAGE = 2000


class PeerRankFailedError(DPSyncError):
    """A peer's step raised, and that is why this rank's step failed. Attributes: ``rank`` (the
    peer), ``error`` (what it reported: step number, exception type and message)."""

    def __init__(self, rank: int, error: str, this_rank: int) -> None:
        self.rank, self.error = rank, error
        super().__init__(f"rank {this_rank}: DP rank {rank} failed in step {error}")


def _group_store(group: Any) -> Any:
    get = getattr(group, "get_group_store", None)
    if get is not None:
        return get()
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class FailureNotice:
    """One rank's side of the protocol (module docstring).

    Args:
        group: the worker's own CPU (gloo) group, or None at world size 1 (then a no-op).
        abandon: called once after this rank published its own failure (the step sync's
            ``abandon``), so peers waiting in the exchange stop at once.
    """

    def __init__(self, group: Any, abandon: Callable[[], None] | None = None) -> None:
        self.world = world_of(group) if group is not None else 1
        self.rank = rank_of(group) if group is not None else 0
        self._store = _group_store(group) if self.world > 1 else None
        self._abandon = abandon
        self._published = False

    @staticmethod
    def _key(rank: int) -> str:
        return f"dp_runtime/failed/{rank}"

    def failed_peers(self) -> dict[int, str]:
        """{rank: reported error} of the peers that published a failure so far (no waiting)."""
        if self._store is None:
            return {}
        out = {}
        for r in range(self.world):
            if r != self.rank and self._store.check([self._key(r)]):
                out[r] = self._store.get(self._key(r)).decode(errors="replace")
        return out

    def on_step_error(self, exc: BaseException, step: int) -> None:
        """Called with the exception that ended this rank's step number ``step``. Raises
        PeerRankFailedError (from ``exc``) when a peer's published failure explains it; else
        publishes ``exc`` for the peers, abandons the exchange, and returns (the caller
        re-raises ``exc``)."""
        if self._store is None:
            return
        try:
            peers = self.failed_peers()
        except Exception:  # the store itself is gone (the job is being torn down)
            peers = {}
        # A plan mismatch is raised by every rank alike from the same gathered table: each
        # rank's own error is the documented one, never re-wrapped as a peer's failure.
        if peers and not isinstance(exc, DPPlanMismatchError):
            first = min(peers)
            raise PeerRankFailedError(first, peers[first], self.rank) from exc
        if self._published:
            return
        self._published = True
        text = f"{step}: {type(exc).__name__}: {exc}"
        # Best effort: without the key the peers still time out, only less precisely.
        with contextlib.suppress(Exception):
            self._store.set(self._key(self.rank), text[:_MAX_MESSAGE])
        if self._abandon is not None:
            self._abandon()
