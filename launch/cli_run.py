"""`dp-runtime run`: launch N ranks, send a workload, print throughput and latency.

With no options it runs on a fresh laptop: a private local Ray cluster, CPU, the tiny model,
2 ranks over gloo, 16 synthetic requests. ``--launcher local`` runs one rank in this process
(no Ray); ``--ray-address auto`` joins a running cluster, and inside ``ray job submit`` the job's
cluster is joined by itself. ``--json`` prints one JSON object (one line) on stdout instead of
the table and the progress bar.

Every option is checked before anything slow starts (torch, Ray), and a bad one is named as it
was typed. Exit codes (``cli_errors``): 0 done; 1 the gang failed after every allowed restart
(or a bug, with its traceback); 2 a user error (one line on stderr; ``--debug`` adds the
traceback); 130 Ctrl-C, after the ranks and a Ray cluster this command started are stopped.

Nothing heavy is imported at module level: ``dp-runtime --help`` must not import torch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import typer

from launch.cli_errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    LOG_LEVELS,
    UsageError,
    check_choice,
    error_line,
    is_user_error,
    print_error,
)

if TYPE_CHECKING:
    from launch.run_config import RunConfig
    from launch.run_report import RunReport

__all__ = ["check_launch", "execute", "run"]

LAUNCHERS = ("ray", "local")
DEVICES = ("auto", "cpu", "cuda")
_RAY_ONLY = ("--ray-address", "--num-cpus", "--max-restarts", "--hang-timeout")
_LOGGERS = ("launch", "dp_runtime", "dispatcher", "graph", "buffers")  # this project's packages


def check_launch(*, launcher: str, device: str, dp: int | None, ray_address: str | None = None,
                 num_cpus: int | None = None, max_restarts: int | None = None,
                 hang_timeout: float | None = None, as_json: bool = False, with_results: bool = False,
                 log_level: str = "warning", ray_address_env: str | None = None) -> tuple[int, dict[str, Any]]:
    """Check the launch options of ``run`` (pure, no imports); returns ``(dp, choice)``, choice
    being the launch keywords of ``execute`` with their defaults filled in.

    ``None`` means "not given" (its default applies). ``ray_address_env`` is RAY_ADDRESS (set
    inside ``ray job submit``). Raises UsageError naming the option as typed: an unknown choice,
    a number out of range, ``--results`` without ``--json``, a Ray option with ``--launcher
    local``, ``--num-cpus`` when the run joins an existing cluster (it sizes only a private one)
    or when it cannot hold ``--dp`` ranks of one CPU each.
    """
    check_choice("--launcher", launcher, LAUNCHERS)
    check_choice("--device", device, DEVICES)
    check_choice("--log-level", log_level, LOG_LEVELS)
    if with_results and not as_json:
        raise UsageError("--results adds every request's output ids to the --json object; add --json")
    if dp is None:
        dp = 1 if launcher == "local" else 2
    if dp < 1:
        raise UsageError(f"--dp must be an integer >= 1, got {dp}")
    if launcher == "local":
        if dp != 1:
            raise UsageError(f"--launcher local runs one rank; got --dp {dp} (use --launcher ray)")
        given = [opt for opt, v in zip(_RAY_ONLY, (ray_address, num_cpus, max_restarts, hang_timeout), strict=True)
                 if v is not None]
        if given:
            raise UsageError(f"{given[0]} applies to --launcher ray; --launcher local runs one rank in this process")
    if num_cpus is not None:
        if num_cpus < 1:
            raise UsageError(f"--num-cpus must be an integer >= 1, got {num_cpus}")
        if ray_address is not None or ray_address_env:
            where = f"--ray-address {ray_address}" if ray_address is not None else "RAY_ADDRESS (a Ray job)"
            raise UsageError(f"--num-cpus sizes a private local cluster; with {where} the run joins an existing "
                             f"cluster, whose CPUs are its own")
        if num_cpus < dp:
            raise UsageError(f"--num-cpus {num_cpus} cannot hold --dp {dp} ranks of one CPU each")
    if max_restarts is not None and max_restarts < 0:
        raise UsageError(f"--max-restarts must be an integer >= 0, got {max_restarts}")
    if hang_timeout is not None and not (math.isfinite(hang_timeout) and hang_timeout > 0):
        raise UsageError(f"--hang-timeout must be a number of seconds > 0, got {hang_timeout}")
    if ray_address is not None and not ray_address.strip():
        raise UsageError("--ray-address must not be empty (leave it out for a private local cluster)")
    choice = dict(launcher=launcher, device=device, ray_address=ray_address, num_cpus=num_cpus,
                  max_restarts=2 if max_restarts is None else max_restarts,
                  hang_timeout_s=120.0 if hang_timeout is None else hang_timeout)
    return dp, choice


def execute(cfg: RunConfig, *, launcher: str = "ray", device: str = "auto", ray_address: str | None = None,
            max_restarts: int = 2, hang_timeout_s: float = 120.0, num_cpus: int | None = None,
            on_poll=None, on_phase: Callable[[str], None] | None = None, show_progress: bool = False,
            log_to_driver: bool = True, requests: list | None = None,
            started_at: float | None = None) -> RunReport:
    """Run ``cfg`` with ``launcher`` and return the RunReport (what the CLI prints).

    The Ray path connects (or starts a private local cluster with ``num_cpus``, default
    ``max(dp, cpu count)``), resolves ``device`` against the cluster, and stops Ray again when it
    started it. ``requests`` (default ``cfg.load_requests()``) are checked before any cluster
    starts. The report's ``wall_s`` runs from ``started_at`` (a ``time.perf_counter()``; default:
    now) to the end, Ray's start and stop included; ``ray_start_s`` is starting or joining Ray.
    Raises ValueError/WorkloadError for bad options, GangFailedError when restarts are exhausted,
    KeyboardInterrupt after cleaning up on Ctrl-C.
    """
    import os

    t0 = time.perf_counter() if started_at is None else started_at
    check_choice("--launcher", launcher, LAUNCHERS)
    check_choice("--device", device, DEVICES)
    if requests is None:
        requests = cfg.load_requests()  # before any cluster starts: a bad file fails fast
    phase = on_phase or (lambda text: None)
    if launcher == "local":
        from launch.local_launcher import launch_local
        from launch.process_group import resolve_device

        spec = cfg.spec(resolve_device(device))
        report = launch_local(spec, requests, on_poll=on_poll, show_progress=show_progress, on_phase=on_phase)
        return replace(report, wall_s=time.perf_counter() - t0)

    from launch.ray_cluster import cluster_device, connect_ray, joins_existing_cluster, stop_ray
    from launch.ray_launcher import LaunchOptions, launch_ray

    cpus = num_cpus or max(cfg.dp, os.cpu_count() or 1)
    t_ray = time.perf_counter()
    if joins_existing_cluster(ray_address):
        phase(f"connecting to Ray ({ray_address or os.environ.get('RAY_ADDRESS')})")
    else:
        phase(f"starting Ray (a private local cluster, {cpus} CPUs)")
    started = connect_ray(ray_address, num_cpus=cpus, log_to_driver=log_to_driver)
    ray_start_s = time.perf_counter() - t_ray
    try:
        spec = cfg.spec(cluster_device(device))
        options = LaunchOptions(max_restarts=max_restarts, hang_timeout_s=hang_timeout_s, show_progress=show_progress)
        report = launch_ray(spec, requests, options, on_poll=on_poll, on_phase=on_phase)
    finally:
        if started:
            phase("stopping Ray")
            stop_ray()
    return replace(report, wall_s=time.perf_counter() - t0, ray_start_s=ray_start_s)


@contextmanager
def _launch_logging(console: Any, as_json: bool, level: str):
    """Launcher and runtime logs (rank failures, restarts, choices) on stderr at ``level``."""
    loggers = [logging.getLogger(name) for name in _LOGGERS]
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
    dp: int = typer.Option(None, "--dp", help="DP ranks (default: 2 with --launcher ray, 1 with local)."),
    model: str = typer.Option("tiny", "--model", help="Preset name (tiny, qwen3-30b-a3b) or a HF checkpoint dir."),
    dispatcher: str = typer.Option("auto", "--dispatcher", help="auto | local (one rank) | all_gather | all_to_all | flashinfer."),
    requests: int = typer.Option(16, "--requests", help="Synthetic requests (ignored with --workload)."),
    prompt_len: int = typer.Option(32, "--prompt-len", help="Synthetic prompt length in tokens."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Tokens to generate per request."),
    workload: str = typer.Option(None, "--workload", help="JSONL file, one request per line (see docs/launch.md)."),
    launcher: str = typer.Option("ray", "--launcher", help="ray (one actor per rank) | local (1 rank, in-process)."),
    ray_address: str = typer.Option(None, "--ray-address", help="Default: a private local cluster (or the job's "
                                    "cluster under ray job submit); 'auto' joins the running one; or host:port."),
    max_restarts: int = typer.Option(None, "--max-restarts", help="Gang restarts allowed after a rank fails [default: 2]."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16."),
    max_running_requests: int = typer.Option(64, "--max-running-requests", help="Decode batch cap per rank."),
    chunked_prefill_size: int = typer.Option(2048, "--chunked-prefill-size", help="Prefill chunk in tokens per rank."),
    hang_timeout: float = typer.Option(None, "--hang-timeout", help="Seconds without a step before a rank is hung [default: 120]."),
    num_cpus: int = typer.Option(None, "--num-cpus", help="Logical CPUs of the private local Ray cluster "
                                 "(default: max(dp, cores); refused when joining a cluster)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic workload and the random weights."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    with_results: bool = typer.Option(False, "--results", help="With --json: add every request's output ids."),
    log_level: str = typer.Option("warning", "--log-level", help="debug | info | warning | error (launcher and runtime logs)."),
    debug: bool = typer.Option(False, "--debug", help="Print the traceback of an error."),
) -> None:
    """Launch ranks, send a synthetic or file workload, print throughput and latency."""
    t0 = time.perf_counter()
    try:
        code = _run(t0, dict(dp=dp, model=model, dispatcher=dispatcher, requests=requests, prompt_len=prompt_len,
                             max_new_tokens=max_new_tokens, workload=workload or None, launcher=launcher,
                             ray_address=ray_address, max_restarts=max_restarts, device=device, dtype=dtype,
                             max_running_requests=max_running_requests, chunked_prefill_size=chunked_prefill_size,
                             hang_timeout=hang_timeout, num_cpus=num_cpus, seed=seed, as_json=as_json,
                             with_results=with_results, log_level=log_level), debug)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        code = EXIT_INTERRUPTED
    if code:
        raise typer.Exit(code)


def _run(t0: float, o: dict[str, Any], debug: bool) -> int:
    """The run command's body; returns the exit code."""
    import os

    from launch.run_config import RunConfig

    as_json = o["as_json"]
    try:
        dp, choice = check_launch(launcher=o["launcher"], device=o["device"], dp=o["dp"],
                                  ray_address=o["ray_address"], num_cpus=o["num_cpus"],
                                  max_restarts=o["max_restarts"], hang_timeout=o["hang_timeout"], as_json=as_json,
                                  with_results=o["with_results"], log_level=o["log_level"],
                                  ray_address_env=os.environ.get("RAY_ADDRESS"))
        cfg = RunConfig(dp=dp, model=o["model"], dispatcher=o["dispatcher"], requests=o["requests"],
                        prompt_len=o["prompt_len"], max_new_tokens=o["max_new_tokens"], workload=o["workload"],
                        dtype=o["dtype"], max_running_requests=o["max_running_requests"],
                        chunked_prefill_size=o["chunked_prefill_size"], seed=o["seed"])
        # What needs the model and torch, still before any cluster starts.
        reqs = cfg.load_requests()
        cfg.spec(_provisional_device(choice["device"], choice["launcher"], choice["ray_address"]))
    except Exception as e:
        if not is_user_error(e):
            raise
        return _user_error(e, as_json, debug)

    from rich.console import Console

    from launch.report_view import RunProgress, json_line, summary_table
    from launch.run_report import GangFailedError, summarize

    err = Console(stderr=True)
    progress = RunProgress(err, len(reqs), enabled=not as_json)
    try:
        with _launch_logging(err, as_json, o["log_level"]):
            report = execute(cfg, **choice, requests=reqs, on_poll=progress.poll, on_phase=progress.phase,
                             show_progress=not as_json, log_to_driver=not as_json, started_at=t0)
    except GangFailedError as e:
        progress.close()
        if debug:
            print_error(e, debug=True)
        if as_json:
            typer.echo(json_line({"error": str(e), "failures": [f.describe() for f in e.failures],
                                  "finished": len(e.report.results) if e.report else 0}))
        err.print(f"[red]error:[/red] {e}", highlight=False)
        for f in e.failures:
            err.print(f"  {f.describe()}", highlight=False)
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
    return 0


def _provisional_device(device: str, launcher: str, ray_address: str | None) -> str:
    """The device to check the spec against before Ray starts: the asked one, else what this
    machine has (a private cluster is this machine; a joined one is checked again once known).
    Raises UsageError for ``--device cuda`` where the ranks would run here and torch sees no GPU."""
    import os

    import torch

    here = launcher == "local" or (ray_address is None and not os.environ.get("RAY_ADDRESS"))
    if device == "cuda" and here and not torch.cuda.is_available():
        raise UsageError("--device cuda, but torch sees no CUDA GPU on this machine (use --device cpu or auto)")
    if device != "auto":
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def _user_error(exc: BaseException, as_json: bool, debug: bool) -> int:
    """One line on stderr (and the error object on stdout with --json); exit code 2."""
    if as_json:
        from launch.report_view import json_line

        typer.echo(json_line({"error": error_line(exc)}))
    print_error(exc, debug=debug)
    return EXIT_USAGE
