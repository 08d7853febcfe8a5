"""Which running counts a rank accepts, by the planner (``launch.planner.plan_capacity``, the
sizing the rank allocates with): each count of ``--want`` whose plan fits, every running request
able to reach ``--context-len`` at once; each other one is skipped with the plan's reason. If
none fits, the largest count that does at that context (0: nothing fits). The last line of
stdout is the accepted counts, comma-separated (``bench/run_gpu.sh dep`` hands it to
serve_load's ``--concurrency``); the verdicts go to stderr.

    python bench/plan_running.py --model qwen3-235b-a22b --quantization fp8 --dp 2 --gpu h200 \\
        --context-len 2048 --want 64,128,256

``--gpu auto`` (the default) takes this machine's CUDA GPU (``gpu_specs.gpu_spec_for_device``).
Exit 1 when no count fits, 2 for a bad option (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.cli_errors import UsageError
from launch.gpu_specs import GpuSpec, gpu_spec, gpu_spec_for_device


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])

    def fail(msg: str) -> None:
        raise UsageError(msg)

    p.error = fail  # type: ignore[method-assign]
    p.add_argument("--model", default="qwen3-235b-a22b")
    p.add_argument("--quantization", default="fp8", choices=("none", "fp8"))
    p.add_argument("--dp", type=int, required=True, help="DP = EP size")
    p.add_argument("--gpu", default="auto", help="a GPU name of `dp-runtime plan --gpu`, or auto")
    p.add_argument("--context-len", type=int, required=True, help="longest prompt + output")
    p.add_argument("--chunked-prefill-size", type=int, default=8192)
    p.add_argument("--want", required=True, help="running counts a rank, comma-separated")
    args = p.parse_args(argv)
    try:
        args.want = sorted({int(x) for x in args.want.split(",")})
    except ValueError:
        raise UsageError(f"--want must be ints, comma-separated; got {args.want!r}") from None
    if min(args.want) < 1 or args.dp < 1 or args.context_len < 1:
        raise UsageError(f"--want, --dp and --context-len must be >= 1; got {args.want}, "
                         f"{args.dp}, {args.context_len}")
    return args


def _gpu(name: str) -> GpuSpec:
    if name != "auto":
        return gpu_spec(name)
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--gpu auto needs a CUDA GPU; name one (--gpu h200)")
    spec = gpu_spec_for_device(torch.cuda.get_device_name())
    if spec is None:
        raise UsageError(f"--gpu auto: {torch.cuda.get_device_name()} is not in "
                         "launch/gpu_specs.py; name one")
    return spec


def accepted(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """(the running counts to run, a line per verdict)."""
    from launch.planner import PlanInput, plan_capacity

    gpu = _gpu(args.gpu)

    def plan(running: int):
        return plan_capacity(PlanInput(
            model=args.model, quantization=args.quantization, dp_size=args.dp, ep_size=args.dp,
            gpu_mem_bytes=gpu.mem_bytes, gpu_name=gpu.name, nvlink=gpu.nvlink,
            max_running_requests=running, context_len=args.context_len,
            chunked_prefill_size=args.chunked_prefill_size))

    where = (f"{args.model} {args.quantization} DP {args.dp} / EP {args.dp} on {gpu.name} at "
             f"context {args.context_len}")
    fits, lines = [], []
    for n in args.want:
        p = plan(n)
        if p.fits:
            fits.append(n)
            lines.append(f"{where}: {n} running a rank fits ({p.reason})")
        else:
            lines.append(f"{where}: {n} running a rank skipped: {p.reason}")
    if fits:
        return fits, lines
    largest = plan(args.want[0]).largest_max_running_requests
    if largest >= 1:
        lines.append(f"{where}: none of {args.want} fits; running {largest} a rank instead, the "
                     "most that fits")
        return [largest], lines
    lines.append(f"{where}: no running count fits")
    return [], lines


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        counts, lines = accepted(args)
    except (UsageError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line, file=sys.stderr)
    print(",".join(map(str, counts)))
    return 0 if counts else 1


if __name__ == "__main__":
    sys.exit(main())
