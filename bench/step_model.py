"""What a serving run at rate inf would give if its steps cost what a model of them says: the
scheduler's steps for serve_load's workload (``load_summary.ideal_steps``: the same admission
rules, no KV limit), each costing

    step ms = decode_ms (if it has decode rows) + mixed_fixed_ms + prompt_token_us x prompt tokens
              (the last two if it has prompt tokens)

and the run's output tok/s, TPOT p50 and ITL p99 from those times. The defaults are one H100's
measurements at 64 running (docs/BENCHMARKS.md, sessions 15 and 16: decode steps at the run's
contexts 23.22 ms, a mixed step 1.2 ms plus ~9.5 us a prompt token, the probe's decode step
21.92 ms), which this model turns into TPOT p50 24.69 ms in 896 steps where the run measured
24.5 in 900. So it answers what a lever is worth before it is built: a cheaper prompt token
(``--prompt-token-us`` several values), a cheaper mixed step, another budget
(``--mixed-step-tokens`` several values).

    python bench/step_model.py                       # issue 27's 64-running row, the defaults
    python bench/step_model.py --max-running-requests 128 --num-requests 512 --decode-ms 24.91 \\
        --prompt-token-us 8.2,3.1 --probe-ms 22.81 --mixed-step-tokens 1024,2048

``eff`` is out tok/s over the decode-only bound, running / ``--probe-ms``, serve_load's.
A model, not a measurement: a step's cost does not depend on its batch or contexts here.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from itertools import pairwise
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load_summary import STEP_KINDS, ideal_steps
from bench.load_workload import Lengths, make_requests
from dp_runtime.model.model_config import PRESETS, ModelConfig
from dp_runtime.serving.request import Request
from launch.cli_errors import UsageError, bench_main
from launch.run_report import percentile


def model_run(requests: list[Request], running: int, chunk: int, mixed_tokens: int, policy: str,
              decode_ms: float, mixed_fixed_ms: float, prompt_token_us: float) -> dict[str, Any]:
    """The modelled run (module docstring): steps by kind, duration, out tok/s, TPOT p50 and
    ITL p99 (ms)."""
    now_ms, token_ms = 0.0, {r.rid: [] for r in requests}
    kinds = dict.fromkeys(STEP_KINDS, 0)
    for step in ideal_steps(requests, running, chunk, mixed_tokens, policy):
        if step.decode_rows:
            now_ms += decode_ms
        if step.prompt_tokens:
            now_ms += mixed_fixed_ms + prompt_token_us * step.prompt_tokens / 1e3
        kinds["mixed" if step.decode_rows and step.prompt_tokens else
              "decode" if step.decode_rows else "extend"] += 1
        for rid in step.gave:
            token_ms[rid].append(now_ms)
    times = [t for t in token_ms.values() if t]
    tpots = [(t[-1] - t[0]) / (len(t) - 1) for t in times if len(t) > 1]
    gaps = [b - a for t in times for a, b in pairwise(t)]
    out = sum(len(t) for t in times)
    return {"steps": kinds, "duration_s": now_ms / 1e3, "output_tokens": out,
            "output_tok_s": out / now_ms * 1e3 if now_ms else 0.0,
            "tpot_ms_p50": statistics.median(tpots) if tpots else None,
            "itl_ms_p99": percentile(gaps, 99) if gaps else None}


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x]
    except ValueError:
        raise UsageError(f"--{name} takes numbers, comma-separated, got {text!r}") from None
    if not values or not all(_non_negative(v) for v in values):
        raise UsageError(f"--{name} takes numbers >= 0, comma-separated, got {text!r}")
    return values


def _non_negative(value: float) -> bool:
    return math.isfinite(value) and value >= 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30b-a3b",
                   help="preset: its vocabulary draws the prompts")
    p.add_argument("--num-requests", type=int, default=384)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--lengths", default="sharegpt", help="sharegpt | random:IN:OUT[:RATIO]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", default="lof", choices=("fcfs", "lof"))
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--mixed-step-tokens", default="1024", help="budgets, comma-separated")
    p.add_argument("--decode-ms", type=float, default=23.22)
    p.add_argument("--mixed-fixed-ms", type=float, default=1.2)
    p.add_argument("--prompt-token-us", default="9.5", help="costs, comma-separated")
    p.add_argument("--probe-ms", type=float, default=21.92, help="the decode-only bound's step")
    p.add_argument("--json", action="store_true")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    args.lengths = Lengths.parse(args.lengths)
    if args.model not in PRESETS:
        raise UsageError(f"--model must be a preset ({', '.join(sorted(PRESETS))}), "
                         f"got {args.model!r}")
    for name in ("num_requests", "max_running_requests", "chunked_prefill_size"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} must be >= 1, got {getattr(args, name)}")
    budgets = _floats(args.mixed_step_tokens, "mixed-step-tokens")
    if any(b != int(b) or not 1 <= b <= args.chunked_prefill_size for b in budgets):
        raise UsageError(f"--mixed-step-tokens takes ints in [1, --chunked-prefill-size "
                         f"{args.chunked_prefill_size}], got {args.mixed_step_tokens!r}")
    args.mixed_step_tokens = [int(b) for b in budgets]
    args.prompt_token_us = _floats(args.prompt_token_us, "prompt-token-us")
    for name in ("decode_ms", "mixed_fixed_ms", "probe_ms"):
        value = getattr(args, name)
        if not _non_negative(value):
            raise UsageError(f"--{name.replace('_', '-')} must be a number >= 0, got {value}")
    if args.probe_ms == 0:
        raise UsageError("--probe-ms must be > 0, got 0")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    vocab = ModelConfig.preset(args.model).vocab_size
    reqs = make_requests(args.num_requests, math.inf, args.lengths, "poisson", vocab, args.seed,
                         "q0")
    bound = args.max_running_requests / args.probe_ms * 1e3
    rows = []
    for budget in args.mixed_step_tokens:
        for us in args.prompt_token_us:
            row = model_run(reqs, args.max_running_requests, args.chunked_prefill_size, budget,
                            args.policy, args.decode_ms, args.mixed_fixed_ms, us)
            rows.append({"mixed_step_tokens": budget, "prompt_token_us": us, **row,
                         "efficiency": row["output_tok_s"] / bound})
    keys = ("num_requests", "max_running_requests", "policy", "decode_ms", "mixed_fixed_ms",
            "probe_ms")
    return {"header": {k: getattr(args, k) for k in keys}, "rows": rows}


def print_table(report: dict[str, Any]) -> None:
    h = report["header"]
    print(f"modelled steps: {h['num_requests']} requests, {h['max_running_requests']} running, "
          f"{h['policy']}; decode {h['decode_ms']} ms, a mixed step +{h['mixed_fixed_ms']} ms, "
          f"probe {h['probe_ms']} ms")
    print(f"{'budget':>6} {'us/tok':>6} {'steps d/e/m':>12} {'run s':>7} {'out tok/s':>9} "
          f"{'eff':>6} {'TPOT p50':>8} {'ITL p99':>7}")
    for r in report["rows"]:
        s = r["steps"]
        steps = f"{s['decode']:>5}/{s['extend']}/{s['mixed']:<4}"
        print(f"{r['mixed_step_tokens']:>6} {r['prompt_token_us']:>6.2f} {steps} "
              f"{r['duration_s']:>7.2f} {r['output_tok_s']:>9.1f} {r['efficiency']:>6.1%} "
              f"{r['tpot_ms_p50']:>8.2f} {r['itl_ms_p99']:>7.2f}")


def main(argv: list[str] | None = None) -> int:
    return bench_main(argv, parse_args, run, print_table)


if __name__ == "__main__":
    sys.exit(main())
