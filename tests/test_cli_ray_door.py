"""`dp-runtime run` and Ray (issue 26 item 5, issue 28 item 3, issue 45 item 2): the private
cluster a run starts listens on loopback only (GCS, raylet, agents, workers, the ranks'
process-group store and gloo; a server's, after a gang restart too, is checked in
tests/test_serve_rank_killed.py); a run names each rank's node and shows
the ranks' own logs at --log-level; an address nothing answers at is named with its cause at
once (Ray alone retries for minutes and drops the cause)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

from launch.cli import main  # noqa: E402
from tests.support.listening import assert_loopback_only, ranks_listen, tree_sockets  # noqa: E402
from tests.support.pythonpath import checkout_first  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": checkout_first(REPO)}
ENV.pop("RAY_ADDRESS", None)


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
        seen |= tree_sockets(root)
        time.sleep(0.25)
    assert proc.returncode == 0, log.read_text()[-3000:]
    names = {name for _, _, name in seen}
    assert any("gcs_server" in n for n in names) and any("raylet" in n for n in names), seen
    assert ranks_listen(seen), f"the ranks' listeners were never seen: {seen}"
    assert_loopback_only(seen)


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
