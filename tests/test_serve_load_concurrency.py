"""serve_load's running-count sweep (``--concurrency``) and the planner's choice of counts
(bench/plan_running.py) that bench/run_gpu.sh dep hands it."""

from __future__ import annotations

import json

import pytest

from tests.support.bench_scripts import check_serve_load_report, load_bench


def test_each_concurrency_is_one_wave_of_that_many_requests_a_rank_on_one_set_of_ranks(capsys):
    code = load_bench("serve_load").main(
        ["--device", "cpu", "--model", "tiny", "--concurrency", "2,3", "--max-running-requests",
         "3", "--lengths", "random:12:4", "--warmup", "2", "--warmup-max-new", "1", "--json",
         "--per-request"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    head, rows = report["header"], report["rows"]
    assert head["concurrency"] == [2, 3] and head["max_running_requests"] == 3
    got = [(r["concurrency"], r["rate"], r["requests"], r["max_running"]) for r in rows]
    assert got == [(2, None, 2, [2]), (3, None, 3, [3])]
    for c, row in zip((2, 3), rows, strict=True):
        mine = [r for r in report["requests"] if r["rid"].startswith(f"c{c}-")]
        check_serve_load_report(dict(report, rows=[row], requests=mine), rates=1, per_rate=c,
                                out_len=4, world=1, max_running=c)


def test_the_warm_up_keeps_its_prompts_and_caps_its_outputs():
    from bench.load_workload import Lengths, warmup_requests

    def warm(max_new):
        return warmup_requests(3, Lengths.parse("random:12:40"), "poisson", 100, 0, chunk=16,
                               max_prompt=64, world=2, max_new=max_new)

    capped, full = warm(5), warm(None)
    assert [r.prompt_ids for r in capped] == [r.prompt_ids for r in full]
    assert [r.sampling.max_new_tokens for r in full] == [1, 1, 40, 40, 40]  # the chunk prompts: 1
    assert [r.sampling.max_new_tokens for r in capped] == [1, 1, 5, 5, 5]


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "2", "--rates", "inf"], "--concurrency and --rates are exclusive"),
    (["--concurrency", "8", "--max-running-requests", "4"],
     "--concurrency 8 exceeds --max-running-requests 4"),
    (["--concurrency", "2,x"], "--concurrency must be ints, comma-separated; got '2,x'"),
    (["--concurrency", "0"], "--concurrency must be >= 1"),
    (["--warmup-max-new", "0"], "--warmup-max-new must be >= 1, got 0"),
])
def test_bad_concurrency_options_are_one_line_and_exit_2(capsys, argv, message):
    code = load_bench("serve_load").main(["--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_the_planner_picks_what_fits_at_dp4_and_the_most_that_fits_at_dp2(capsys):
    plan_running = load_bench("plan_running")
    want = ["--gpu", "h200", "--context-len", "2048", "--want", "64,128,256"]
    assert plan_running.main(["--dp", "4", *want]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-1] == "64,128"
    assert "256 running a rank skipped: the KV cache gets" in err and "524288" in err
    assert plan_running.main(["--dp", "2", *want]) == 0
    out, err = capsys.readouterr()
    most = int(out.splitlines()[-1])
    assert 24 <= most < 64 and f"none of [64, 128, 256] fits; running {most} a rank instead" in err
    assert plan_running.main(["--dp", "1", *want]) == 1  # the weights alone do not fit one H200
    assert "weights alone are" in capsys.readouterr().err
