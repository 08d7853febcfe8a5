"""Graphs under DP with the all-gather dispatcher, on every rank of a torchrun job (gloo): the
runners have no DP hook, so the only layout a replay's gathers get is the one the dispatcher
takes from the plan in the batch. Steps alternate graph replays (MAX_LEN at the bucket, IDLE
ranks included) with eager SUM_LEN steps of the same batch, in both orders: a layout one leaves
behind must never leak into the next, and both must give the same logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from _graph_fixtures import TINY

from buffers import BufferPool, build_decode_registry, build_prefill_registry
from dispatcher import DispatcherConfig, EPGroup, make_dispatcher
from dp_runtime.attention import TorchSDPABackend
from dp_runtime.config import RuntimeConfig
from dp_runtime.graph_setup import capture_plan
from dp_runtime.model.qwen3_moe import Qwen3MoeModel
from dp_runtime.model.weights import iter_random
from dp_runtime.serving.forward_batch import capture_batch, idle_batch
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.kv_cache import KVCache
from dp_runtime.sync.dp_buffer import DPBufferService
from dp_runtime.sync.padding_mode import PaddingMode
from dp_runtime.sync.step_plan import plan_step
from dp_runtime.sync.step_table import StepTable
from graph import EagerRunner, GraphRunner
from tests.support.synthetic_batch import add_requests, decode_batch

pytestmark = pytest.mark.dist

SIZES = (1, 2, 4, 8)


def _config(world: int, padding: str | None) -> RuntimeConfig:
    return RuntimeConfig(dp_size=world, ep_size=world, hidden_size=TINY.hidden_size, dtype="float32", device="cpu",
                         max_running_requests=8, chunked_prefill_size=16, cuda_graph_bs=SIZES,
                         cuda_graph_max_bs=SIZES[-1], dp_padding=padding)


def _steps(world: int) -> list[list[int]]:
    """Per-rank decode counts of each step (the same table on every rank)."""
    return [[3] + [1] * (world - 1), [0] + [2] * (world - 1), [5] + [0] * (world - 1), [1] * world,
            [8] + [7] * (world - 1), [2] + [6] * (world - 1)]


def test_graphs_replay_every_dp_plan_as_eager_runs_it(dist_group):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, cfg_sum = _config(world, None), _config(world, "sum_len")
    ep = EPGroup.from_torch(dist_group)
    buffers = DPBufferService(cfg, BufferPool(), rank, group=dist_group, routing_top_k=TINY.top_k)
    dcfg = DispatcherConfig(num_experts=TINY.num_experts, top_k=TINY.top_k, hidden_size=TINY.hidden_size,
                            dtype=torch.float32, max_tokens_per_rank=cfg.max_tokens_per_rank, check_expert_ids=False)
    dispatcher = make_dispatcher("all_gather", dcfg, ep=ep, device="cpu", buffers=buffers)
    dispatcher.warmup()
    cache = KVCache(num_layers=TINY.num_layers, num_kv_heads=TINY.num_kv_heads, head_dim=TINY.head_dim,
                    num_slots=512, max_reqs=16, max_context_len=64, dtype=torch.float32, device="cpu")
    backend = TorchSDPABackend(cache, num_q_heads=TINY.num_heads, num_kv_heads=TINY.num_kv_heads,
                               head_dim=TINY.head_dim)
    model = Qwen3MoeModel(TINY, iter_random(TINY, rank, world, torch.float32, "cpu", 0), attention=backend,
                          dispatcher=dispatcher, dtype=torch.float32, device="cpu")
    graphs = GraphRunner(model.forward, backend, build_decode_registry(SIZES[-1], "cpu", BufferPool(), dp_size=world),
                         SIZES, capture_batch=lambda bs, n, plan: capture_batch(bs, n, plan, device="cpu"),
                         capture_plan=lambda bucket: capture_plan(cfg, bucket), show_progress=False)
    graphs.capture()
    eager = EagerRunner(model.forward, backend,
                        lambda bs, n: build_prefill_registry(bs, n, "cpu", BufferPool(), register_input_embeds=False,
                                                             dp_size=world, user="eager"),
                        max_bs=8, max_num_tokens=16)
    allocator = KVAllocator(cache)
    reqs = add_requests(allocator, [4, 9, 17, 2, 30, 11, 6, 21], seed=rank)
    errors, seen = [], set()
    for step, counts in enumerate(_steps(world)):
        n = counts[rank]
        graph_plan = plan_step(StepTable.from_counts(counts, can_run_graph=True), cfg)
        eager_plan = plan_step(StepTable.from_counts(counts, can_run_graph=False), cfg_sum)
        assert graph_plan.graph_bucket is not None and eager_plan.padding is PaddingMode.SUM_LEN
        batch = decode_batch(allocator, reqs[:n], [(7 * step + 3 * i + rank) % TINY.vocab_size for i in range(n)]) \
            if n else idle_batch("cpu", graph_plan)
        runs = {
            "graph": lambda b=batch, p=graph_plan: graphs.replay(dataclasses.replace(b, plan=p), p),
            "eager": lambda b=batch, p=eager_plan: eager.run(dataclasses.replace(b, plan=p)),
        }
        order = ("graph", "eager") if step % 2 else ("eager", "graph")  # each leaves its layout behind
        out = {name: runs[name]().clone() for name in order}
        seen.add((buffers.layout.padding, order[-1]))
        if out["graph"].shape != (n, TINY.vocab_size) or out["eager"].shape != (n, TINY.vocab_size):
            errors.append(f"rank {rank} step {step}: shapes {tuple(out['graph'].shape)}, {tuple(out['eager'].shape)}")
        elif not torch.allclose(out["graph"], out["eager"], atol=1e-5, rtol=1e-5):
            diff = (out["graph"] - out["eager"]).abs().max().item()
            errors.append(f"rank {rank} step {step} counts {counts}: graph and eager differ by {diff:.3g}")
    graphs.destroy()
    dispatcher.close()
    # Every rank's verdict before asserting: a rank failing alone would leave the others hanging.
    report = [None] * world
    dist.all_gather_object(report, errors)
    assert not any(report), report
    # The stand-in replay laid the service out MAX_LEN, the eager steps SUM_LEN: both really ran.
    assert {padding for padding, _ in seen} == {PaddingMode.MAX_LEN, PaddingMode.SUM_LEN}
