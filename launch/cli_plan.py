"""`dp-runtime plan`: the capacity planner on the command line (a table, or --json).

``--measure`` (one CUDA GPU) builds the planned rank with ``RankWorker``, which sizes its own KV
cache (profile step, graphs' reserve), and prints predicted beside measured bytes for every
component it reports (``planner.compare_measured``).

The planner (and torch) is imported inside the command: ``--help`` answers without them.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import typer

from dp_runtime.model.quant_config import QUANTIZATION_CHOICES
from dp_runtime.options import DEFAULTS as D
from launch.cli_errors import EXIT_USAGE, UsageError, check_choice
from launch.gpu_specs import GIB, GPUS, gpu_spec
from launch.run_config import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from launch.planner import CapacityPlan, ComparisonRow, PlanInput

__all__ = ["MEASURE_SCHEMA", "measure_workload", "parse_graph_sizes", "plan"]

MEASURE_SCHEMA = "dp-runtime.plan-measure/5"


def parse_graph_sizes(text: str) -> tuple[int, ...] | str:
    """``"auto"`` -> ``"auto"``; ``"none"`` or ``""`` -> ``()`` (no graphs); ``"1,2,4"`` -> sizes.

    Raises typer.BadParameter naming the value otherwise.
    """
    value = text.strip().lower()
    if value == "auto":
        return "auto"
    if value in ("", "none", "0"):
        return ()
    try:
        return tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not 'auto', 'none' or a comma list of ints",
                                 param_hint="--cuda-graph-bs") from None


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(EXIT_USAGE)


def plan(
    model: str = typer.Option(
        "qwen3-30b-a3b", "--model",
        help="Preset (tiny, qwen3-30b-a3b), checkpoint dir or its config.json."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 | float16 | float32."),
    kv_cache_dtype: str = typer.Option(D.kv_cache_dtype, "--kv-cache-dtype", help=(
        "KV cache storage: auto (the model's dtype) | fp8_e4m3 (FP8, scale 1: half the bytes "
        "per token, twice the slots; K/V rounded to e4m3).")),
    quantization: str = typer.Option(D.quantization, "--quantization", help=(
        "Weights: none (as the checkpoint stores them) | fp8 (float weights quantized at load to "
        "FP8 in 128x128 blocks: a byte per value plus a float32 scale per block).")),
    dp: int = typer.Option(1, "--dp", help="DP size (ranks = GPUs)."),
    ep: int | None = typer.Option(
        None, "--ep", help="EP size; must divide the world size (default: the world size)."),
    gpu: str | None = typer.Option(None, "--gpu", help=f"GPU name: {', '.join(GPUS)}."),
    gpu_mem_gib: float | None = typer.Option(
        None, "--gpu-mem-gib", help="Usable GPU memory in GiB (overrides --gpu's)."),
    nvlink: bool | None = typer.Option(
        None, "--nvlink/--no-nvlink", help="GPUs on NVLink (default: from --gpu, else yes)."),
    max_running_requests: int = typer.Option(
        D.max_running_requests, "--max-running-requests",
        help="Requests running at once per rank."),
    chunked_prefill_size: int = typer.Option(
        D.chunked_prefill_size, "--chunked-prefill-size", help="Tokens of one prefill chunk."),
    cuda_graph_bs: str = typer.Option(
        "auto", "--cuda-graph-bs", help="Capture sizes: auto, none, or a comma list."),
    context_len: int | None = typer.Option(
        None, "--context-len", help="Longest prompt + output (default: min(model limit, 4096))."),
    dispatcher: str = typer.Option(
        D.dispatcher, "--dispatcher",
        help="auto | local (one rank) | all_gather | all_to_all | flashinfer."),
    no_graphs: bool = typer.Option(False, "--no-graphs", help="Eager only (no CUDA graphs)."),
    kv_tokens_per_request: int | None = typer.Option(
        None, "--kv-tokens-per-request",
        help="KV tokens guaranteed per running request (default: --context-len)."),
    kv_mem_fraction: float = typer.Option(
        D.kv_mem_fraction, "--kv-mem-fraction",
        help="The rank's share for its KV cache of what is left after the rest."),
    json_out: bool = typer.Option(
        False, "--json", help="Print the plan as JSON (schema dp-runtime.plan/5)."),
    measure: bool = typer.Option(
        False, "--measure", help="Build the rank on this CUDA GPU; print predicted vs measured."),
) -> None:
    """Plan one rank's memory: every component, the KV cache that fits, and the verdict."""
    try:
        check_choice("--kv-cache-dtype", kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("--quantization", quantization, QUANTIZATION_CHOICES)
    except UsageError as exc:
        raise _fail(str(exc)) from None
    if measure:
        import torch

        if not torch.cuda.is_available():
            raise _fail("--measure builds the rank on a CUDA GPU and none is visible "
                        "(torch.cuda.is_available() is False); run without --measure to plan")
        if dp != 1 or (ep or 1) != 1:
            raise _fail("--measure builds one rank without a process group: use --dp 1 --ep 1")
    from launch.planner import compare_measured, plan_capacity

    try:
        inp = _plan_input(model, dtype, kv_cache_dtype, dp, ep, gpu, gpu_mem_gib, nvlink,
                          max_running_requests, chunked_prefill_size,
                          parse_graph_sizes(cuda_graph_bs), context_len, dispatcher, no_graphs,
                          kv_tokens_per_request, kv_mem_fraction, measure, quantization)
        result = plan_capacity(inp)
    except (ValueError, FileNotFoundError) as exc:
        raise _fail(str(exc)) from None
    rows = measured = None
    if measure:
        measured = _measure(inp, result)
        rows = compare_measured(result, measured)
    if json_out:
        doc = result.to_dict()
        if rows is not None:
            doc = {"schema": MEASURE_SCHEMA, "plan": doc, "comparison": [vars(r) for r in rows],
                   "measured": measured}
        typer.echo(json.dumps(doc, indent=2))
        return
    _print_plan(result)
    if rows is not None:
        _print_comparison(result, rows, measured)


def _plan_input(model, dtype, kv_cache_dtype, dp, ep, gpu, gpu_mem_gib, nvlink, mrr, chunk,
                graph_bs, context_len, dispatcher, no_graphs, kv_tokens_per_request,
                kv_mem_fraction, measure, quantization="none") -> PlanInput:
    from launch.planner import PlanInput

    name, mem, link = None, None, True
    if gpu is not None:
        spec = gpu_spec(gpu)
        name, mem, link = spec.name, spec.mem_bytes, spec.nvlink
    if gpu_mem_gib is not None:
        if gpu_mem_gib <= 0:
            raise ValueError(f"--gpu-mem-gib must be > 0, got {gpu_mem_gib}")
        mem, name = round(gpu_mem_gib * GIB), name or f"{gpu_mem_gib:g} GiB"
    if mem is None and measure:
        import torch

        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        name, mem = props.name, props.total_memory  # plan the GPU being measured
    if mem is None:
        default = GPUS["h100"]
        name, mem, link = default.name, default.mem_bytes, default.nvlink
    return PlanInput(
        model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, dp_size=dp, ep_size=ep,
        gpu_mem_bytes=mem, gpu_name=name, nvlink=link if nvlink is None else nvlink,
        max_running_requests=mrr, chunked_prefill_size=chunk,
        cuda_graph_bs=graph_bs, context_len=context_len, dispatcher=dispatcher,
        use_cuda_graph=False if no_graphs else None, kv_tokens_per_request=kv_tokens_per_request,
        kv_mem_fraction=kv_mem_fraction, quantization=quantization,
    )


def measure_workload(result: CapacityPlan) -> list:
    """Requests whose prefill fills one eager step of ``chunked_prefill_size`` tokens (the
    largest prefill step), one new token each, within the planned KV slots and the context
    length: what makes the worker's measured ``activation_peak`` comparable with the estimate."""
    from dp_runtime.serving.request import Request, SamplingParams

    rt, vocab = result.runtime, result.model.vocab_size
    tokens = max(1, min(rt.chunked_prefill_size, result.kv.slots - 1))
    length = max(1, min(result.context_len - 1, tokens))
    count = min(rt.max_running_requests, -(-tokens // length))
    once = SamplingParams(max_new_tokens=1)
    return [Request(f"measure-{i}", tuple((i * length + j) % vocab for j in range(length)), once)
            for i in range(count)]


def _measure(inp: PlanInput, result: CapacityPlan) -> dict[str, int]:
    """Build the planned rank on CUDA as serving builds it (it profiles its largest step and
    sizes its own KV cache by the rule the plan predicts), run one full prefill step
    (``measure_workload``) and return ``RankWorker.memory_report()``."""
    try:
        from dp_runtime.rank_worker import RankWorker
    except ImportError as exc:
        raise _fail(f"--measure needs dp_runtime.rank_worker ({exc})") from None
    if result.kv.slots < 1:
        raise _fail(f"the plan leaves no memory for the KV cache ({result.reason}); "
                    "nothing to measure")
    worker = RankWorker(inp.rank_spec(device="cuda"), rank=0, world_size=1)
    try:
        worker.generate(measure_workload(result))
        return {k: int(v) for k, v in worker.memory_report().items()}
    finally:
        worker.close()


# -- output ---------------------------------------------------------------------------------------
def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.3f}"


def _sources(p: CapacityPlan) -> dict[str, str]:
    from dp_runtime.memory_sizing import largest_step_tokens

    rt = p.runtime
    tokens, requests = largest_step_tokens(rt, p.context_len)
    graph_note = (f"estimate: decode buckets up to {rt.cuda_graph_bs[-1]}, extend pieces"
                  if p.cuda_graphs else f"no graphs ({p.cuda_graphs_reason})")
    ws = ("transient, inside activation_peak" if p.components.dispatcher_workspace_transient
          else "persistent")
    return {
        "weights": f"weight_bytes_per_rank (EP rank {p.ep_rank}: {p.local_experts} experts)",
        "kv_cache": (f"kv_budget_bytes x {p.input.kv_mem_fraction:g}: {p.kv.slots} slots, "
                     f"{rt.max_running_requests} request rows"),
        "dp_buffers": f"DPBufferService ({rt.max_global_tokens} + {rt.max_tokens_per_rank} rows)",
        "dispatcher_workspace": f"dispatcher.sizing, {p.dispatcher} ({ws})",
        "graph_inputs": "decode + eager registries, pooled by name",
        "penalty_counts": (f"penalty tables (float32 counts, bool marks), "
                           f"{rt.max_running_requests + 1} request rows x vocab"),
        "graph_pool": graph_note,
        "activation_peak": f"estimate: profile step of {tokens} tokens in {requests} requests",
        "allocator_cache": "estimate: RoPE table + cuBLAS workspace + a small segment",
        "nccl": "estimate: communicators x 256 MiB",
        "cuda_context": "measured once per process: qwen3-30b-a3b on an H100",
    }


def _console():
    from rich.console import Console

    # Wide enough for the source column when output is not a terminal (tests, pipes).
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120, highlight=False)


def _print_plan(p: CapacityPlan) -> None:
    from rich.markup import escape  # a model path or a reason may hold [brackets]
    from rich.table import Table

    console, rt = _console(), p.runtime
    dtype = str(rt.dtype).removeprefix("torch.")
    if p.model.quantization is not None:
        dtype += ", FP8 weights (128x128 blocks)"
    if rt.kv_cache_dtype != rt.dtype:
        dtype += f", KV {str(rt.kv_cache_dtype).removeprefix('torch.')}"
    console.print(
        f"[bold]{escape(p.input.model)}[/] {dtype}, dp={rt.dp_size} ep={rt.ep_size}, "
        f"GPU {escape(p.input.gpu_name)} ({_gib(p.gpu_mem_bytes)} GiB), "
        f"max_running_requests={rt.max_running_requests}, "
        f"chunked_prefill_size={rt.chunked_prefill_size}, context_len={p.context_len}, "
        f"dispatcher={p.dispatcher}, graphs={'on' if p.cuda_graphs else 'off'}"
    )
    table = Table(title="per rank")
    for col, justify in (("component", "left"), ("GiB", "right"), ("bytes", "right"),
                         ("from", "left")):
        table.add_column(col, justify=justify)
    sources = _sources(p)
    for name, nbytes in p.components.as_dict().items():
        table.add_row(name, _gib(nbytes), f"{nbytes:,}", escape(sources[name]))
    table.add_section()
    table.add_row("total", _gib(p.total_bytes), f"{p.total_bytes:,}", "")
    table.add_row("graphs' reserve", _gib(p.graph_reserve_bytes), f"{p.graph_reserve_bytes:,}",
                  "set aside for graph_pool before the KV cache")
    table.add_row("headroom", _gib(p.headroom_bytes), f"{p.headroom_bytes:,}",
                  f"the {1 - p.input.kv_mem_fraction:.0%} the KV cache leaves")
    table.add_row("free", _gib(p.free_bytes), f"{p.free_bytes:,}", "GPU - total")
    console.print(table)

    modes = Table(title="gathered DP buffer per step (rows / MiB)")
    for col in ("padding", "one rank full, others idle", "every rank full"):
        modes.add_column(col)
    for m in p.dp_buffer_modes:
        modes.add_row(m.padding, f"{m.one_rank_full_rows} / {m.one_rank_full_bytes / 2**20:.1f}",
                      f"{m.all_ranks_full_rows} / {m.all_ranks_full_bytes / 2**20:.1f}")
    console.print(modes)

    kv = p.kv
    console.print(f"KV cache: {kv.bytes_per_token:,} bytes/token, {kv.slots:,} token slots, "
                  f"{kv.requests_at_full_context} requests at full context; needed "
                  f"{rt.max_running_requests} x {p.kv_tokens_per_request} = {kv.needed_slots:,}")
    verdict = "[bold green]FITS[/]" if p.fits else "[bold red]DOES NOT FIT[/]"
    console.print(f"{verdict}: {escape(p.reason)}")
    console.print(f"largest max_running_requests that fits: {p.largest_max_running_requests}")


def _print_comparison(p: CapacityPlan, rows: list[ComparisonRow], measured: dict[str, int]) -> None:
    from rich.table import Table

    table = Table(title="predicted vs measured (this GPU; measured: the rank's memory_report)")
    for col, justify in (("component", "left"), ("predicted GiB", "right"),
                         ("measured GiB", "right"), ("error %", "right")):
        table.add_column(col, justify=justify)
    for r in rows:
        got = "-" if r.measured_bytes is None else _gib(r.measured_bytes)
        error = "-" if r.error_pct is None else f"{r.error_pct:+.1f}"
        table.add_row(r.component, _gib(r.predicted_bytes), got, error)
    console = _console()
    console.print(table)
    reserve, pool = measured.get("graph_reserve"), measured.get("graph_pool")
    if reserve is not None and pool is not None:
        within = "within it" if pool <= reserve else "OVER it"
        console.print(f"graphs' reserve: planned {_gib(p.graph_reserve_bytes)} GiB, "
                      f"the rank's {_gib(reserve)} GiB; "
                      f"graph_pool measured {_gib(pool)} GiB, {within}")
