"""`dp-runtime plan` and `dp-runtime bench` through the real CLI app (typer's CliRunner, CPU)."""

from __future__ import annotations

import json
import sys
import types
from typing import ClassVar

import pytest
import torch
from typer.testing import CliRunner

from dp_runtime import memory_sizing as ms
from launch import cli_bench
from launch.cli import app
from launch.cli_bench import BENCHES, bench_command, bench_dir
from launch.cli_plan import measure_workload
from launch.planner import COMPONENTS, GIB, MEASURED_COMPONENTS, PlanInput, plan_capacity

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


# -- plan -------------------------------------------------------------------------------------------
def test_table_lists_every_component_and_the_verdict():
    result = invoke("plan", "--max-running-requests", "32")
    assert result.exit_code == 0, result.output
    for name in COMPONENTS:
        assert name in result.output
    assert "FITS" in result.output and "DOES NOT FIT" not in result.output
    assert "largest max_running_requests that fits: " in result.output
    assert "61,064,245,248" in result.output  # qwen3-30b-a3b bf16 weights at ep 1


def test_json_is_the_plan_of_the_same_input():
    result = invoke("plan", "--json", "--dp", "2", "--max-running-requests", "64", "--context-len", "2048")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    want = plan_capacity(PlanInput(dp_size=2, max_running_requests=64, context_len=2048)).to_dict()
    assert doc == want
    assert doc["schema"] == "dp-runtime.plan/5" and doc["resolved"]["dispatcher"] == "flashinfer"


def test_gpu_options():
    doc = json.loads(invoke("plan", "--json", "--gpu", "L40S", "--dp", "2").output)
    assert doc["input"]["gpu"] == "L40S 48GB" and doc["input"]["nvlink"] is False
    assert doc["resolved"]["dispatcher"] == "all_gather"  # auto without NVLink, graphs on
    doc = json.loads(invoke("plan", "--json", "--gpu-mem-gib", "200").output)
    assert doc["gpu_mem_bytes"] == 200 * GIB and doc["input"]["gpu"] == "200 GiB"
    half = json.loads(invoke("plan", "--json", "--gpu-mem-gib", "200", "--kv-mem-fraction", "0.5").output)
    assert half["input"]["kv_mem_fraction"] == 0.5 and half["kv"]["slots"] < doc["kv"]["slots"]


def test_small_gpu_does_not_fit_and_says_weights():
    result = invoke("plan", "--gpu-mem-gib", "24")
    assert result.exit_code == 0
    assert "DOES NOT FIT" in result.output and "weights alone are 56.87 GiB" in result.output
    doc = json.loads(invoke("plan", "--json", "--gpu", "rtx-4090").output)
    assert doc["fits"] is False and doc["largest_max_running_requests"] == 0


def test_graph_sizes_option():
    doc = json.loads(invoke("plan", "--json", "--model", "tiny", "--max-running-requests", "8",
                            "--cuda-graph-bs", "1,2,4").output)
    assert doc["resolved"]["cuda_graph_bs"] == [1, 2, 4] and doc["resolved"]["cuda_graphs"] is True
    doc = json.loads(invoke("plan", "--json", "--model", "tiny", "--cuda-graph-bs", "none").output)
    assert doc["resolved"]["cuda_graphs"] is False and doc["components_bytes"]["graph_pool"] == 0
    result = invoke("plan", "--cuda-graph-bs", "1,x")
    assert result.exit_code == 2 and "--cuda-graph-bs" in result.output


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--dp", "3", "--ep", "2"), "ep_size must be an int >= 1 that divides world_size"),
        (("--gpu", "tpu-v5"), "unknown GPU 'tpu-v5'"),
        (("--model", "/no/such/dir"), "neither a preset"),
        (("--dispatcher", "all_to_all"), "cannot be captured in a CUDA graph"),
        (("--dtype", "int8"), "dtype must be"),
        (("--kv-mem-fraction", "0"), "kv_mem_fraction must be in (0, 1]"),
        (("--kv-cache-dtype", "fp16"), "--kv-cache-dtype must be one of auto, fp8, fp8_e4m3; got 'fp16'"),
    ],
)
def test_bad_input_exits_2_with_the_rule(args, words):
    result = invoke("plan", *args)
    assert result.exit_code == 2
    assert words in result.output


def test_fp8_kv_cache_halves_the_bytes_per_token_and_doubles_the_slots():
    base, fp8 = (json.loads(invoke("plan", "--json", "--max-running-requests", "32", *kv).output)
                 for kv in ((), ("--kv-cache-dtype", "fp8_e4m3")))
    assert (base["input"]["kv_cache_dtype"], base["resolved"]["kv_cache_dtype"]) == ("auto", "bfloat16")
    assert (fp8["input"]["kv_cache_dtype"], fp8["resolved"]["kv_cache_dtype"]) == ("fp8_e4m3", "float8_e4m3fn")
    assert (base["kv"]["bytes_per_token"], fp8["kv"]["bytes_per_token"]) == (98_304, 49_152)
    # The rest is the same but the activation peak, which holds the profile step's one-slot
    # cache (memory_estimates): a few KiB less in FP8.
    same = ("weights", "dp_buffers", "dispatcher_workspace", "graph_inputs", "graph_pool", "nccl")
    assert all(base["components_bytes"][k] == fp8["components_bytes"][k] for k in same)
    assert 0 < base["components_bytes"]["activation_peak"] - fp8["components_bytes"]["activation_peak"] < 2**20
    cfg, ctx = PlanInput().rank_spec().model_config(), base["resolved"]["context_len"]
    for doc, dtype in ((base, torch.bfloat16), (fp8, torch.float8_e4m3fn)):
        # What the cache may take: the fraction of headroom + cache (the planner's rule).
        left = doc["headroom_bytes"] + doc["components_bytes"]["kv_cache"]
        budget = ms.kv_budget_bytes(left, 0, 0, doc["input"]["kv_mem_fraction"])
        assert doc["kv"]["slots"] == ms.kv_slots_for_budget(cfg, dtype, budget, 32, ctx)
        assert doc["components_bytes"]["kv_cache"] == ms.kv_cache_bytes(cfg, dtype, doc["kv"]["slots"], 32, ctx)
    # The req_to_token table is the same either way and the budget no smaller: twice the slots.
    assert fp8["kv"]["slots"] >= 2 * base["kv"]["slots"]
    table = invoke("plan", "--max-running-requests", "32", "--kv-cache-dtype", "fp8").output
    assert "qwen3-30b-a3b bfloat16, KV float8_e4m3fn, dp=1" in table and "49,152 bytes/token" in table
    assert "KV float8" not in invoke("plan", "--max-running-requests", "32").output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_measure_without_gpu_exits_2():
    result = invoke("plan", "--measure")
    assert result.exit_code == 2
    assert "--measure builds the rank on a CUDA GPU and none is visible" in result.output


class _FakeWorker:
    """Stands in for dp_runtime.rank_worker.RankWorker: records how it was built."""

    built: ClassVar[list] = []
    requests: ClassVar[list] = []
    closed: ClassVar[int] = 0

    def __init__(self, spec, *, rank, world_size):
        type(self).built.append((spec, rank, world_size))
        self.generated: list = []

    def generate(self, requests):
        self.generated.extend(requests)
        type(self).requests = list(requests)
        return []

    def memory_report(self):
        return {"weights": 1000, "kv_cache": 2000, "dp_buffers": 10, "dispatcher_workspace": 0,
                "graph_inputs": 5, "graph_pool": 40, "activation_peak": 7, "graph_reserve": 50,
                "allocator_cache": 4, "cuda_context": 3}

    def close(self):
        type(self).closed += 1


def test_measure_builds_one_rank_and_compares(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "dp_runtime.rank_worker", types.SimpleNamespace(RankWorker=_FakeWorker))
    _FakeWorker.built, _FakeWorker.closed = [], 0
    result = invoke("plan", "--measure", "--json", "--model", "tiny", "--max-running-requests", "8",
                    "--gpu-mem-gib", "10")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["schema"] == "dp-runtime.plan-measure/5"
    rows = {r["component"]: r for r in doc["comparison"]}
    assert list(rows) == list(MEASURED_COMPONENTS)
    assert rows["weights"]["measured_bytes"] == 1000
    assert rows["weights"]["predicted_bytes"] == doc["plan"]["components_bytes"]["weights"]
    assert rows["cuda_context"]["measured_bytes"] == 3 and doc["measured"]["graph_reserve"] == 50
    assert rows["allocator_cache"]["measured_bytes"] == 4
    spec, rank, world = _FakeWorker.built[0]
    assert (rank, world, _FakeWorker.closed) == (0, 1, 1)
    # the rank sizes its own KV cache, by the rule and fraction the plan used
    assert spec.runtime.device.type == "cuda" and spec.kv_cache_tokens is None
    assert spec.kv_mem_fraction == doc["plan"]["input"]["kv_mem_fraction"] == 0.85
    # One full prefill chunk of tiny's default 8192 tokens, requests within the context (2048).
    prompts = [r.prompt_ids for r in _FakeWorker.requests]
    assert sum(map(len, prompts)) >= 8192 and max(map(len, prompts)) <= 2047
    assert len(prompts) <= 8 and all(r.sampling.max_new_tokens == 1 for r in _FakeWorker.requests)
    table = invoke("plan", "--measure", "--model", "tiny", "--max-running-requests", "8", "--gpu-mem-gib", "10")
    assert "predicted vs measured" in table.output and "error %" in table.output
    assert "graph_pool measured 0.000 GiB, within it" in table.output


def test_measure_workload_fits_the_plan():
    kw = dict(model="tiny", max_running_requests=2, chunked_prefill_size=512, kv_mem_fraction=1.0)
    big = plan_capacity(PlanInput(**kw))
    full = measure_workload(big)
    assert sum(len(r.prompt_ids) for r in full) >= 512 and len(full) <= 2
    # A GPU whose memory leaves exactly 300 KV slots: the workload stays within them.
    c = big.components
    others = big.total_bytes - c.kv_cache_bytes - c.graph_pool_bytes + big.graph_reserve_bytes
    tight = plan_capacity(PlanInput(gpu_mem_bytes=others + ms.kv_cache_bytes(big.model, torch.bfloat16, 300, 2, 2048),
                                    **kw))
    assert tight.kv.slots == 300
    reqs = measure_workload(tight)
    assert sum(len(r.prompt_ids) for r in reqs) <= 299
    assert all(0 <= t < 256 for r in reqs for t in r.prompt_ids)


def test_measure_refuses_more_than_one_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = invoke("plan", "--measure", "--dp", "2")
    assert result.exit_code == 2 and "--dp 1 --ep 1" in result.output


# -- bench ------------------------------------------------------------------------------------------
def test_bench_list_names_every_benchmark():
    result = invoke("bench", "--list")
    assert result.exit_code == 0
    for name in BENCHES:
        assert name in result.output


def test_every_benchmark_script_is_listed():
    # Scripts under bench/ that are not benchmarks themselves: shared helpers, the tree runner,
    # the side-by-side table of a call's runs, and the planner's running counts for a GPU call.
    helpers = {"gpu_kernels", "gpu_spans", "compare_trees", "side_by_side", "load_rows", "load_ranks",
               "load_workload", "load_summary", "load_table", "plan_running", "__init__"}
    scripts = {p.stem for p in bench_dir().glob("*.py")} - helpers
    assert scripts == set(BENCHES)


def test_bench_unknown_name_lists_the_known_ones():
    result = invoke("bench", "nope")
    assert result.exit_code == 2
    assert "unknown benchmark 'nope'" in result.output and "registry_fill, decode_graph" in result.output


def test_bench_commands():
    script = str(bench_dir() / "dispatch.py")
    assert bench_command("dispatch", ["--quick"]) == [sys.executable, script, "--quick"]
    assert bench_command("dispatch", ["--quick"], nproc=2) == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", script, "--quick"]
    with pytest.raises(ValueError, match="runs in one process"):
        bench_command("registry_fill", [], nproc=2)
    with pytest.raises(ValueError, match="has no script"):
        bench_command("registry_fill", [], root=bench_dir() / "missing")


def test_bench_runs_the_script_with_passthrough_args(monkeypatch):
    calls = []

    def fake_run(argv, cwd, check):
        calls.append((argv, cwd))
        return types.SimpleNamespace(returncode=3)

    monkeypatch.setattr(cli_bench.subprocess, "run", fake_run)
    result = invoke("bench", "dp_sync", "--nproc", "2", "--", "--device", "cpu")
    assert result.exit_code == 3  # the script's exit code
    argv, cwd = calls[0]
    assert argv[-3:] == [str(bench_dir() / "dp_sync.py"), "--device", "cpu"]
    assert "--nproc-per-node=2" in argv and cwd == bench_dir().parent
