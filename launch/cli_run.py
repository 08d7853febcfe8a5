"""`dp-runtime run`: launch N ranks, send a workload, print throughput and latency.

With no options it runs on a fresh laptop: a private local Ray cluster, CPU, the tiny model,
2 ranks over gloo, 16 synthetic requests. ``--launcher local`` runs one rank in this process
(no Ray); ``--ray-address auto`` joins a running cluster, and inside ``ray job submit`` the job's
cluster is joined by itself. ``--json`` prints one JSON object (one line) on stdout instead of
the table and the progress bar.

Every option is checked before anything slow starts (torch, Ray), and a bad one is named as it
was typed. Exit codes (``cli_errors``): 0 done; 1 the gang failed after every allowed restart
(or a bug, with its traceback); 2 a user error (one line on stderr; ``--debug`` adds the
traceback); 130 Ctrl-C, 143 SIGTERM, after the ranks and a Ray cluster this command started are
stopped.

Nothing heavy is imported at module level: ``dp-runtime --help`` must not import torch.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import typer

from dp_runtime.options import DEFAULTS as D
from launch.cli_errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_REQUESTS_FAILED,
    EXIT_TERMINATED,
    EXIT_USAGE,
    UsageError,
    check_choice,
    error_line,
    is_user_error,
    print_error,
)
from launch.cli_options import (
    DEVICES,
    LAUNCHERS,
    CheckedOptions,
    check_gang_options,
    check_launch,
    check_synthetic_fits,
)
from launch.interrupts import sigterm_raises

if TYPE_CHECKING:
    from launch.run_config import RunConfig
    from launch.run_report import RunReport

__all__ = ["check_launch", "check_run_options", "execute", "run"]

def execute(cfg: RunConfig, *, launcher: str = "ray", device: str = "auto",
            ray_address: str | None = None, max_restarts: int | None = None,
            hang_timeout_s: float | None = None, num_cpus: int | None = None, on_poll=None,
            on_phase: Callable[[str], None] | None = None, show_progress: bool = False,
            log_to_driver: bool = True, log_level: str | None = None, requests: list | None = None,
            started_at: float | None = None) -> RunReport:
    """Run ``cfg`` through one Engine (``engine_run.run_requests``) and return the RunReport
    (what the CLI prints).

    The Ray path connects (or starts a private local cluster with ``num_cpus``, default
    ``max(dp, cpu count)``), resolves ``device`` against the cluster, and stops Ray again when it
    started it. ``requests`` (default ``cfg.load_requests()``) are checked before any cluster
    starts. The report's ``wall_s`` runs from ``started_at`` (a ``time.perf_counter()``; default:
    now) to the end, Ray's start and stop included; ``ray_start_s`` is starting or joining Ray.
    ``log_level``: the level of this project's logs in the Ray rank processes (None: Ray's).
    ``max_restarts`` and ``hang_timeout_s`` default to the engine's (EngineOptions).
    Raises ValueError/WorkloadError for bad options, GangFailedError when restarts are exhausted,
    KeyboardInterrupt after cleaning up on Ctrl-C.
    """
    import os

    from launch.engine_run import run_requests
    from launch.engine_types import EngineOptions

    t0 = time.perf_counter() if started_at is None else started_at
    check_choice("--launcher", launcher, LAUNCHERS)
    check_choice("--device", device, DEVICES)
    if requests is None:
        requests = cfg.load_requests()  # before any cluster starts: a bad file fails fast
    phase = on_phase or (lambda text: None)
    bounds = {k: v for k, v in dict(max_restarts=max_restarts,
                                    hang_timeout_s=hang_timeout_s).items()
              if v is not None}
    # The workload's own sampling fields rule: the checkpoint's generation defaults are a door's.
    options = EngineOptions(launcher=launcher, ray_address=ray_address, show_progress=show_progress,
                            sampling_defaults="none", log_to_driver=log_to_driver,
                            log_level=log_level, **bounds)
    if launcher == "local":
        from launch.process_group import resolve_device

        spec = cfg.spec(resolve_device(device))
        report = run_requests(spec, requests, options, on_poll=on_poll, on_phase=on_phase)
        return replace(report, wall_s=time.perf_counter() - t0)

    from launch.ray_cluster import cluster_device, connect_ray, joins_existing_cluster, stop_ray

    cpus = num_cpus or max(cfg.dp, os.cpu_count() or 1)
    t_ray = time.perf_counter()
    if joins_existing_cluster(ray_address):
        phase(f"connecting to Ray ({ray_address or os.environ.get('RAY_ADDRESS')})")
    else:
        phase(f"starting Ray (a private local cluster, {cpus} CPUs)")
    # Connected here, not by the engine: the ranks' device is the cluster's, known once joined.
    started = connect_ray(ray_address, num_cpus=cpus, log_to_driver=log_to_driver,
                          log_level=log_level)
    ray_start_s = time.perf_counter() - t_ray
    try:
        spec = cfg.spec(cluster_device(device))
        report = run_requests(spec, requests, options, on_poll=on_poll, on_phase=on_phase)
    finally:
        if started:
            phase("stopping Ray")
            stop_ray()
    return replace(report, wall_s=time.perf_counter() - t0, ray_start_s=ray_start_s)


@contextmanager
def _launch_logging(console: Any, as_json: bool, level: str):
    """Launcher and runtime logs (rank failures, restarts, choices) on stderr at ``level``."""
    from launch.ray_cluster import LOGGERS

    loggers = [logging.getLogger(name) for name in LOGGERS]
    if as_json:
        handler: logging.Handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    else:
        from rich.logging import RichHandler

        handler = RichHandler(console=console, show_path=False)
    previous = [(log, log.level, log.propagate) for log in loggers]
    for log in loggers:
        log.addHandler(handler)
        log.setLevel(level.upper())
        log.propagate = False
    try:
        yield
    finally:
        for log, lvl, prop in previous:
            log.removeHandler(handler)
            log.setLevel(lvl)
            log.propagate = prop


def run(
    dp: int = typer.Option(None, "--dp", show_default="2 with --launcher ray, 1 with local",
                           help="DP ranks."),
    model: str = typer.Option("tiny", "--model",
                              help="Preset name (tiny, qwen3-30b-a3b) or a HF checkpoint dir."),
    dispatcher: str = typer.Option(D.dispatcher, "--dispatcher", help=(
        "auto | local (one rank) | all_gather | all_to_all | flashinfer.")),
    requests: int = typer.Option(16, "--requests",
                                 help="Synthetic requests (ignored with --workload)."),
    prompt_len: int = typer.Option(32, "--prompt-len", help="Synthetic prompt length in tokens."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens",
                                       help="Tokens to generate per request."),
    workload: str = typer.Option(None, "--workload",
                                 help="JSONL file, one request per line (see docs/launch.md)."),
    launcher: str = typer.Option("ray", "--launcher",
                                 help="ray (one actor per rank) | local (1 rank, in-process)."),
    ray_address: str = typer.Option(None, "--ray-address", show_default="a private local cluster",
                                    help=("'auto' joins the running cluster; or host:port (under "
                                          "ray job submit: the job's cluster).")),
    max_restarts: int = typer.Option(None, "--max-restarts", show_default=str(D.max_restarts),
                                     help="Gang restarts allowed after a rank fails."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    dtype: str = typer.Option(D.dtype, "--dtype", help=(
        "auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16.")),
    max_running_requests: int = typer.Option(D.max_running_requests, "--max-running-requests",
                                             help="Decode batch cap per rank."),
    chunked_prefill_size: int = typer.Option(D.chunked_prefill_size, "--chunked-prefill-size",
                                             help="Prefill chunk in tokens per rank."),
    schedule_policy: str = typer.Option(D.schedule_policy, "--schedule-policy", help=(
        "Admission order: fcfs (arrival) | lof (longest output first: the most "
        "--max-new-tokens).")),
    mixed_step_tokens: str = typer.Option(str(D.mixed_step_tokens), "--mixed-step-tokens",
                                          show_default="auto: the largest extend graph", help=(
        "Most tokens of a mixed prefill+decode step, its decode rows included: "
        "1..--chunked-prefill-size.")),
    kv_cache_dtype: str = typer.Option(D.kv_cache_dtype, "--kv-cache-dtype", help=(
        "KV cache storage: auto (the model's dtype) | fp8_e4m3 (FP8, scale 1: half the bytes "
        "per token, twice the slots; K/V rounded to e4m3).")),
    prefix_caching: bool = typer.Option(
        D.prefix_caching, "--prefix-caching/--no-prefix-caching",
        help="Reuse the KV of prompt prefixes cached from earlier requests on the same rank."),
    quantization: str = typer.Option(D.quantization, "--quantization", help=(
        "Weights: none (as the checkpoint stores them; an FP8 checkpoint is served FP8) | fp8 "
        "(float weights quantized at load to FP8 in 128x128 blocks).")),
    context_len: int = typer.Option(None, "--context-len", show_default="min(model limit, 4096)",
                                    help=("Longest prompt + output; a request over it is "
                                          "refused alone.")),
    hang_timeout: float = typer.Option(None, "--hang-timeout", show_default=f"{D.hang_timeout_s:g}",
                                       help="Seconds without a step before a rank is hung."),
    num_cpus: int = typer.Option(None, "--num-cpus", show_default="max(dp, cores)",
                                 help=("Logical CPUs of the private local Ray cluster "
                                       "(refused when joining one).")),
    seed: int = typer.Option(D.seed, "--seed",
                             help="Seed of the synthetic workload and the random weights."),
    as_json: bool = typer.Option(False, "--json",
                                 help="Print one JSON object instead of the table."),
    with_results: bool = typer.Option(False, "--results",
                                      help="With --json: add every request's output ids."),
    log_level: str = typer.Option("warning", "--log-level", help=(
        "debug | info | warning | error (launcher, runtime and rank logs).")),
    debug: bool = typer.Option(False, "--debug", help="Print the traceback of an error."),
) -> None:
    """Launch ranks, send a synthetic or file workload, print throughput and latency.

    Exit codes: 0 every request served; 1 the gang failed; 2 a user error; 3 some requests
    failed (listed); 130 interrupted; 143 terminated (SIGTERM).
    """
    t0 = time.perf_counter()
    o = dict(dp=dp, model=model, dispatcher=dispatcher, requests=requests, prompt_len=prompt_len,
             max_new_tokens=max_new_tokens, workload=workload or None, launcher=launcher,
             ray_address=ray_address, max_restarts=max_restarts, device=device, dtype=dtype,
             max_running_requests=max_running_requests, chunked_prefill_size=chunked_prefill_size,
             schedule_policy=schedule_policy, mixed_step_tokens=mixed_step_tokens,
             kv_cache_dtype=kv_cache_dtype, prefix_caching=prefix_caching,
             quantization=quantization, context_len=context_len, hang_timeout=hang_timeout,
             num_cpus=num_cpus, seed=seed, as_json=as_json, with_results=with_results,
             log_level=log_level)
    try:
        # A supervisor's SIGTERM stops the ranks and Ray as Ctrl-C does (a KeyboardInterrupt).
        with sigterm_raises() as terminated:
            code = _run(t0, o, debug)
    except KeyboardInterrupt:
        typer.echo("terminated" if terminated else "interrupted", err=True)
        code = EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    if code:
        raise typer.Exit(code)


def check_run_options(o: dict[str, Any]) -> CheckedOptions:
    """Every option of ``run`` (the keywords of ``run`` but ``debug``), alone and together
    (``cli_options.check_gang_options`` plus the workload's): raises UsageError naming the
    option, or the ValueError of a model or runtime rule. Starts nothing."""
    if o["with_results"] and not o["as_json"]:
        raise UsageError("--results adds every request's output ids to the --json object; "
                         "add --json")
    gang_keys = ("model", "launcher", "device", "dtype", "dp", "dispatcher", "ray_address",
                 "max_running_requests", "chunked_prefill_size", "schedule_policy",
                 "mixed_step_tokens", "kv_cache_dtype", "context_len", "num_cpus", "max_restarts",
                 "hang_timeout", "log_level")
    run_keys = ("requests", "prompt_len", "max_new_tokens", "workload", "seed", "prefix_caching",
                "quantization")
    opts = check_gang_options(**{k: o[k] for k in gang_keys}, **{k: o[k] for k in run_keys})
    check_synthetic_fits(opts.cfg, opts.spec)
    return opts


def _run(t0: float, o: dict[str, Any], debug: bool) -> int:
    """The run command's body; returns the exit code."""
    as_json = o["as_json"]
    try:
        opts = check_run_options(o)
        reqs = opts.cfg.load_requests()  # still before any cluster starts: a bad file fails fast
    except Exception as e:
        if not is_user_error(e):
            raise
        return _user_error(e, as_json, debug)

    from rich.console import Console
    from rich.markup import escape

    from launch.report_view import RunProgress, json_line, summary_table
    from launch.run_report import GangFailedError, summarize

    # Ray forwards the ranks' output only when asked: with --json, only for the logs asked for.
    forward = not as_json or o["log_level"] in ("debug", "info")
    err = Console(stderr=True)
    progress = RunProgress(err, len(reqs), enabled=not as_json)
    try:
        with _launch_logging(err, as_json, o["log_level"]):
            report = execute(opts.cfg, **opts.launch, requests=reqs, on_poll=progress.poll,
                             on_phase=progress.phase, show_progress=not as_json,
                             log_to_driver=forward, log_level=o["log_level"], started_at=t0)
    except GangFailedError as e:
        progress.close()
        if debug:
            print_error(e, debug=True)
        if as_json:
            done = summarize(e.report).as_dict() if e.report else {}
            typer.echo(json_line({"error": str(e), "failures": [f.describe() for f in e.failures],
                                  "finished": len(e.report.results) if e.report else 0,
                                  "errors": done.get("errors", []),
                                  "nodes": done.get("nodes", {})}))
        err.print(f"[red]error:[/red] {escape(str(e))}", highlight=False)
        for f in e.failures:
            err.print(f"  {escape(f.describe())}", highlight=False)
        return EXIT_FAILED
    except Exception as e:
        progress.close()
        if not is_user_error(e):
            raise
        return _user_error(e, as_json, debug)
    finally:
        progress.close()
    summary = summarize(report)
    if as_json:
        obj = {"submitted": len(reqs), **summary.as_dict()}
        if o["with_results"]:
            obj["results"] = {r.rid: list(r.output_ids) for r in report.results}
        typer.echo(json_line(obj))
    else:
        Console().print(summary_table(summary))
    if summary.failed:
        # One line on stderr too, so a script reading only the exit code and stderr knows why.
        first = summary.errors[0]
        more = f" (and {summary.failed - 1} more)" if summary.failed > 1 else ""
        print(f"error: {summary.failed} of {summary.requests} requests failed; "
              f"first: {first.describe()}{more}", file=sys.stderr, flush=True)
        return EXIT_REQUESTS_FAILED
    return 0


def _user_error(exc: BaseException, as_json: bool, debug: bool) -> int:
    """One line on stderr (and the error object on stdout with --json); exit code 2."""
    if as_json:
        from launch.report_view import json_line

        typer.echo(json_line({"error": error_line(exc)}))
    print_error(exc, debug=debug)
    return EXIT_USAGE
