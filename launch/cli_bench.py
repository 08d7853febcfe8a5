"""`dp-runtime bench NAME [ARGS...]`: run one of the scripts in the repository's ``bench/``.

Single-process benchmarks run as ``python bench/NAME.py ARGS``; the multi-rank ones (``dp_sync``,
``dispatch``, ``serve_load``, ``prefill``) under ``--nproc N`` run as ``torchrun --standalone
--nproc-per-node N bench/NAME.py ARGS`` (``python -m torch.distributed.run``, the same program, so
no PATH lookup). Arguments for the script follow the name; put ``--`` before them when they start
with a dash (``dp-runtime bench dispatch --nproc 2 -- --device cpu --quick``). The exit code is
the script's.

``bench/`` is found next to the installed packages: the project is installed editable, so the
repository root is the parent of ``launch/``.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["BENCHES", "BenchInfo", "bench", "bench_command", "bench_dir"]


@dataclass(frozen=True)
class BenchInfo:
    """A benchmark script: whether it runs one process per rank, and what it measures."""

    multi_rank: bool
    summary: str


BENCHES: dict[str, BenchInfo] = {
    "registry_fill": BenchInfo(
        False, "host and device cost of one registry fill vs a slot-by-slot loop"),
    "decode_graph": BenchInfo(
        False, "one decode step: eager, no-copy, graph replay, torch.compile"),
    "dp_sync": BenchInfo(True, "per-step DP sync (shm vs gloo) and dp_gather vs a raw all-gather"),
    "dispatch": BenchInfo(True, "dispatch + combine latency of the MoE dispatchers"),
    "serve_step": BenchInfo(
        True, "one serving step of a rank worker, end to end (DP N under torchrun)"),
    "serve_load": BenchInfo(
        True, "arriving requests at several rates: throughput, TTFT, ITL, TPOT, concurrency"),
    "serve_http": BenchInfo(
        False, "serve_load's workload through dp-runtime serve (HTTP, streaming) vs in-process"),
    "mixed_step": BenchInfo(
        False, "a mixed prefill+decode step against a decode step at the same batch"),
    "step_model": BenchInfo(
        False, "serve_load's steps at modelled costs: what a cheaper prompt token is worth"),
    "prefill": BenchInfo(
        True, "prefill throughput and MFU of the rank worker (one chunk, 8 x 1024, 64 x 128)"),
    "moe_layer": BenchInfo(
        False, "one MoE layer's experts: grouped GEMM vs Triton fused vs the bytes floor"),
    "fp8_kernels": BenchInfo(
        False, "FP8-weight expert and dense kernels (W8A16, W8A8) beside bf16, one GPU"),
    "fp8_tune": BenchInfo(
        False, "FP8 kernel tiles swept per row count beside the rules and bf16, one GPU"),
    "skinny_linear": BenchInfo(
        False, "1-4 row projections: the skinny Triton kernel vs cuBLAS vs the bytes floor"),
    "decode_attention": BenchInfo(
        False, "decode attention: FlashInfer's variants vs the Triton kernel vs the floor"),
    "prefill_attention": BenchInfo(
        False, "causal prefill attention: FlashInfer FA2 vs FA3 vs SDPA"),
    "draw_tokens": BenchInfo(
        False, "a step's token draw alone per sampling config (temperature, top-k/p) vs greedy"),
    "sync_probe": BenchInfo(
        False, "serve_load under torch's sync debug mode: where serving makes the host wait"),
    "memory_growth": BenchInfo(
        False, "what serving allocates beyond the profiled peak, by call site (prefix caching)"),
}


def bench_dir() -> Path:
    """The repository's ``bench/`` folder (the parent of ``launch/``, editable install)."""
    return Path(__file__).resolve().parent.parent / "bench"


def bench_command(name: str, args: list[str] | tuple[str, ...] = (), nproc: int | None = None,
                  root: Path | None = None) -> list[str]:
    """The argv that runs benchmark ``name`` with ``args`` (``nproc``: ranks under torchrun).

    Raises ValueError for an unknown name (listing the known ones), a script missing from
    ``root`` (default ``bench_dir()``), ``nproc`` on a single-process benchmark, or ``nproc < 1``.
    """
    if name not in BENCHES:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHES)}")
    script = (root or bench_dir()) / f"{name}.py"
    if not script.is_file():
        raise ValueError(f"benchmark {name!r} has no script at {script} (is this an editable "
                         f"install of the repository, and is the script written yet?)")
    if nproc is None:
        return [sys.executable, str(script), *args]
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if not BENCHES[name].multi_rank:
        multi = ", ".join(n for n, b in BENCHES.items() if b.multi_rank)
        raise ValueError(f"benchmark {name!r} runs in one process; --nproc is for {multi}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", str(script), *args]


def _listing() -> str:
    lines = []
    for name, info in BENCHES.items():
        present = (bench_dir() / f"{name}.py").is_file()
        ranks = "torchrun (--nproc N)" if info.multi_rank else "one process"
        lines.append(f"{name:<14} {ranks:<21} "
                     f"{info.summary}{'' if present else '  [script missing]'}")
    return "\n".join(lines)


def bench(
    name: str | None = typer.Argument(None, help=(
        "Benchmark: registry_fill, decode_graph, dp_sync, dispatch, serve_step, serve_load, "
        "prefill, moe_layer.")),
    args: Annotated[list[str] | None,
                    typer.Argument(help="Arguments passed to the script (after --).")] = None,
    nproc: int | None = typer.Option(
        None, "--nproc", help="Ranks under torchrun (dp_sync, dispatch, serve_load, prefill)."),
    list_: bool = typer.Option(False, "--list", help="List the benchmarks and exit."),
) -> None:
    """Run a benchmark script from bench/ and exit with its code."""
    if list_:
        typer.echo(_listing())
        return
    if name is None:
        typer.echo(f"error: name a benchmark; known:\n{_listing()}", err=True)
        raise typer.Exit(2)
    try:
        argv = bench_command(name, list(args or ()), nproc)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo("+ " + " ".join(argv), err=True)
    # The repository root as cwd: the scripts document themselves as run from there.
    code = subprocess.run(argv, cwd=bench_dir().parent, check=False).returncode
    raise typer.Exit(code)
