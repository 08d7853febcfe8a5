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
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import torch.distributed as dist

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.admission import admit
from dp_runtime.serving.request import Request
from launch import process_group
from launch.rank_session import ERROR, RankSession
from launch.run_config import RunConfig
from launch.run_report import RunReport, summarize
from launch.workload import split_round_robin

__all__ = ["main", "run_torchrun"]


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
        raise RuntimeError(f"{len(missing)} requests have no result after every rank finished: {missing[:5]}")
    return RunReport(
        results=tuple(by_rid[r.rid] for r in requests), world_size=world, launcher="torchrun",
        device=spec.runtime.device.type, wall_s=time.perf_counter() - t0,
        run_s=max(p[2] for p in gathered), setup_s=max(p[3] for p in gathered),
        rank_metrics=tuple(p[1] for p in gathered),
    )


def _parser() -> argparse.ArgumentParser:
    d = RunConfig()
    p = argparse.ArgumentParser(prog="torchrun ... -m launch.torchrun_main", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model)
    p.add_argument("--dispatcher", default=d.dispatcher)
    p.add_argument("--requests", type=int, default=d.requests)
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--workload", default=None, help="JSONL file, one request per line")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default=d.dtype)
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--pg-timeout", type=float, default=process_group.DEFAULT_TIMEOUT_S,
                   help="seconds before a collective gives up (a dead peer)")
    p.add_argument("--json", action="store_true", help="one JSON line on rank 0 instead of a table")
    p.add_argument("--results", action="store_true", help="with --json: add every request's output ids")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = process_group.resolve_device(args.device)
    info = process_group.init_from_env(device=device, timeout_s=args.pg_timeout)
    try:
        cfg = RunConfig(dp=info.world_size, model=args.model, dispatcher=args.dispatcher, requests=args.requests,
                        prompt_len=args.prompt_len, max_new_tokens=args.max_new_tokens, workload=args.workload,
                        dtype=args.dtype, max_running_requests=args.max_running_requests,
                        chunked_prefill_size=args.chunked_prefill_size, seed=args.seed)
        report = run_torchrun(cfg.spec(device), cfg.load_requests())
    finally:
        process_group.destroy_process_group()
    if report is not None:
        _print(report, args.json, args.results)
    return 0


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
