"""Requests that arrive over time (``Request.arrival_s``): the scheduler admits each no earlier
than its arrival, in arrival order; the rank's step loop waits for the last one; times count
from arrival and every token is timed. And the serving benchmark (bench/serve_load.py) on one
in-process rank: its report's invariants."""

from __future__ import annotations

import json
import math
import threading
import time
from itertools import pairwise

import pytest
import torch.distributed as dist

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from launch import process_group, rank_session
from tests.support.bench_scripts import check_serve_load_report, load_bench


def _worker(**kw) -> RankWorker:
    base = dict(dp_size=1, max_running_requests=4, chunked_prefill_size=64, dtype="float32", device="cpu",
                max_context_len=64)
    return RankWorker(RankSpec.create("tiny", **{**base, **kw}))


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan])
def test_arrival_must_be_finite_and_non_negative(bad):
    with pytest.raises(ValueError, match=r"request 'x': arrival_s must be finite and >= 0"):
        Request("x", [1, 2], arrival_s=bad)


def test_scheduler_admits_in_arrival_order_and_not_before():
    with _worker() as w:
        s = w.scheduler
        w.submit([Request("late", [1, 2, 3], arrival_s=60.0), Request("now", [4, 5]),
                  Request("mid", [6], arrival_s=30.0)])
        assert [q.request.rid for q in s.waiting] == ["now", "mid", "late"]
        assert s.next_arrival_in() == 0.0  # "now" has arrived
        step = s.next_step()
        assert [q.request.rid for q in step.reqs] == ["now"]  # "mid" and "late" have not arrived
        assert s.num_waiting == 2 and s.has_work
        wait = s.next_arrival_in()
        assert wait is not None and 29.0 < wait <= 30.0


def test_a_request_arriving_after_the_schedulers_look_counts_as_due():
    # The race of a request arriving between next_step and the end of an empty step: the loop
    # must step again at once, not conclude that nothing is left. An hour away, the request has
    # surely not arrived when next_step looks; next_arrival_in asked for a moment past its arrival
    # stands for the loop asking after it arrived.
    with _worker() as w:
        w.submit([Request("soon", [1, 2], arrival_s=3600.0)])
        assert w.scheduler.next_step() is None and w.scheduler.next_arrival_in() > 0
        assert w.scheduler.next_arrival_in(now=time.perf_counter() + 3600.0) == 0.0
        assert w.scheduler.num_waiting == 1
    with _worker() as w:
        assert w.scheduler.next_arrival_in() is None


class _FirstSleepStops(threading.Event):
    """A ``stop`` for run_until_idle that records the loop's first sleep, and ends the loop
    there instead of sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.sleeps.append(timeout)
        self.set()
        return True


def test_step_loop_idle_before_an_arrival_sleeps_until_it_instead_of_ending():
    # Before arrivals existed, the loop ended at the first idle step. "late" arrives in an hour,
    # long after "a" is done however slow the machine: the loop runs "a", goes idle, and then
    # sleeps until the arrival (the stop ends that sleep at once here).
    stop = _FirstSleepStops()
    with _worker() as w:
        t0 = time.perf_counter()
        w.submit([Request("a", [1, 2, 3], SamplingParams(max_new_tokens=4)),
                  Request("late", [4, 5], SamplingParams(max_new_tokens=2), arrival_s=3600.0)])
        w.run_until_idle(stop)
        elapsed = time.perf_counter() - t0
        done, m = w.pop_finished(), w.metrics()
    assert [(r.rid, len(r.output_ids)) for r in done] == [("a", 4)]
    assert m["skipped_steps"] == 1 and m["waiting"] == 1  # one idle step, then the sleep
    assert len(stop.sleeps) == 1 and 3600.0 - elapsed <= stop.sleeps[0] <= 3600.0, stop.sleeps


def test_step_loop_serves_late_arrivals_and_times_count_from_arrival():
    arrivals = {"a": 0.0, "c": 0.3, "b": 0.15}
    reqs = [Request("a", [1, 2, 3], SamplingParams(max_new_tokens=4)),
            Request("c", [7, 8], SamplingParams(max_new_tokens=3), arrival_s=arrivals["c"]),
            Request("b", [4, 5, 6], SamplingParams(max_new_tokens=5), arrival_s=arrivals["b"])]
    with _worker() as w:
        t0 = time.perf_counter()
        results = w.generate(reqs)
        wall = time.perf_counter() - t0
        m = w.metrics()
    assert wall >= 0.3  # "c" is admitted no earlier than its arrival
    assert [len(r.output_ids) for r in results] == [4, 3, 5]
    assert m["skipped_steps"] >= 1 and m["waiting"] == 0  # the final idle step, nothing left
    for r in results:
        times = r.token_times_s
        assert len(times) == len(r.output_ids)
        assert times[0] == r.ttft_s and times[-1] == r.latency_s
        assert all(a < b for a, b in pairwise(times))
        assert 0 <= r.queued_s <= r.ttft_s
        # Counted from arrival, not from submit: the last token came inside generate, and the
        # request arrived arrival_s after generate began, so at most wall - arrival_s later.
        assert r.latency_s <= wall - arrivals[r.rid], (r, wall)


def test_serve_load_report_holds_its_invariants(capsys):
    bench = load_bench("serve_load")
    code = bench.main(["--device", "cpu", "--model", "tiny", "--num-requests", "6", "--rates", "40,inf",
                       "--lengths", "random:16:4", "--max-running-requests", "3", "--warmup", "1",
                       "--json", "--per-request"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    check_serve_load_report(report, rates=2, per_rate=6, out_len=4, world=1, max_running=3)
    # All at once: more requests than may run, so the cap is reached and some wait in the queue.
    inf_row = report["rows"][1]
    assert inf_row["rate"] is None and inf_row["max_running"] == [3]
    assert max(r["queued_s"] for r in report["requests"] if r["rid"].startswith("q1-")) > 0


@pytest.mark.parametrize("argv, message", [
    (["--rates", "4,fast"], "--rates must be numbers or inf"),
    (["--rates", "0"], "--rates must be > 0"),
    (["--lengths", "random:8"], "--lengths must be 'sharegpt' or 'random:IN:OUT[:RATIO]', got 'random:8'"),
    (["--lengths", "random:8:0"], "IN and OUT must be >= 1"),
    (["--dp", "2"], "--dp 2 needs --launcher ray"),
    (["--lengths", "random:2000:100"], "max_context_len=2099 exceeds the model's max_position_embeddings=2048"),
    (["--arrival", "bursty"], "invalid choice: 'bursty'"),
    (["--repetition-penalty", "0"], "SamplingParams.repetition_penalty must be a finite number > 0 (1: off), got 0.0"),
])
def test_serve_load_bad_options_are_one_line_and_exit_2(capsys, argv, message):
    code = load_bench("serve_load").main(["--device", "cpu", "--num-requests", "2", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


class _FailingWorker:
    def submit(self, requests):
        pass

    def run_until_idle(self, stop=None):
        raise RuntimeError("boom on rank 0")

    def pop_finished(self):
        return []

    def metrics(self):
        return {}

    def close(self):
        pass


def test_serve_load_shows_a_rank_error_then_aborts_its_group(monkeypatch, capsys):
    # Before: the error was only raised, and the group's destroy on the way out waited forever for
    # the peer stuck in NCCL, so it was never printed. Here rank 0 of a 2-rank torchrun job fails
    # (its group is a one-process gloo group: the peer never takes part).
    monkeypatch.setattr(rank_session, "_default_worker", lambda *args: _FailingWorker())
    for key, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(process_group, "init_from_env", lambda device: process_group.init_process_group(
        0, 1, "127.0.0.1", process_group.free_port(), timeout_s=30.0))
    aborts, destroy = [], process_group.destroy_process_group

    def recorded_destroy(abort=False):
        aborts.append(abort)
        destroy(abort)

    monkeypatch.setattr(process_group, "destroy_process_group", recorded_destroy)
    with pytest.raises(RuntimeError, match="rank 0: the step loop raised"):
        load_bench("serve_load").main(["--device", "cpu", "--num-requests", "2", "--warmup", "0", "--json"])
    err = capsys.readouterr().err
    assert "error: rank 0: the step loop raised:\n" in err and "RuntimeError: boom on rank 0" in err, err
    assert aborts == [True] and not dist.is_initialized()
