"""bench/mixed_step.py as a CPU smoke test: a mixed step timed against a decode step, and the
routing of one mixed step saved for bench/moe_layer.py --routing."""

from __future__ import annotations

import json

import torch

from dp_runtime.model.model_config import ModelConfig
from tests.support.bench_scripts import load_bench


def test_times_a_mixed_step_and_saves_its_routing(tmp_path, capsys):
    path = tmp_path / "mixed.pt"
    code = load_bench("mixed_step").main([
        "--device", "cpu", "--model", "tiny", "--decode-rows", "4", "--decode-context", "24", "--prompts", "1x12",
        "--iters", "2", "--warmup", "1", "--modes", "eager", "--json", "--save-routing", str(path)])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    (row,) = report["rows"]
    assert row["shape"] == "1x12" and row["mode"] == "eager" and row["mixed_ms"] > 0 and row["decode_ms"] > 0
    tiny = ModelConfig.preset("tiny")
    routed = torch.load(path)
    assert len(routed) == tiny.num_layers  # every layer of the preset is sparse
    for ids, weights in routed:  # the 4 decode rows, then the prompt's 12 tokens
        assert ids.shape == weights.shape == (4 + 12, tiny.top_k)
        assert ((ids >= 0) & (ids < tiny.num_experts)).all() and (weights > 0).all()
