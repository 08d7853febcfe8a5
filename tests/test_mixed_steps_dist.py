"""Mixed steps under DP (torchrun, gloo): rank 0 prefills a long prompt in chunks, with its
decode rows, while the other ranks only decode; the ranks step together (one rank EXTEND, the
others DECODE in the same plan) and every rank's tokens equal its single-rank run. A rank with
only a prompt to prefill keeps its chunks to the mixed budget while its peers decode."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dp_runtime.forward_mode import ForwardMode
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.hf_reference import write_tiny_checkpoint
from tests.support.job_dir import job_dir

pytestmark = pytest.mark.dist
pytest.importorskip("transformers")

CHUNK = 8


def _spec(ckpt, dp: int, **kw) -> RankSpec:
    return RankSpec.create(str(ckpt), dp_size=dp, max_running_requests=2, chunked_prefill_size=CHUNK,
                           dtype="float32", device="cpu", max_context_len=64, **kw)


def _requests(rank: int) -> list[Request]:
    g = torch.Generator().manual_seed(100 + rank)
    # Rank 0: a short request that decodes beside a 40-token prompt prefilled over 6 steps.
    # The others: two short prompts prefilled in the first step, then decode only.
    shape = [(6, 8), (40, 3)] if rank == 0 else [(5, 10), (3, 6)]
    return [Request(f"r{rank}.{i}", torch.randint(0, 256, (n,), generator=g).tolist(),
                    SamplingParams(max_new_tokens=new)) for i, (n, new) in enumerate(shape)]


@pytest.fixture(scope="module")
def setup(dist_group):
    rank, world = dist.get_rank(), dist.get_world_size()
    with job_dir("dp_runtime_mixed_") as root:
        ckpt = write_tiny_checkpoint(root)
        dist.barrier()
        # This rank's requests served alone (world size 1, no mixed steps): the tokens to match.
        with RankWorker(_spec(ckpt, 1, mixed_steps=False)) as w:
            alone = {r.rid: r.output_ids for r in w.generate(_requests(rank))}
        yield ckpt, rank, world, alone


@pytest.mark.parametrize("graphs", [False, "extend"], ids=["eager", "graphs"])
@pytest.mark.parametrize(("dispatcher", "padding"), [("all_gather", "max_len"), ("all_gather", "sum_len"),
                                                     ("all_to_all", None)])
def test_a_rank_prefilling_beside_decoding_ranks_gives_the_single_rank_tokens(setup, dispatcher, padding, graphs):
    """The gathered DP buffers are laid out from each step's counts (a mixed rank brings its
    decode rows plus a chunk, within chunked_prefill_size), with the padding forced either way;
    with graphs, steps where every busy rank decodes replay decode graphs and steps where one
    extends and another decodes replay the extend pieces on every rank (the decoding ranks'
    rows as one-token requests)."""
    ckpt, rank, world, alone = setup
    spec = _spec(ckpt, world, dispatcher=dispatcher, dp_padding=padding, use_cuda_graph=bool(graphs),
                 cuda_graph_extend_tokens=(4, CHUNK) if graphs else ())
    with RankWorker(spec, rank=rank, world_size=world) as w:
        w.submit(_requests(rank))
        both = graphed = 0  # steps whose plan has a rank extending (mixed) and a rank decoding
        while not (plan := w.step()).skip:
            modes = set(plan.forward_modes)
            mixed_kinds = ForwardMode.EXTEND in modes and ForwardMode.DECODE in modes
            both += mixed_kinds
            graphed += mixed_kinds and plan.graph_bucket is not None
            assert max(plan.raw_num_tokens) <= CHUNK  # the budget bounds every rank's step
        w.wait_tokens()
        got = {r.rid: r.output_ids for r in w.pop_finished()}
        m = w.metrics()
        w.sync.verify()
    # vllm:iteration_tokens_total: one observation per step that carried tokens (IDLE ones not),
    # each the step's prompt tokens plus decode rows (a report, not an assert: every rank gathers)
    hist = m["tokens_per_step"]
    counted = (hist["count"], hist["sum"]) == (m["steps"] - m["idle_steps"],
                                               m["prefill_tokens"] + m["decode_rows"])
    report = [None] * world
    dist.all_gather_object(report, (got == alone, both, m["steps_by_kind"], graphed, counted))
    assert all(same for same, *_ in report), [(r, got, alone) for r, (same, *_) in enumerate(report) if not same]
    assert len({b for _, b, _, _, _ in report}) == 1 and report[0][1] > 0  # the same plans everywhere
    assert report[0][2]["mixed"] >= 4  # rank 0: its chunks carried its decode row
    assert all(kinds["mixed"] == 0 and kinds["decode"] > 0 for _, _, kinds, _, _ in report[1:])
    # with graphs every such step replayed the extend pieces, the decoding ranks' rows included
    assert all(g == (b if graphs else 0) for _, b, _, g, _ in report), report
    assert all(counted for *_, counted in report), report


def test_a_rank_only_prefilling_keeps_to_the_mixed_budget_while_its_peers_decode(setup):
    """Rank 0 has only the 40-token prompt: its first step takes a whole chunk (no peer has
    sampled yet), then, while the peers' requests decode, chunks of the mixed budget (4), so it
    never holds their next tokens up for a whole chunk; the tokens are the single-rank run's."""
    ckpt, rank, world, alone = setup
    reqs = _requests(rank)[1:] if rank == 0 else _requests(rank)
    with RankWorker(_spec(ckpt, world, mixed_step_tokens=4), rank=rank, world_size=world) as w:
        w.submit(reqs)
        sizes, peers_sampled = [], []  # rank 0's tokens per step; whether a peer sampled before
        before = False
        while not (plan := w.step()).skip:
            sizes.append(plan.raw_num_tokens[0])
            peers_sampled.append(before)
            before = any(plan.global_num_tokens_for_logprob_cpu[1:])
        w.wait_tokens()
        got = {r.rid: r.output_ids for r in w.pop_finished()}
    assert got == {r.rid: alone[r.rid] for r in reqs}
    prefill = [(n, p) for n, p in zip(sizes, peers_sampled, strict=True) if n > 1]
    assert prefill[0] == (CHUNK, False)  # the first step: nobody decodes yet
    assert all(n <= 4 for n, p in prefill if p) and sum(p for _, p in prefill) >= 4
    assert sum(n for n, _ in prefill) == 40
