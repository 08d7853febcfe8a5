"""EagerRunner: decode, extend and IDLE batches through a registry grown on demand, and the
no-copy escape hatch."""

from __future__ import annotations

import pytest
import torch
from _graph_fixtures import Padding, Plan, make_eager_runner, make_stack

from buffers import BufferPool, build_prefill_registry
from dp_runtime.config import RuntimeConfig
from dp_runtime.env import read_env
from dp_runtime.serving.forward_batch import idle_batch
from graph import EagerRunner, next_power_of_two
from tests.support.synthetic_batch import add_requests, decode_batch, extend_batch


class Seen:
    """A forward that remembers the batch it was given, around the real model's forward."""

    def __init__(self, forward) -> None:
        self.forward, self.batches = forward, []

    def __call__(self, batch):
        self.batches.append(batch)
        return self.forward(batch)


def _decode(stack, lens, ids):
    return decode_batch(stack.allocator, add_requests(stack.allocator, lens), ids)


def test_next_power_of_two():
    assert [next_power_of_two(n) for n in (0, 1, 2, 3, 5, 8, 9, 1000)] == [1, 1, 2, 4, 8, 8, 16, 1024]


def test_decode_goes_through_registry_views():
    stack = make_stack()
    runner = make_eager_runner(stack, max_bs=8, max_num_tokens=8)
    seen = Seen(stack.model.forward)
    runner.forward = seen
    batch = _decode(stack, [3, 8, 5], [7, 8, 9])
    out = runner.run(batch)
    view = seen.batches[-1]
    assert out.shape == (3, stack.config.vocab_size)
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
        tensor = getattr(view, name)
        assert tensor.data_ptr() == runner.registry.buffer(name).data_ptr(), name
        assert torch.equal(tensor, getattr(batch, name)), name
    assert view.extend_seq_lens is None  # a slot the decode batch lacks stays None
    assert int(view.num_token_non_padded) == 3  # computed slots are exposed
    assert batch.num_token_non_padded is None  # the caller's batch is not mutated


def test_no_copy_hands_the_model_the_batch_tensors():
    stack = make_stack()
    batch = _decode(stack, [3, 8, 5], [7, 8, 9])
    ref = make_eager_runner(stack).run(batch)
    runner = make_eager_runner(stack, no_copy=True)
    seen = Seen(stack.model.forward)
    runner.forward = seen
    out = runner.run(batch)
    view = seen.batches[-1]
    assert runner.registry is None
    assert view is not batch
    for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
        assert getattr(view, name) is getattr(batch, name)
    torch.testing.assert_close(out, ref)


def test_no_copy_from_the_environment_reaches_the_runner_through_the_config(monkeypatch):
    stack = make_stack()
    monkeypatch.setenv("DP_RUNTIME_EAGER_INPUT_NO_COPY", "1")
    cfg = RuntimeConfig(device="cpu")
    assert cfg.eager_input_no_copy is True
    assert EagerRunner(stack.model.forward, stack.backend, no_copy=cfg.eager_input_no_copy).no_copy
    monkeypatch.setenv("DP_RUNTIME_EAGER_INPUT_NO_COPY", "0")
    assert RuntimeConfig(device="cpu").eager_input_no_copy is False
    with pytest.raises(ValueError, match="registry_factory is needed"):
        EagerRunner(stack.model.forward, stack.backend, no_copy=False)
    monkeypatch.setenv("DP_RUNTIME_EAGER_INPUT_NO_COPY", "maybe")
    with pytest.raises(ValueError, match="DP_RUNTIME_EAGER_INPUT_NO_COPY='maybe'"):
        RuntimeConfig(device="cpu")


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), ("ON", True), (" yes ", True), ("0", False), ("", None), ("off", False)],
)
def test_env_flag_parsing(value, expected):
    assert read_env({"DP_RUNTIME_EAGER_INPUT_NO_COPY": value}).eager_input_no_copy is expected
    assert read_env({}).eager_input_no_copy is None


def test_explicit_config_value_overrides_the_environment(monkeypatch):
    monkeypatch.setenv("DP_RUNTIME_EAGER_INPUT_NO_COPY", "1")
    assert RuntimeConfig(device="cpu", eager_input_no_copy=False).eager_input_no_copy is False
    stack = make_stack()
    runner = make_eager_runner(stack, no_copy=False)
    assert not runner.no_copy and runner.registry is not None


def test_registry_grows_to_the_next_power_of_two_on_each_axis():
    stack = make_stack()
    asked = []

    def factory(bs, tokens):
        asked.append((bs, tokens))
        return build_prefill_registry(bs, tokens, "cpu", BufferPool(), register_input_embeds=False)

    runner = EagerRunner(stack.model.forward, stack.backend, factory)
    assert asked == [(1, 1)]
    runner.run(_decode(stack, [4, 4, 4, 4, 4], [1, 2, 3, 4, 5]))  # 5 requests, 5 tokens
    assert asked[-1] == (8, 8)
    reqs = add_requests(stack.allocator, [2, 3, 4])
    runner.run(extend_batch(stack.allocator, reqs, [7, 6, 7], list(range(20))))  # 3 requests, 20 tokens
    assert asked[-1] == (8, 32)
    runner.run(_decode(stack, [2, 2], [1, 2]))  # fits: no rebuild
    assert len(asked) == 3 and runner.growths == 2
    assert (runner.registry.max_bs, runner.registry.max_num_tokens) == (8, 32)


def test_growth_that_the_pool_cannot_serve_names_the_sizes():
    stack = make_stack()
    pool = BufferPool()
    runner = EagerRunner(
        stack.model.forward, stack.backend, lambda b, t: build_prefill_registry(b, t, "cpu", pool, register_input_embeds=False)
    )
    with pytest.raises(ValueError, match=r"building the registry for max_bs=4, max_num_tokens=4 failed.*never reallocated"):
        runner.run(_decode(stack, [2, 2, 2], [1, 2, 3]))


def test_extend_then_decode_equals_one_longer_extend():
    # Two copies of one model: one prefills 6 tokens at once, the other prefills 5 (in two
    # chunks, the second on top of a cached prefix) then decodes the 6th. The last token's
    # logits must agree: the eager path's extend, prefix handling and decode read one cache.
    # (An extend returns the logits of each request's last token: (1, V) here.)
    tokens = [5, 17, 3, 44, 9, 28]
    a, b = make_stack(), make_stack()
    ra, rb = make_eager_runner(a), make_eager_runner(b)
    [req_a] = add_requests(a.allocator, [0])
    full = ra.run(extend_batch(a.allocator, [req_a], [6], tokens))
    assert full.shape == (1, a.config.vocab_size)
    [req_b] = add_requests(b.allocator, [0])
    rb.run(extend_batch(b.allocator, [req_b], [3], tokens[:3]))
    rb.run(extend_batch(b.allocator, [req_b], [2], tokens[3:5]))
    last = rb.run(decode_batch(b.allocator, [req_b], tokens[5:]))
    torch.testing.assert_close(last, full, atol=1e-5, rtol=1e-5)


def test_mixed_prefix_extend_batch_matches_per_request_runs():
    # One extend of three requests (no prefix, a 12-token prefix, a 5-token prefix) gives each
    # request's last-token logits; each must equal that request extended alone.
    stack = make_stack()
    runner = make_eager_runner(stack)
    reqs = add_requests(stack.allocator, [0, 12, 5])
    ext = [4, 1, 6]
    ids = list(range(1, 12))
    out = runner.run(extend_batch(stack.allocator, reqs, ext, ids))
    assert out.shape == (3, stack.config.vocab_size)
    solo = make_stack()
    solo_runner = make_eager_runner(solo)
    solo_reqs = add_requests(solo.allocator, [0, 12, 5])  # same seed: same cached K/V
    start = 0
    for i, (req, e) in enumerate(zip(solo_reqs, ext, strict=True)):
        one = solo_runner.run(extend_batch(solo.allocator, [req], [e], ids[start : start + e]))
        assert one.shape == (1, stack.config.vocab_size)
        torch.testing.assert_close(one[0], out[i], atol=1e-5, rtol=1e-5)
        start += e
    assert not torch.allclose(out[0], out[1])  # the rows are the requests' own, not one repeated


def test_idle_batch_runs_with_zero_tokens():
    # A batch with zero tokens goes through the model (attention, dispatch with zero rows,
    # combine). The model's dispatcher here is one rank's, so the plan lists one rank; the
    # IDLE rank of a DP-2 step, whose dispatcher exchanges with the other, is in
    # test_model_dist.py.
    stack = make_stack()
    for no_copy in (False, True):
        runner = make_eager_runner(stack, no_copy=no_copy)
        out = runner.run(idle_batch("cpu", Plan(None, Padding.MAX_LEN, 0, (0,))))
        assert out.shape == (0, stack.config.vocab_size)
        assert stack.backend.metadata is None
