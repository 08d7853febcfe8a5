"""The torchrun entry: the same rank code as the Ray actors, one process per rank.

    torchrun --standalone --nproc-per-node 2 -m launch.torchrun_main --requests 8 [--json]

Every rank joins the group torchrun describes (``process_group.init_from_env``: gloo on CPU,
NCCL + gloo on CUDA with the device from LOCAL_RANK), builds the same workload from the same
options (the synthetic one is a pure function of its seed; a file is read by every rank),
takes its round-robin share, runs its step loop in a RankSession until every rank is idle,
and the results are gathered to rank 0 (``dist.gather_object``), which prints the summary (a
table, or one JSON line with ``--json``; ``--results`` adds every request's output ids).

``run_torchrun(spec, requests)`` is the collective part, callable from a test whose process
group already exists. No restarts here: torchrun's own ``--max-restarts`` restarts the job.

A bad option, workload or model is found before the process group exists, the same on every
rank and by the same checks as ``dp-runtime run`` (``cli_options``: each option, then the
combinations, e.g. ``--dispatcher local`` with several ranks, ``--dispatcher flashinfer`` where
flashinfer does not import, a synthetic prompt over ``--context-len``): rank 0 prints one line,
every rank exits 2 (no traceback without ``--debug``; a peer that torchrun stops while rank 0
prints exits 2 too), and torchrun reports exit code 2 for every rank in its own summary.
Requests over ``--context-len`` in a workload file are refused alone (their errors in the
report); then the exit code is 3, as with ``dp-runtime run``. Without torchrun the entry runs
one rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Sequence

import torch.distributed as dist

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.admission import admit
from dp_runtime.serving.request import Request
from launch import process_group
from launch.cli_errors import (
    EXIT_INTERRUPTED,
    EXIT_REQUESTS_FAILED,
    EXIT_USAGE,
    LOG_LEVELS,
    UsageError,
    check_choice,
    error_line,
    is_user_error,
    print_error,
)
from launch.cli_options import check_choices, check_synthetic_fits
from launch.rank_session import ERROR, RankSession
from launch.run_config import RunConfig, parse_mixed_step_tokens
from launch.run_report import RunReport, summarize
from launch.workload import split_round_robin

__all__ = ["main", "run_torchrun"]

_PEER_EXIT_DELAY_S = 2.0


def run_torchrun(spec: RankSpec, requests: Sequence[Request]) -> RunReport | None:
    """Run this rank's share of ``requests`` (collective over the default group when
    ``spec.runtime.world_size > 1``); returns the RunReport on rank 0, None elsewhere.

    Every rank must pass the same ``requests``. A request refused at the door
    (``admission.check_request``) gets a result with its error and runs nowhere. Raises
    ValueError naming the rids when two requests share one (on every rank, before any
    collective), and RuntimeError carrying the rank's traceback when its step loop raised.
    """
    world = spec.runtime.world_size
    rank = dist.get_rank() if world > 1 else 0
    # Every rank holds the same requests, so every rank refuses the same ones (and raises alike
    # for duplicate rids) before the first collective.
    accepted, refused = admit(requests, spec.model_config().vocab_size, spec.context_len)
    t0 = time.perf_counter()
    session = RankSession(spec, rank, world)
    try:
        setup_s = time.perf_counter() - t0
        session.submit(split_round_robin(accepted, world)[rank])
        final = session.run()
    finally:
        session.close()
    if final.state == ERROR:
        raise RuntimeError(f"rank {rank}: the step loop raised:\n{final.error}")
    mine = (list(final.results), dict(final.metrics), final.loop_s, setup_s)
    gathered = [None] * world if rank == 0 else None
    if world > 1:
        dist.gather_object(mine, gathered, dst=0)
    else:
        gathered = [mine]
    if rank != 0:
        return None
    by_rid = {r.rid: r for r in refused}
    by_rid.update((r.rid, r) for part in gathered for r in part[0])
    missing = [r.rid for r in requests if r.rid not in by_rid]
    if missing:
        raise RuntimeError(f"{len(missing)} requests have no result after every rank finished: "
                           f"{missing[:5]}")
    return RunReport(
        results=tuple(by_rid[r.rid] for r in requests), world_size=world, launcher="torchrun",
        device=spec.runtime.device.type, wall_s=time.perf_counter() - t0,
        run_s=max(p[2] for p in gathered), setup_s=max(p[3] for p in gathered),
        rank_metrics=tuple(p[1] for p in gathered),
    )


class _Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage and exiting on every rank."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    d = RunConfig()
    p = _Parser(prog="torchrun ... -m launch.torchrun_main", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model)
    p.add_argument("--dispatcher", default=d.dispatcher)
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--workload", default=None, help="JSONL file, one request per line")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    p.add_argument("--schedule-policy", default=d.schedule_policy,
                   help="fcfs | lof (longest output first)")
    p.add_argument("--mixed-step-tokens", default=d.mixed_step_tokens,
                   help="most tokens of a mixed step: auto (the largest extend graph) or 1..chunk")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   help="KV cache storage: auto (the model's dtype) | fp8_e4m3 (FP8, scale 1: "
                   "half the bytes per token, twice the slots; K/V rounded to e4m3)")
    p.add_argument("--quantization", default=d.quantization,
                   help="weights: none (as stored; an FP8 checkpoint is served FP8) | fp8 "
                   "(quantized at load)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d.prefix_caching,
                   help="reuse the KV of prompt prefixes cached from earlier requests on the same "
                   "rank")
    p.add_argument("--context-len", type=int, default=d.context_len,
                   help="longest prompt + output (default: min(model limit, 4096)); a request over "
                   "it is refused alone")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--pg-timeout", type=float, default=process_group.DEFAULT_TIMEOUT_S,
                   help="seconds before a collective gives up (a dead peer)")
    p.add_argument("--json", action="store_true", help="one JSON line on rank 0 instead of a table")
    p.add_argument("--results", action="store_true",
                   help="with --json: add every request's output ids")
    p.add_argument("--log-level", default="warning", help="debug | info | warning | error")
    p.add_argument("--debug", action="store_true", help="print the traceback of an error")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The torchrun entry; returns the exit code (``cli_errors``).

    Every option, the workload and the spec are checked before the process group exists; they
    are the same on every rank, so a bad one fails every rank alike: rank 0 prints one line, and
    every rank exits 2 without a traceback (``--debug`` prints it). Ctrl-C exits 130.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    rank = _env_rank()
    debug = "--debug" in argv
    try:
        return _main(argv, rank)
    except KeyboardInterrupt:
        if rank == 0:
            print("interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except _SameOnEveryRank as e:
        if rank == 0:
            print_error(e.__cause__ or e, debug=debug)
        # torchrun stops every rank when the first one exits: every rank leaves with exit code 2
        # when torchrun's SIGTERM comes, and none leaves before all got here (torchrun's store),
        # so torchrun reports exit code 2 for every rank.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(EXIT_USAGE))
        if "RANK" in os.environ:
            _wait_for_peers()
            # Not through interpreter shutdown: it restores SIGTERM's default action while a
            # peer's exit already has torchrun signalling this rank.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_USAGE)
        return EXIT_USAGE
    except Exception as e:
        if not is_user_error(e):
            raise
        # After the group exists a user error may be this rank's alone: each rank names itself.
        if debug:
            traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
        print(f"error: rank {rank}: {error_line(e)}", file=sys.stderr, flush=True)
        return EXIT_USAGE


class _SameOnEveryRank(Exception):
    """A user error found before the process group exists (every rank finds the same one)."""


def _main(argv: list[str], rank: int) -> int:
    try:
        args = _parser().parse_args(argv)
        check_choice("--device", args.device, ("auto", "cpu", "cuda"))
        check_choice("--log-level", args.log_level, LOG_LEVELS)
        if args.results and not args.json:
            raise UsageError("--results adds every request's output ids to the --json object; "
                             "add --json")
        if not args.pg_timeout > 0:
            raise UsageError(f"--pg-timeout must be a number of seconds > 0, got {args.pg_timeout}")
        world = _env_world()
        cfg = RunConfig(dp=world, model=args.model, dispatcher=args.dispatcher,
                        requests=args.requests, prompt_len=args.prompt_len,
                        max_new_tokens=args.max_new_tokens, workload=args.workload,
                        dtype=args.dtype, max_running_requests=args.max_running_requests,
                        chunked_prefill_size=args.chunked_prefill_size, seed=args.seed,
                        context_len=args.context_len, schedule_policy=args.schedule_policy,
                        kv_cache_dtype=args.kv_cache_dtype, prefix_caching=args.prefix_caching,
                        quantization=args.quantization,
                        mixed_step_tokens=parse_mixed_step_tokens(args.mixed_step_tokens,
                                                                  args.chunked_prefill_size))
        device = process_group.resolve_device(args.device)
        spec = cfg.spec(device)
        check_choices(spec, here=True)  # torchrun starts every rank of this node here
        check_synthetic_fits(cfg, spec)
        requests = cfg.load_requests()
    except Exception as e:
        if not is_user_error(e):
            raise
        raise _SameOnEveryRank(str(e)) from e
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"rank {rank} %(levelname)s %(name)s: %(message)s")
    if "RANK" in os.environ:
        process_group.init_from_env(device=device, timeout_s=args.pg_timeout)
    failed = True
    try:
        report = run_torchrun(spec, requests)
        # Every rank exits with the same code: rank 0 (which holds the report) says whether a
        # request failed.
        some_failed = [report is not None and any(r.error is not None for r in report.results)]
        if world > 1 and dist.is_initialized():
            dist.broadcast_object_list(some_failed, src=0)
        failed = False
    finally:
        # After a failure a peer may wait in a collective for this rank: abort, do not wait.
        process_group.destroy_process_group(abort=failed)
    if report is not None and rank == 0:
        _print(report, args.json, args.results)
    return EXIT_REQUESTS_FAILED if some_failed[0] else 0


def _wait_for_peers(timeout_s: float = 30.0) -> None:
    """Return once every rank of this torchrun job got here, counted in torchrun's own store
    (MASTER_ADDR:MASTER_PORT; no process group exists yet), or after ``timeout_s``; without
    the store, after a short fixed delay."""
    from datetime import timedelta

    addr, port, world = (os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"))
    key = f"dp_runtime/usage_error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.TCPStore(addr, int(port), is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < int(world) and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # no store to count in (not under torchrun's agent): wait a little
        time.sleep(_PEER_EXIT_DELAY_S)


def _env_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _env_world() -> int:
    """WORLD_SIZE as torchrun sets it (1 when run without torchrun)."""
    text = os.environ.get("WORLD_SIZE", "1")
    try:
        world = int(text)
    except ValueError:
        raise UsageError(f"WORLD_SIZE must be an integer, got {text!r} "
                         "(run with torchrun --nproc-per-node N)") from None
    if world < 1:
        raise UsageError(f"WORLD_SIZE must be >= 1, got {world}")
    return world


def _print(report: RunReport, as_json: bool, with_results: bool) -> None:
    from launch.report_view import json_line, summary_table

    summary = summarize(report)
    if as_json:
        obj = summary.as_dict()
        if with_results:
            obj["results"] = {r.rid: list(r.output_ids) for r in report.results}
        print(json_line(obj), flush=True)
    else:
        from rich.console import Console

        Console().print(summary_table(summary))


if __name__ == "__main__":
    sys.exit(main())
