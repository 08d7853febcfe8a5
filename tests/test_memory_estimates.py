"""The graph-memory estimate (dp_runtime/memory_estimates.py) against a real rank on CPU (tiny
preset): the extend buckets it counts are the ones the rank captures, and per bucket what it
counts a piece keeping is what the model's attention calls hand the piece (the tensors a
captured piece holds between graphs), read from the real tensors, not restated by hand."""

from __future__ import annotations

import inspect

import pytest
import torch

from dp_runtime import memory_estimates as me
from dp_runtime.attention.flashinfer_backend import FlashInferBackend
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.graph_setup import capture_plan, extend_capture_tokens
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.forward_batch import capture_batch


@pytest.fixture(scope="module")
def worker():
    # max_context_len 8: the 64-token bucket would need requests of 16 tokens (64 over 4
    # requests), so the rank leaves it out.
    spec = RankSpec.create("tiny", dp_size=1, max_running_requests=4, chunked_prefill_size=64, dtype="float32",
                           device="cpu", max_context_len=8, use_cuda_graph=True, cuda_graph_bs=(1, 2, 4))
    with RankWorker(spec) as w:
        yield w


def test_the_extend_buckets_estimated_are_the_ones_the_rank_captures(worker):
    spec = worker.spec
    rt, mc = spec.runtime, spec.model_config()
    assert rt.cuda_graph_extend_tokens == (16, 32, 64)
    captured = worker.extend_graphs.sizes
    assert captured == extend_capture_tokens(rt, spec.context_len) == (16, 32)
    kw = dict(capture_sizes=rt.cuda_graph_bs, max_running_requests=4, context_len=8, attention="sdpa")
    assert me.rank_graph_pool_bytes_estimate(mc, rt, 8, attention="sdpa", graphs=True) == (
        me.graph_pool_bytes_estimate(mc, rt.dtype, extend_tokens=captured, **kw))
    assert me.rank_graph_pool_bytes_estimate(mc, rt, 8, attention="sdpa", graphs=False) == 0


def _unique_storage_bytes(*tensors: torch.Tensor) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_a_pieces_reads_fit_the_working_set_the_estimate_counts(worker):
    """Each extend bucket runs as its capture batch does (min(T, max_running_requests) requests
    of T tokens, the bucket's plan), through the rank's eager runner and model, with the model's
    attention seam recording what every attention call receives: the q, k, v a piece hands the
    attention, which the pool holds in the bucket's working set (the piece keeps none)."""
    mc, rt = worker.model_config, worker.spec.runtime
    e = torch.empty((), dtype=rt.dtype).element_size()
    split = worker.model.attention
    for tokens in worker.extend_graphs.sizes:
        calls = []

        def record(q, k, v, layer_id, batch, calls=calls):
            calls.append((q, k, v))
            return split.backend.forward(q, k, v, layer_id, batch)

        plan = capture_plan(rt, tokens, extend=True)
        requests = worker.extend_graphs.slots(tokens)
        batch = capture_batch(requests, tokens, plan, device=worker.device, forward_mode=ForwardMode.EXTEND)
        with split.hooked(record):
            logits = worker.eager.run(batch)
        assert len(calls) == mc.num_layers
        working_set = me.forward_peak_bytes_estimate(mc, rt.dtype, tokens, requests)
        for q, k, v in calls:
            assert _unique_storage_bytes(q, k, v) <= working_set
            # the per-layer output buffer a piece writes: q's heads (graph/piecewise_runner.py)
            assert q.shape[1] * q.shape[2] * e == mc.num_heads * mc.head_dim * e
        # the bucket's logits, min(T, max_running_requests) fp32 rows: the head's phase counts them
        assert logits.dtype == torch.float32
        assert logits.nbytes == min(tokens, rt.max_running_requests) * mc.vocab_size * 4 == requests * mc.vocab_size * 4
        head = me.forward_phase_bytes(mc, rt.dtype, tokens, requests)[2]
        assert head >= logits.nbytes


def test_the_flashinfer_workspace_counted_is_the_backends():
    default = inspect.signature(FlashInferBackend).parameters["workspace_bytes"].default
    assert default == me.FLASHINFER_FLOAT_WORKSPACE_BYTES
