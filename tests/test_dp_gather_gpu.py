"""dp_gather / dp_scatter on CUDA tensors over NCCL, SUM_LEN and MAX_LEN captured in CUDA graphs
and replayed with different counts.

GPU run (two or more GPUs):
``torchrun --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider tests/test_dp_gather_gpu.py``

Each body takes a device and whether to capture a graph; the ``*_cpu_static`` variants run the
same bodies on CPU with gloo and no graph (``-m dist``), so the bookkeeping of the GPU tests is
exercised on every machine. Checks inside loops are recorded and compared across ranks at the
end (see test_dp_sync_dist.py: a rank must not leave the others inside a collective).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from buffers.pool import BufferPool
from dp_runtime.config import RuntimeConfig
from dp_runtime.sync.dp_buffer import DPBufferService, dp_buffer_layout
from dp_runtime.sync.dp_gather import (
    dp_gather,
    dp_reduce_scatter,
)
from dp_runtime.sync.step_sync import DPStepSync
from dp_runtime.sync.step_table import LocalStepInfo
from tests.support.dp_step import DPRankStep

D = 64
CAP = 16  # rows per rank of the captured buffers


def cuda_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def counts_of(step: int, world: int, cap: int = CAP) -> list[int]:
    rng = random.Random(4243 * step + world)
    return [rng.choice([0, 1, 2, 5, cap // 2, cap]) for _ in range(world)]


def rows_of(step: int, rank: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Small integers (<= 32): exact in bf16 even after summing 8 ranks' copies."""
    base = torch.arange(n * D, device=device).view(n, D) % 23
    return (base + rank % 8 + step % 3).to(dtype)


def agree(problems: list, group) -> None:
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problems[:5], group=group)
    assert not any(everyone), everyone


def _round_trip(group, device, dtype, padding, reduce):
    world, rank = dist.get_world_size(), dist.get_rank()
    config = RuntimeConfig(
        dp_size=world,
        hidden_size=D,
        dtype=dtype,
        device=device,
        max_running_requests=CAP,
        chunked_prefill_size=CAP,
        dp_padding=padding,
        dp_sync_exchange="auto",
    )
    sync = DPStepSync(config, group)
    runner = DPRankStep(
        sync, DPBufferService(config, BufferPool(), rank, group=group, device=device)
    )
    problems = []
    for step in range(30):
        counts = counts_of(step, world)
        x = rows_of(step, rank, counts[rank], dtype, device)

        def compute(global_GD, plan, step=step, counts=counts):
            expected = torch.zeros_like(global_GD)
            for r, n in enumerate(counts):
                start = r * plan.local_dp_buffer_len(r) if plan.is_max_len else sum(counts[:r])
                expected[start : start + n] = rows_of(step, r, n, dtype, device)
            if not torch.equal(global_GD, expected):
                problems.append(("gathered", step, plan.padding.name))
            return global_GD.clone() if reduce else global_GD * 2

        info = LocalStepInfo(counts[rank], can_run_graph=True)
        res = runner.run(info, x if counts[rank] else None, compute, reduce=reduce)
        if res.plan.skip:
            continue
        want = x * (world if reduce else 2)
        if not torch.equal(res.out_TD, want):
            problems.append(("returned", step, res.plan.padding.name))
    sync.verify()
    sync.close()
    agree(problems, group)


def _max_len_replay(group, device, dtype, use_graph):
    """MAX_LEN at a fixed bucket: static shapes, so the eager gather itself is capturable."""
    world, rank = dist.get_world_size(), dist.get_rank()
    bucket = CAP
    lay = dp_buffer_layout(
        bucket * world,
        bucket,
        True,
        [bucket] * world,
        rank=rank,
        dp_size=world,
        max_tokens_per_rank=bucket,
    )
    local_TD = torch.zeros(bucket, D, dtype=dtype, device=device)
    global_GD = torch.zeros(bucket * world, D, dtype=dtype, device=device)
    out_TD = torch.zeros(bucket, D, dtype=dtype, device=device)

    def step_fn():
        dp_gather(global_GD, local_TD, lay, group)
        dp_reduce_scatter(global_GD.clone(), lay, group, out_TD=out_TD)

    run = step_fn
    if use_graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step_fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step_fn()
        run = graph.replay

    problems = []
    for step in range(12):
        counts = counts_of(step, world)
        local_TD.zero_()  # the runner's fill pads the tail; here: zeros
        local_TD[: counts[rank]] = rows_of(step, rank, counts[rank], dtype, device)
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        for r, n in enumerate(counts):
            slot = global_GD[r * bucket : (r + 1) * bucket]
            if not torch.equal(slot[:n], rows_of(step, r, n, dtype, device)) or torch.count_nonzero(
                slot[n:]
            ):
                problems.append(("gather", step, r))
        if not torch.equal(out_TD, local_TD * world):
            problems.append(("reduce_scatter", step))
    agree(problems, group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padding", [None, "max_len", "sum_len"])
@pytest.mark.parametrize("reduce", [False, True], ids=["scatter", "reduce_scatter"])
@pytest.mark.gpu2
@pytest.mark.dist
def test_round_trip_on_cuda(dist_group, dtype, padding, reduce):
    _round_trip(dist_group, cuda_device(), dtype, padding, reduce)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.gpu2
@pytest.mark.dist
def test_max_len_gather_replays_in_a_cuda_graph(dist_group, dtype):
    _max_len_replay(dist_group, cuda_device(), dtype, use_graph=True)


@pytest.mark.dist
def test_round_trip_cpu_static(dist_group):
    _round_trip(dist_group, torch.device("cpu"), torch.float32, None, True)


@pytest.mark.dist
def test_max_len_gather_cpu_static(dist_group):
    _max_len_replay(dist_group, torch.device("cpu"), torch.float32, use_graph=False)
