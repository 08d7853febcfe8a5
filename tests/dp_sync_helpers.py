"""Helpers of the step-sync tests: open a shared-memory exchange for several ranks in one
process, and run one function per rank on its own thread."""

from __future__ import annotations

import os
import random
import threading

import pytest

from dp_runtime.sync.shm_exchange import ShmExchange

NCOLS = 8


def open_ranks(path, world, timeout_s=5.0, ncols=NCOLS, **kw):
    exs = [
        ShmExchange(str(path), 0, world, ncols, timeout_s=timeout_s, create=True, nonce=42, **kw)
    ]
    exs += [
        ShmExchange(str(path), r, world, ncols, timeout_s=timeout_s, create=False, nonce=42, **kw)
        for r in range(1, world)
    ]
    exs[0].unlink()
    return exs


def run_ranks(fns, join_s=30.0):
    """Run fns[r]() on one thread each; return {rank: result or exception}."""
    out: dict[int, object] = {}

    def target(r):
        try:
            out[r] = fns[r]()
        except BaseException as e:
            out[r] = e

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
        assert not t.is_alive(), "a rank thread hangs"
    return out


@pytest.fixture(name="shm_path")
def shm_path_fixture(tmp_path):
    """A fresh file name under /dev/shm (removed afterwards if a test left it)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(base, f"dp_runtime_test_{os.getpid()}_{random.getrandbits(32):08x}")
    yield path
    if os.path.exists(path):
        os.unlink(path)
