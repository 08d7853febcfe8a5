"""`dp-runtime run`'s driver (``engine_run.run_requests``: a batch through the Engine) on Ray's own
two-node test cluster on this machine (one per module, 2 CPUs a node): 2 ranks over gloo give the
tokens of world size 1 and report their start-up phases and token counts; 4 ranks span both
nodes, node by node, with the tokens of world size 1, and killing every rank of one node
restarts the gang with every request answered once; a killed rank actor is restarted with the
gang and its requests are submitted again; a hung or failing rank (a real worker with a fault
injected) is named; the CLI's Ray path; the serving benchmark's Ray path."""

from __future__ import annotations

import json
import time

import pytest

ray = pytest.importorskip("ray")

from typer.testing import CliRunner  # noqa: E402

from dp_runtime.rank_spec import RankSpec  # noqa: E402
from launch.cli import app  # noqa: E402
from launch.run_config import RunConfig  # noqa: E402
from launch.run_report import GangFailedError  # noqa: E402
from tests.support.engine_runs import run_local, run_ray  # noqa: E402

# Long enough that a kill lands mid-run: each rank runs 16 requests 2 at a time, 8 waves of 32
# decode steps, while the first results arrive after the first wave.
CFG = RunConfig(dp=2, requests=32, prompt_len=12, max_new_tokens=32, max_running_requests=2,
                chunked_prefill_size=64, dp_sync_timeout_s=10.0)


@pytest.fixture(scope="module")
def cluster():
    """Two nodes of 2 CPUs each (Ray's multi-node test cluster, all on this machine): a gang of
    2 fits one node (STRICT_PACK), a gang of 4 spans both. The head node also holds this
    machine's GPUs, so the GPU test's gang of {GPU: 1} bundles packs onto it."""
    import torch
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 2, "num_gpus": torch.cuda.device_count(), "include_dashboard": False}
    nodes = Cluster(initialize_head=True, head_node_args=head)
    nodes.add_node(num_cpus=2)
    nodes.wait_for_nodes()
    ray.init(address=nodes.address, configure_logging=False)
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture(scope="module")
def reference():
    """Tokens of every request at world size 1, in this process."""
    one = RunConfig(**{**CFG.__dict__, "dp": 1, "max_running_requests": 32})
    report = run_local(one.spec("cpu"), one.load_requests())
    return {r.rid: r.output_ids for r in report.results}


def test_two_ranks_give_the_tokens_of_one(cluster, reference):
    cfg = RunConfig(**{**CFG.__dict__, "requests": 8, "max_new_tokens": 8, "max_running_requests": 8})
    requests = cfg.load_requests()
    phases, events, history = [], [], []

    def on_poll(event):
        events.append(event)
        if not history:
            history.extend(ray.get([a.phases.remote() for a in event.actors], timeout=20))

    report = run_ray(cfg.spec("cpu"), requests, max_restarts=0, on_poll=on_poll, on_phase=phases.append)
    assert [r.rid for r in report.results] == [r.rid for r in requests]
    assert {r.rank for r in report.results} == {0, 1}
    # Start-up phases from the driver and from the ranks while they set up, then the run.
    assert phases[:2] == ["starting Ray (a private local cluster, 2 CPUs)", "placing 2 ranks"], phases
    assert phases[-1] == "running", phases
    assert any(p.startswith("ranks: ") for p in phases), phases  # sampled while they set up
    assert history == [("starting", "joining the process group", "loading weights", "warming up the dispatcher",
                        "ready")] * 2
    assert events[-1].tokens == events[-1].total_tokens == 64
    assert [e.tokens for e in events] == sorted(e.tokens for e in events)
    # Greedy decoding of the same model: same tokens whatever the world size (a prefix of the
    # reference's 32 tokens, since only 8 were asked for here).
    for r in report.results:
        assert r.output_ids == reference[r.rid][:8], r.rid
    assert report.restarts == 0 and report.failures == ()
    assert all(m["finished_requests"] == 4 for m in report.rank_metrics)


def test_killed_rank_restarts_the_gang_and_every_request_finishes_once(cluster, reference):
    killed = {}

    def on_poll(event):
        if not killed and event.finished >= 2:
            killed["pid"] = ray.get(event.actors[1].health.remote())["pid"]
            killed["finished"] = event.finished
            ray.kill(event.actors[1], no_restart=True)  # a real actor death

    requests = CFG.load_requests()
    t = time.perf_counter()
    report = run_ray(CFG.spec("cpu"), requests, max_restarts=2, on_poll=on_poll)
    assert killed, "the run ended before the kill"
    assert killed["finished"] < len(requests), "the kill came after the last result"
    assert report.restarts == 1
    primary = [f for f in report.failures if not f.secondary]
    assert [(f.attempt, f.rank, f.kind) for f in primary] == [(0, 1, "died")]
    assert "ray.kill" in primary[0].message
    # Exactly once, in request order, with the undisturbed tokens.
    assert [r.rid for r in report.results] == [r.rid for r in requests]
    assert {r.rid: r.output_ids for r in report.results} == reference
    print(f"kill test: {time.perf_counter() - t:.1f} s, failures: {[f.describe() for f in report.failures]}")


def test_ranks_span_two_nodes_node_by_node_and_survive_losing_a_node(cluster, reference):
    """4 ranks on two 2-CPU nodes: ranks 0-1 on one node, 2-3 on the other, the tokens of world
    size 1; SIGKILL both ranks of the second node mid-run: the gang restarts and every request
    is answered once, with the same tokens."""
    import os
    import signal

    cfg = RunConfig(**{**CFG.__dict__, "dp": 4})
    requests = cfg.load_requests()
    seen = {}

    def on_poll(event):
        if event.attempt == 0 and "nodes" not in seen:
            where = ray.get([a.where.remote() for a in event.actors], timeout=20)
            seen["nodes"] = [w["node_id"] for w in where]
            seen["pids"] = [w["pid"] for w in where]
        if event.attempt == 0 and "killed" not in seen and event.finished >= 2:
            node = seen["nodes"][3]
            seen["killed"] = [r for r in range(4) if seen["nodes"][r] == node]
            seen["finished"] = event.finished
            for r in seen["killed"]:
                os.kill(seen["pids"][r], signal.SIGKILL)  # every rank process of that node dies

    report = run_ray(cfg.spec("cpu"), requests, max_restarts=1, on_poll=on_poll)
    nodes = seen["nodes"]
    assert len(set(nodes)) == 2 and nodes[0] == nodes[1] and nodes[2] == nodes[3], nodes
    assert seen["killed"] == [2, 3] and seen["finished"] < len(requests)
    assert report.restarts == 1
    assert {f.rank for f in report.failures if not f.secondary} <= {2, 3}
    assert [r.rid for r in report.results] == [r.rid for r in requests]
    assert {r.rid: r.output_ids for r in report.results} == reference


def _faulty_factory(mode: str):
    """A worker factory shipped to the actors by value (defined in a function, so cloudpickle
    does not need this test module on the actors' path): real RankWorkers, rank 1's with a fault.
    ``setup``: rank 1 cannot build; ``hang`` / ``raise``: rank 1's first step with a request of
    its own never returns / raises (its peers then wait in that step's collective)."""
    import threading

    def make(spec, rank, world):
        from dp_runtime.rank_worker import RankWorker

        if rank == 1 and mode == "setup":
            raise MemoryError("rank 1 cannot build its worker")
        worker = RankWorker(spec, rank=rank, world_size=world)
        if rank == 1:
            step = worker.step

            def faulty_step():
                if worker.scheduler.num_waiting or worker.scheduler.running:
                    if mode == "hang":
                        threading.Event().wait()
                    raise RuntimeError("rank 1 exploded")
                return step()

            worker.step = faulty_step
        return worker

    return make


def test_hung_rank_is_named(cluster):
    """Rank 1 stuck in a step, rank 0 in that step's collective: both named hung once their step
    counters have not moved for the hang timeout (dp_sync_timeout_s, 10 s, would end rank 0's
    wait later), and no restart is left."""
    requests = CFG.load_requests()[:4]
    with pytest.raises(GangFailedError, match=r"rank 1 .*hung: no step completed for 1.5 s") as info:
        run_ray(CFG.spec("cpu"), requests, max_restarts=0, hang_timeout_s=1.5,
                worker_factory=_faulty_factory("hang"))
    named = {(f.rank, f.kind) for f in info.value.failures}
    assert (1, "hung") in named and named <= {(0, "hung"), (1, "hung")}, named
    assert info.value.report.results == ()  # every request was in the hung steps


def test_failing_rank_is_retried_then_reported(cluster):
    requests = CFG.load_requests()[:4]
    with pytest.raises(GangFailedError, match=r"failed 2 times.*RuntimeError: rank 1 exploded") as info:
        run_ray(CFG.spec("cpu"), requests, max_restarts=1, worker_factory=_faulty_factory("raise"))
    primary = [(f.attempt, f.rank, f.kind) for f in info.value.failures if not f.secondary]
    assert primary == [(0, 1, "error"), (1, 1, "error")]
    assert "Traceback" in info.value.failures[0].detail
    assert "4 requests finished" in str(info.value)  # "k of 4 requests finished"
    rids = [r.rid for r in info.value.report.results]
    assert len(rids) == len(set(rids)) and all(r.ok for r in info.value.report.results)


def test_setup_failure_is_named(cluster):
    with pytest.raises(GangFailedError, match=r"rank 1 .*setup: setup: MemoryError: rank 1 cannot build") as info:
        run_ray(CFG.spec("cpu"), CFG.load_requests()[:2], max_restarts=0, worker_factory=_faulty_factory("setup"))
    assert [(f.rank, f.kind) for f in info.value.failures] == [(1, "setup")]
    assert info.value.report.results == ()


def test_bad_requests_cost_no_other_request_and_no_restart(cluster, reference):
    """24 requests: one refused at the door (a token id over the vocabulary), one that fails
    inside a step on its rank (its draw raises). Before: the in-step failure made the rank's loop
    raise, the gang restarted on the same request until restarts ran out, healthy ones lost."""
    from dp_runtime.serving.request import Request, SamplingParams

    cfg = RunConfig(**{**CFG.__dict__, "requests": 22, "max_new_tokens": 8, "max_running_requests": 8})
    good = cfg.load_requests()
    bad_step = Request("bad-step", good[0].prompt_ids, SamplingParams(max_new_tokens=8, temperature=1e-45))
    bad_door = Request("bad-door", (1, 2, 10_000))
    requests = [*good[:5], bad_step, *good[5:17], bad_door, *good[17:]]
    assert len(requests) == 24
    report = run_ray(cfg.spec("cpu"), requests, max_restarts=2)
    assert report.restarts == 0 and report.failures == ()
    assert [r.rid for r in report.results] == [r.rid for r in requests]
    res = {r.rid: r for r in report.results}
    assert "vocab_size=256" in res.pop("bad-door").error
    failed = res.pop("bad-step")
    assert failed.finish_reason == "error" and "sampling failed (temperature=1e-45" in failed.error
    assert failed.rank in (0, 1)  # it ran, on a rank, and failed there alone
    assert {rid: r.output_ids for rid, r in res.items()} == {r.rid: reference[r.rid][:8] for r in good}
    assert all(r.ok for r in res.values())


def test_deterministic_setup_error_is_not_retried(cluster):
    """Three ranks, two experts: every rank refuses to build (num_experts < ep_size). Before: three
    gangs over ~30 s, then GangFailedError (exit 1); now SetupError (a ValueError: exit 2) at once."""
    from launch.errors import SetupError

    spec = RankSpec.create("tiny", model_overrides={"num_experts": 2}, dp_size=3, device="cpu", dtype="float32",
                           max_running_requests=4, chunked_prefill_size=64, dp_sync_timeout_s=10.0)
    with pytest.raises(SetupError, match=r"rank \d could not be set up: ValueError: .*num_experts=2 < ep_size=3"):
        run_ray(spec, CFG.load_requests()[:3], max_restarts=2)


def test_cli_run_uses_the_connected_cluster(cluster):
    res = CliRunner().invoke(app, ["run", "--requests", "4", "--max-new-tokens", "4", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(next(ln for ln in res.output.splitlines() if ln.startswith("{")))
    assert out["launcher"] == "ray" and out["world_size"] == 2 and out["requests"] == 4
    assert out["per_rank_requests"] == {"0": 2, "1": 2}
    assert ray.is_initialized()  # the CLI did not shut down a cluster it did not start


def test_serve_load_on_ray_actors(cluster, capsys):
    """bench/serve_load.py through one gang of 2 rank actors, kept for both rates."""
    from tests.support.bench_scripts import check_serve_load_report, load_bench

    code = load_bench("serve_load").main(["--launcher", "ray", "--dp", "2", "--device", "cpu", "--num-requests", "6",
                                          "--rates", "30,inf", "--lengths", "random:12:3", "--max-running-requests",
                                          "2", "--warmup", "0", "--json", "--per-request"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    assert report["header"]["launcher"] == "ray"
    check_serve_load_report(report, rates=2, per_rate=6, out_len=3, world=2, max_running=2)
    assert ray.is_initialized()  # the bench did not shut down a cluster it did not start

@pytest.mark.gpu
def test_two_gpu_ranks_give_the_tokens_of_one(cluster):
    """On a machine with 2+ GPUs: {GPU: 1} bundles, NCCL + gloo, each actor on its own GPU."""
    import torch

    if torch.cuda.device_count() < 2 or ray.cluster_resources().get("GPU", 0) < 2:
        pytest.skip("needs 2 CUDA GPUs visible to Ray")
    # all_gather: NCCL between the actors without FlashInfer's MoeAlltoAll, whose first use
    # JIT-builds for minutes on a fresh machine (the model's gpu2 test covers that dispatcher).
    cfg = RunConfig(dp=2, requests=8, prompt_len=12, max_new_tokens=8, max_running_requests=8,
                    chunked_prefill_size=64, dtype="float32", dp_sync_timeout_s=30.0, dispatcher="all_gather")
    requests = cfg.load_requests()
    report = run_ray(cfg.spec("cuda"), requests, max_restarts=0, setup_timeout_s=180.0)
    one = RunConfig(**{**cfg.__dict__, "dp": 1})
    reference = run_local(one.spec("cuda"), requests)
    assert report.device == "cuda" and {r.rank for r in report.results} == {0, 1}
    assert {r.rid: r.output_ids for r in report.results} == {r.rid: r.output_ids for r in reference.results}
