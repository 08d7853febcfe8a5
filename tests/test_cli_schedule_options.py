"""`--schedule-policy` and `--mixed-step-tokens` on a local run of the tiny preset: the options
as typed reach the rank's scheduler (the admission order, the mixed steps' budget), and they
change no request's greedy tokens (the bad values: test_cli_run / test_serve_cli)."""

from __future__ import annotations

import json
import random

import pytest
from typer.testing import CliRunner

from launch.cli import app
from launch.cli_options import check_gang_options
from launch.cli_run import execute

# Two run at once (--max-running-requests 2); the longest outputs are q1 and q3. Prompts are
# longer than a 16-token mixed step, so that budget splits them over several steps.
NEW_TOKENS = (3, 12, 5, 12, 1, 8)


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("schedule") / "w.jsonl"
    lines = [json.dumps({"rid": f"q{i}", "prompt_ids": [rng.randrange(1, 200) for _ in range(24 + 2 * i)],
                         "max_new_tokens": n}) for i, n in enumerate(NEW_TOKENS)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _cli_tokens(workload: str, *extra: str) -> dict:
    res = CliRunner().invoke(app, ["run", "--launcher", "local", "--workload", workload, "--max-running-requests",
                                   "2", "--json", "--results", *extra])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["served"] == len(NEW_TOKENS) and out["failed"] == 0, out
    return out["results"]


def test_lof_and_a_small_mixed_budget_keep_every_request_s_tokens(workload):
    fcfs = _cli_tokens(workload)
    lof = _cli_tokens(workload, "--schedule-policy", "lof", "--mixed-step-tokens", "16")
    assert lof == fcfs and [len(fcfs[f"q{i}"]) for i in range(len(NEW_TOKENS))] == list(NEW_TOKENS)


def _run(workload: str, policy: str, mixed: str):
    opts = check_gang_options(launcher="local", device="cpu", max_running_requests=2, workload=workload,
                              schedule_policy=policy, mixed_step_tokens=mixed)
    report = execute(opts.cfg, **opts.launch)
    queued = {r.rid: r.queued_s for r in report.results}
    first = sorted(queued, key=queued.get)[:2]
    # Admitted by the first step: both wait less than any request admitted later.
    assert max(queued[rid] for rid in first) < min(q for rid, q in queued.items() if rid not in first)
    return opts.spec.runtime, set(first), report.rank_metrics[0]["steps_by_kind"]["mixed"]


def test_the_options_reach_the_rank_scheduler(workload):
    rt, first, _ = _run(workload, "fcfs", "auto")
    assert (rt.schedule_policy, first) == ("fcfs", {"q0", "q1"})
    rt, first, mixed_auto = _run(workload, "lof", "auto")
    assert (rt.schedule_policy, rt.mixed_step_tokens, first) == ("lof", 1024, {"q1", "q3"})
    rt, first, mixed_16 = _run(workload, "lof", "16")
    # The same admissions; the 16-token budget splits each later prompt over more mixed steps.
    assert (rt.mixed_step_tokens, first) == (16, {"q1", "q3"}) and mixed_16 > mixed_auto


def test_the_torchrun_entry_checks_them_before_the_group(monkeypatch, capsys):
    from launch import torchrun_main

    monkeypatch.delenv("RANK", raising=False)
    assert torchrun_main.main(["--schedule-policy", "lof", "--mixed-step-tokens", "x"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: --mixed-step-tokens must be auto or an integer in [1, 8192] (at most "
                   "--chunked-prefill-size), got 'x'\n")
