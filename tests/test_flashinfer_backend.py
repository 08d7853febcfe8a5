"""FlashInferBackend on CPU, against a pure-torch emulation of flashinfer 0.7.2.post1
(``flashinfer_emulator.py``): the plan inputs for an extend with and without cached prefixes
(hand-computed), attention equal to SDPA on extend and decode in both layouts, the separation
of eager and graph wrappers, and the limits a batch is checked against."""

from __future__ import annotations

import pytest
import torch
from _graph_fixtures import Stack, agreed_plan, make_eager_runner, make_graph_runner, make_stack
from flashinfer_emulator import emulated_flashinfer

from dp_runtime.attention import (
    FlashInferBackend,
    KVLayout,
    TorchSDPABackend,
    extend_plan_inputs,
    last_page_len,
)
from dp_runtime.env import read_env
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.serving.forward_batch import ForwardBatch
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.kv_cache import KVCache
from tests.support.synthetic_batch import add_requests, decode_batch, extend_batch

HQ, HKV, D = 4, 2, 8
PREFIXES, EXTENDS = [0, 30, 7, 0], [12, 5, 20, 4]  # the GPU test's batch


def make_cache(max_reqs: int = 16, max_context_len: int = 64, num_slots: int = 1024, layers: int = 1) -> KVCache:
    return KVCache(
        num_layers=layers, num_kv_heads=HKV, head_dim=D, num_slots=num_slots, max_reqs=max_reqs,
        max_context_len=max_context_len, dtype=torch.float32, device="cpu",
    )


def fi_backend(cache: KVCache, **kw) -> FlashInferBackend:
    return FlashInferBackend(cache, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, flashinfer_module=emulated_flashinfer(), **kw)


def qkv(t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, HQ, D, generator=gen), torch.randn(t, HKV, D, generator=gen), torch.randn(t, HKV, D, generator=gen)


# -- plan inputs ---------------------------------------------------------------------------------
def test_extend_plan_inputs_for_prefixes_0_30_7_0_match_hand_computed_values():
    seq = torch.tensor([p + e for p, e in zip(PREFIXES, EXTENDS, strict=True)])  # 12, 35, 27, 4
    p = extend_plan_inputs(torch.tensor(EXTENDS), seq)
    assert p.qo_indptr.tolist() == [0, 12, 17, 37, 41]
    assert p.kv_indptr.tolist() == [0, 12, 47, 74, 78]  # PAGED: prefix + new tokens
    assert p.kv_last_page_len.tolist() == [1, 1, 1, 1]
    assert p.prefix_indptr.tolist() == [0, 0, 30, 37, 37]  # RAGGED's paged pass: the prefix only
    assert p.prefix_last_page_len.tolist() == [0, 1, 1, 0]  # no pages: 0, or FlashInfer plans 1 token
    assert p.prefix_lens.tolist() == PREFIXES
    assert p.has_prefix
    for t in (p.qo_indptr, p.kv_indptr, p.kv_last_page_len, p.prefix_indptr, p.prefix_last_page_len):
        assert t.dtype == torch.int32 and t.device.type == "cpu"
    assert not extend_plan_inputs(torch.tensor([3, 2]), torch.tensor([3, 2])).has_prefix


def test_extend_plan_inputs_refuse_inconsistent_lengths():
    with pytest.raises(ValueError, match="extend_len <= seq_len"):
        extend_plan_inputs(torch.tensor([5]), torch.tensor([4]))
    with pytest.raises(ValueError, match="extend_len <= seq_len"):
        extend_plan_inputs(torch.tensor([0]), torch.tensor([4]))


def test_last_page_len_is_zero_only_for_empty_requests():
    assert last_page_len(torch.tensor([0, 1, 57, 0])).tolist() == [0, 1, 1, 0]


# -- attention equals SDPA -----------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True])
def test_attention_matches_sdpa_on_extend_with_prefixes_then_decode(deterministic):
    cache = make_cache()
    alloc = KVAllocator(cache)
    fi = fi_backend(cache, deterministic=deterministic, check_indices=True)
    ref = TorchSDPABackend(cache, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
    reqs = add_requests(alloc, PREFIXES, seed=11)
    batch = extend_batch(alloc, reqs, EXTENDS, list(range(sum(EXTENDS))))
    q, k, v = qkv(sum(EXTENDS), seed=1)
    cache.set_kv(0, batch.out_cache_loc, k, v)  # the model's store, before attention
    fi.init_forward_metadata(batch)
    want_layout = KVLayout.PAGED if deterministic else KVLayout.RAGGED
    assert fi.metadata.layout is want_layout
    got = fi.forward(q, k, v, 0, batch)
    ref.init_forward_metadata(batch)
    want = ref.forward(q, k, v, 0, batch)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    dec = decode_batch(alloc, reqs, [3, 1, 4, 1])
    q, k, v = qkv(4, seed=2)
    cache.set_kv(0, dec.out_cache_loc, k, v)  # the model's store, before attention
    fi.init_forward_metadata(dec)
    got = fi.forward(q, k, v, 0, dec)
    ref.init_forward_metadata(dec)
    torch.testing.assert_close(got, ref.forward(q, k, v, 0, dec), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("prefixes", [PREFIXES, [0, 0, 0, 0]], ids=["prefix", "no-prefix"])
def test_ragged_extend_reads_k_v_views_of_one_projection_and_writes_the_given_output(prefixes):
    # The model hands k/v over as views of its fused QKV rows and the extend graphs hand a
    # per-layer output buffer: the ragged pass takes both as they are (no dense copy, no copy of
    # the result; the prefix pass merges into that buffer) and gives what dense inputs give.
    cache = make_cache()
    alloc = KVAllocator(cache)
    fi = fi_backend(cache)
    batch = extend_batch(alloc, add_requests(alloc, prefixes, seed=5), EXTENDS, list(range(sum(EXTENDS))))
    q, k, v = qkv(sum(EXTENDS), seed=6)
    cache.set_kv(0, batch.out_cache_loc, k, v)  # the model's store, before attention
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)
    k_view = fused[:, HQ * D:(HQ + HKV) * D].view(-1, HKV, D)
    v_view = fused[:, (HQ + HKV) * D:].view(-1, HKV, D)
    assert not k_view.is_contiguous() and not v_view.is_contiguous()
    fi.init_forward_metadata(batch)
    assert fi.metadata.layout is KVLayout.RAGGED and fi.metadata.has_prefix == any(prefixes)
    want = fi.forward(q, k, v, 0, batch)
    out = torch.full_like(want, float("nan"))
    got = fi.forward(q, k_view, v_view, 0, batch, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_long_extends_plan_the_auto_backend_wrapper_and_still_match_sdpa():
    # A request with LONG_EXTEND_TOKENS new tokens or more: the ragged pass runs on the wrapper
    # made with backend="auto" (FA3 on sm90); shorter steps keep FA2's. Both match SDPA.
    from dp_runtime.attention.flashinfer_backend import LONG_EXTEND_TOKENS

    cache = make_cache(max_context_len=LONG_EXTEND_TOKENS + 64, num_slots=2048)
    alloc = KVAllocator(cache)
    fi = fi_backend(cache)
    ref = TorchSDPABackend(cache, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)
    for extends, long in (([LONG_EXTEND_TOKENS, 5], True), ([LONG_EXTEND_TOKENS - 1, 5], False)):
        reqs = add_requests(alloc, [0, 9], seed=3)
        batch = extend_batch(alloc, reqs, extends, list(range(sum(extends))))
        q, k, v = qkv(sum(extends), seed=4)
        cache.set_kv(0, batch.out_cache_loc, k, v)  # the model's store, before attention
        fi.init_forward_metadata(batch)
        assert (fi.metadata.ragged is fi._ragged_long) is long
        got = fi.forward(q, k, v, 0, batch)
        ref.init_forward_metadata(batch)
        torch.testing.assert_close(got, ref.forward(q, k, v, 0, batch), atol=1e-5, rtol=1e-5)


def test_ragged_and_paged_layouts_agree():
    outs = []
    for deterministic in (False, True):
        cache = make_cache()
        alloc = KVAllocator(cache)
        fi = fi_backend(cache, deterministic=deterministic)
        batch = extend_batch(alloc, add_requests(alloc, PREFIXES, seed=3), EXTENDS, list(range(sum(EXTENDS))))
        q, k, v = qkv(sum(EXTENDS), seed=4)
        cache.set_kv(0, batch.out_cache_loc, k, v)  # the model's store, before attention
        fi.init_forward_metadata(batch)
        outs.append(fi.forward(q, k, v, 0, batch))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def _model_stack(backend_name: str, deterministic: bool = False) -> Stack:
    if backend_name == "sdpa":
        return make_stack()
    return make_stack(backend="flashinfer", deterministic=deterministic, flashinfer_module=emulated_flashinfer())


@pytest.mark.parametrize("deterministic", [False, True])
def test_model_logits_match_sdpa_through_the_eager_runner(deterministic):
    # The extend gives each request's last-token logits; the decode step after it reads the
    # K/V that every extend token wrote.
    outs = []
    for name in ("flashinfer", "sdpa"):
        stack = _model_stack(name, deterministic)
        runner = make_eager_runner(stack, max_bs=8, max_num_tokens=64)
        reqs = add_requests(stack.allocator, PREFIXES, seed=11)
        ext = runner.run(extend_batch(stack.allocator, reqs, EXTENDS, list(range(1, 42)))).clone()
        dec = runner.run(decode_batch(stack.allocator, reqs, [3, 1, 4, 1])).clone()
        assert ext.shape == dec.shape == (len(PREFIXES), stack.config.vocab_size)
        outs.append((ext, dec))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-4, rtol=1e-4)


def _replays_match_eager(stack, sizes, seed: int, tol: float, on_replay=lambda live: None) -> None:
    """Capture ``sizes``, then replay decode batches of 1, 3, 5 and 8 live requests of random
    lengths and compare each with the eager runner (``on_replay(live)`` checks after a replay)."""
    runner = make_graph_runner(stack, sizes)
    runner.capture()
    eager = make_eager_runner(stack, max_bs=8, max_num_tokens=8)
    gen = torch.Generator().manual_seed(seed)
    for live in (1, 3, 5, 8):
        lens = torch.randint(4, 60, (live,), generator=gen).tolist()
        batch = decode_batch(stack.allocator, add_requests(stack.allocator, lens, seed=live), list(range(live)))
        want = eager.run(batch).clone()
        got = runner.replay(batch, agreed_plan(live, sizes)).clone()
        on_replay(live)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    runner.destroy()


def test_graph_runner_replays_match_eager_with_flashinfer_wrappers():
    _replays_match_eager(_model_stack("flashinfer"), (1, 2, 4, 8), seed=0, tol=1e-5)


def test_large_buckets_replay_the_triton_decode_kernel_and_match_eager():
    # Buckets from triton_decode_min_bs on attend with the Triton kernel (Triton's interpreter
    # here) over the graph's fixed indptr/indices buffers, which the replay fills without a plan.
    import dataclasses

    from tests._graph_fixtures import TINY

    stack = make_stack(config=dataclasses.replace(TINY, head_dim=16), backend="flashinfer",
                       flashinfer_module=emulated_flashinfer())
    assert stack.backend.triton_decode_min_bs == 0 and stack.backend.decode_kernels == "flashinfer"  # CPU default
    stack.backend.triton_decode_min_bs = 4

    def uses_triton_from_bucket_4(live: int) -> None:
        assert stack.backend.metadata.triton_bs == (0 if live <= 2 else (4 if live <= 4 else 8))
        assert stack.backend._graph_wrappers[8] is None and stack.backend._graph_wrappers[2] is not None

    _replays_match_eager(stack, (2, 4, 8), seed=1, tol=1e-4, on_replay=uses_triton_from_bucket_4)


# -- eager and graph wrappers are separate --------------------------------------------------------
def test_eager_plans_leave_graph_wrappers_and_buffers_alone():
    cache = make_cache(max_reqs=32, max_context_len=64)
    alloc = KVAllocator(cache)
    fi = fi_backend(cache)
    fi.init_capture(max_bs=8, max_num_tokens=8)
    assert fi.graph_workspace is not None and fi.graph_workspace.data_ptr() != fi.workspace.data_ptr()
    assert fi.graph_indices_capacity == 8 * 64  # max_bs x max_context_len
    rows = torch.zeros(8, dtype=torch.int64)
    fi.init_forward_metadata_capture(bs=8, num_tokens=8, req_pool_indices=rows, seq_lens=torch.ones(8, dtype=torch.int64), forward_mode=ForwardMode.DECODE)
    a = decode_batch(alloc, add_requests(alloc, [10, 20, 30, 40, 50], seed=1), [0] * 5)
    pad_rows = torch.cat([a.req_pool_indices, torch.zeros(3, dtype=torch.int64)])
    pad_lens = torch.cat([a.seq_lens, torch.ones(3, dtype=torch.int64)])
    fi.init_forward_metadata_replay(
        bs=8, raw_bs=5, req_pool_indices=pad_rows, seq_lens=pad_lens, seq_lens_sum=int(pad_lens.sum()),
        forward_mode=ForwardMode.DECODE, seq_lens_cpu=pad_lens,
    )
    graph_wrapper = fi.metadata.decode
    snapshot = (fi._graph_indptr.clone(), fi._graph_indices.clone(), fi._graph_last_page_len.clone())
    b = decode_batch(alloc, add_requests(alloc, [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29], seed=2), [0] * 12)
    fi.init_forward_metadata(b)  # an eager decode of 12 > 8 requests
    assert fi.metadata.decode is not graph_wrapper
    for before, after in zip(snapshot, (fi._graph_indptr, fi._graph_indices, fi._graph_last_page_len), strict=True):
        assert torch.equal(before, after)


# -- limits ---------------------------------------------------------------------------------------
def _decode_batch_of(rows: list[int], lens: list[int], lens_cpu: list[int] | None = None) -> ForwardBatch:
    n = len(rows)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=n,
        input_ids=torch.zeros(n, dtype=torch.int64), positions=torch.zeros(n, dtype=torch.int64),
        out_cache_loc=torch.zeros(n, dtype=torch.int64),
        req_pool_indices=torch.tensor(rows, dtype=torch.int64), seq_lens=torch.tensor(lens, dtype=torch.int64),
        seq_lens_cpu=torch.tensor(lens if lens_cpu is None else lens_cpu, dtype=torch.int64),
    )


def test_a_sequence_longer_than_the_cache_is_refused_by_name():
    fi = fi_backend(make_cache(max_context_len=64))
    with pytest.raises(ValueError, match=r"request 1 has 65 KV tokens.*max_context_len=64"):
        fi.init_forward_metadata(_decode_batch_of([1, 2], [3, 65]))


def test_an_eager_batch_beyond_max_reqs_is_refused_by_name():
    fi = fi_backend(make_cache(max_reqs=4))
    with pytest.raises(ValueError, match=r"batch of 5 requests exceeds max_reqs=4"):
        fi.init_forward_metadata(_decode_batch_of([1] * 5, [2] * 5))


def test_graph_limits_are_named():
    fi = fi_backend(make_cache())
    ones = torch.ones(16, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="init_capture"):
        fi.init_forward_metadata_capture(bs=4, num_tokens=4, req_pool_indices=ones * 0, seq_lens=ones, forward_mode=ForwardMode.DECODE)
    fi.init_capture(max_bs=4, max_num_tokens=4)
    with pytest.raises(ValueError, match=r"bucket 8 exceeds init_capture's max_bs=4"):
        fi.init_forward_metadata_capture(bs=8, num_tokens=8, req_pool_indices=ones * 0, seq_lens=ones, forward_mode=ForwardMode.DECODE)
    fi.init_forward_metadata_capture(bs=4, num_tokens=4, req_pool_indices=ones * 0, seq_lens=ones, forward_mode=ForwardMode.DECODE)
    with pytest.raises(ValueError, match=r"5 live requests exceed bucket 4"):
        fi.init_forward_metadata_replay(
            bs=4, raw_bs=5, req_pool_indices=ones * 0, seq_lens=ones, seq_lens_sum=4,
            forward_mode=ForwardMode.DECODE, seq_lens_cpu=ones,
        )
    with pytest.raises(KeyError, match=r"no captured wrapper for bucket 2"):
        fi.init_forward_metadata_replay(
            bs=2, raw_bs=2, req_pool_indices=ones * 0, seq_lens=ones, seq_lens_sum=2,
            forward_mode=ForwardMode.DECODE, seq_lens_cpu=ones,
        )


def test_large_graph_buckets_plan_decode_without_kv_splits(monkeypatch):
    # Graph buckets of NO_SPLIT_KV_BS requests or more plan with disable_split_kv (no merge
    # kernel); smaller buckets and every eager decode plan keep FlashInfer's split.
    from dp_runtime.attention.flashinfer_backend import NO_SPLIT_KV_BS

    big = NO_SPLIT_KV_BS
    fi = fi_backend(make_cache(max_reqs=big))
    seen = []
    wrapper_cls = type(fi._decode)  # graph and eager decode wrappers are one class
    real = wrapper_cls.plan

    def plan(self, *args, **kw):
        seen.append(kw.get("disable_split_kv", False))
        return real(self, *args, **kw)
    monkeypatch.setattr(wrapper_cls, "plan", plan)
    ones = torch.ones(big, dtype=torch.int64)
    fi.init_capture(max_bs=big, max_num_tokens=big)
    for bs in (big, big // 2):
        fi.init_forward_metadata_capture(bs=bs, num_tokens=bs, req_pool_indices=ones[:bs] * 0, seq_lens=ones[:bs],
                                         forward_mode=ForwardMode.DECODE)
    fi.init_forward_metadata_replay(bs=big, raw_bs=big, req_pool_indices=ones * 0, seq_lens=ones, seq_lens_sum=big,
                                    forward_mode=ForwardMode.DECODE, seq_lens_cpu=ones)
    alloc = KVAllocator(fi.kv_cache)
    reqs = add_requests(alloc, [1] * big, seed=5)
    fi.init_forward_metadata(decode_batch(alloc, reqs, [1] * big))
    assert seen == [True, False, True, False]


def test_checks_catch_host_device_length_mismatch_and_out_of_range_indices():
    cache = make_cache(num_slots=100)
    fi = fi_backend(cache, check_indices=True)
    with pytest.raises(RuntimeError, match=r"device sequence lengths \[3, 4\] differ from the host copy \[3, 5\]"):
        fi.init_forward_metadata(_decode_batch_of([1, 2], [3, 4], [3, 5]))
    cache.req_to_token[2, :4] = torch.tensor([1, 2, 3, 500], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"KV indices span \[0, 500\], outside the cache's slots \[0, 100\]"):
        fi.init_forward_metadata(_decode_batch_of([1, 2], [3, 4]))
    unchecked = fi_backend(cache, check_indices=False)
    unchecked.init_forward_metadata(_decode_batch_of([1, 2], [3, 4]))  # planned; the kernel would fault


def test_checks_flag_reads_the_environment():
    assert read_env({}).flashinfer_checks is None
    assert read_env({"DP_RUNTIME_FLASHINFER_CHECKS": "1"}).flashinfer_checks is True
    with pytest.raises(ValueError, match="DP_RUNTIME_FLASHINFER_CHECKS"):
        read_env({"DP_RUNTIME_FLASHINFER_CHECKS": "maybe"})


def test_a_real_flashinfer_backend_still_needs_cuda():
    with pytest.raises(ValueError, match="CUDA KV cache"):
        FlashInferBackend(make_cache(), num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)



@pytest.mark.gpu
def test_kv_index_list_in_one_kernel_equals_the_torch_build():
    """The Triton gather of a decode replay's KV slots equals the torch ops it replaces, for
    rows of different lengths (one longer than the kernel's block) and a zero-length row."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dp_runtime.attention.kv_indices import build_kv_indices, host_indptr

    g = torch.Generator().manual_seed(0)
    req_to_token = torch.randint(1, 10**6, (9, 3000), generator=g, dtype=torch.int32).cuda()
    rows = torch.tensor([3, 1, 8, 5], device="cuda")
    for lens in ([1, 7, 2500, 33], [1, 1, 1, 1], [0, 4, 1025, 2]):
        lens_cpu = torch.tensor(lens)
        indptr = host_indptr(lens_cpu)
        total = int(indptr[-1])
        fused = build_kv_indices(req_to_token, rows, lens_cpu.cuda(), total, indptr_cpu=indptr)
        ops = build_kv_indices(req_to_token, rows, lens_cpu.cuda(), total)
        assert torch.equal(fused, ops)
