"""Arrivals over time on every rank of a torchrun job (gloo): ranks whose requests arrive later
keep every rank stepping (IDLE, or waiting together between arrivals) until the last arrival
is served; every rank takes the same steps. And bench/serve_load.py on the torchrun path."""

from __future__ import annotations

import json
import time

import pytest
import torch.distributed as dist

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.support.bench_scripts import check_serve_load_report, load_bench

pytestmark = pytest.mark.dist


def test_late_arrivals_on_one_rank_keep_every_rank_stepping(dist_group):
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = RankSpec.create("tiny", dp_size=world, max_running_requests=4, chunked_prefill_size=64,
                           dtype="float32", device="cpu", max_context_len=64, dp_sync_timeout_s=30.0)
    # Rank 0 is busy at once; the last rank's requests arrive later, one after the other is done.
    arrivals = {0: [0.0], world - 1: [0.2, 0.4]}.get(rank, [])
    reqs = [Request(f"r{rank}-{i}", [1 + i, 2, 3], SamplingParams(max_new_tokens=3), arrival_s=t)
            for i, t in enumerate(arrivals)]
    with RankWorker(spec, rank=rank, world_size=world) as w:
        t0 = time.perf_counter()
        results = w.generate(reqs)
        wall = time.perf_counter() - t0
        m = w.metrics()
        w.sync.verify()
    seen = [None] * world
    dist.all_gather_object(seen, (len(results), [len(r.output_ids) for r in results], m["steps"],
                                  m["skipped_steps"], wall))
    assert [n for n, *_ in seen] == [len({0: [0.0], world - 1: [0.2, 0.4]}.get(k, [])) for k in range(world)]
    assert all(lens == [3] * n for n, lens, *_ in seen)
    assert len({(steps, skipped) for _, _, steps, skipped, _ in seen}) == 1  # the same steps everywhere
    assert all(w >= 0.4 for *_, w in seen)  # nobody left before the last arrival


def test_serve_load_on_torchrun(dist_group, capsys):
    world = dist.get_world_size()
    code = load_bench("serve_load").main(["--device", "cpu", "--num-requests", "5", "--rates", "30,inf",
                                          "--lengths", "random:12:3", "--max-running-requests", "2",
                                          "--warmup", "0", "--json", "--per-request"])
    out = capsys.readouterr().out
    assert code == 0
    if dist.get_rank() != 0:
        assert out == ""  # rank 0 alone reports
        return
    report = json.loads(out)
    assert report["header"]["launcher"] == "torchrun"
    check_serve_load_report(report, rates=2, per_rate=5, out_len=3, world=world, max_running=2)
