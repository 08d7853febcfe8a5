"""`dp-runtime run` and Ray (issue 26 item 5, issue 28 item 3): the private cluster a run starts
listens on loopback only (GCS, raylet, agents, workers); a run names each rank's node and shows
the ranks' own logs at --log-level; an address nothing answers at is named with its cause at
once (Ray alone retries for minutes and drops the cause)."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from launch.cli import main  # noqa: E402
from launch.ray_cluster import connect_ray, stop_ray  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
ENV.pop("RAY_ADDRESS", None)


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


@pytest.mark.skipif(os.environ.get("RAY_ADDRESS"), reason="inside a Ray job the job's cluster is joined")
def test_private_cluster_listens_on_loopback_only():
    me = psutil.Process()
    before = _listening([me])
    # Only what this cluster starts: an earlier test's leftovers are not this test's subject.
    older = {p.pid for p in me.children(recursive=True)}
    assert connect_ray(None, num_cpus=1)
    try:
        @ray.remote(num_cpus=1)
        class Probe:
            def ip(self) -> str:
                return ray.util.get_node_ip_address()

        actor = Probe.remote()
        assert ray.get(actor.ip.remote(), timeout=120) == "127.0.0.1"
        # This process's new servers (its core worker) and everything Ray started under it.
        ours = [p for p in me.children(recursive=True) if p.pid not in older]
        sockets = (_listening([me]) - before) | _listening(ours)
    finally:
        stop_ray()
    names = {name for _, _, name in sockets}
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), sockets
    wide = sorted(s for s in sockets if not _is_loopback(s[0]))
    assert not wide, f"listening beyond loopback: {wide}"


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
