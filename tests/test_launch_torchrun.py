"""The torchrun entry: the same rank code (RankSession over RankWorker) under torchrun gives the
tokens of world size 1, in-process (dist tier) and through ``launch.torchrun_main`` (a
2-process torchrun from the unit tier)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from launch import torchrun_main
from launch.run_config import RunConfig
from launch.torchrun_main import run_torchrun
from tests.support.engine_runs import run_local
from tests.support.pythonpath import checkout_first

REPO = Path(__file__).resolve().parents[1]


def _reference(cfg: RunConfig) -> dict[str, tuple[int, ...]]:
    one = RunConfig(**{**cfg.__dict__, "dp": 1})
    return {r.rid: r.output_ids for r in run_local(one.spec("cpu"), one.load_requests()).results}


@pytest.mark.dist
def test_run_torchrun_matches_world_size_one(dist_group):
    world, rank = dist.get_world_size(), dist.get_rank()
    # One request more than a multiple of the world: ranks get uneven shares and idle-step along.
    cfg = RunConfig(dp=world, requests=2 * world + 1, prompt_len=10, max_new_tokens=6, max_running_requests=4,
                    chunked_prefill_size=64, dp_sync_timeout_s=30.0)
    report = run_torchrun(cfg.spec("cpu"), cfg.load_requests())
    if rank != 0:
        assert report is None
        return
    assert report.world_size == world and len(report.rank_metrics) == world
    assert [r.rid for r in report.results] == [r.rid for r in cfg.load_requests()]
    assert {r.rid: r.rank for r in report.results} == {f"r{i:04d}": i % world for i in range(2 * world + 1)}
    assert {r.rid: r.output_ids for r in report.results} == _reference(cfg)


@pytest.mark.dist
def test_run_torchrun_refuses_a_duplicate_rid_on_every_rank(dist_group):
    # Before: both "r0001" ran (on different ranks); one result was reported twice, one lost.
    cfg = RunConfig(dp=dist.get_world_size(), requests=3, prompt_len=6, max_new_tokens=2, dp_sync_timeout_s=30.0)
    reqs = cfg.load_requests()
    with pytest.raises(ValueError, match=r"duplicate request ids .*\['r0001'\]"):
        run_torchrun(cfg.spec("cpu"), [*reqs, reqs[1]])
    dist.barrier()  # raised before any collective, on every rank alike


@pytest.mark.parametrize("error, code", [(RuntimeError("the step loop raised"), None), (ValueError("bad rid"), 2)])
def test_torchrun_main_aborts_the_group_after_a_failure(monkeypatch, capsys, error, code):
    # A plain destroy waits for the peers, and one stuck in an NCCL collective never comes:
    # after a failure the group is aborted; the exit code and the user-error line stay as they were.
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    aborts = []
    monkeypatch.setattr(torchrun_main.process_group, "destroy_process_group", lambda abort=False: aborts.append(abort))

    def failing_run(spec, requests):
        raise error

    monkeypatch.setattr(torchrun_main, "run_torchrun", failing_run)
    argv = ["--requests", "2", "--device", "cpu"]
    if code is None:
        with pytest.raises(RuntimeError, match="the step loop raised"):
            torchrun_main.main(argv)
    else:
        assert torchrun_main.main(argv) == code
        assert capsys.readouterr().err == "error: rank 0: bad rid\n"
    assert aborts == [True]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_torchrun_main_two_processes():
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "launch.torchrun_main",
           "--requests", "5", "--max-new-tokens", "4", "--device", "cpu", "--json", "--results"]
    # The repository first on the path, as in an editable install (the children import launch.*).
    path = checkout_first(REPO)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, done.stdout  # rank 0 alone prints
    out = json.loads(lines[0])
    assert out["launcher"] == "torchrun" and out["world_size"] == 2 and out["requests"] == 5
    assert out["per_rank_requests"] == {"0": 3, "1": 2}
    ref = _reference(RunConfig(requests=5, max_new_tokens=4))
    assert out["results"] == {rid: list(ids) for rid, ids in ref.items()}
