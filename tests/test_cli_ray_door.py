"""`dp-runtime run` and Ray (issue 26 item 5, issue 28 item 3, issue 45 item 2): the private
cluster a run or a server starts listens on loopback only (GCS, raylet, agents, workers, the ranks'
process-group store and gloo), after a gang restart too; a run names each rank's node and shows
the ranks' own logs at --log-level; an address nothing answers at is named with its cause at
once (Ray alone retries for minutes and drops the cause)."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from launch.cli import main  # noqa: E402
from tests.support.serve_process import ServeProcess, get  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
ENV.pop("RAY_ADDRESS", None)


def _post(url: str, body: dict):
    """(status, headers (case-insensitive), body) of a JSON POST; an HTTP error status is
    returned, not raised."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read().decode()


def _listening(procs) -> set[tuple[str, int, str]]:
    found = set()
    for p in procs:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.add((c.laddr.ip, c.laddr.port, p.name()))
        except psutil.Error:
            pass  # a worker that exited meanwhile
    return found


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    mapped = getattr(addr, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return (mapped or addr).is_loopback


def _tree_sockets(root: psutil.Process) -> set[tuple[str, int, str]]:
    """Every listening socket of ``root`` and every process under it (Ray's GCS, raylet and
    agents are the driver's children, its workers the raylet's)."""
    return _listening([root, *root.children(recursive=True)])


def _ranks_listen(sockets) -> bool:
    return any("RankActor" in name for _, _, name in sockets)


def _assert_loopback_only(sockets) -> None:
    wide = sorted(s for s in sockets if not _is_loopback(s[0]))
    assert not wide, f"listening beyond loopback: {wide}"


private_only = pytest.mark.skipif(os.environ.get("RAY_ADDRESS"),
                                  reason="inside a Ray job the job's cluster is joined")


@private_only
def test_a_private_run_listens_on_loopback_only_store_included(tmp_path):
    """Every listening socket of every process `run --dp 2` starts (Ray's servers, its workers,
    the ranks' TCPStore and gloo listeners), sampled until the run exits: loopback only."""
    cmd = [sys.executable, "-m", "launch", "run", "--dp", "2", "--requests", "16",
           "--max-new-tokens", "16", "--json"]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    root, seen = psutil.Process(proc.pid), set()
    while proc.poll() is None:
        seen |= _tree_sockets(root)
        time.sleep(0.25)
    assert proc.returncode == 0, log.read_text()[-3000:]
    names = {name for _, _, name in seen}
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), seen
    assert _ranks_listen(seen), f"the ranks' listeners were never seen: {seen}"
    _assert_loopback_only(seen)


@private_only
def test_serve_on_a_private_cluster_listens_on_loopback_only_after_a_gang_restart(tmp_path):
    """`serve --dp 2`: the same before and after a killed rank restarts the gang (the new
    gang's store is a new socket, on loopback too); while it restarts, /health and new requests
    answer 503 with their reason, then the new gang serves."""
    with ServeProcess(tmp_path, "--dp", "2", env={"OMP_NUM_THREADS": "1"}) as srv:
        root = psutil.Process(srv.proc.pid)
        first = _tree_sockets(root)
        assert _ranks_listen(first), first
        _assert_loopback_only(first)
        ranks = [p for p in root.children(recursive=True) if "RankActor" in p.name()]
        assert len(ranks) == 2, ranks
        ranks[1].kill()
        during = []  # what a load balancer saw while the gang restarted (issue 45 item 4)
        for _ in range(1200):
            health = get(srv.url + "/health")
            if health[0] != 200:
                during.append((health, _post(srv.url + "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})))
            if srv.metrics().get(("dp_runtime_restarts_total", ())) == 1.0 and health[0] == 200:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the gang did not restart:\n{srv.log()[-3000:]}")
        # Between the kill and the new gang: /health 503 naming the state, new requests 503
        # with Retry-After and OpenAI's error object (never a bare 500, never text/plain).
        assert during, "the restart was never seen from /health"
        for (code, body), (status, headers, answer) in during:
            assert code == 503 and json.loads(body)["status"] in ("restarting", "failed"), body
            assert status == 503 and headers.get("Retry-After"), (status, headers, answer)
            assert headers.get("Content-Type", "").startswith("application/json")
            assert json.loads(answer)["error"]["code"], answer
        assert any(json.loads(body)["status"] == "restarting" for (_, body), _ in during), during
        ok = _post(srv.url + "/v1/completions", {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2})
        assert ok[0] == 200, ok
        again = _tree_sockets(root)
        new_ranks = {p.pid for p in root.children(recursive=True) if "RankActor" in p.name()}
        assert new_ranks and not new_ranks & {p.pid for p in ranks}, (new_ranks, ranks)
        assert _ranks_listen(again), again
        _assert_loopback_only(again)
    assert srv.returncode == 0, srv.log()[-3000:]


def test_an_address_nothing_answers_at_is_named_at_once(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free once closed: nothing listens there
    with pytest.raises(SystemExit) as info:
        main(["run", "--ray-address", f"127.0.0.1:{port}", "--requests", "1"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"error: cannot join the Ray cluster at 127.0.0.1:{port}: nothing answers at 127.0.0.1:{port} " \
           f"(Connection refused)" in err, err
    assert not ray.is_initialized()


@pytest.mark.skipif(os.environ.get("RAY_ADDRESS"), reason="inside a Ray job the job's cluster is joined")
def test_ray_run_names_rank_nodes_and_shows_rank_logs_at_log_level():
    cmd = [sys.executable, "-m", "launch", "run", "--requests", "2", "--max-new-tokens", "2", "--num-cpus", "2",
           "--log-level", "info", "--json"]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["served"] == 2 and sorted(out["nodes"]) == ["0", "1"]
    assert all(node.startswith("127.0.0.1") for node in out["nodes"].values()), out["nodes"]
    # The dispatcher is built inside the rank actors: its INFO line comes from a Ray worker.
    rank_lines = [ln for ln in done.stderr.splitlines() if "RankActor" in ln and "MoE dispatcher:" in ln]
    assert rank_lines and "INFO dispatcher" in rank_lines[0], done.stderr[-3000:]
