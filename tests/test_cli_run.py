"""`dp-runtime run` and the torchrun entry as a user meets them: every option checked before
torch or Ray is imported and named as typed; a user error is one line on stderr and exit 2
(a traceback only with --debug, or for a bug); --help and --version answer without torch; the
start-up phases and a progress count of tokens; what ran (dispatcher, attention, graphs) and
the start-up time in the report. No Ray here (the Ray paths: test_launch_ray, test_cli_interrupt).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from launch.cli import app, main
from launch.rank_phases import summarize_phases
from launch.report_view import RunProgress
from launch.run_config import DISPATCHERS, DTYPES, KV_CACHE_DTYPES, SCHEDULE_POLICIES, RunConfig
from launch.run_report import PollEvent
from tests.support.cli_probe import ENV, REPO, probe_cli
from tests.support.engine_runs import run_local


def _probe(cases: list[list[str]]) -> dict:
    return probe_cli(cases, timeout_s=120)


BAD_OPTIONS = [
    (["--hang-timeout", "0"], "--hang-timeout must be a number of seconds > 0, got 0.0"),
    (["--num-cpus", "0"], "--num-cpus must be an integer >= 1, got 0"),
    (["--num-cpus", "4", "--ray-address", "auto"], "--num-cpus sizes a private local cluster"),
    (["--dp", "4", "--num-cpus", "2"], "--num-cpus 2 cannot hold --dp 4 ranks"),
    (["--results"], "--results adds every request's output ids to the --json object; add --json"),
    (["--dispatcher", "nope"], "--dispatcher must be one of auto, local, all_gather, all_to_all, flashinfer; got 'nope'"),
    (["--dtype", "int8"], "--dtype must be one of"),
    (["--max-restarts", "-1"], "--max-restarts must be an integer >= 0, got -1"),
    (["--launcher", "local", "--max-restarts", "1"], "--max-restarts applies to --launcher ray"),
    (["--log-level", "loud"], "--log-level must be one of debug, info, warning, error"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1, got 0"),
    (["--model", "qwen3-7b"], "--model 'qwen3-7b' is neither a preset"),
    (["--schedule-policy", "sjf"], "--schedule-policy must be one of fcfs, lof; got 'sjf'"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype must be one of auto, fp8, fp8_e4m3; got 'fp8_e5m2'"),
    (["--mixed-step-tokens", "0"], "--mixed-step-tokens must be auto or an integer in [1, 8192] "
                                   "(at most --chunked-prefill-size), got 0"),
    (["--chunked-prefill-size", "64", "--mixed-step-tokens", "65"],
     "--mixed-step-tokens must be auto or an integer in [1, 64] (at most --chunked-prefill-size), got 65"),
    (["--mixed-step-tokens", "many"], "--mixed-step-tokens must be auto or an integer in [1, 8192]"),
    (["--dp", "x"], "Invalid value for '--dp'"),
    (["--bogus"], "No such option: --bogus"),
]


def test_bad_options_are_one_line_exit_2_before_torch_or_ray():
    report = _probe([["run", *args] for args, _ in BAD_OPTIONS])
    for (args, message), (code, err) in zip(BAD_OPTIONS, report["cases"], strict=True):
        assert code == 2, (args, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err, (args, err)
    assert not report["torch"] and not report["ray"], "an option was checked after torch or Ray came in"


def test_help_and_version_do_not_import_torch():
    report = _probe([["--help"], ["run", "--help"], ["plan", "--help"], ["bench", "--help"], ["--version"]])
    assert [code for code, _ in report["cases"]] == [0, 0, 0, 0, 0]
    assert not report["torch"] and not report["ray"]


def _main(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as info:
        main(argv)
    captured = capsys.readouterr()
    return info.value.code, captured.out, captured.err


def test_runtime_user_errors_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{not json")
    code, _, err = _main(["run", "--launcher", "local", "--model", str(ckpt)], capsys)
    # A ValueError from reading the model config: the user's input, so exit 2 and one line.
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    code, _, err = _main(["run", "--launcher", "local", "--model", str(ckpt), "--debug"], capsys)
    assert code == 2 and "Traceback (most recent call last)" in err and err.splitlines()[-1].startswith("error: ")

    bad = tmp_path / "w.jsonl"
    bad.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 99999]}\n')
    code, out, err = _main(["run", "--launcher", "local", "--workload", str(bad), "--json"], capsys)
    assert code == 2 and err.count("\n") == 1 and f"{bad}:2" in err
    assert json.loads(out)["error"].startswith(f"{bad}:2")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_refused_before_ray(capsys):
    code, _, err = _main(["run", "--device", "cuda"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--device cuda, but torch sees no CUDA GPU" in err
    assert "ray" not in sys.modules or not __import__("ray").is_initialized()


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(self):
        raise KeyError("a bug, not the user's input")

    monkeypatch.setattr(RunConfig, "load_requests", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["run", "--launcher", "local"])


def test_log_level_shows_the_runtime_logs(capsys):
    quiet = _main(["run", "--launcher", "local", "--requests", "1", "--max-new-tokens", "1", "--json"], capsys)
    loud = _main(["run", "--launcher", "local", "--requests", "1", "--max-new-tokens", "1", "--json",
                  "--log-level", "info"], capsys)
    assert quiet[0] == loud[0] == 0
    assert "MoE dispatcher:" not in quiet[2] and "INFO dispatcher: MoE dispatcher:" in loud[2]


def test_option_names_match_the_runtime():
    from dp_runtime.choices import DISPATCHERS as RUNTIME_DISPATCHERS
    from dp_runtime.config import _DTYPES, _KV_DTYPES, RuntimeConfig
    from dp_runtime.config import SCHEDULE_POLICIES as _POLICIES

    assert DISPATCHERS == RUNTIME_DISPATCHERS and SCHEDULE_POLICIES == _POLICIES
    assert set(DTYPES) - {"auto"} <= set(_DTYPES)
    # The runtime's FP8 names but its torch spelling (float8_e4m3fn), each taken by RuntimeConfig.
    assert set(KV_CACHE_DTYPES) == (set(_KV_DTYPES) - {"float8_e4m3fn"}) | {"auto"}
    for name in KV_CACHE_DTYPES:
        RuntimeConfig(device="cpu", dtype="bfloat16", kv_cache_dtype=name)


# -- progress and report ----------------------------------------------------------------------------
def test_local_run_reports_phases_and_counts_tokens_while_running():
    cfg = RunConfig(dp=1, requests=3, prompt_len=8, max_new_tokens=40, max_running_requests=4)
    phases, events = [], []
    report = run_local(cfg.spec("cpu"), cfg.load_requests(), poll_interval_s=0.005,
                          on_poll=events.append, on_phase=phases.append)
    assert phases == ["loading weights", "warming up the dispatcher", "running"]
    tokens = [e.tokens for e in events]
    assert tokens == sorted(tokens) and tokens[-1] == 120 and events[-1].total_tokens == 120
    # The count moves while requests are still running, not only when they finish.
    assert any(0 < e.tokens < 120 and e.finished == 0 for e in events), tokens
    assert sum(len(r.output_ids) for r in report.results) == 120


def test_progress_lines_without_a_terminal():
    buf = io.StringIO()
    view = RunProgress(Console(file=buf, force_terminal=False), 3, line_interval_s=0.0)
    view.phase("starting Ray (a private local cluster, 2 CPUs)")
    view.phase("ranks: loading weights (2)")
    view.poll(PollEvent(0, 0, 3, (), (), tokens=10, total_tokens=48))
    view.poll(PollEvent(0, 3, 3, (), (), tokens=48, total_tokens=48))
    view.close()
    assert buf.getvalue().splitlines() == [
        "dp-runtime: starting Ray (a private local cluster, 2 CPUs)",
        "dp-runtime: ranks: loading weights (2)",
        "dp-runtime: requests 0/3  tokens 10/48",
        "dp-runtime: requests 3/3  tokens 48/48",
    ]
    silent = io.StringIO()
    off = RunProgress(Console(file=silent, force_terminal=True), 3, enabled=False)
    off.phase("starting Ray")
    off.poll(PollEvent(0, 3, 3, (), (), tokens=48, total_tokens=48))
    off.close()
    assert silent.getvalue() == ""


def test_progress_bar_on_a_terminal_shows_requests_and_tokens():
    buf = io.StringIO()
    view = RunProgress(Console(file=buf, force_terminal=True, width=120), 4)
    view.phase("placing 2 ranks")
    view.poll(PollEvent(0, 1, 4, (), (), tokens=30, total_tokens=64))
    view.close()
    assert "requests 1/4  tokens 30/64" in buf.getvalue()


def test_summarize_phases_lists_the_least_advanced_first():
    assert summarize_phases(["loading weights", "loading weights"]) == "ranks: loading weights (2)"
    assert summarize_phases(["capturing graphs", "starting", "capturing graphs", "odd"]) == \
        "ranks: starting (1), capturing graphs (2), odd (1)"


def test_json_names_what_ran_and_the_times_add_up():
    res = CliRunner().invoke(app, ["run", "--launcher", "local", "--requests", "2", "--max-new-tokens", "3", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert (out["dispatcher"], out["attention"], out["graphs"]) == ("local", "sdpa", False)
    assert out["ray_start_s"] == 0.0 and out["wall_s"] >= out["setup_s"] + out["run_s"] > 0
    table = CliRunner().invoke(app, ["run", "--launcher", "local", "--requests", "1", "--max-new-tokens", "1"])
    assert "local / sdpa / off" in table.stdout and "set up ranks" in table.stdout


# -- the torchrun entry ------------------------------------------------------------------------------
def test_torchrun_entry_user_error_without_torchrun():
    done = subprocess.run([sys.executable, "-m", "launch.torchrun_main", "--results"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == "error: --results adds every request's output ids to the --json object; add --json\n"


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_torchrun_entry_bad_option_is_printed_once_and_every_rank_exits_2():
    # A combination (local exchanges nothing between 2 ranks): refused before the group exists.
    cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "launch.torchrun_main", "--dispatcher", "local"]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=180)
    logs = done.stdout + done.stderr
    assert done.returncode != 0
    assert logs.count("error: --dispatcher local runs one rank") == 1, logs[-3000:]
    # The ranks print no traceback of their own, and torchrun's own failure report names exit
    # code 2 for both ranks (not SIGTERM for the one it stopped).
    assert "launch/" not in logs and logs.count("exitcode  : 2") == 2, logs[-3000:]


# -- the README's examples ---------------------------------------------------------------------------
def test_readme_plan_examples_say_what_the_readme_says():
    import re
    import shlex

    text = (REPO / "README.md").read_text()
    assert "../" not in text, "the README points outside the repository"
    commands = re.findall(r"`?(dp-runtime plan --model qwen3-30b-a3b [^`\n]*)`?", text)
    fits = [c for c in commands if "--max-running-requests 96" in c]
    too_big = [c for c in commands if "--gpu-mem-gib 40" in c]
    assert len(fits) == 1 and len(too_big) == 1, commands
    out = CliRunner().invoke(app, shlex.split(fits[0])[1:]).stdout
    # The verdicts the README quotes, as the CLI prints them today (line breaks of the prose aside).
    prose = " ".join(text.split())
    holds = re.search(r"FITS: the KV cache holds \d+ tokens", prose).group(0)
    largest = re.search(r"largest max_running_requests that fits: \d+", prose).group(0)
    assert holds in out and largest in out, (holds, largest, out)
    out = CliRunner().invoke(app, shlex.split(too_big[0])[1:]).stdout
    assert "DOES NOT FIT: weights alone are 56.87 GiB" in out
