"""RAY JOB SUBMIT (slow tier of the CPU unit run, ~25 s): the README's command against a local
head node.

Starts a private head node (``ray start --head --block`` in its own session, its own temp dir
and free ports, so it neither joins nor disturbs another Ray instance on the machine), submits
``python -m launch run --dp 2 --requests 4 --device cpu --json --results`` with
``--working-dir .``, checks
that the job printed the JSON of a run in which every request finished with the tokens of an
in-process world-size-1 run, then stops the head by signalling the process it started.

Token auth: Ray 2.60 turns token authentication on for a head node when ~/.ray/auth_token
exists (any earlier ``ray.init`` writes one), and the job CLI then needs RAY_AUTH_MODE=token.
The test sets RAY_AUTH_MODE=token and a fresh RAY_AUTH_TOKEN for the head and the client alike
(the job and its actors inherit them from the head), so it behaves the same on a fresh machine
and after other tests, and writes no token file.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("aiohttp")  # ray[default]: the dashboard and its job server

from launch.local_launcher import launch_local
from launch.run_config import RunConfig

REPO = Path(__file__).resolve().parents[1]
RAY = shutil.which("ray")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_http(url: str, head: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # the server answers (maybe 401 before the token): it is up
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"the dashboard at {url} did not answer within {timeout_s} s")


@pytest.fixture
def head_node():
    """A private head node with the dashboard (the job server lives there); yields its URL."""
    gcs, dash, client, agent_http, agent_grpc, metrics, env_agent = _free_ports(7)
    # Short path: Ray's unix sockets live under the temp dir and must stay under 108 bytes.
    temp = tempfile.mkdtemp(prefix="dprt", dir="/tmp")
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    log = open(Path(temp) / "head.log", "w")  # noqa: SIM115 - closed in the teardown below
    cmd = [RAY, "start", "--head", "--block", "--disable-usage-stats", "--num-cpus", "4", "--num-gpus", "0",
           "--port", str(gcs), "--include-dashboard=true", "--dashboard-host", "127.0.0.1",
           "--dashboard-port", str(dash), "--ray-client-server-port", str(client),
           "--dashboard-agent-listen-port", str(agent_http), "--dashboard-agent-grpc-port", str(agent_grpc),
           "--metrics-export-port", str(metrics), "--runtime-env-agent-port", str(env_agent), "--temp-dir", temp]
    head = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        _wait_http(f"{url}/api/version", head, timeout_s=60)
        yield url, env
    finally:
        # SIGTERM to `ray start --block` drains the node and ends every process it started.
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)  # the session this test created, nothing else
            head.wait(10)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.skipif(RAY is None, reason="the ray CLI is not installed")
def test_ray_job_submit_runs_the_cli(head_node):
    url, env = head_node
    cmd = [RAY, "job", "submit", "--address", url, "--working-dir", ".", "--",
           "python", "-m", "launch", "run", "--dp", "2", "--requests", "4", "--device", "cpu", "--json", "--results"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    logs = done.stdout + done.stderr
    assert done.returncode == 0, logs[-4000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{") and '"submitted"' in ln]
    assert lines, f"no JSON summary in the job's output:\n{logs[-4000:]}"
    out = json.loads(lines[-1])
    assert out["submitted"] == out["requests"] == 4
    assert out["launcher"] == "ray" and out["world_size"] == 2 and out["restarts"] == 0
    assert out["per_rank_requests"] == {"0": 2, "1": 2}
    cfg = RunConfig(dp=1, requests=4)
    reference = launch_local(cfg.spec("cpu"), cfg.load_requests())
    assert out["results"] == {r.rid: list(r.output_ids) for r in reference.results}


def test_python_dash_m_launch_is_the_cli():
    done = subprocess.run([sys.executable, "-m", "launch", "--version"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("dp-runtime ")
