"""Qwen3-235B-A22B's shape at toy sizes on every rank of a torchrun job (DP = EP = world size,
gloo): 128 experts, top 8, 16:1 grouped-query attention, the preset's routing over EP 2-4 (the
4-rank tier is the shape of DEP4), FP8 weights quantized at load. Each rank's greedy tokens equal
those of a world-size-1 worker of the same random weights (drawn per tensor name: every rank
draws its experts as the single rank does)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dispatcher.partition import ExpertPartition
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams

pytestmark = pytest.mark.dist

# The preset's ratios at toy sizes: experts, top-k and the query/KV head ratio stay.
TOY = dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=16, num_kv_heads=1, head_dim=16,
           moe_intermediate_size=32, intermediate_size=128, max_position_embeddings=512)
NEW = 4


def _spec(world: int, dispatcher: str) -> RankSpec:
    return RankSpec.create("qwen3-235b-a22b", model_overrides=TOY, dp_size=world, max_running_requests=2,
                           chunked_prefill_size=16, dtype="float32", device="cpu", max_context_len=48,
                           dispatcher=dispatcher, quantization="fp8")


def _run(spec: RankSpec, rank: int, world: int, prompts) -> dict[str, tuple[int, ...]]:
    with RankWorker(spec, rank=rank, world_size=world) as w:
        assert (w.model_config.num_experts, w.model_config.top_k) == (128, 8)
        assert w.model.num_local_experts == ExpertPartition(128, world).num_local(rank)
        res = w.generate([Request(rid, p, SamplingParams(max_new_tokens=NEW)) for rid, p in prompts])
    return {r.rid: r.output_ids for r in res}


@pytest.mark.parametrize("dispatcher", ["all_to_all", "all_gather"])
def test_the_235b_shape_at_every_rank_equals_one_rank(dist_group, dispatcher):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    lens = [7, 19, 4, 11, 2, 15]
    prompts = [(f"p{i}", torch.randint(0, 256, (n,), generator=g).tolist()) for i, n in enumerate(lens)]
    mine = [p for i, p in enumerate(prompts) if i % world == rank]
    alone = _run(_spec(1, "local"), 0, 1, mine)  # no process group: this rank's prompts alone
    together = _run(_spec(world, dispatcher), rank, world, mine)
    report = [None] * world
    dist.all_gather_object(report, [rid for rid in alone if alone[rid] != together[rid]])
    assert report == [[]] * world, report
