"""bench/side_by_side.py: a serve_load report read back from a step log (stderr lines around its
JSON), rows matched across runs with ratios, per-GPU division, units, and a missing run named."""

from __future__ import annotations

import json

from tests.support.bench_scripts import load_bench


def test_a_serve_load_log_side_by_side_with_itself(tmp_path, capsys):
    code = load_bench("serve_load").main(["--device", "cpu", "--model", "tiny", "--num-requests", "4", "--rates",
                                          "inf", "--lengths", "random:12:3", "--max-running-requests", "2",
                                          "--warmup", "0", "--probe-tokens", "4", "--json"])
    doc = capsys.readouterr().out
    assert code == 0, doc
    log = tmp_path / "load.log"
    log.write_text("W some warning on stderr\n" + doc + "\n[rank0] a line after the document\n")
    side = load_bench("side_by_side")
    assert side.main(["--key", "rate", "--metric", "output_tok_s/gpu,itl_s.p50,efficiency",
                      f"a={log}", f"b={log}", f"c={tmp_path / 'absent.log'}"]) == 0
    out = capsys.readouterr().out
    assert "c: no JSON document in" in out and "left out" in out
    row = json.loads(doc)["rows"][0]
    lines = out.splitlines()
    tok = lines[lines.index("output_tok_s/gpu, ratio against a:") + 2].split()
    assert tok == ["inf", f"{row['output_tok_s']:.2f}", f"{row['output_tok_s']:.2f}", "1.000"]
    itl = lines[lines.index("itl_s.p50 (ms), ratio against a:") + 2].split()
    assert itl[1] == f"{row['itl_s']['p50'] * 1e3:.2f}"
    assert "efficiency (%), ratio against a:" in lines


def test_gpus_and_values():
    side = load_bench("side_by_side")
    assert side.gpus({"header": "date 2026-11-27  GPU NVIDIA H100 80GB HBM3 x2  torch 2.11", "rows": []}) == 2
    assert side.gpus({"header": {"world_size": 2}, "rows": []}) == 2
    assert side.gpus({"header": {"dp": 2, "launcher": "ray"}, "rows": []}) == 2
    row = {"output_tok_s": 300.0, "itl_s": {"p99": 0.02}, "flag": True}
    assert side.value(row, "output_tok_s/gpu", 2) == 150.0
    assert side.value(row, "itl_s.p99", 2) == 0.02
    assert side.value(row, "itl_s.p50", 2) is None and side.value(row, "flag", 1) is None
    assert side.unit("itl_s.p99") == (" (ms)", 1e3) and side.unit("output_tok_s/gpu") == ("", 1.0)
    assert side.unit("efficiency") == (" (%)", 100.0)
