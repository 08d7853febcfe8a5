"""Extend steps through graphs captured in pieces (graph/piecewise_runner.py), on CPU: the
runner's stand-in runs the same split (every attention call on the live rows only, padded back
to the bucket), the same registry fill and the same slicing as a CUDA replay. The rank worker
with extend graphs gives the eager worker's tokens, chunked prompts included; the multi-rank
case (an IDLE rank replaying the same bucket) is in tests/test_model_dist.py."""

from __future__ import annotations

import pytest
import torch

from buffers import BufferPool, build_prefill_registry
from dp_runtime.config import RuntimeConfig
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.forward_batch import ForwardBatch, capture_batch, idle_batch
from dp_runtime.serving.request import Request, SamplingParams
from dp_runtime.sync.step_plan import plan_step
from dp_runtime.sync.step_table import StepTable
from graph import AttentionSplit, PiecewiseRunner


class RecordingBackend:
    """Attention that doubles q, recording what it was planned for and what it attended."""

    def __init__(self) -> None:
        self.planned: list[tuple[str, int, int]] = []
        self.attended: list[tuple[int, int]] = []

    def init_forward_metadata(self, batch) -> None:
        self.planned.append((batch.forward_mode.name, batch.batch_size, batch.num_tokens))

    def forward(self, q, k, v, layer_id, batch, out=None):
        self.attended.append((layer_id, q.shape[0]))
        o = 2 * q.reshape(q.shape[0], -1)
        return o if out is None else out.copy_(o)


def _toy(split: AttentionSplit):
    def forward(batch):
        x = batch.input_ids.float()[:, None].repeat(1, 4).view(-1, 2, 2)
        o = split.forward(x, x, x, 0, batch) + split.forward(x + 1, x, x, 1, batch)
        rows = torch.cumsum(batch.extend_seq_lens[: batch.batch_size], 0) - 1
        return o[rows]
    return forward


def _runner(max_requests=3, sizes=(4, 8)):
    cfg = RuntimeConfig(dp_size=1, hidden_size=8, max_running_requests=max_requests, chunked_prefill_size=8,
                        cuda_graph_extend_tokens=sizes)
    backend = RecordingBackend()
    split = AttentionSplit(backend)
    registry = build_prefill_registry(max_requests, sizes[-1], "cpu", BufferPool(), register_input_embeds=False)

    def plan_for(tokens):
        return plan_step(StepTable.from_counts([tokens], can_run_graph=True, is_extend=True), cfg)

    runner = PiecewiseRunner(
        _toy(split), split, backend, registry, sizes, max_requests=max_requests,
        capture_batch=lambda bs, n, plan: capture_batch(bs, n, plan, device="cpu", forward_mode=ForwardMode.EXTEND),
        capture_plan=plan_for, show_progress=False,
    )
    runner.capture()
    return runner, backend, plan_for


def _extend(ids, lens, plan):
    n, bs = len(ids), len(lens)
    t = torch.tensor
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=t(ids), positions=torch.zeros(n, dtype=torch.int64),
        out_cache_loc=torch.arange(1, n + 1), req_pool_indices=torch.arange(1, bs + 1), seq_lens=t(lens),
        seq_lens_cpu=t(lens), extend_seq_lens=t(lens), extend_prefix_lens=torch.zeros(bs, dtype=torch.int64),
        extend_seq_lens_cpu=tuple(lens), extend_prefix_lens_cpu=(0,) * bs, plan=plan,
    )


def test_attention_sees_live_rows_and_the_logits_are_the_live_requests():
    runner, backend, plan_for = _runner()
    assert runner.slots(4) == 3 and runner.slots(8) == 3
    plan = plan_for(5)
    assert plan.graph_bucket == 8
    out = runner.replay(_extend([5, 6, 7, 8, 9], [3, 2], plan), plan)
    # rows 2 and 4 (each request's last token): 2*x + 2*(x+1) per column
    assert torch.equal(out, torch.tensor([[30.0] * 4, [38.0] * 4]))
    assert backend.planned[-1] == ("EXTEND", 2, 5)  # the live batch, not the bucket
    assert backend.attended[-2:] == [(0, 5), (1, 5)]


def test_an_idle_rank_replays_the_bucket_without_attention():
    runner, backend, plan_for = _runner()
    plan = plan_for(4)
    runner.replay(_extend([1, 2, 3, 4], [4], plan), plan)  # leaves lengths in the registry
    backend.attended.clear()
    out = runner.replay(idle_batch("cpu", plan), plan)
    assert out.shape == (0, 4)
    assert backend.attended == [] and backend.planned[-1] == ("IDLE", 0, 0)


def test_batches_the_pieces_cannot_take_are_named():
    runner, _, plan_for = _runner()
    plan = plan_for(8)
    decode = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=1, input_ids=torch.tensor([1]), plan=plan)
    assert "DECODE" in runner.why_not(decode, plan)
    many = _extend([1, 2, 3, 4], [1, 1, 1, 1], plan)
    assert "4 requests" in runner.why_not(many, plan)
    with pytest.raises(ValueError, match="bucket 8 holds 8 tokens in 3 requests"):
        runner.replay(many, plan)
    big = plan_for(8)
    assert runner.why_not(_extend(list(range(9)), [9], big), big) is not None


def _tokens(graphs: bool, extend_tokens, chunk: int):
    spec = RankSpec.create("tiny", use_cuda_graph=graphs, device="cpu", dtype="float32", max_running_requests=4,
                           chunked_prefill_size=chunk, cuda_graph_extend_tokens=extend_tokens, max_context_len=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (7, 30, 61, 3, 16)]
    with RankWorker(spec) as w:
        results = w.generate([Request(f"r{i}", p, SamplingParams(max_new_tokens=5)) for i, p in enumerate(prompts)])
        m = w.metrics()
    return {r.rid: r.output_ids for r in results}, m


def test_worker_tokens_through_extend_graphs_equal_eager_chunked_or_not():
    eager, m0 = _tokens(False, (), chunk=128)
    assert m0["graph_steps"] == 0
    # Prompts chunked at 24 tokens: every extend step (a chunk, a tail, short prompts together)
    # replays a token bucket; decode steps replay decode graphs.
    graphs, m1 = _tokens(True, (8, 16, 24), chunk=24)
    assert graphs == eager
    assert m1["extend_graph_steps"] == m1["extend_steps"] > 0 and m1["eager_steps"] == 0
    # Unchunked, the 61-token prompt's step is over the largest bucket: that step runs eager.
    mixed, m2 = _tokens(True, (8, 16, 24), chunk=128)
    assert mixed == eager
    assert 0 < m2["extend_graph_steps"] < m2["extend_steps"]


def test_padding_rows_of_a_bucket_route_to_no_expert():
    """A replayed bucket's padding rows (past ``num_token_non_padded``) get the padding id and
    weight 0, so the expert kernels give them no rows; the live rows route as in eager steps
    and the tokens stay eager's."""
    from dp_runtime.model.expert_path import recording_routes
    from dp_runtime.model.routing import PADDING_ID

    spec = RankSpec.create("tiny", use_cuda_graph=True, device="cpu", dtype="float32", max_running_requests=4,
                           chunked_prefill_size=24, cuda_graph_extend_tokens=(8, 16, 24), max_context_len=128)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (7, 30, 61, 3, 16)]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    with RankWorker(spec) as w:
        w.model.experts = recording_routes(w.model.experts, lambda wt, ids: seen.append((wt.clone(), ids.clone())))
        results = w.generate([Request(f"r{i}", p, SamplingParams(max_new_tokens=5)) for i, p in enumerate(prompts)])
    eager, _ = _tokens(False, (), chunk=128)
    assert {r.rid: r.output_ids for r in results} == eager
    padded = 0
    for weights, ids in seen:
        pad_T = (ids == PADDING_ID).all(1)
        assert torch.equal(pad_T, (ids == PADDING_ID).any(1))  # a row is padding or not, never half
        live = int((~pad_T).sum())
        assert not pad_T[:live].any()  # padding is the tail
        assert (weights[live:] == 0).all() and (ids[:live] >= 0).all()
        padded += live < ids.shape[0]
    assert padded > 0  # some steps ran padded buckets (7 of 8 tokens, 3 of 8, ...)
