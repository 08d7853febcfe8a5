"""`dp-runtime serve` user errors: one line on stderr, exit 2, before any gang starts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.support.serve_process import ROOT, free_port


def _serve(*args, env=None):
    proc = subprocess.run(
        [sys.executable, "-m", "launch", "serve", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        cwd=ROOT,
        timeout=120,
    )
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.parametrize(
    "args,message",
    [
        (["--launcher", "local", "--dp", "2"], "--launcher local runs one rank; got --dp 2"),
        (["--port", "70000"], "--port must be in [1, 65535], got 70000"),
        (["--max-queued", "0"], "--max-queued must be an integer >= 1, got 0"),
        (["--launcher", "local", "--context-len", "100000"], "--context-len 100000 exceeds the model's limit"),
        (
            ["--launcher", "local", "--api-key", " "],
            "--api-key (or DP_RUNTIME_API_KEY) must not be empty",
        ),
        (["--model", "/no/such/dir"], "--model '/no/such/dir' is neither a preset"),
        (["--max-running-requests", "0"], "--max-running-requests must be an integer >= 1, got 0"),
        (["--schedule-policy", "LOF"], "--schedule-policy must be one of fcfs, lof; got 'LOF'"),
        (
            ["--kv-cache-dtype", "FP8"],
            "--kv-cache-dtype must be one of auto, fp8, fp8_e4m3; got 'FP8'",
        ),
        (
            ["--chunked-prefill-size", "32", "--mixed-step-tokens", "64"],
            "--mixed-step-tokens must be auto or an integer in [1, 32] (at most "
            "--chunked-prefill-size), got 64",
        ),
        (["--drain-timeout", "-1"], "--drain-timeout must be a number of seconds >= 0, got -1.0"),
        (
            ["--keep-alive-timeout", "0"],
            "--keep-alive-timeout must be an integer number of seconds >= 1, got 0",
        ),
        (
            ["--launcher", "local", "--sampling-defaults", "openai"],
            "--sampling-defaults must be one of model, none; got 'openai'",
        ),
        (
            ["--max-request-bytes", "100"],
            "--max-request-bytes must be an integer >= 1024, got 100",
        ),
        (["--header-timeout", "0"], "--header-timeout must be a number of seconds > 0, got 0.0"),
        (["--body-timeout", "inf"], "--body-timeout must be a number of seconds > 0, got inf"),
        (["--bogus"], "No such option: --bogus"),
    ],
)
def test_bad_option_is_one_line_and_exit_2(args, message):
    code, lines = _serve(*args)
    assert code == 2 and len(lines) == 1, lines
    assert message in lines[0]


def test_port_in_use_is_a_user_error_before_the_gang_starts():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        code, lines = _serve("--launcher", "local", "--port", str(port))
    assert code == 2 and len(lines) == 1, lines
    assert f"--host 127.0.0.1 --port {port}: cannot listen there" in lines[0]


def test_a_sampling_default_out_of_its_limits_is_one_line_naming_the_file(tmp_path):
    # config.json alone: the command must stop at generation_config.json, before any weights.
    import json

    import transformers

    from tests.hf_reference import TINY

    transformers.Qwen3MoeConfig(**TINY).save_pretrained(str(tmp_path))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 1.5}))
    code, lines = _serve("--launcher", "local", "--model", str(tmp_path))
    assert code == 2 and len(lines) == 1, lines
    want = f"{tmp_path / 'generation_config.json'}: top_p must be a finite number in (0, 1], got 1.5"
    assert lines[0] == f"error: {want}"


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_or_blank_key_from_the_environment_is_refused(key):
    code, lines = _serve("--launcher", "local", env={"DP_RUNTIME_API_KEY": key})
    assert code == 2 and len(lines) == 1, lines
    assert "--api-key (or DP_RUNTIME_API_KEY) must not be empty" in lines[0]


def test_listening_beyond_loopback_without_a_key_warns():
    # The warning is the first line on stderr, before the engine starts; then SIGTERM.
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch", "serve", "--launcher", "local", "--host", "0.0.0.0",
         "--port", str(free_port())],
        stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        line = proc.stderr.readline()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert line.startswith("warning: listening on 0.0.0.0 (beyond loopback) without an API key")


def test_without_the_serve_extra_it_is_one_line_naming_the_extra(tmp_path):
    # An install without [serve]: a finder ahead of every other refuses uvicorn and fastapi.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('uvicorn', 'fastapi'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hide())\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    code, lines = _serve("--launcher", "local", env=env)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == ("error: dp-runtime serve needs the [serve] extra (fastapi, uvicorn do not "
                        "import here): pip install 'dp-runtime[serve]'")
