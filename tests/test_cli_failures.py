"""The door of `dp-runtime run`, round 2 (issue 28): failed requests are listed with their
reasons, in the table and in --json, left out of the latency percentiles, and make the exit
code 3; every option combination that cannot work is refused before Ray or a model starts (one
line, exit 2); rich prints user text and help as written; --context-len bounds requests one by
one; the torchrun entry applies the same checks."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dp_runtime.serving.request import RequestResult
from launch.cli import app, main
from launch.cli_options import check_choices, check_gang_options
from launch.cli_run import check_run_options
from launch.report_view import SHOWN_ERRORS, summary_table
from launch.run_config import RunConfig
from launch.run_report import RankFailure, RunReport, summarize
from tests.support.cli_probe import ENV, REPO, probe_cli


def _result(rid: str, rank: int, latency: float, error: str | None = None) -> RequestResult:
    out = () if error else (1, 2)
    return RequestResult(rid=rid, prompt_len=3, output_ids=out, finish_reason="error" if error else "length",
                         rank=rank, queued_s=0.0, ttft_s=latency / 2 if not error else 0.0,
                         latency_s=latency if not error else 0.0, decode_steps=1, error=error)


def _report(results, failures=()) -> RunReport:
    return RunReport(results=tuple(results), world_size=2, launcher="ray", device="cpu", wall_s=1.0, run_s=0.5,
                     failures=tuple(failures), nodes=("10.0.0.1 (a)", "10.0.0.2 (b)"))


def test_percentiles_count_served_requests_only_and_errors_name_rid_rank_reason():
    served = [_result(f"s{i}", i % 2, 1.0) for i in range(3)]
    refused = [_result(f"x{i}", -1, 0.0, error=f"request 'x{i}' is too long") for i in range(3)]
    failed = _result("f", 1, 0.0, error="ValueError: boom")
    summary = summarize(_report([*served, *refused, failed]))
    # Before: the refused requests' zero times halved both percentiles.
    assert summary.latency_p50_s == summary.latency_p99_s == 1.0 and summary.ttft_p50_s == 0.5
    assert (summary.requests, summary.served, summary.failed) == (7, 3, 4)
    d = json.loads(json.dumps(summary.as_dict()))
    assert d["failed"] == 4 and d["served"] == 3
    assert d["errors"][0] == {"rid": "x0", "rank": None, "reason": "request 'x0' is too long"}
    assert d["errors"][-1] == {"rid": "f", "rank": 1, "reason": "ValueError: boom"}
    assert d["nodes"] == {"0": "10.0.0.1 (a)", "1": "10.0.0.2 (b)"}


def test_no_served_request_gives_null_percentiles():
    d = summarize(_report([_result("x", -1, 0.0, error="refused")])).as_dict()
    assert d["latency_p50_s"] is None and d["ttft_p99_s"] is None and d["failed"] == 1


def _render(table) -> str:
    console = Console(record=True, width=300)
    console.print(table)
    return console.export_text()


def test_table_lists_the_first_failed_requests_their_count_and_keeps_brackets():
    hint = "the flashinfer dispatcher needs flashinfer-python: pip install 'dp-runtime[gpu]'"
    errors = [_result(f"x{i}", -1, 0.0, error=f"bad [prompt] {i}") for i in range(SHOWN_ERRORS + 2)]
    failure = RankFailure(0, 1, "setup", hint, "10.0.0.2")
    text = _render(summary_table(summarize(_report([_result("s", 0, 1.0), *errors], [failure]))))
    assert f"{SHOWN_ERRORS + 3} (1 served, {SHOWN_ERRORS + 2} failed)" in text
    assert "x0 (refused): bad [prompt] 0" in text and f"x{SHOWN_ERRORS - 1} (refused)" in text
    assert f"x{SHOWN_ERRORS} (refused)" not in text and "... and 2 more (--json lists all)" in text
    assert "pip install 'dp-runtime[gpu]'" in text  # rich would read [gpu] as markup
    assert "0: 10.0.0.1 (a), 1: 10.0.0.2 (b)" in text


def _main(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


def test_a_request_over_context_len_is_refused_alone_and_the_run_exits_3(tmp_path, capsys):
    work = tmp_path / "w.jsonl"
    work.write_text('{"rid": "ok", "prompt_ids": [1, 2, 3], "max_new_tokens": 4}\n'
                    '{"rid": "long", "prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "max_new_tokens": 4}\n')
    code, out, err = _main(["run", "--launcher", "local", "--workload", str(work), "--context-len", "8",
                            "--json"], capsys)
    assert code == 3, err
    obj = json.loads(out)
    assert obj["served"] == 1 and obj["failed"] == 1 and obj["output_tokens"] == 4
    (error,) = obj["errors"]
    assert error["rid"] == "long" and error["rank"] is None and "13 KV tokens" in error["reason"]
    assert "8" in error["reason"] and obj["latency_p50_s"] > 0
    assert obj["nodes"]["0"]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: 1 of 2 requests failed; first: long (refused): {error['reason']}"]

    code, out, _ = _main(["run", "--launcher", "local", "--workload", str(work), "--context-len", "8"], capsys)
    assert code == 3 and "failed request" in out and "long (refused)" in out and "1 served, 1 failed" in out



BAD_COMBINATIONS = [
    (["--dispatcher", "local", "--dp", "2"], "--dispatcher local runs one rank (it exchanges nothing); got --dp 2"),
    (["--dispatcher", "flashinfer", "--device", "cpu"], "--dispatcher flashinfer runs on CUDA"),
    (["--context-len", "0"], "--context-len must be an integer >= 1, got 0"),
    (["--context-len", "100000"], "--context-len 100000 exceeds the model's limit of 2048 positions (tiny)"),
    (["--prompt-len", "100000"], "--prompt-len 100000 + --max-new-tokens 16 - 1 = 100015 KV tokens exceeds "
                                 "the default context length 2048"),
    (["--prompt-len", "60", "--context-len", "64"], "exceeds --context-len 64"),
]


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="the Ray path needs ray")
def test_impossible_combinations_are_one_line_exit_2_before_ray():
    report = probe_cli([["run", *a] for a, _ in BAD_COMBINATIONS])
    for (args, message), (code, err) in zip(BAD_COMBINATIONS, report["cases"], strict=True):
        assert code == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, (args, err)
    assert not report["ray"]


@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is not None, reason="flashinfer imports here")
def test_flashinfer_dispatcher_without_flashinfer_names_the_install_hint():
    spec = RunConfig(dp=2, dispatcher="flashinfer").spec("cuda")
    with pytest.raises(ValueError, match=r"pip install 'dp-runtime\[gpu\]'"):
        check_choices(spec, here=True)
    check_choices(spec, here=False)  # a joined cluster's nodes may have it: asked there


def test_check_gang_options_is_the_shared_entry():
    opts = check_gang_options(launcher="local", device="cpu", context_len=64, max_running_requests=4)
    assert opts.cfg.dp == 1 and opts.spec.context_len == 64 and opts.launch["launcher"] == "local"
    with pytest.raises(ValueError, match="--max-running-requests must be an integer >= 1, got 0"):
        check_gang_options(launcher="local", device="cpu", max_running_requests=0)
    base = dict(dp=None, model="tiny", dispatcher="auto", requests=2, prompt_len=8, max_new_tokens=2,
                workload=None, launcher="local", ray_address=None, max_restarts=None, device="cpu",
                dtype="auto", max_running_requests=4, chunked_prefill_size=64, context_len=None,
                hang_timeout=None, num_cpus=None, seed=0, as_json=False, with_results=False,
                log_level="warning", schedule_policy="fcfs", mixed_step_tokens="auto", kv_cache_dtype="auto",
                prefix_caching=False, quantization="none")
    assert check_run_options(base).cfg.requests == 2
    fp8 = check_run_options({**base, "quantization": "fp8"})
    assert fp8.spec.runtime.quantization == "fp8" and fp8.spec.model_config().quantization.source == "online"
    typed = check_run_options({**base, "schedule_policy": "lof", "mixed_step_tokens": "16", "kv_cache_dtype": "fp8"})
    assert (typed.spec.runtime.schedule_policy, typed.spec.runtime.mixed_step_tokens) == ("lof", 16)
    assert str(typed.spec.runtime.kv_cache_dtype) == "torch.float8_e4m3fn"


def test_run_help_shows_every_default():
    out = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).stdout
    flat = " ".join(out.split())
    for option, default in (("--max-restarts", "2"), ("--hang-timeout", "120"), ("--context-len", "min(model"),
                            ("--num-cpus", "max(dp, cores)"), ("--dp", "2 with --launcher ray"),
                            ("--mixed-step-tokens", "auto: the largest extend graph")):
        at = flat.index(option + " ")
        assert f"[default: ({default}" in flat[at:at + 300], (option, flat[at:at + 300])
    assert "3 some requests failed" in flat


# -- the torchrun entry ----------------------------------------------------------------------------
def test_torchrun_entry_checks_combinations_and_context_len(tmp_path):
    cmd = [sys.executable, "-m", "launch.torchrun_main"]
    for args, message in ((["--requests", "-1"], "--requests must be an integer >= 1, got -1"),
                          (["--prompt-len", "5000"], "exceeds the default context length 2048"),
                          (["--dispatcher", "flashinfer", "--device", "cpu"], "--dispatcher flashinfer runs on CUDA")):
        done = subprocess.run([*cmd, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    work = tmp_path / "w.jsonl"
    work.write_text('{"rid": "ok", "prompt_ids": [1, 2, 3], "max_new_tokens": 4}\n'
                    '{"rid": "long", "prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "max_new_tokens": 4}\n')
    done = subprocess.run([*cmd, "--workload", str(work), "--context-len", "8", "--json"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    obj = json.loads(done.stdout)
    assert [e["rid"] for e in obj["errors"]] == ["long"] and obj["served"] == 1


def test_progress_phases_print_user_text_as_written():
    import io

    from launch.report_view import RunProgress

    buf = io.StringIO()
    progress = RunProgress(Console(file=buf, width=200), 1)
    progress.phase("connecting to Ray (ray://gpu-head[eu]:10001)")
    assert "dp-runtime: connecting to Ray (ray://gpu-head[eu]:10001)" in buf.getvalue()


def test_a_package_missing_on_a_rank_is_not_retried():
    from launch.errors import is_deterministic_setup_error

    # Before: the gang retried a missing flashinfer 3 times (19.5 s) and exited 1.
    assert is_deterministic_setup_error(ImportError("the flashinfer dispatcher needs flashinfer-python"))
    assert not is_deterministic_setup_error(RuntimeError("a peer died"))
