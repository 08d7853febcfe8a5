"""The engine on a 2-rank Ray gang (a private local cluster on loopback, gloo): concurrent
requests spread over both ranks give transformers' tokens, idle ranks wake for a late request,
prompts sharing a prefix go to the rank that caches it, logprobs come back with their tokens
(streamed and whole), and a killed rank fails its in-flight requests as retryable, then the
gang comes back."""

from __future__ import annotations

import re
import time

import pytest
import torch

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request, SamplingParams
from launch.engine import Engine, EngineOptions, EngineUnavailable
from tests.hf_reference import greedy_reference, load_reference, write_tiny_checkpoint

ray = pytest.importorskip("ray")
pytest.importorskip("transformers")

NEW = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("engine_ray"))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (4, 9, 15, 6, 21, 3, 11, 8)]
    hf = load_reference(ckpt)
    return ckpt, prompts, [greedy_reference(hf, p, NEW)[0] for p in prompts]


def test_two_ranks_serve_concurrent_requests_and_survive_a_killed_rank(setup):
    ckpt, prompts, reference = setup
    spec = RankSpec.create(str(ckpt), dp_size=2, ep_size=2, max_running_requests=4, chunked_prefill_size=16,
                           dtype="float32", device="cpu", max_context_len=64)
    with Engine(spec, EngineOptions(launcher="ray", max_restarts=1, ray_num_cpus=2)).start() as eng:
        reqs = [Request(f"r{i}", p, SamplingParams(max_new_tokens=NEW)) for i, p in enumerate(prompts)]
        results = eng.generate(reqs, timeout_s=120)
        assert [list(r.output_ids) for r in results] == reference
        assert {r.rank for r in results} == {0, 1}  # least-outstanding routing used both ranks
        assert [s["routed_requests"] for s in eng.stats().ranks] == [4, 4]
        # A second start is refused before it touches Ray: no second gang, the first serves on.
        with pytest.raises(RuntimeError, match="started already"):
            eng.start()
        assert eng.health().ok and len(eng.rank_handles()) == 2

        time.sleep(0.5)  # every rank asleep; one request wakes them all
        late = eng.generate([Request("late", prompts[2], SamplingParams(max_new_tokens=NEW))], timeout_s=60)
        assert list(late[0].output_ids) == reference[2]

        # Prefix caching is on by default: prompts sharing a 34-token prefix (a whole 32-token
        # routing block) go to the rank that took the first one, whose cache serves the prefix.
        shared = [(7 * i + 3) % 256 for i in range(34)]
        first = eng.generate([Request("p0", [*shared, 1], SamplingParams(max_new_tokens=NEW))], 60)
        after = [eng.generate([Request(f"p{i}", [*shared, i + 1], SamplingParams(max_new_tokens=NEW))],
                              60)[0] for i in range(1, 4)]
        assert {r.rank for r in after} == {first[0].rank}
        assert first[0].cached_tokens == 0 and all(r.cached_tokens >= 32 for r in after)

        # Logprobs cross the actor boundary with their tokens: streamed per step, whole at the end.
        streamed = []
        eng.submit(Request("lp", prompts[1], SamplingParams(max_new_tokens=NEW, logprobs=2)), streamed.append)
        deadline = time.monotonic() + 60
        while not (streamed and streamed[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.005)
        res = streamed[-1].result
        assert list(res.output_ids) == reference[1] and len(res.logprobs) == NEW
        assert tuple(lp for out in streamed for lp in out.new_logprobs) == res.logprobs
        assert all(top[0] == (t, lp) and len(top) == 2 for t, (lp, top) in zip(res.output_ids, res.logprobs, strict=True))

        outs = []
        eng.submit(Request("doomed", prompts[0], SamplingParams(max_new_tokens=50)), outs.append)
        while not outs:
            time.sleep(0.005)
        ray.kill(eng.rank_handles()[1], no_restart=True)  # a real actor death
        deadline = time.monotonic() + 60
        while not (outs[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        last = outs[-1]
        assert last.finished and last.retryable and last.result.finish_reason == "error"
        assert "failed" in last.result.error
        refused = 0
        while eng.health().state != "ready" and time.monotonic() < deadline + 60:
            try:
                eng.submit(Request(f"during{refused}", prompts[0]), lambda out: None)
            except EngineUnavailable as e:
                assert "restarting: rank 1 died" in str(e)  # the kind the engine named
                refused += 1
            time.sleep(0.05)
        assert refused > 0 and eng.health().ok and eng.stats().restarts == 1
        again = eng.generate([Request("again", prompts[1], SamplingParams(max_new_tokens=NEW))], timeout_s=60)
        assert list(again[0].output_ids) == reference[1]


def _hang_once_factory(marker: str):
    """Real RankWorkers; in the first gang (no ``marker`` file yet) rank 1's first step with a
    request of its own never returns. Shipped to the actors by value."""
    import os
    import threading

    def make(spec, rank, world):
        from dp_runtime.rank_worker import RankWorker

        worker = RankWorker(spec, rank=rank, world_size=world)
        if rank == 1 and not os.path.exists(marker):
            step = worker.step

            def hanging_step():
                if worker.scheduler.num_waiting or worker.scheduler.running:
                    open(marker, "w").close()
                    threading.Event().wait()
                return step()

            worker.step = hanging_step
        return worker

    return make


def test_a_hung_gang_is_restarted_by_the_engine(setup, tmp_path):
    """What serve gets from the engine: rank 1 hangs in a step (its peer waits in the step's
    collective, both answer polls); past hang_timeout_s the requests in flight end retryable, the
    gang is replaced, and the new one serves. Before: only `run` noticed hung ranks."""
    ckpt, prompts, reference = setup
    spec = RankSpec.create(str(ckpt), dp_size=2, ep_size=2, max_running_requests=4, chunked_prefill_size=16,
                           dtype="float32", device="cpu", max_context_len=64, dp_sync_timeout_s=60.0)
    options = EngineOptions(launcher="ray", max_restarts=1, ray_num_cpus=2, hang_timeout_s=2.0,
                            worker_factory=_hang_once_factory(str(tmp_path / "hung")))
    with Engine(spec, options).start() as eng:
        outs = []
        for i in range(2):  # one per rank: rank 1 gets one of them
            eng.submit(Request(f"h{i}", prompts[i], SamplingParams(max_new_tokens=NEW)), outs.append)
        deadline = time.monotonic() + 90
        while eng.stats().restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = [o for o in outs if o.finished]
        assert len(ended) == 2 and all(o.retryable for o in ended), ended
        failures = eng.stats().failures
        assert (1, "hung") in {(f.rank, f.kind) for f in failures}, failures
        # whichever poller notices first names its rank with the timeout, a peer with its time
        assert re.search(r"no step completed for [0-9.]+ s", next(f.message for f in failures if f.rank == 1))
        while eng.health().state != "ready" and time.monotonic() < deadline:
            time.sleep(0.05)
        again = eng.generate([Request("after", prompts[1], SamplingParams(max_new_tokens=NEW))], timeout_s=60)
        assert list(again[0].output_ids) == reference[1]
