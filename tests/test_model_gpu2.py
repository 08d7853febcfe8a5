"""The reference model on two GPUs (DP 2, EP 2, NCCL) in bf16: each rank against transformers,
identical tokens with CUDA graphs and without, for the FlashInfer and all-gather dispatchers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.hf_reference import greedy_reference, load_reference, write_tiny_checkpoint
from tests.model_gpu_checks import NEW, compare_to_reference, prompts_for, run

pytestmark = pytest.mark.gpu2

# all_gather runs through the DP buffer service: every eager step forced to MAX_LEN, then to
# SUM_LEN (NCCL's uneven all-gather and reduce-scatter); graph steps gather MAX_LEN at the bucket.
DISPATCHERS = [("all_gather", "max_len"), ("all_gather", "sum_len")] + (
    [("flashinfer", None)] if importlib.util.find_spec("flashinfer") else [])
ATTENTION = "flashinfer" if importlib.util.find_spec("flashinfer") else "sdpa"


@pytest.fixture(scope="module")
def setup(dist_group, tmp_path_factory):
    pytest.importorskip("transformers")
    rank, world = dist.get_rank(), dist.get_world_size()
    name = [str(tmp_path_factory.mktemp("tiny_gpu2")) if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    ckpt = write_tiny_checkpoint(Path(name[0]), head_dim=64)  # saves on rank 0 only
    dist.barrier()
    hf = load_reference(ckpt)
    refs = {f"p{i}": greedy_reference(hf, p, NEW) for i, p in prompts_for(rank, world)}
    return ckpt, rank, world, refs


@pytest.mark.parametrize(("dispatcher", "padding"), DISPATCHERS)
def test_two_gpus_graphs_and_eager_agree_and_match_transformers(setup, dispatcher, padding):
    ckpt, rank, world, refs = setup
    kw = dict(rank=rank, world=world, attention=ATTENTION, dispatcher=dispatcher, dp_padding=padding)
    eager = run(ckpt, graphs=False, **kw)
    graph = run(ckpt, graphs=True, **kw)
    problems = compare_to_reference(*graph[:2], refs) + compare_to_reference(*eager[:2], refs)
    if graph[0] != eager[0]:
        problems.append(f"graph tokens {graph[0]} != eager tokens {eager[0]}")
    if graph[2]["dispatcher"] != dispatcher or graph[2]["graph_steps"] == 0:
        problems.append(f"graph run: {graph[2]}")
    report = [None] * world
    dist.all_gather_object(report, problems)  # every rank asserts on every rank's verdict
    assert report == [[]] * world


def test_steps_on_a_thread_of_their_own_give_the_same_tokens(setup):
    # RankSession steps on a background thread whose current GPU is 0: rank 1's events, plans
    # and streams must still be those of its own GPU (overlapped steps read tokens by event).
    import threading

    from dp_runtime.rank_spec import RankSpec
    from dp_runtime.rank_worker import RankWorker
    from dp_runtime.serving.request import Request, SamplingParams

    ckpt, rank, world, _ = setup
    spec = RankSpec.create(str(ckpt), dp_size=world, max_running_requests=4, chunked_prefill_size=16,
                           cuda_graph_bs=(1, 2, 4), dtype="bfloat16", device="cuda", max_context_len=96,
                           attention=ATTENTION, dispatcher="all_gather")

    def reqs(tag):
        return [Request(f"{tag}{i}", p, SamplingParams(max_new_tokens=NEW)) for i, p in prompts_for(rank, world)]

    with RankWorker(spec, rank=rank, world_size=world) as w:
        here = [r.output_ids for r in w.generate(reqs("a"))]
        there: list = []
        t = threading.Thread(target=lambda: there.extend(r.output_ids for r in w.generate(reqs("b"))))
        t.start()
        t.join()
    report = [None] * world
    dist.all_gather_object(report, here == there and len(there) == len(here))
    assert report == [True] * world
