"""`dp-runtime run` on a private Ray cluster as a real subprocess (slow tier, ~1 min): a full run
reports Ray's start-up inside its wall time and leaves no process behind; Ctrl-C (SIGINT to the
command's process group, as a terminal sends it) while Ray starts and while the ranks run exits
130 with no traceback and leaves no process behind; SIGTERM to the command's process while Ray
starts exits 143, the same way. `dp-runtime serve` on a private cluster: SIGTERM to the server
process while Ray starts exits 0 and leaves no process or listening socket behind.

The interrupt waits for a sign of its phase, never for a fixed time (Ray's start takes from a few
seconds to minutes on a loaded machine): while Ray starts, a Ray server carrying the marker
(``ray.init`` has begun; the command prints "placing" only after the init, and it must not);
while the ranks run, a progress line with tokens made (the ranks generate and the command
polls them).

"No process behind" is checked by a marker: the command runs with a unique environment
variable, which every process it starts inherits (Ray's GCS, raylet, agents, workers); after
the command exits no process on the machine may still carry it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.pythonpath import checkout_first

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
MARKER = "DP_RUNTIME_TEST_MARKER"
_TOKENS_MADE = re.compile(r"dp-runtime: requests \d+/\d+ +tokens [1-9]\d*/")  # the ranks generate


def _carriers(tag: str) -> list[int]:
    """Pids of processes whose environment holds MARKER=tag."""
    needle = f"{MARKER}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue  # gone, or not ours to read
    return found


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return ""


def _assert_nothing_left(tag: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while (left := _carriers(tag)) and time.monotonic() < deadline:
        time.sleep(0.5)
    cmds = [_cmdline(pid)[:120] for pid in left]
    assert not left, f"processes left behind: {cmds}"


class _Cli:
    """``python -m launch COMMAND ARGS`` (``run`` unless said) in its own session, stderr read line
    by line."""

    def __init__(self, *args: str, command: str = "run") -> None:
        self.tag = uuid.uuid4().hex
        env = {**os.environ, "OMP_NUM_THREADS": "1", MARKER: self.tag,
               "PYTHONPATH": checkout_first(REPO)}
        env.pop("RAY_ADDRESS", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "launch", command, *args], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)
            self.lines.put(line)

    def wait_for(self, text: str | re.Pattern[str], timeout_s: float) -> None:
        """Wait for a stderr line not yet waited past that holds ``text`` (or matches it)."""
        found = text.search if isinstance(text, re.Pattern) else (lambda line: text in line)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if found(self.lines.get(timeout=max(0.0, deadline - time.monotonic()))):
                    return
            except queue.Empty:
                break
        self.kill()
        pytest.fail(f"no {text!r} on stderr within {timeout_s} s:\n{''.join(self.err)[-3000:]}")

    def wait_until(self, done: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.kill()
                pytest.fail(f"no {what} within {timeout_s} s (exit code {self.proc.poll()}):\n"
                            f"{''.join(self.err)[-3000:]}")
            time.sleep(0.05)

    def ray_server_started(self) -> bool:
        """A process of Ray's own (GCS, raylet, agents) carries the marker: ``ray.init`` has
        started the node, so ``import ray`` is over and the interrupt lands inside the init."""
        return any("/ray/" in _cmdline(pid) for pid in _carriers(self.tag) if pid != self.proc.pid)

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)  # the whole foreground group, as a terminal does

    def finish(self, timeout_s: float) -> tuple[int, str, str]:
        try:
            out = self.proc.stdout.read() if self.proc.wait(timeout_s) is not None else ""
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the command did not end within {timeout_s} s:\n{''.join(self.err)[-3000:]}")
        time.sleep(0.2)  # the reader thread drains stderr
        return self.proc.returncode, out, "".join(self.err)

    def kill(self) -> None:
        for pid in _carriers(self.tag):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)  # only what this test started (the marker)


def test_full_run_counts_ray_start_in_wall_time_and_leaves_nothing(tmp_path):
    cli = _Cli("--requests", "4", "--max-new-tokens", "4", "--num-cpus", "2", "--json")
    code, out, err = cli.finish(240)
    assert code == 0, err[-3000:]
    obj = json.loads(out.strip().splitlines()[-1])
    assert obj["ray_start_s"] > 0 and obj["setup_s"] > 0 and obj["run_s"] > 0
    assert obj["wall_s"] >= obj["ray_start_s"] + obj["setup_s"] + obj["run_s"]
    _assert_nothing_left(cli.tag)


@pytest.mark.parametrize("when", ["starting Ray", "running"])
def test_ctrl_c_exits_130_and_leaves_nothing(when):
    # Long enough that the run is still going when the interrupt lands.
    cli = _Cli("--requests", "16", "--max-new-tokens", "1000", "--prompt-len", "8", "--num-cpus", "2")
    if when == "starting Ray":
        cli.wait_for("dp-runtime: starting Ray", timeout_s=180)
        cli.wait_until(cli.ray_server_started, "Ray server process", timeout_s=180)
    else:
        cli.wait_for("dp-runtime: running", timeout_s=300)
        cli.wait_for(_TOKENS_MADE, timeout_s=300)
    assert len(_carriers(cli.tag)) >= 2  # the marker does find what the command started
    cli.ctrl_c()
    code, _, err = cli.finish(120)
    assert code == 130, err[-3000:]
    assert "interrupted" in err and "Traceback" not in err and "Segmentation fault" not in err, err[-3000:]
    if when == "starting Ray":
        assert "dp-runtime: placing" not in err, err[-3000:]  # it landed before Ray was up
    _assert_nothing_left(cli.tag)


def test_sigterm_while_ray_starts_exits_143_and_leaves_nothing():
    """SIGTERM to the `run` process alone (what a supervisor or `timeout` sends) while `ray.init`
    starts the private cluster: held until the start is over (Ray's own handler would exit at
    once and leave its agents running), then the cluster stops; exit 143, no traceback, no Ray
    signal dump, nothing left."""
    cli = _Cli("--requests", "4", "--max-new-tokens", "4", "--num-cpus", "2")
    cli.wait_for("dp-runtime: starting Ray", timeout_s=180)
    cli.wait_until(cli.ray_server_started, "Ray server process", timeout_s=180)
    cli.proc.send_signal(signal.SIGTERM)
    code, _, err = cli.finish(120)
    assert code == 143, err[-3000:]
    assert "terminated" in err and "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]
    assert "dp-runtime: placing" not in err, err[-3000:]  # it landed in Ray's start
    _assert_nothing_left(cli.tag)


def _listening(pids: list[int]) -> set[tuple[str, int]]:
    """The (address, port) pairs ``pids`` listen on (TCP, IPv4 and IPv6)."""
    import psutil

    found = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):  # a process that exited meanwhile
            found |= {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
                      if c.status == psutil.CONN_LISTEN}
    return found


def test_sigterm_while_a_servers_private_ray_cluster_starts_exits_0_and_leaves_nothing():
    """`serve --dp 2` on a private cluster, SIGTERM (what a supervisor sends: the process alone,
    not its group) while `ray.init` starts the cluster: the start stops the cluster it brought up,
    the command exits 0 (docs/serve.md) with no traceback or Ray signal dump, and no process it
    started and no socket they listened on is left."""
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("uvicorn")
    from tests.support.serve_process import free_port

    cli = _Cli("--model", "tiny", "--dp", "2", "--port", str(free_port()), command="serve")
    cli.wait_for("[dp-runtime serve] starting Ray", timeout_s=180)
    cli.wait_until(cli.ray_server_started, "Ray server process", timeout_s=180)
    sockets = _listening(_carriers(cli.tag))
    cli.proc.send_signal(signal.SIGTERM)
    code, _, err = cli.finish(120)
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "SIGTERM received" not in err, err[-3000:]  # Ray's C++ dump
    assert "[dp-runtime serve] placing" not in err, err[-3000:]  # it landed in Ray's start
    assert "[dp-runtime serve] stopped" in err, err[-3000:]
    _assert_nothing_left(cli.tag)
    assert sockets, "the Ray server's listening sockets were never seen"
    still = {(c.laddr.ip, c.laddr.port) for c in psutil.net_connections("inet")
             if c.status == psutil.CONN_LISTEN} & sockets
    assert not still, f"still listening after the exit: {sorted(still)}"
