"""The README's multi-node block on one machine (slow tier, ~1-2 min): a head node and a second
node that joins it, both in token-auth mode with the same token (two raylets, each with its own
ports), then ``dp-runtime run --ray-address HEAD:PORT --dp 4`` from the head's environment:
4 ranks span both nodes, the report names each rank's node, and every request is served. A
client with the wrong token is refused in one line naming the authentication failure (exit 2).

Isolation as in test_launch_job_submit: own HOME (the token), own temp dir and free ports, each
node started with ``ray start --block`` in its own session and stopped by signalling it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.ports import free_ports
from tests.support.pythonpath import checkout_first

pytest.importorskip("ray")

REPO = Path(__file__).resolve().parents[1]
RAY = shutil.which("ray")


def _readme_join_lines() -> list[str]:
    """The README's multi-node block (the one with ``ray start --address``), comments dropped."""
    text = (REPO / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        if "ray start --address" in block:
            return [ln.split("#")[0].strip() for ln in block.splitlines() if ln.split("#")[0].strip()]
    raise AssertionError("README.md has no multi-node block (ray start --address)")


def _start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = open(log, "w")  # noqa: SIM115 - the child holds it; closed with the process
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)  # `ray start --block` drains its node and ends its processes
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test created, nothing else
        proc.wait(10)


def _node_ports(*names: str) -> list[str]:
    ports = free_ports(len(names))
    return [arg for name, port in zip(names, ports, strict=True) for arg in (name, str(port))]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A token-auth head (2 CPUs) and a second node (2 CPUs) joined to it as the README says;
    yields ``(address, env)``."""
    lines = _readme_join_lines()
    join = [ln for ln in lines if ln.startswith("RAY_AUTH_MODE=token ray start --address")]
    run = [ln for ln in lines if "dp-runtime run --ray-address" in ln]
    assert len(join) == 1 and len(run) == 1, lines
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
    env = {**os.environ, "HOME": str(home), "RAY_AUTH_MODE": "token", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": checkout_first(REPO)}
    for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(var, None)
    temp = tempfile.mkdtemp(prefix="dprm", dir="/tmp")  # Ray's unix sockets: keep the path short
    (gcs,) = free_ports(1)
    common = ["--block", "--disable-usage-stats", "--num-cpus", "2", "--num-gpus", "0"]
    head = _start([RAY, "start", "--head", "--port", str(gcs), "--include-dashboard=false", "--temp-dir", temp,
                   *common, *_node_ports("--node-manager-port", "--object-manager-port",
                                         "--metrics-export-port", "--runtime-env-agent-port",
                                         "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port")],
                  env, Path(temp) / "head.log")
    nodes = [head]
    try:
        address = f"127.0.0.1:{gcs}"
        _wait_for(lambda: subprocess.run([RAY, "status", "--address", address], env=env, capture_output=True,
                                         timeout=60).returncode == 0, head, timeout_s=90)
        # The README's join line, as written, with this node's own ports (two raylets, one machine).
        argv = join[0].replace("HEAD_IP", "127.0.0.1").replace(":6379", f":{gcs}").split()[1:]
        for attempt in (1, 2):
            # Ports picked free can be taken before the raylet binds them (Ray's own workers
            # take ports too): a node that exits at start is started once more on fresh ones.
            log = Path(temp) / f"node{attempt}.log"
            nodes.append(_start([*argv, *common, *_node_ports(
                "--node-manager-port", "--object-manager-port", "--metrics-export-port",
                "--runtime-env-agent-port", "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port")],
                env, log))
            try:
                _wait_for(lambda: _alive_nodes(address, env) >= 2, nodes[-1], timeout_s=90)
                break
            except AssertionError as e:
                if attempt == 2 or nodes[-1].poll() is None:
                    raise AssertionError(f"{e}; its log ends:\n{log.read_text()[-2000:]}") from None
        yield address, env, run[0]
    finally:
        for proc in reversed(nodes):
            _stop(proc)
        shutil.rmtree(temp, ignore_errors=True)


def _alive_nodes(address: str, env: dict[str, str]) -> int:
    done = subprocess.run([RAY, "status", "--address", address], env=env, capture_output=True, text=True,
                          timeout=60)
    return len(re.findall(r"^\s*1 node_", done.stdout, flags=re.M)) if done.returncode == 0 else 0


def _wait_for(ready, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ray start exited with {proc.returncode}"
        if ready():
            return
        time.sleep(1.0)
    raise AssertionError(f"not ready within {timeout_s} s")


@pytest.mark.skipif(RAY is None, reason="the ray CLI is not installed")
def test_readme_multi_node_block_runs_ranks_on_both_nodes(two_nodes):
    address, env, line = two_nodes
    argv = line.replace("HEAD_IP", "127.0.0.1").replace(":6379", ":" + address.rsplit(":", 1)[1]).split()
    assert argv[:2] == ["RAY_AUTH_MODE=token", "dp-runtime"]
    cmd = [sys.executable, "-m", "launch", *argv[2:], "--requests", "8", "--max-new-tokens", "4", "--json"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["world_size"] == 4 and out["served"] == 8 and out["failed"] == 0
    assert sorted(out["nodes"]) == ["0", "1", "2", "3"] and all(out["nodes"].values())


@pytest.mark.skipif(RAY is None, reason="the ray CLI is not installed")
def test_a_wrong_token_is_named(two_nodes):
    address, env, _ = two_nodes
    bad = {**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    cmd = [sys.executable, "-m", "launch", "run", "--ray-address", address, "--requests", "1"]
    done = subprocess.run(cmd, cwd=REPO, env=bad, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-4000:]
    assert f"cannot join the Ray cluster at {address}" in errors[0] and "token" in errors[0].lower(), errors
