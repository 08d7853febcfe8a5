"""An FP8 checkpoint on every rank of a torchrun job (DP = EP = world size, gloo): each rank
loads only its experts and their block scales and serves its own prompts with the greedy tokens
of transformers on the dequantized float32 twin, through each CPU dispatcher."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dp_runtime.model.fp8_blocks import Fp8BlockWeight
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.fp8_checkpoint import write_fp8_pair
from tests.hf_reference import greedy_reference, load_reference
from tests.support.job_dir import job_dir

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

NEW = 5


@pytest.fixture(scope="module")
def fp8_setup(dist_group):
    rank, world = dist.get_rank(), dist.get_world_size()
    with job_dir("dp_runtime_fp8_") as root:
        if rank == 0:  # the pair is written with plain file writes beside save_pretrained
            write_fp8_pair(root)
        dist.barrier()
        g = torch.Generator().manual_seed(11)
        lens = [6, 17, 3, 25, 9, 12, 4][: 2 * world]
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
        mine = [(i, p) for i, p in enumerate(prompts) if i % world == rank]
        hf = load_reference(root / "deq")
        refs = {i: greedy_reference(hf, p, NEW)[0] for i, p in mine}
        yield root / "fp8", rank, world, mine, refs


@pytest.mark.parametrize(("dispatcher", "graphs"), [("all_gather", False), ("all_to_all", False),
                                                    ("all_gather", True)])
def test_every_rank_serves_the_fp8_checkpoint(fp8_setup, dispatcher, graphs):
    ckpt, rank, world, mine, refs = fp8_setup
    spec = RankSpec.create(str(ckpt), dp_size=world, max_running_requests=2, chunked_prefill_size=12,
                           dtype="float32", device="cpu", max_context_len=48, dispatcher=dispatcher,
                           use_cuda_graph=graphs)
    with RankWorker(spec, rank=rank, world_size=world) as w:
        w13 = w.model.layers[0].w13
        local = (isinstance(w13, Fp8BlockWeight), w13.shape[0], w.model.first_expert)
        results = w.generate([Request(f"p{i}", p, SamplingParams(max_new_tokens=NEW)) for i, p in mine])
    bad = [(r.rid, r.output_ids, tuple(refs[int(r.rid[1:])])) for r in results
           if r.output_ids != tuple(refs[int(r.rid[1:])])]
    report = [None] * world
    dist.all_gather_object(report, (bad, local))
    assert all(not b for b, _ in report), [b for b, _ in report]
    # Each rank holds FP8 blocks of its own experts only (8 experts split over the ranks).
    assert all(fp8 for _, (fp8, _, _) in report)
    assert sum(n for _, (_, n, _) in report) == 8
    assert sorted(first for _, (_, _, first) in report) == [first for _, (_, _, first) in report]
