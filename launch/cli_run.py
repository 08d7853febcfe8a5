"""`dp-runtime run`: launch N ranks, send a workload, print throughput and latency.

With no options it runs on a fresh laptop: a private local Ray cluster, CPU, the tiny model,
2 ranks over gloo, 16 synthetic requests. ``--launcher local`` runs one rank in this process
(no Ray); ``--ray-address auto`` joins a running cluster, and inside ``ray job submit`` the job's
cluster is joined by itself. ``--json`` prints one JSON object (one line) on stdout instead of
the table and the progress bar.

Exit codes: 0 done; 1 the gang failed after every allowed restart; 2 bad options or workload.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import typer
from rich.console import Console

from launch.report_view import json_line, poll_progress, summary_table
from launch.run_config import RunConfig
from launch.run_report import GangFailedError, RunReport, summarize

__all__ = ["execute", "run"]

LAUNCHERS = ("ray", "local")
DEVICES = ("auto", "cpu", "cuda")


def execute(cfg: RunConfig, *, launcher: str = "ray", device: str = "auto", ray_address: str | None = None,
            max_restarts: int = 2, hang_timeout_s: float = 120.0, num_cpus: int | None = None,
            on_poll=None, show_progress: bool = False, log_to_driver: bool = True) -> RunReport:
    """Run ``cfg`` with ``launcher`` and return the RunReport (what the CLI prints).

    The Ray path connects (or starts a private local cluster with ``num_cpus``, default
    ``max(dp, cpu count)``), resolves ``device`` against the cluster, and shuts Ray down again
    when it started it. Raises ValueError/WorkloadError for bad options, GangFailedError when
    restarts are exhausted.
    """
    if launcher not in LAUNCHERS:
        raise ValueError(f"--launcher must be one of {LAUNCHERS}, got {launcher!r}")
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {DEVICES}, got {device!r}")
    requests = cfg.load_requests()  # before any cluster starts: a bad file fails fast
    if launcher == "local":
        from launch.local_launcher import launch_local
        from launch.process_group import resolve_device

        spec = cfg.spec(resolve_device(device))
        return launch_local(spec, requests, on_poll=on_poll, show_progress=show_progress)

    import ray

    from launch.ray_cluster import cluster_device, connect_ray
    from launch.ray_launcher import LaunchOptions, launch_ray

    cpus = num_cpus or max(cfg.dp, os.cpu_count() or 1)
    started = connect_ray(ray_address, num_cpus=cpus, log_to_driver=log_to_driver)
    try:
        spec = cfg.spec(cluster_device(device))
        options = LaunchOptions(max_restarts=max_restarts, hang_timeout_s=hang_timeout_s, show_progress=show_progress)
        return launch_ray(spec, requests, options, on_poll=on_poll)
    finally:
        if started:
            ray.shutdown()


@contextmanager
def _launch_logging(console: Console, as_json: bool):
    """Launcher warnings (rank failures, restarts) on stderr while the command runs."""
    log = logging.getLogger("launch")
    if as_json:
        handler: logging.Handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    else:
        from rich.logging import RichHandler

        handler = RichHandler(console=console, show_path=False)
    log.addHandler(handler)
    previous = log.level
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(previous)


def run(
    dp: int = typer.Option(None, "--dp", help="DP ranks (default: 2 with --launcher ray, 1 with local)."),
    model: str = typer.Option("tiny", "--model", help="Preset name (tiny, qwen3-30b-a3b) or a HF checkpoint dir."),
    dispatcher: str = typer.Option("auto", "--dispatcher", help="auto | all_gather | all_to_all | flashinfer."),
    requests: int = typer.Option(16, "--requests", help="Synthetic requests (ignored with --workload)."),
    prompt_len: int = typer.Option(32, "--prompt-len", help="Synthetic prompt length in tokens."),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Tokens to generate per request."),
    workload: str = typer.Option(None, "--workload", help="JSONL file, one request per line (see docs/launch.md)."),
    launcher: str = typer.Option("ray", "--launcher", help="ray (one actor per rank) | local (1 rank, in-process)."),
    ray_address: str = typer.Option(None, "--ray-address", help="Default: a private local cluster (or the job's "
                                    "cluster under ray job submit); 'auto' joins the running one; or host:port."),
    max_restarts: int = typer.Option(2, "--max-restarts", help="Gang restarts allowed after a rank fails."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16 | float16."),
    max_running_requests: int = typer.Option(64, "--max-running-requests", help="Decode batch cap per rank."),
    chunked_prefill_size: int = typer.Option(2048, "--chunked-prefill-size", help="Prefill chunk in tokens per rank."),
    hang_timeout: float = typer.Option(120.0, "--hang-timeout", help="Seconds without a step before a rank is hung."),
    num_cpus: int = typer.Option(None, "--num-cpus", help="Logical CPUs of a local Ray cluster (default: max(dp, cores))."),
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic workload and the random weights."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of the table."),
    with_results: bool = typer.Option(False, "--results", help="With --json: add every request's output ids."),
) -> None:
    """Launch ranks, send a synthetic or file workload, print throughput and latency."""
    out = Console()
    err = Console(stderr=True)
    try:
        if dp is None:
            dp = 1 if launcher == "local" else 2
        if launcher == "local" and dp != 1:
            raise ValueError(f"--launcher local runs one rank; got --dp {dp} (use --launcher ray)")
        cfg = RunConfig(dp=dp, model=model, dispatcher=dispatcher, requests=requests, prompt_len=prompt_len,
                        max_new_tokens=max_new_tokens, workload=workload or None, dtype=dtype,
                        max_running_requests=max_running_requests, chunked_prefill_size=chunked_prefill_size,
                        seed=seed)
        total = len(cfg.load_requests())
        with _launch_logging(err, as_json), poll_progress(err, total, enabled=not as_json) as on_poll:
            report = execute(cfg, launcher=launcher, device=device, ray_address=ray_address,
                             max_restarts=max_restarts, hang_timeout_s=hang_timeout, num_cpus=num_cpus,
                             on_poll=on_poll, show_progress=not as_json, log_to_driver=not as_json)
    except GangFailedError as e:
        if as_json:
            typer.echo(json_line({"error": str(e), "failures": [f.describe() for f in e.failures],
                                  "finished": len(e.report.results) if e.report else 0}))
        else:
            err.print(f"[red]error:[/red] {e}")
            for f in e.failures:
                err.print(f"  {f.describe()}")
        raise typer.Exit(1) from None
    except (ValueError, OSError) as e:
        if as_json:
            typer.echo(json_line({"error": str(e)}))
        else:
            err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    summary = summarize(report)
    if as_json:
        obj = {"submitted": total, **summary.as_dict()}
        if with_results:
            obj["results"] = {r.rid: list(r.output_ids) for r in report.results}
        typer.echo(json_line(obj))
    else:
        out.print(summary_table(summary))
