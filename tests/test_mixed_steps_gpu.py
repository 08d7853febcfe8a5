"""Mixed steps on one GPU (bf16, SDPA and FlashInfer, eager and graphs with extend pieces): the
decode rows of a mixed step give the logits a decode step gives them, so serving with mixed
steps gives the tokens of serving without them up to bf16 near-ties, which are reported as
such (the same rule as ``_graph_fixtures.assert_same_greedy``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.hf_reference import write_tiny_checkpoint
from tests.support.greedy_match import assert_same_greedy

pytestmark = pytest.mark.gpu

ATTENTION = ["sdpa"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
LENS, NEW = (4, 21, 9, 37, 15, 28), 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    pytest.importorskip("transformers")
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_mixed_gpu"), head_dim=64)


def _serve(ckpt, attention: str, graphs: bool, mixed: bool):
    spec = RankSpec.create(str(ckpt), dp_size=1, max_running_requests=3, chunked_prefill_size=16,
                           cuda_graph_bs=(1, 2, 3), cuda_graph_extend_tokens=(8, 16) if graphs else (),
                           use_cuda_graph=graphs, dtype="bfloat16", device="cuda", max_context_len=96,
                           attention=attention, dispatcher="local", mixed_steps=mixed)
    g = torch.Generator().manual_seed(9)
    reqs = [Request(f"p{i}", torch.randint(0, 256, (n,), generator=g).tolist(), SamplingParams(max_new_tokens=NEW))
            for i, n in enumerate(LENS)]
    with RankWorker(spec, keep_logits=True) as w:
        tokens = {r.rid: r.output_ids for r in w.generate(reqs)}
        logits = {rid: torch.stack(rows) for rid, rows in w.sampled_logits.items()}
        assert w.scheduler.kv_metrics()["free_kv_slots"] == w.kv_cache.num_slots
        return tokens, logits, w.metrics()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("attention", ATTENTION)
def test_mixed_steps_give_the_tokens_and_logits_of_prefill_or_decode_steps(ckpt, attention, graphs):
    plain_tokens, plain_logits, m_off = _serve(ckpt, attention, graphs, mixed=False)
    tokens, logits, m_on = _serve(ckpt, attention, graphs, mixed=True)
    assert m_on["steps_by_kind"]["mixed"] > 0 and m_off["steps_by_kind"]["mixed"] == 0
    if graphs:
        assert m_on["extend_graph_steps"] > 0 and m_on["graph_steps"] > m_on["extend_graph_steps"]
    assert_same_greedy(plain_tokens, plain_logits, tokens, logits)
