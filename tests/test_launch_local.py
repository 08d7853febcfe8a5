"""One rank in-process: RankSession's lifecycle, the local launcher, the report, `dp-runtime run
--launcher local` (no Ray needed)."""

from __future__ import annotations

import json
import logging
import threading

import pytest
from typer.testing import CliRunner

from dp_runtime.serving.request import RequestResult
from launch.cli import app
from launch.rank_session import RankSession
from launch.run_config import RunConfig
from launch.run_report import RunReport, percentile, summarize
from launch.workload import SyntheticWorkload
from tests.support.engine_runs import run_local


class _FakeWorker:
    """Finishes every request with one token; ``fail`` makes the loop raise, ``gate`` holds it."""

    def __init__(self, fail: bool = False, gate: threading.Event | None = None) -> None:
        self.queue, self.done, self.fail, self.gate, self.closed, self.steps = [], [], fail, gate, False, 0

    def submit(self, requests):
        self.queue.extend(requests)

    def run_until_idle(self, stop=None):
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("boom in the step loop")
        for r in self.queue:
            self.steps += 1
            self.done.append(RequestResult(r.rid, len(r.prompt_ids), (1,), "length", 0, 0.0, 0.1, 0.1, 0))
        self.queue = []

    def pop_finished(self):
        out, self.done = self.done, []
        return out

    def metrics(self):
        return {"steps": self.steps}

    def close(self):
        self.closed = True


def _session(worker):
    return RankSession(None, 0, 1, worker_factory=lambda spec, rank, world: worker)


def test_session_lifecycle():
    gate = threading.Event()
    worker = _FakeWorker(gate=gate)
    s = _session(worker)
    assert s.state() == "ready"
    s.submit(SyntheticWorkload(num_requests=3).requests())
    s.start()
    assert s.collect().state == "running"
    with pytest.raises(RuntimeError, match="cannot submit in state 'running'"):
        s.submit([])
    gate.set()
    s._thread.join(5)
    st = s.collect()
    assert (st.state, st.steps, len(st.results)) == ("done", 3, 3)
    assert s.collect().results == ()  # popped once
    assert s.close() == "done" and worker.closed
    assert s.collect().state == "closed"


def test_session_keeps_the_traceback():
    s = _session(_FakeWorker(fail=True))
    st = s.run()
    assert st.state == "error"
    assert "RuntimeError: boom in the step loop" in st.error and "Traceback" in st.error
    s.close()


def test_session_logs_the_error_before_it_reports_it(caplog):
    # Before: the traceback was only kept for collect, and a teardown that then blocked (the
    # process group's destroy waiting for a peer stuck in NCCL) meant it was never printed.
    s = RankSession(None, 3, 4, worker_factory=lambda spec, rank, world: _FakeWorker(fail=True))
    state_when_logged = []

    class _StateAtEmit(logging.Handler):
        def emit(self, record):
            state_when_logged.append(s.state())

    probe = _StateAtEmit(logging.ERROR)
    logging.getLogger("launch").addHandler(probe)
    try:
        with caplog.at_level(logging.ERROR, logger="launch"):
            st = s.run()
    finally:
        logging.getLogger("launch").removeHandler(probe)
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    text = record.getMessage()
    assert text.startswith("rank 3: the step loop raised:\n"), text
    assert "RuntimeError: boom in the step loop" in text and st.error.rstrip() in text
    assert state_when_logged == ["running"]  # logged before any launcher could see "error"
    assert st.state == "error"
    s.close()


def test_local_launcher_runs_the_tiny_model():
    cfg = RunConfig(dp=1, requests=6, prompt_len=12, max_new_tokens=5, max_running_requests=4)
    requests = cfg.load_requests()
    report = run_local(cfg.spec("cpu"), requests)
    assert [r.rid for r in report.results] == [r.rid for r in requests]
    assert all(len(r.output_ids) == 5 and r.rank == 0 for r in report.results)
    s = summarize(report)
    assert (s.requests, s.output_tokens, s.per_rank_requests, s.restarts) == (6, 30, {0: 6}, 0)
    assert s.throughput_tok_s > 0 and s.latency_p99_s >= s.latency_p50_s >= s.ttft_p50_s > 0
    with pytest.raises(ValueError, match="local launcher runs world size 1"):
        run_local(RunConfig(dp=2).spec("cpu"), requests)


def test_summary_of_an_empty_report_is_json_safe():
    s = summarize(RunReport((), 2, "ray", "cpu", wall_s=1.0, run_s=0.0))
    d = s.as_dict()
    assert d["ttft_p50_s"] is None and d["throughput_tok_s"] is None
    assert d["per_rank_requests"] == {"0": 0, "1": 0}
    json.dumps(d, allow_nan=False)
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0


def test_cli_run_local_json():
    res = CliRunner().invoke(app, ["run", "--launcher", "local", "--requests", "3", "--max-new-tokens", "4",
                                   "--json", "--results"])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if ln.startswith("{"))
    out = json.loads(line)
    assert out["submitted"] == out["requests"] == 3 and out["output_tokens"] == 12
    assert out["launcher"] == "local" and sorted(out["results"]) == ["r0000", "r0001", "r0002"]


def test_cli_run_local_table():
    res = CliRunner().invoke(app, ["run", "--launcher", "local", "--requests", "2", "--max-new-tokens", "2"])
    assert res.exit_code == 0, res.output
    assert "throughput" in res.output and "latency p50 / p99" in res.output


@pytest.mark.parametrize(("args", "message"), [
    (["--launcher", "local", "--dp", "2"], "runs one rank; got --dp 2"),
    (["--launcher", "local", "--workload", "/nonexistent.jsonl"], "does not exist"),
    (["--launcher", "mpi"], "--launcher must be one of"),
    (["--launcher", "local", "--requests", "0"], "--requests must be an integer >= 1"),
])
def test_cli_run_bad_options_exit_2(args, message):
    res = CliRunner().invoke(app, ["run", *args, "--json"])
    assert res.exit_code == 2, res.output
    assert message in json.loads(res.stdout.strip().splitlines()[-1])["error"]
    assert res.stderr.count("\n") == 1 and message in res.stderr
