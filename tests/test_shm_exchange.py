"""The shared-memory step exchange, with one thread per rank in one process (no torchrun)."""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
import time

import pytest
from dp_sync_helpers import NCOLS, open_ranks, run_ranks, shm_path_fixture  # noqa: F401 (fixture)

from dp_runtime.sync.errors import DPSyncError, DPSyncTimeoutError
from dp_runtime.sync.shm_exchange import ShmExchange, pid_alive, shm_file_size


@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_gets_every_row(shm_path, world):
    exs = open_ranks(shm_path, world)
    steps = 300

    def rows_of(r, s):
        rng = random.Random(s * 31 + r)
        return tuple(rng.randint(-(2**63), 2**63 - 1) for _ in range(NCOLS))

    def rank(r):
        return [exs[r].exchange(rows_of(r, s)) for s in range(steps)]

    out = run_ranks([lambda r=r: rank(r) for r in range(world)])
    for r in range(world):
        assert not isinstance(out[r], BaseException), out[r]
        assert out[r] == out[0]
    for s in (0, steps // 2, steps - 1):
        assert out[0][s] == [rows_of(r, s) for r in range(world)]
    assert exs[0].seq == steps
    for ex in exs:
        ex.close()
    assert not os.path.exists(shm_path)


def test_timeout_names_the_silent_rank(shm_path):
    exs = open_ranks(shm_path, 3, timeout_s=0.3)
    row = (1,) * NCOLS
    start = time.monotonic()
    out = run_ranks([lambda: exs[0].exchange(row), lambda: None, lambda: exs[2].exchange(row)])
    assert time.monotonic() - start < 10
    for r in (0, 2):
        err = out[r]
        assert isinstance(err, DPSyncTimeoutError), err
        assert err.silent_ranks == (1,)
        assert "rank(s) [1] never wrote" in str(err) and "dp_sync_timeout_s=0.3s" in str(err)


def test_exited_peer_is_reported_before_the_deadline(shm_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not pid_alive(proc.pid) and pid_alive(os.getpid())
    exs = open_ranks(shm_path, 2, timeout_s=60.0, peer_pids={1: proc.pid})
    start = time.monotonic()
    with pytest.raises(DPSyncTimeoutError, match=f"rank 1 \\(pid {proc.pid}\\) has exited") as info:
        exs[0].exchange((0,) * NCOLS)
    assert time.monotonic() - start < 5
    assert info.value.silent_ranks == (1,)


def test_abandoned_peer_is_reported_at_once(shm_path):
    # A live peer whose step raised marks its slots; before, the others waited the full timeout.
    exs = open_ranks(shm_path, 2, timeout_s=60.0)
    row = (1,) * NCOLS
    out = run_ranks([lambda: exs[0].exchange(row), lambda: exs[1].exchange(row)])
    assert out[0] == out[1] == [row, row]
    exs[1].abandon()
    start = time.monotonic()
    with pytest.raises(DPSyncError, match=r"rank 1 abandoned the step sync .* exchange #2"):
        exs[0].exchange(row)
    assert time.monotonic() - start < 5


def test_torn_or_stale_row_is_not_accepted(shm_path):
    """A slot whose seq says 'written' but whose checksum does not match is treated as unwritten."""
    exs = open_ranks(shm_path, 2, timeout_s=0.3)
    slot = 64 + (2 * 1 + 1) * exs[1]._stride  # rank 1, parity of exchange #1
    struct.pack_into("@q", exs[1]._mm, slot, 1)  # seq without a matching payload/checksum
    with pytest.raises(DPSyncTimeoutError):
        exs[0].exchange((0,) * NCOLS)


def test_peer_ahead_is_an_error(shm_path):
    exs = open_ranks(shm_path, 2)
    slot = 64 + (2 * 1 + 1) * exs[1]._stride
    struct.pack_into("@q", exs[1]._mm, slot, 3)  # rank 1 claims exchange #3 while rank 0 does #1
    with pytest.raises(DPSyncError, match="rank 1 is at exchange #3 while rank 0 is at #1"):
        exs[0].exchange((0,) * NCOLS)


def test_foreign_or_stale_file_is_refused(shm_path):
    owner = ShmExchange(shm_path, 0, 2, NCOLS, timeout_s=1, create=True, nonce=1)
    with pytest.raises(DPSyncError, match="header"):
        ShmExchange(shm_path, 1, 2, NCOLS, timeout_s=1, create=False, nonce=2)
    with pytest.raises(DPSyncError, match=f"expected {shm_file_size(3, NCOLS)}"):
        ShmExchange(shm_path, 1, 3, NCOLS, timeout_s=1, create=False, nonce=1)
    with pytest.raises(FileExistsError):
        ShmExchange(shm_path, 0, 2, NCOLS, timeout_s=1, create=True, nonce=1)
    owner.close()
    owner.close()
    assert not os.path.exists(shm_path)


def test_abandon_never_overwrites_a_row_a_peer_has_not_read(shm_path):
    # Rank 0 reads rank 1's row, then gives up at once (a plan mismatch seen in the table); rank 1
    # still reads rank 0's row of that exchange. Before: abandon overwrote it with the mark, so
    # rank 1 raised "abandoned" instead of getting the table (and then a different error).
    owner = ShmExchange(shm_path, 0, 2, NCOLS, timeout_s=30, create=True, nonce=7)
    # Rank 1 writes its row, finds none from rank 0, and naps for a second before looking again.
    slow = ShmExchange(shm_path, 1, 2, NCOLS, timeout_s=30, create=False, nonce=7, spin_polls=0, yield_s=0,
                       nap_s=1.0)
    rows = [(1,) * NCOLS, (2,) * NCOLS]
    out = run_ranks([lambda: (time.sleep(0.2), owner.exchange(rows[0]), owner.abandon())[1],
                     lambda: slow.exchange(rows[1])])
    assert out == {0: rows, 1: rows}
    with pytest.raises(DPSyncError, match=r"rank 0 abandoned the step sync .* exchange #2"):
        slow.exchange(rows[1])  # the next exchange, which rank 0 never writes, sees the mark
    owner.close()
    slow.close()


def test_row_width_and_rank_are_checked(shm_path):
    with pytest.raises(ValueError, match="rank 2 is not in"):
        ShmExchange(shm_path, 2, 2, NCOLS, timeout_s=1, create=True)
    ex = open_ranks(shm_path, 1)[0]
    with pytest.raises(ValueError, match="row has 2 values, ncols is 8"):
        ex.exchange((1, 2))


def test_slots_do_not_share_cache_lines():
    assert shm_file_size(4, 8) == 64 + 8 * 128 + 64  # header, 2 slots per rank, abandon marks
    assert shm_file_size(4, 6) == 64 + 8 * 64 + 64
    assert shm_file_size(9, 6) == 64 + 18 * 64 + 128
