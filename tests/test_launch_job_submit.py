"""RAY JOB SUBMIT (slow tier of the CPU unit run, ~30 s): the README's lines, as written, on a
machine that has just run the Quickstart.

The README's block is read from README.md and run line by line: its ``export`` lines set the
environment, its ``ray get-auth-token`` line runs as written, and its ``ray job submit`` line
runs exactly as written. Two things differ, both for isolation: ``ray start --head`` becomes a
private head node (``--block`` in its own session, own temp dir and free ports, so it neither
joins nor disturbs another Ray instance on the machine; same environment as the README's line
would have), and the job client is pointed at that head's dashboard by RAY_API_SERVER_ADDRESS
(which Ray's job client honours over ``--address``). ``ray stop`` is replaced by signalling
the head this test started.

HOME is a temporary directory holding ``.ray/auth_token``, the state the Quickstart leaves
behind (its ``ray.init()`` writes one): with it, Ray 2.60's ``ray start --head`` turns token
authentication on, and a job client that is not in token mode fails with an
AuthenticationError. The README's lines must work anyway.

A second test runs ``python -m launch run --dp 2 --requests 4 --device cpu --json --results``
the same way and checks every request's tokens against an in-process world-size-1 run.
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
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("ray")
pytest.importorskip("aiohttp")  # ray[default]: the dashboard and its job server

from launch.run_config import RunConfig
from tests.support.engine_runs import run_local
from tests.support.ports import free_ports

REPO = Path(__file__).resolve().parents[1]
RAY = shutil.which("ray")


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


def readme_job_lines() -> list[str]:
    """The lines of the README's code block that holds ``ray job submit`` (comments dropped)."""
    text = (REPO / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        if "ray job submit" in block:
            return [ln.split("  #")[0].strip() for ln in block.splitlines() if ln.strip()]
    raise AssertionError("README.md has no ray job submit block")


@pytest.fixture(scope="module")
def head_node(tmp_path_factory):
    """The README's environment and token lines, then a private head node with the dashboard (the
    job server lives there); yields ``(url, env, submit_line)``."""
    home = tmp_path_factory.mktemp("home")
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))  # what the Quickstart leaves
    env = {**os.environ, "HOME": str(home)}
    for var in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_API_SERVER_ADDRESS"):
        env.pop(var, None)
    lines = readme_job_lines()
    submit = [ln for ln in lines if ln.startswith("ray job submit")]
    assert len(submit) == 1 and any(ln.startswith("ray start --head") for ln in lines), lines
    for line in lines:
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value
        elif line.startswith("ray get-auth-token"):
            subprocess.run(["bash", "-c", line], env=env, check=True, timeout=60, capture_output=True)
    gcs, dash, client, agent_http, agent_grpc, metrics, env_agent = free_ports(7)
    # Short path: Ray's unix sockets live under the temp dir and must stay under 108 bytes.
    temp = tempfile.mkdtemp(prefix="dprt", dir="/tmp")
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
        yield url, env, submit[0]
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


def _submit(line: str, url: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", line], cwd=REPO, env={**env, "RAY_API_SERVER_ADDRESS": url},
                          capture_output=True, text=True, timeout=240)


def _summary(done: subprocess.CompletedProcess) -> dict:
    logs = done.stdout + done.stderr
    assert done.returncode == 0, logs[-4000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{") and '"submitted"' in ln]
    assert lines, f"no JSON summary in the job's output:\n{logs[-4000:]}"
    return json.loads(lines[-1])


@pytest.mark.skipif(RAY is None, reason="the ray CLI is not installed")
def test_readme_ray_job_submit_line_works_as_written(head_node):
    url, env, line = head_node
    out = _summary(_submit(line, url, env))
    assert out["launcher"] == "ray" and out["world_size"] == 2 and out["restarts"] == 0
    assert out["submitted"] == out["requests"] and out["output_tokens"] > 0


@pytest.mark.skipif(RAY is None, reason="the ray CLI is not installed")
def test_ray_job_submit_runs_the_cli_with_world_size_one_tokens(head_node):
    url, env, _ = head_node
    line = ("ray job submit --working-dir . -- python -m launch run --dp 2 --requests 4 --device cpu "
            "--json --results")
    out = _summary(_submit(line, url, env))
    assert out["submitted"] == out["requests"] == 4
    assert out["launcher"] == "ray" and out["world_size"] == 2 and out["restarts"] == 0
    assert out["per_rank_requests"] == {"0": 2, "1": 2}
    cfg = RunConfig(dp=1, requests=4)
    reference = run_local(cfg.spec("cpu"), cfg.load_requests())
    assert out["results"] == {r.rid: list(r.output_ids) for r in reference.results}


def test_python_dash_m_launch_is_the_cli():
    done = subprocess.run([sys.executable, "-m", "launch", "--version"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("dp-runtime ")
