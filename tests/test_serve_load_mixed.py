"""bench/serve_load.py's step kinds, decode-only bound and efficiency, with and without mixed
steps side by side (``--mixed both``), and its decode-probe timing on hand-made results."""

from __future__ import annotations

import json

from dp_runtime.serving.request import RequestResult
from tests.support.bench_scripts import load_bench


def test_mixed_both_reports_steps_by_kind_the_bound_and_efficiency_side_by_side(capsys):
    bench = load_bench("serve_load")
    code = bench.main(["--device", "cpu", "--model", "tiny", "--num-requests", "8", "--rates", "inf",
                       "--lengths", "random:20:5", "--max-running-requests", "3", "--chunked-prefill-size", "32",
                       "--warmup", "1", "--mixed", "both", "--probe-tokens", "8", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    assert report["header"]["mixed_steps"] == [False, True]
    off, on = report["rows"]
    assert (off["mixed"], on["mixed"]) == (False, True)
    # 8 prompts of 20 tokens, 3 running at most: later prompts arrive while others decode.
    assert off["steps"]["mixed"] == 0 and off["steps"]["extend"] >= 3 and off["steps"]["decode"] > 0
    assert on["steps"]["mixed"] > 0
    for row in (off, on):
        assert row["completed"] == 8 and row["output_tokens"] == 40 and max(row["max_running"]) == 3
        assert row["decode_step_s"] > 0
        assert row["decode_bound_tok_s"] == 3 / row["decode_step_s"]  # 3 running / the probe's step
        assert abs(row["efficiency"] - row["output_tok_s"] / row["decode_bound_tok_s"]) < 1e-12


def _result(rid: str, rank: int, times: tuple[float, ...]) -> RequestResult:
    return RequestResult(rid=rid, prompt_len=4, output_ids=tuple(range(len(times))), finish_reason="length",
                         rank=rank, queued_s=0.0, ttft_s=times[0], latency_s=times[-1], decode_steps=len(times) - 1,
                         token_times_s=times)


def test_the_decode_step_is_timed_once_every_probe_request_has_its_first_token():
    bench = load_bench("serve_load")
    # Rank 0: b's prompt went in a step after a's (a's gap 1.0 -> 1.5 is a prefill step's and
    # is left out); from 1.5 on both decode every 0.1 s. Rank 1: one request, steps of 0.3 s.
    results = [_result("a", 0, (1.0, 1.5, 1.6, 1.7)), _result("b", 0, (1.5, 1.6, 1.7)),
               _result("c", 1, (0.5, 0.8, 1.1, 1.4, 1.7))]
    step = bench.decode_step_s(results, 2)
    gaps = sorted([0.1, 0.1, 0.1, 0.1] + [0.3] * 4)
    assert abs(step - (gaps[3] + gaps[4]) / 2) < 1e-9
    assert bench.decode_step_s([_result("a", 0, (1.0,))], 1) is None


def test_gpu_spans_on_a_cpu_rank_is_a_one_line_usage_error(capsys):
    # --gpu-spans times CUDA steps in this process (bench/gpu_spans.py): refused before any rank
    bench = load_bench("serve_load")
    code = bench.main(["--device", "cpu", "--model", "tiny", "--num-requests", "2", "--gpu-spans"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--gpu-spans" in err and "--launcher local and a GPU" in err and "\n" not in err
