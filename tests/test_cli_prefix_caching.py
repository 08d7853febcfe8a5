"""`--prefix-caching` as a user meets it: `dp-runtime run` of the tiny preset on the CPU with
the prefix cache serves a workload of shared prompts in full; the flag reaches the rank's
RuntimeConfig from run, serve's shared check and the torchrun entry (on by default; the
``--no-`` form turns it off)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from launch.cli import app
from launch.cli_options import check_gang_options
from launch.run_config import RunConfig


def test_a_local_run_with_prefix_caching_serves_shared_prompts(tmp_path):
    shared = list(range(1, 41))
    lines = [json.dumps({"prompt_ids": [*shared, 100 + i], "max_new_tokens": 4}) for i in range(4)]
    (tmp_path / "w.jsonl").write_text("\n".join(lines) + "\n")
    res = CliRunner().invoke(app, ["run", "--launcher", "local", "--workload", str(tmp_path / "w.jsonl"),
                                   "--max-running-requests", "1", "--prefix-caching", "--json", "--results"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert (out["served"], out["failed"], out["output_tokens"]) == (4, 0, 16)


def test_the_flag_reaches_the_runtime_config(monkeypatch, capsys):
    assert check_gang_options(launcher="local", device="cpu").spec.runtime.prefix_caching
    assert not check_gang_options(launcher="local", device="cpu", prefix_caching=False).spec.runtime.prefix_caching
    with pytest.raises(ValueError, match="--prefix-caching is a flag"):
        RunConfig(prefix_caching="yes")
    from launch import torchrun_main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for flag in ("--prefix-caching", "--no-prefix-caching"):
        assert torchrun_main.main([flag, "--requests", "2", "--max-new-tokens", "3", "--prompt-len", "8", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["output_tokens"] == 6
