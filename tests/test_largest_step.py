"""The largest steps a rank profiles before sizing its KV cache (``rank_memory.run_largest_step``),
run for real on a CPU rank (tiny preset, SDPA): the token budget over the most requests, one
request as long as the context allows, and one request's last chunk after a prefix that fills
the context, the shape whose attention reads the most keys when the budget is below the
context (a prompt's later chunk, or a cached prefix)."""

from __future__ import annotations

from dp_runtime import rank_memory as rm
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams


class _Recording:
    """The rank's eager runner, recording each batch's (requests, new tokens, prefix, keys)."""

    def __init__(self, eager) -> None:
        self.eager, self.shapes = eager, []

    def run(self, batch):
        prefix = batch.extend_prefix_lens_cpu[0]
        self.shapes.append((batch.batch_size, int(batch.input_ids.shape[0]), prefix, int(batch.seq_lens_cpu.max())))
        return self.eager.run(batch)


def test_the_profile_runs_a_last_chunk_after_a_prefix_filling_the_context():
    spec = RankSpec.create("tiny", dp_size=1, max_running_requests=4, chunked_prefill_size=64, dtype="float32",
                           device="cpu", max_context_len=96)
    with RankWorker(spec) as w:
        rec = _Recording(w.eager)
        rm.run_largest_step(rec, spec.runtime, w.device, spec.context_len)
        # the profile's batches touch only the padding targets: the rank serves as before
        [r] = w.generate([Request("after", list(range(1, 41)), SamplingParams(max_new_tokens=4))])
    # the budget over 4 requests; one request of the budget (<= the context); its last chunk
    # after 32 cached tokens: 64 queries over all 96 keys
    assert rec.shapes == [(4, 64, 0, 16), (1, 64, 0, 64), (1, 64, 32, 96)]
    assert r.ok and len(r.output_ids) == 4


def test_a_context_of_one_token_has_no_prefixed_shape():
    spec = RankSpec.create("tiny", dp_size=1, max_running_requests=1, chunked_prefill_size=8, dtype="float32",
                           device="cpu", max_context_len=1)
    with RankWorker(spec) as w:
        rec = _Recording(w.eager)
        rm.run_largest_step(rec, spec.runtime, w.device, spec.context_len)
    assert rec.shapes == [(1, 1, 0, 1)]
