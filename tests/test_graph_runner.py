"""GraphRunner on CPU: the same fill / view / replay-metadata / forward / slice path that
captures and replays CUDA graphs on a GPU, run eagerly on the padded views."""

from __future__ import annotations

import gc

import pytest
import torch
from _graph_fixtures import (
    Padding,
    Plan,
    agreed_plan,
    assert_same_greedy,
    graph_plan,
    make_eager_runner,
    make_graph_runner,
    make_stack,
)

from dp_runtime.attention import TorchSDPABackend
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.serving.forward_batch import ForwardBatch, idle_batch
from graph import AttentionMetadataBackend, GraphRunner
from tests.support.synthetic_batch import add_requests, decode_batch, extend_batch


class RecordingBackend:
    """Records what the runner asks of an attention backend (the real protocol, no attention)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    def init_forward_metadata(self, batch) -> None:
        self.calls.append(("eager", {"bs": batch.batch_size, "forward_mode": batch.forward_mode}))

    def init_capture(self, max_bs, max_num_tokens) -> None:
        self.calls.append(("init_capture", {"max_bs": max_bs, "max_num_tokens": max_num_tokens}))

    def init_forward_metadata_capture(self, *, bs, num_tokens, req_pool_indices, seq_lens, forward_mode) -> None:
        self.calls.append(("capture", {"bs": bs, "num_tokens": num_tokens, "rows": len(req_pool_indices), "forward_mode": forward_mode}))

    def init_forward_metadata_replay(
        self, *, bs, raw_bs, req_pool_indices, seq_lens, seq_lens_sum, forward_mode, seq_lens_cpu
    ) -> None:
        self.calls.append(
            (
                "replay",
                {
                    "bs": bs,
                    "raw_bs": raw_bs,
                    "req_pool_indices": req_pool_indices.clone(),
                    "seq_lens": seq_lens.clone(),
                    "seq_lens_sum": seq_lens_sum,
                    "forward_mode": forward_mode,
                    "seq_lens_cpu": None if seq_lens_cpu is None else seq_lens_cpu.clone(),
                },
            )
        )

    def last(self, kind: str) -> dict:
        return [c for k, c in self.calls if k == kind][-1]


def echo(batch):
    """A forward whose row i is a function of input i only (and which shows the padded size)."""
    return {"ids": batch.input_ids * 10 + 1, "rows": torch.tensor(batch.batch_size), "fixed": torch.zeros(3)}


def manual_decode(bs: int) -> ForwardBatch:
    lens = torch.arange(2, bs + 2)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=torch.arange(100, 100 + bs),
        positions=lens - 1,
        out_cache_loc=torch.arange(1, bs + 1),
        req_pool_indices=torch.arange(1, bs + 1),
        seq_lens=lens,
        seq_lens_cpu=lens.clone(),
    )


def echo_runner(sizes=(1, 2, 4, 8, 16), dp_size: int = 1, max_bs: int | None = None):
    stack = make_stack()
    backend = RecordingBackend()
    runner = make_graph_runner(stack, sizes, backend=backend, forward=echo, dp_size=dp_size)
    if max_bs is not None:  # a registry larger than the buckets: buffers longer than any bucket
        from buffers import BufferPool, build_decode_registry

        runner.registry = build_decode_registry(max_bs, "cpu", BufferPool(), dp_size=dp_size)
    runner.capture()
    return runner, backend


def test_recording_backend_satisfies_the_protocol():
    assert isinstance(RecordingBackend(), AttentionMetadataBackend)
    stack = make_stack()
    assert isinstance(stack.backend, AttentionMetadataBackend)


def test_capture_goes_largest_first_with_one_init_capture():
    runner, backend = echo_runner(sizes=(4, 1, 16, 8, 2))
    assert runner.sizes == (1, 2, 4, 8, 16)
    assert backend.calls[0] == ("init_capture", {"max_bs": 16, "max_num_tokens": 16})
    captured = [c["bs"] for k, c in backend.calls if k == "capture"]
    assert captured == [16, 8, 4, 2, 1]
    assert all(c["forward_mode"] is ForwardMode.DECODE for k, c in backend.calls if k == "capture")
    assert gc.get_freeze_count() == 0  # gc unfrozen after capture


def test_capture_records_what_was_baked_in():
    runner, _ = echo_runner()
    rec = runner.record(8)
    assert (rec.bucket, rec.num_tokens, rec.padding, rec.runtime_max_tokens_per_rank) == (8, 8, "MAX_LEN", 8)
    assert rec.forward_mode is ForwardMode.DECODE
    assert {"input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens", "seq_lens_cpu"} <= rec.fields
    with pytest.raises(RuntimeError, match="already captured"):
        runner.capture()
    runner.destroy()
    assert not runner.captured
    runner.capture()
    assert runner.captured


def test_the_stand_in_runs_the_forward_with_the_capture_plan():
    """The runner lays out nothing for DP: the plan travels in the batch, and a replay runs what
    the capture ran, the capture plan (the bucket on every rank), not the step's live counts. A
    gathering dispatcher lays its buffers out from that plan, as it did while capturing."""
    seen = []

    def forward(batch):
        seen.append(batch.plan)
        return echo(batch)

    runner = make_graph_runner(make_stack(), (1, 2, 4), backend=RecordingBackend(), forward=forward, dp_size=2)
    runner.capture()
    runner.replay(manual_decode(3), Plan(4, Padding.MAX_LEN, 4, (3, 1)))
    runner.replay(idle_batch("cpu", Plan(2, Padding.MAX_LEN, 2, (0, 2))), Plan(2, Padding.MAX_LEN, 2, (0, 2)))
    assert seen == [graph_plan(4, (4, 4)), graph_plan(2, (2, 2))]


def test_bucket_is_smallest_captured_size_at_or_above_the_plan():
    runner, _ = echo_runner()
    assert [runner.bucket_for(graph_plan(n)) for n in (1, 3, 5, 8, 9, 16)] == [1, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="exceeds the largest captured bucket 16"):
        runner.bucket_for(graph_plan(17))
    with pytest.raises(ValueError, match="no graph bucket"):
        runner.bucket_for(Plan(None, Padding.MAX_LEN, 4, (4,)))


def test_bucket_follows_the_dp_plan_never_the_local_batch():
    # This rank has 3 requests, the other has 7: every rank replays bucket 8, not 4.
    runner, backend = echo_runner(dp_size=2)
    batch = manual_decode(3)
    out = runner.replay(batch, Plan(8, Padding.MAX_LEN, 8, (3, 7)))
    replay = backend.last("replay")
    assert (replay["bs"], replay["raw_bs"]) == (8, 3)
    assert out["ids"].tolist() == [1001, 1011, 1021]
    assert int(out["rows"]) == 8  # the forward ran at the bucket size


def test_replay_metadata_gets_bucket_and_live_size_whatever_the_buffer_length():
    # Upstream bug: replay re-derived the batch size from len(req_pool_indices), the length of a
    # buffer. Here the registry holds 256 rows; bucket 8 with 5 live requests must say bs=8,
    # raw_bs=5, and the padded rows are row 0 / length 1.
    runner, backend = echo_runner(max_bs=256)
    assert runner.registry.buffer("req_pool_indices").shape[0] == 256
    batch = manual_decode(5)
    out = runner.replay(batch, agreed_plan(5, runner.sizes))
    replay = backend.last("replay")
    assert (replay["bs"], replay["raw_bs"]) == (8, 5)
    assert replay["forward_mode"] is ForwardMode.DECODE
    assert replay["req_pool_indices"].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert replay["seq_lens"].tolist() == [2, 3, 4, 5, 6, 1, 1, 1]
    assert replay["seq_lens_sum"] == 2 + 3 + 4 + 5 + 6 + 3
    assert replay["seq_lens_cpu"].tolist() == replay["seq_lens"].tolist()
    assert out["ids"].shape == (5,)
    assert out["fixed"].shape == (3,)  # outputs not of the padded length are left whole


def test_sdpa_replay_metadata_reads_bs_rows_of_longer_buffers():
    stack = make_stack(max_reqs=300)
    backend: TorchSDPABackend = stack.backend
    reqs = add_requests(stack.allocator, [4, 7, 3, 9, 5])
    backend.init_capture(max_bs=256, max_num_tokens=256)
    rows = torch.zeros(256, dtype=torch.int64)
    lens = torch.ones(256, dtype=torch.int64)
    rows[:5] = torch.tensor([r.row for r in reqs])
    lens[:5] = torch.tensor([r.seq_len for r in reqs])
    rows[8:] = rows[0]  # rows past the bucket hold live-looking garbage: it must be ignored
    lens[8:] = 50
    backend.init_forward_metadata_capture(bs=8, num_tokens=8, req_pool_indices=rows, seq_lens=lens, forward_mode=ForwardMode.DECODE)
    backend.init_forward_metadata_replay(
        bs=8, raw_bs=5, req_pool_indices=rows, seq_lens=lens, seq_lens_sum=int(lens[:8].sum()),
        forward_mode=ForwardMode.DECODE, seq_lens_cpu=lens,
    )
    meta = backend.metadata
    assert meta.kv_indices_BW.shape[0] == 8 and meta.valid_BW.shape[0] == 8
    assert meta.valid_BW.sum(1).tolist() == lens[:8].tolist()
    for i, r in enumerate(reqs):
        assert meta.kv_indices_BW[i, : r.seq_len].tolist() == stack.cache.req_to_token[r.row, : r.seq_len].tolist()
    assert meta.kv_indices_BW[5:, 0].tolist() == [0, 0, 0]  # padded rows read slot 0 only


def _live_batch(stack, lens, ids):
    reqs = add_requests(stack.allocator, lens)
    return decode_batch(stack.allocator, reqs, ids)


def test_padded_rows_holding_garbage_never_change_live_outputs():
    stack = make_stack()
    vocab = stack.config.vocab_size
    runner = make_graph_runner(stack, (1, 2, 4, 8))
    runner.capture()
    batch = _live_batch(stack, [5, 17, 9, 30, 2], [3, 14, 15, 92, 65])
    ref = make_eager_runner(stack).run(batch)

    # input_ids pads with KEEP: the padded rows run on whatever is there. Make that a token
    # whose embedding is NaN: the padded rows then compute NaN, write NaN K/V into slot 0, and
    # the live rows must not see any of it.
    runner.registry.buffer("input_ids").fill_(vocab - 1)
    with torch.no_grad():
        stack.model.embed[vocab - 1] = float("nan")
    before = [k.clone() for k in stack.cache.k]

    out = runner.replay(batch, agreed_plan(5, runner.sizes))
    assert out.shape == (5, vocab)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert runner.registry.buffer("input_ids")[5:8].tolist() == [vocab - 1] * 3  # they did run
    assert torch.isnan(stack.cache.k[0][0]).all()  # ... and wrote slot 0, the padding target
    live = set(batch.out_cache_loc.tolist()) | {0}
    for k_before, k_after in zip(before, stack.cache.k, strict=True):
        changed = ((k_before != k_after) & ~(k_before.isnan() & k_after.isnan())).flatten(1).any(1)
        assert set(changed.nonzero().flatten().tolist()) <= live


@pytest.mark.parametrize("live", [1, 2, 3, 4, 5, 7, 8, 9, 12, 16])
def test_replay_equals_eager_for_every_bucket_and_between(live):
    stack = make_stack()
    runner = make_graph_runner(stack, (1, 2, 4, 8, 16))
    runner.capture()
    gen = torch.Generator().manual_seed(live)
    lens = torch.randint(1, 60, (live,), generator=gen).tolist()
    ids = torch.randint(0, stack.config.vocab_size - 1, (live,), generator=gen).tolist()
    batch = _live_batch(stack, lens, ids)
    eager = make_eager_runner(stack).run(batch)
    replay = runner.replay(batch, agreed_plan(live, runner.sizes))
    assert replay.shape == eager.shape == (live, stack.config.vocab_size)
    torch.testing.assert_close(replay, eager, atol=1e-5, rtol=1e-5)
    assert_same_greedy(replay, eager)


def test_replay_on_its_own_backend_instance_equals_eager():
    # What the decode benchmark does: the graphs call a second attention backend over the same
    # KV cache (its own metadata), through a copy of the model that shares the weights.
    stack = make_stack()
    graph_backend = TorchSDPABackend(stack.cache, num_q_heads=4, num_kv_heads=2, head_dim=8)
    graph_model = stack.model.with_attention(graph_backend)
    assert graph_model.attention is graph_backend and stack.model.attention is stack.backend
    assert graph_model.embed is stack.model.embed and graph_model.dispatcher is stack.model.dispatcher
    runner = make_graph_runner(stack, (4, 8), backend=graph_backend, forward=graph_model.forward)
    runner.capture()
    batch = _live_batch(stack, [6, 25, 11, 40, 3], [9, 8, 7, 6, 5])
    eager = make_eager_runner(stack).run(batch)
    replay = runner.replay(batch, agreed_plan(5, runner.sizes))
    torch.testing.assert_close(replay, eager, atol=1e-5, rtol=1e-5)
    assert graph_backend.metadata is not None and stack.backend.metadata is not graph_backend.metadata


def test_replay_after_refill_answers_for_the_new_batch():
    stack = make_stack()
    runner = make_graph_runner(stack, (4, 8))
    runner.capture()
    eager = make_eager_runner(stack)
    a = _live_batch(stack, [10, 20, 30, 40, 50], [1, 2, 3, 4, 5])
    b = _live_batch(stack, [33, 3, 12], [60, 70, 80])
    out_a = runner.replay(a, agreed_plan(5, runner.sizes)).clone()
    out_b = runner.replay(b, agreed_plan(3, runner.sizes))
    torch.testing.assert_close(out_b, eager.run(b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_a, eager.run(a), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out_a[:3], out_b)


def test_idle_batch_replays_the_bucket_with_zero_live_rows():
    runner, backend = echo_runner(dp_size=2)
    plan = Plan(4, Padding.MAX_LEN, 4, (0, 4))
    idle = idle_batch("cpu", plan)
    assert runner.can_run(idle, plan)
    out = runner.replay(idle, plan)
    replay = backend.last("replay")
    assert (replay["bs"], replay["raw_bs"], replay["forward_mode"]) == (4, 0, ForwardMode.DECODE)
    assert replay["req_pool_indices"].tolist() == [0] * 4 and replay["seq_lens"].tolist() == [1] * 4
    assert out["ids"].shape == (0,)
    assert runner.registry.buffer("out_cache_loc")[:4].tolist() == [0] * 4


def test_idle_batch_through_the_model():
    # Zero live rows replay bucket 4 of padded rows through the model and return none. The
    # model's dispatcher is one rank's, so the plans list one rank (the echo test above has the
    # DP-2 plan; test_model_dist.py runs IDLE ranks through a two-rank dispatcher).
    stack = make_stack()
    runner = make_graph_runner(stack, (1, 2, 4))
    runner.capture()
    plan = Plan(3, Padding.MAX_LEN, 4, (0,))
    out = runner.replay(idle_batch("cpu", plan), plan)
    assert out.shape == (0, stack.config.vocab_size)


def test_baked_values_are_checked_and_named():
    runner, _ = echo_runner()
    batch = manual_decode(5)
    wrong_max = Plan(5, Padding.MAX_LEN, 5, (5,))
    assert not runner.can_run(batch, wrong_max)
    assert "runtime_max_tokens_per_rank 5 (captured 8)" in runner.why_not(batch, wrong_max)
    with pytest.raises(ValueError, match=r"runtime_max_tokens_per_rank 5 \(captured 8\)"):
        runner.replay(batch, wrong_max)
    wrong_padding = Plan(5, Padding.SUM_LEN, 8, (5,))
    with pytest.raises(ValueError, match=r"padding SUM_LEN \(captured MAX_LEN\)"):
        runner.replay(batch, wrong_padding)
    assert runner.can_run(batch, graph_plan(8))


def test_can_run_conditions():
    runner, _ = echo_runner(sizes=(1, 2, 4, 8))
    batch = manual_decode(5)
    assert runner.can_run(batch, graph_plan(8))
    cases = {
        "no graph bucket": (batch, Plan(None, Padding.MAX_LEN, 5, (5,))),
        "exceeds the largest captured bucket 8": (manual_decode(9), graph_plan(9)),
        "a rank has 9 tokens": (batch, Plan(8, Padding.MAX_LEN, 8, (5, 9))),
        "batch has 5 requests; bucket 4": (batch, graph_plan(4)),
    }
    for reason, (b, plan) in cases.items():
        assert not runner.can_run(b, plan)
        assert reason in runner.why_not(b, plan)
    stack = make_stack()
    extend = extend_batch(stack.allocator, add_requests(stack.allocator, [1, 1]), [2, 2], [1, 2, 3, 4])
    assert "batch mode EXTEND" in runner.why_not(extend, graph_plan(4))
    no_host_lens = manual_decode(5)
    no_host_lens.seq_lens_cpu = None
    assert "captured but missing ['seq_lens_cpu']" in runner.why_not(no_host_lens, graph_plan(8))
    with pytest.raises(ValueError, match="captured but missing"):
        runner.replay(no_host_lens, graph_plan(8))
    fresh = make_graph_runner(make_stack(), (1, 2), backend=RecordingBackend(), forward=echo)
    assert fresh.why_not(batch, graph_plan(1)) == "graphs are not captured"
    with pytest.raises(RuntimeError, match="not captured"):
        fresh.replay(batch, graph_plan(1))


def test_outputs_are_sliced_by_their_leading_dimension():
    def forward(batch):
        n = batch.input_ids.shape[0]
        return (batch.input_ids.float(), [torch.ones(n, 3)], {"scalar": torch.tensor(1.0), "odd": torch.zeros(7)})

    stack = make_stack()
    runner = make_graph_runner(stack, (8,), backend=RecordingBackend(), forward=forward)
    runner.capture()
    ids, (ones,), rest = runner.replay(manual_decode(5), agreed_plan(5, runner.sizes))
    assert ids.tolist() == [100.0, 101.0, 102.0, 103.0, 104.0]
    assert ones.shape == (5, 3)
    assert rest["scalar"].dim() == 0 and rest["odd"].shape == (7,)


def test_construction_errors_name_the_limit():
    stack = make_stack()
    from buffers import BufferPool, build_decode_registry

    small = build_decode_registry(4, "cpu", BufferPool())
    kw = {"capture_batch": lambda *a: None, "capture_plan": graph_plan, "show_progress": False}
    with pytest.raises(ValueError, match=r"largest bucket 8 .* exceeds registry"):
        GraphRunner(echo, RecordingBackend(), small, (1, 8), **kw)
    with pytest.raises(ValueError, match="non-empty"):
        GraphRunner(echo, RecordingBackend(), small, (), **kw)
    with pytest.raises(ValueError, match="cannot capture IDLE"):
        GraphRunner(echo, RecordingBackend(), small, (1,), forward_mode=ForwardMode.IDLE, **kw)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_cuda_graph=True needs CUDA"):
            GraphRunner(echo, RecordingBackend(), small, (1,), use_cuda_graph=True, **kw)
    del stack


def test_capture_failure_releases_what_was_captured():
    stack = make_stack()
    calls = []

    def capture_plan(bucket):
        calls.append(bucket)
        if bucket == 2:
            raise RuntimeError("boom")
        return graph_plan(bucket)

    runner = make_graph_runner(stack, (1, 2, 4), backend=RecordingBackend(), forward=echo)
    runner._capture_plan = capture_plan
    with pytest.raises(RuntimeError, match="boom"):
        runner.capture()
    assert calls == [4, 2]
    assert not runner.captured
    assert gc.get_freeze_count() == 0
