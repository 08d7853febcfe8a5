"""`--kv-cache-dtype` as a user meets it: `dp-runtime run` of the tiny preset on the CPU with an
FP8 KV cache serves every request in full and reports the cache's dtype; the option reaches the
rank's RuntimeConfig from run, serve's shared check and the torchrun entry; a bad value is one
line and exit 2 before anything starts (the probe of test_cli_run and test_serve_cli has the
run and serve cases; plan's: test_cli_plan)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from launch.cli import app
from launch.cli_options import check_gang_options
from launch.run_config import RunConfig

REQUESTS, NEW_TOKENS = 3, 6


def _run_json(*extra: str) -> dict:
    res = CliRunner().invoke(app, ["run", "--launcher", "local", "--requests", str(REQUESTS), "--prompt-len", "12",
                                   "--max-new-tokens", str(NEW_TOKENS), "--json", "--results", *extra])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


def test_a_local_run_with_an_fp8_kv_cache_serves_every_token():
    out = _run_json("--kv-cache-dtype", "fp8_e4m3")
    assert (out["served"], out["failed"], out["output_tokens"]) == (REQUESTS, 0, REQUESTS * NEW_TOKENS)
    assert sorted(len(ids) for ids in out["results"].values()) == [NEW_TOKENS] * REQUESTS
    assert out["kv_cache_dtype"] == "float8_e4m3fn"  # what the rank allocated (its metrics)
    assert _run_json()["kv_cache_dtype"] == "float32"  # auto: the model's dtype (float32 on CPU)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_the_option_reaches_the_runtime_config(name):
    opts = check_gang_options(launcher="local", device="cpu", kv_cache_dtype=name)
    rt = opts.spec.runtime
    assert (opts.cfg.kv_cache_dtype, rt.kv_cache_dtype, rt.dtype) == (name, torch.float8_e4m3fn, torch.float32)
    assert check_gang_options(launcher="local", device="cpu").spec.runtime.kv_cache_dtype == torch.float32
    assert RunConfig(kv_cache_dtype=name).spec("cuda").runtime.dtype == torch.bfloat16  # the model's stays


def test_a_bad_value_names_the_option_the_choices_and_the_value():
    with pytest.raises(ValueError, match=r"^--kv-cache-dtype must be one of auto, fp8, fp8_e4m3; got 'int8'$"):
        RunConfig(kv_cache_dtype="int8")


def test_the_torchrun_entry_passes_and_checks_it(monkeypatch, capsys):
    from launch import torchrun_main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert torchrun_main.main(["--kv-cache-dtype", "e5m2"]) == 2
    assert capsys.readouterr().err == "error: --kv-cache-dtype must be one of auto, fp8, fp8_e4m3; got 'e5m2'\n"
    assert torchrun_main.main(["--kv-cache-dtype", "fp8", "--requests", "2", "--max-new-tokens", "3",
                               "--prompt-len", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["output_tokens"], out["kv_cache_dtype"]) == (6, "float8_e4m3fn")
