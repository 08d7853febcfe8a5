"""bench/step_model.py: the ideal steps are the real Scheduler's, the step model costs a run
small enough to cost by hand, and its command line."""

from __future__ import annotations

import math

import pytest
import torch

from bench.load_summary import ideal_steps
from bench.load_workload import Lengths, make_requests
from bench.step_model import main, model_run
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.kv_cache import KVCache
from dp_runtime.serving.request import Request, SamplingParams
from dp_runtime.serving.scheduler import Scheduler
from launch.run_report import percentile

D, F, U = 20.0, 1.5, 10.0  # decode step ms, a prompt step's fixed ms, us a prompt token


def _req(rid: str, prompt_len: int, new: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=new))


@pytest.mark.parametrize("policy", ["fcfs", "lof"])
def test_the_ideal_steps_are_the_schedulers_on_a_sharegpt_mix(policy):
    reqs = make_requests(40, math.inf, Lengths.parse("sharegpt"), "poisson", 1000, 3, "m")
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_slots=40 * 2048, max_reqs=8,
                    max_context_len=2048, dtype=torch.float32, device="cpu")
    s = Scheduler(KVAllocator(cache), max_running_requests=8, chunked_prefill_size=512,
                  mixed_step_tokens=64, policy=policy)
    s.submit(reqs)
    real = []
    while (step := s.next_step()) is not None:
        rows = len(step.reqs) if step.kind == "decode" else step.num_decode
        prompt = step.num_tokens - step.num_decode if step.is_extend else 0
        gave = [r.request.rid for r, smp in zip(step.reqs, step.samples, strict=True) if smp]
        real.append((rows, prompt, sorted(gave)))
        s.advance(step, [7 if smp else None for smp in step.samples])
    ideal = [(x.decode_rows, x.prompt_tokens, sorted(x.gave))
             for x in ideal_steps(reqs, 8, 512, 64, policy)]
    kinds = {(rows > 0, prompt > 0) for rows, prompt, _ in real}
    assert kinds == {(True, False), (False, True), (True, True)}  # decode, extend and mixed
    assert real == ideal


def test_a_finished_request_makes_room_for_a_mixed_step_and_its_cost_lands_on_the_decoding_row():
    # Two places: r0 (2 tokens) and r1 (4) prefill together; r0 finishes after one decode step,
    # so r2 is admitted beside r1's decode row: one mixed step of 1 row + 4 prompt tokens.
    reqs = [_req("r0", 4, 2), _req("r1", 4, 4), _req("r2", 4, 3)]
    steps = list(ideal_steps(reqs, 2, 64, 64, "fcfs"))
    assert [(s.decode_rows, s.prompt_tokens) for s in steps] == [
        (0, 8), (2, 0), (1, 4), (2, 0), (1, 0)]
    assert [set(s.gave) for s in steps] == [
        {"r0", "r1"}, {"r0", "r1"}, {"r1", "r2"}, {"r1", "r2"}, {"r2"}]
    run = model_run(reqs, 2, 64, 64, "fcfs", D, F, U)
    assert run["steps"] == {"decode": 3, "extend": 1, "mixed": 1}
    mixed_ms = D + F + 4 * U / 1e3
    assert run["duration_s"] * 1e3 == pytest.approx((F + 8 * U / 1e3) + D + mixed_ms + D + D)
    assert run["output_tokens"] == 2 + 4 + 3
    # r0 and r2 saw decode steps only; r1's three gaps include the mixed step.
    assert run["tpot_ms_p50"] == pytest.approx(D)
    assert run["itl_ms_p99"] == pytest.approx(percentile([D] * 5 + [mixed_ms], 99))


def test_free_prompts_leave_the_decode_step_and_dearer_prompts_raise_tpot():
    reqs = [_req(f"r{i}", 30 + 7 * i, 5 + i % 4) for i in range(24)]
    free = model_run(reqs, 4, 64, 32, "lof", D, 0.0, 0.0)
    assert free["tpot_ms_p50"] == pytest.approx(D)
    dear = model_run(reqs, 4, 64, 32, "lof", D, F, U)
    assert dear["steps"] == free["steps"]  # the costs change the times, not the schedule
    assert dear["tpot_ms_p50"] > D and dear["output_tok_s"] < free["output_tok_s"]


def test_the_command_prints_a_row_per_budget_and_cost_and_refuses_bad_values(capsys):
    assert main(["--num-requests", "16", "--max-running-requests", "4",
                 "--mixed-step-tokens", "256,512", "--prompt-token-us", "9.5,0"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.strip().startswith(("256", "512"))]
    assert len(rows) == 4
    assert main(["--prompt-token-us", "x"]) == 2
    assert "--prompt-token-us takes numbers" in capsys.readouterr().err
    assert main(["--mixed-step-tokens", "9000"]) == 2
    err = capsys.readouterr().err
    assert "--mixed-step-tokens takes ints in [1, --chunked-prefill-size 8192], got '9000'" in err
