"""ShmExchange: the same-node step exchange, through one memory-mapped file shared by the ranks.

A gloo all-gather of a few bytes costs ~100-200 us (two socket round trips through the kernel);
ranks on one node can instead write their row into shared memory and read the others' rows in
a few microseconds. ``exchange(row)`` returns every rank's row, like an all-gather.

File layout, in int64 words::

    header (64 bytes):  MAGIC, nonce, world, ncols, 0, 0, 0, 0
    slot (rank r, parity p) at 64 + (2*r + p) * stride:  seq, v_0 ... v_{ncols-1}, checksum
    abandon marks at 64 + 2*world*stride:  one word per rank (0, or 1 once that rank gave up)

``stride`` is a multiple of 64 bytes, so ranks never write the same cache line.

Protocol of exchange number ``s`` (1, 2, ...; 0 = never written):

1. write ``v`` and ``checksum = hash((s, *v))`` into slot ``(rank, s % 2)``, then ``seq = s``;
2. for each peer, wait until its slot ``(peer, s % 2)`` says ``seq == s``, read ``v`` and the
   checksum, and accept them only if the checksum matches ``(s, *v)`` (else read again).

Why two slots per rank: a rank that finished reading exchange ``s`` may write ``s + 1`` while a
slower peer still reads ``s``; ``s + 1`` goes to the other slot. It cannot get to ``s + 2`` (the
slot being read) before every peer has written ``s + 1``, which each does only after reading
``s``. Why the checksum: Python gives no memory-ordering guarantees between two stores, and
weakly ordered CPUs (ARM) may show a reader the new ``seq`` with an old payload; the checksum
makes a torn or stale read look like "not yet written", so the reader simply retries.

Waiting spins for a few polls, then yields the CPU, then sleeps in short naps; past
``timeout_s`` it raises DPSyncTimeoutError naming the ranks that never wrote. When the peers'
process ids are known (same pid namespace) a peer whose process has exited is reported at once
instead of at the deadline. A dead rank therefore never hangs the others forever.

A rank whose step raised sets its abandon mark (``abandon``); a peer that waits for a row of
that rank not yet written finds the mark and raises at once. The mark lives apart from the
slots, and a reader takes a written row before it looks at the mark: a rank that gives up right
after an exchange (a plan mismatch every rank raises alike) never overwrites a row a slower
peer has not read yet, so that peer still gets the table, and raises the same error.

Ownership: one rank creates the file (``create=True``), the others attach; the creator unlinks
the name as soon as everyone is attached (``unlink()``), so a crash leaves nothing in /dev/shm:
the mappings live until each rank closes its exchange.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import time
from collections.abc import Mapping, Sequence

from dp_runtime.sync.errors import DPSyncError, DPSyncTimeoutError

__all__ = ["ShmExchange", "pid_alive", "shm_file_size"]

_MAGIC = 0x44505253594E4331  # "DPRSYNC1"
_HEADER_BYTES = 64
_LINE = 64


def _stride(ncols: int) -> int:
    return -(-(ncols + 2) * 8 // _LINE) * _LINE


def _marks_bytes(world: int) -> int:
    return -(-world * 8 // _LINE) * _LINE


def shm_file_size(world: int, ncols: int) -> int:
    """Bytes of the exchange file for ``world`` ranks and rows of ``ncols`` int64 values."""
    return _HEADER_BYTES + 2 * world * _stride(ncols) + _marks_bytes(world)


def _cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (in this pid namespace) exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            # "pid (comm) S ...": the state follows the last ')' (comm may hold parentheses).
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


class ShmExchange:
    """An all-gather of one int64 row per rank through shared memory (see the module docstring).

    Args:
        path: the file (under /dev/shm for real shared memory).
        rank, world: this rank and the number of ranks.
        ncols: values per row.
        timeout_s: how long ``exchange`` waits for the slowest peer before raising.
        create: this rank creates the file (exactly one rank does, before the others attach).
        nonce: written by the creator and checked by the others (a stale or foreign file of the
            same name is refused).
        peer_pids: {rank: pid} of the peers, only when they share this pid namespace; enables
            the early report of a peer whose process has exited.
        spin_polls, yield_s, nap_s: waiting policy (polls before yielding; seconds of yielding
            before napping; length of a nap). ``spin_polls=None``: 200 when every rank can have
            a core of its own, else 0 — on an oversubscribed host a spinning rank only delays the
            peer it waits for (3 ranks on 2 cores: 3x slower steps with spinning).
    """

    kind = "shm"

    def __init__(
        self,
        path: str,
        rank: int,
        world: int,
        ncols: int,
        *,
        timeout_s: float,
        create: bool,
        nonce: int = 0,
        peer_pids: Mapping[int, int] | None = None,
        spin_polls: int | None = None,
        yield_s: float = 2e-3,
        nap_s: float = 1e-4,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"ShmExchange: rank {rank} is not in [0, world={world})")
        self.path, self.rank, self.world, self.ncols = path, rank, world, ncols
        self.timeout_s = float(timeout_s)
        self._peer_pids = dict(peer_pids or {})
        if spin_polls is None:
            spin_polls = 200 if world <= _cores() else 0
        self._spin_polls, self._yield_s, self._nap_s = spin_polls, yield_s, nap_s
        self._stride = _stride(ncols)
        self._seq = 0
        self._owner = create
        size = shm_file_size(world, ncols)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            elif os.fstat(fd).st_size != size:
                raise DPSyncError(
                    f"shm step-sync file {path} has {os.fstat(fd).st_size} bytes, expected {size} "
                    f"(world={world}, ncols={ncols})"
                )
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        header = struct.Struct("@4q")
        if create:
            header.pack_into(self._mm, 0, _MAGIC, nonce, world, ncols)
        else:
            got = header.unpack_from(self._mm, 0)
            if got != (_MAGIC, nonce, world, ncols):
                self._mm.close()
                raise DPSyncError(
                    f"shm step-sync file {path} has header {got}, "
                    f"expected {(_MAGIC, nonce, world, ncols)}"
                )
        self._seq_fmt = struct.Struct("@q")
        self._body_fmt = struct.Struct(f"@{ncols + 1}q")  # the values, then the checksum

    def _slot(self, rank: int, seq: int) -> int:
        return _HEADER_BYTES + (2 * rank + (seq & 1)) * self._stride

    @property
    def seq(self) -> int:
        """The number of exchanges done so far."""
        return self._seq

    def exchange(self, row: Sequence[int]) -> list[tuple[int, ...]]:
        """Publish ``row`` (``ncols`` ints) and return every rank's row, in rank order.

        Raises DPSyncTimeoutError naming the ranks that did not write within ``timeout_s`` (or
        whose process exited), DPSyncError if a peer is ahead by more than the protocol allows.
        """
        s = self._seq + 1
        row = tuple(row)
        if len(row) != self.ncols:
            raise ValueError(f"ShmExchange: row has {len(row)} values, ncols is {self.ncols}")
        mm, off = self._mm, self._slot(self.rank, s)
        self._body_fmt.pack_into(mm, off + 8, *row, hash((s, *row)))
        self._seq_fmt.pack_into(mm, off, s)  # publish last: a reader that sees s finds the row
        self._seq = s

        rows: list[tuple[int, ...] | None] = [None] * self.world
        rows[self.rank] = row
        pending = [q for q in range(self.world) if q != self.rank]
        polls, start, next_check = 0, 0.0, 0.0
        while True:
            pending = [q for q in pending if not self._try_read(q, s, rows)]
            if not pending:
                return rows  # type: ignore[return-value]
            polls += 1
            if polls <= self._spin_polls:
                continue
            now = time.perf_counter()
            if start == 0.0:
                start = next_check = now
            waited = now - start
            if waited > self.timeout_s:
                self._raise_timeout(s, pending, waited, dead=[])
            if waited < self._yield_s:
                os.sched_yield()
                continue
            if now >= next_check and self._peer_pids:
                next_check = now + 0.05
                dead = [
                    q for q in pending if q in self._peer_pids and not pid_alive(self._peer_pids[q])
                ]
                if dead:
                    self._raise_timeout(s, pending, waited, dead)
            time.sleep(self._nap_s)

    def abandon(self) -> None:
        """Set this rank's abandon mark (its step raised; it will not write again): a peer
        waiting for a row it has not written raises at once instead of at ``timeout_s``; rows
        it wrote stay readable. Not a collective."""
        if self._mm.closed:
            return
        self._seq_fmt.pack_into(self._mm, self._mark(self.rank), 1)

    def _mark(self, rank: int) -> int:
        return _HEADER_BYTES + 2 * self.world * self._stride + 8 * rank

    def _try_read(self, q: int, s: int, rows: list) -> bool:
        if self._read_slot(q, s, rows):
            return True
        if self._seq_fmt.unpack_from(self._mm, self._mark(q))[0]:
            # Read the slot once more after the mark: a row written just before the mark
            # (not yet visible on the first read) is still the peer's answer.
            if self._read_slot(q, s, rows):
                return True
            raise DPSyncError(
                f"shm step sync: rank {q} abandoned the step sync (its step raised) while rank "
                f"{self.rank} waited for exchange #{s}"
            )
        return False

    def _read_slot(self, q: int, s: int, rows: list) -> bool:
        off = self._slot(q, s)
        seq = self._seq_fmt.unpack_from(self._mm, off)[0]
        if seq != s:
            if seq > s:
                raise DPSyncError(
                    f"shm step sync: rank {q} is at exchange #{seq} while rank {self.rank} is at "
                    f"#{s}; the ranks do not run the same sequence of steps"
                )
            return False
        *values, checksum = self._body_fmt.unpack_from(self._mm, off + 8)
        if checksum != hash((s, *values)):
            return False  # torn or stale read: the writer's stores are not all visible yet
        rows[q] = tuple(values)
        return True

    def _raise_timeout(self, s: int, pending: list[int], waited: float, dead: list[int]) -> None:
        read = self._seq_fmt.unpack_from
        last = {
            q: max(read(self._mm, self._slot(q, s))[0], read(self._mm, self._slot(q, s + 1))[0])
            for q in pending
        }
        if dead:
            why = ", ".join(f"rank {q} (pid {self._peer_pids[q]}) has exited" for q in dead)
        else:
            why = f"no write within dp_sync_timeout_s={self.timeout_s:g}s"
        raise DPSyncTimeoutError(
            f"DP step sync (shm, {self.path}): rank {self.rank} waited {waited:.2f}s for exchange "
            f"#{s}; rank(s) {pending} never wrote it ({why}; last exchange each wrote: {last}). A "
            "rank that crashed, hangs, or skipped a step leaves the others here.",
            silent_ranks=pending,
            timeout_s=self.timeout_s,
        )

    def unlink(self) -> None:
        """Remove the file's name (the creator calls it once every rank is attached)."""
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self._owner = False

    def close(self) -> None:
        """Unmap the file (and unlink it if this rank created it and has not yet)."""
        self.unlink()
        if not self._mm.closed:
            self._mm.close()
