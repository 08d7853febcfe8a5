"""The reference model on every rank of a torchrun job (DP = EP = world size, gloo): each rank
serves its own prompts and must produce transformers' greedy tokens, with each CPU dispatcher,
with and without the graph runner, while ranks with fewer requests run IDLE steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.hf_reference import greedy_reference, load_reference, write_tiny_checkpoint
from tests.support.job_dir import job_dir

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

NEW = 6


@pytest.fixture(scope="module")
def setup(dist_group):
    rank, world = dist.get_rank(), dist.get_world_size()
    with job_dir("dp_runtime_tiny_") as root:
        # Every rank calls save_pretrained: it writes on rank 0 only under torch.distributed.
        ckpt = write_tiny_checkpoint(root)
        dist.barrier()
        g = torch.Generator().manual_seed(3)
        lens = [5, 19, 9, 33, 2, 14, 27, 8, 12][: 2 * world + 1]  # rank 0 one more: others idle
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in lens]
        mine = [(i, p) for i, p in enumerate(prompts) if i % world == rank]
        hf = load_reference(ckpt)
        refs = {i: greedy_reference(hf, p, NEW)[0] for i, p in mine}
        yield ckpt, rank, world, mine, refs


@pytest.mark.parametrize("graphs", [False, True, "extend"], ids=["eager", "graph-runner", "extend-graphs"])
@pytest.mark.parametrize(("dispatcher", "padding"), [("all_gather", "max_len"), ("all_gather", "sum_len"),
                                                     ("all_to_all", None)])
def test_every_rank_matches_transformers(setup, dispatcher, padding, graphs):
    """With all_gather the tokens travel through the DP buffer service, laid out by each
    step's padding mode: forced MAX_LEN (slots padded to the longest rank) or SUM_LEN (live
    rows only) on every eager step; graph steps always gather MAX_LEN at the bucket.
    ``extend-graphs``: prefill chunks replay token buckets in pieces too, an IDLE rank with them
    (the ranks with fewer prompts idle through the others' prefill steps)."""
    ckpt, rank, world, mine, refs = setup
    spec = RankSpec.create(str(ckpt), dp_size=world, max_running_requests=2, chunked_prefill_size=12,
                           dtype="float32", device="cpu", max_context_len=64, dispatcher=dispatcher,
                           use_cuda_graph=bool(graphs), dp_padding=padding,
                           cuda_graph_extend_tokens=(4, 12) if graphs == "extend" else ())
    with RankWorker(spec, rank=rank, world_size=world) as w:
        assert w.dispatcher.ep.size == world
        # Only a gathering dispatcher has a DP buffer service (and lays it out itself).
        assert hasattr(w.dispatcher, "buffers") == (dispatcher == "all_gather")
        results = w.generate([Request(f"p{i}", p, SamplingParams(max_new_tokens=NEW)) for i, p in mine])
        m = w.metrics()
        w.sync.verify()  # the last plan's fingerprint agrees on every rank
    # Every rank gathers every rank's verdict before asserting: a rank that failed alone would
    # leave the others waiting in the next test's collectives.
    mine_bad = [(res.rid, res.output_ids, tuple(refs[int(res.rid[1:])])) for res in results
                if res.output_ids != tuple(refs[int(res.rid[1:])]) or res.rank != rank]
    report = [None] * world
    dist.all_gather_object(report, (mine_bad, m["steps"], m["skipped_steps"], m["idle_steps"],
                                    m["graph_steps"] if graphs != "extend" else m["extend_graph_steps"]))
    assert all(not bad for bad, *_ in report), [bad for bad, *_ in report]
    assert len({(steps, skipped) for _, steps, skipped, _, _ in report}) == 1  # the same steps everywhere
    assert all(idle > 0 for _, _, _, idle, _ in report[1:])  # rank 0 had one request more: the others idled
    if graphs:
        assert all(g > 0 for *_, g in report)
