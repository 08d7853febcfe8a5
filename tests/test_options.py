"""One options type, one default per option (``dp_runtime/options.py``): every door's default is
the one there, and ``plan`` with no rank options sizes exactly the rank ``serve`` starts for the
same model and ranks (before: plan 256 running / 8192-token chunks, serve 64 / 2048; max_restarts
1 in the engine, 2 on the command line)."""

from __future__ import annotations

import dataclasses
import inspect

from dp_runtime.config import RuntimeConfig
from dp_runtime.options import DEFAULTS, Options
from launch import cli_plan, cli_run, cli_serve, torchrun_main
from launch.cli_options import check_gang_options
from launch.engine_types import EngineOptions
from launch.plan_input import PlanInput
from launch.run_config import RunConfig

# The CLI spelling of each option where it differs from the field's name.
_CLI = {"context_len": "context_len", "hang_timeout_s": "hang_timeout"}


def _typer_defaults(command) -> dict:
    return {name: p.default.default for name, p in inspect.signature(command).parameters.items()}


def test_every_door_defaults_as_the_options_say():
    want = dataclasses.asdict(DEFAULTS)
    assert dataclasses.asdict(RunConfig()) | want == dataclasses.asdict(
        RunConfig()
    )  # a RunConfig is Options
    assert isinstance(RunConfig(), Options)
    argv = vars(torchrun_main._parser().parse_args([]))
    shared = (
        "max_running_requests",
        "chunked_prefill_size",
        "dispatcher",
        "dtype",
        "kv_cache_dtype",
        "schedule_policy",
        "mixed_step_tokens",
        "prefix_caching",
        "seed",
        "context_len",
    )
    for command in (cli_run.run, cli_serve.serve):
        given = _typer_defaults(command)
        for name in shared:
            assert str(given[name]) == str(want[name]), (command.__name__, name)
            assert str(argv[name]) == str(want[name]), ("torchrun", name)
    plan = _typer_defaults(cli_plan.plan)
    for name in (
        "max_running_requests",
        "chunked_prefill_size",
        "dispatcher",
        "kv_cache_dtype",
        "kv_mem_fraction",
        "context_len",
    ):
        assert plan[name] == want[name] == getattr(PlanInput(), name), name
    runtime = {f.name: f.default for f in dataclasses.fields(RuntimeConfig)}
    for name in (
        "max_running_requests",
        "chunked_prefill_size",
        "schedule_policy",
        "mixed_step_tokens",
        "prefix_caching",
        "dp_sync_timeout_s",
    ):
        assert runtime[name] == want[name], name
    engine = EngineOptions()
    assert (engine.max_restarts, engine.hang_timeout_s) == (
        DEFAULTS.max_restarts,
        DEFAULTS.hang_timeout_s,
    )


def test_plan_with_no_rank_options_sizes_the_rank_serve_starts():
    """``plan --model tiny --dp 2`` (every rank option at its default) against ``serve --model
    tiny --dp 2`` on CUDA ranks (a joined cluster's: nothing here needs a GPU): the same RankSpec,
    RuntimeConfig included, so the plan's numbers are the started rank's."""
    plan = _typer_defaults(cli_plan.plan)
    plan.update(model="tiny", dp=2, graph_bs=cli_plan.parse_graph_sizes(plan["cuda_graph_bs"]))
    inp = cli_plan._plan_input(
        plan["model"],
        plan["dtype"],
        plan["kv_cache_dtype"],
        plan["dp"],
        plan["ep"],
        plan["gpu"],
        plan["gpu_mem_gib"],
        plan["nvlink"],
        plan["max_running_requests"],
        plan["chunked_prefill_size"],
        plan["graph_bs"],
        plan["context_len"],
        plan["dispatcher"],
        plan["no_graphs"],
        plan["kv_tokens_per_request"],
        plan["kv_mem_fraction"],
        plan["measure"],
    )
    planned = inp.rank_spec(device="cuda")
    serve = _typer_defaults(cli_serve.serve)
    keys = (
        "launcher",
        "dtype",
        "dispatcher",
        "max_running_requests",
        "chunked_prefill_size",
        "schedule_policy",
        "mixed_step_tokens",
        "kv_cache_dtype",
        "prefix_caching",
        "context_len",
        "max_restarts",
        "seed",
    )
    started = check_gang_options(
        **{k: serve[k] for k in keys},
        model="tiny",
        dp=2,
        device="cuda",
        ray_address="127.0.0.1:6379",
        ray_address_env=None,
    ).spec
    assert planned.runtime == started.runtime
    assert planned == started
