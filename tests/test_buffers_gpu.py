"""buffers/ on a CUDA GPU: GPU slots beside CPU slots, grouped fill equals the loop, graphs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from buffers import BufferPool, build_decode_registry

sys.path.insert(0, str(Path(__file__).parent))
from test_builders import FB

pytestmark = pytest.mark.gpu


def gpu_batch(bs, dp=2):
    d = "cuda"
    return FB(
        batch_size=bs,
        input_ids=torch.randint(0, 1000, (bs,), device=d),
        positions=torch.randint(0, 1000, (bs,), device=d),
        out_cache_loc=torch.randint(1, 1000, (bs,), device=d),
        req_pool_indices=torch.randint(1, 100, (bs,), device=d),
        seq_lens=torch.randint(1, 1000, (bs,), device=d),
        seq_lens_cpu=torch.randint(1, 1000, (bs,)),
        mrope_positions=torch.randint(0, 1000, (3, bs), device=d),
        global_num_tokens_cpu=[bs, 5][:dp],
        global_num_tokens_for_logprob_cpu=[bs, 4][:dp],
    )


def test_decode_registry_on_cuda_with_cpu_slot():
    reg = build_decode_registry(64, "cuda", BufferPool(), dp_size=2, mrope=True, register_global_num_tokens=True)
    assert reg.buffer("seq_lens_cpu").device.type == "cpu" and reg.buffer("seq_lens").is_cuda
    for name in reg.names():
        reg.buffer(name).fill_(-3)
    b = gpu_batch(13)
    reg.fill(b, 13, 16)
    v = reg.view(b, 16)
    torch.cuda.synchronize()
    assert torch.equal(v.input_ids[:13], b.input_ids) and (v.input_ids[13:] == -3).all()
    assert torch.equal(v.seq_lens[:13], b.seq_lens) and (v.seq_lens[13:] == 1).all()
    assert torch.equal(v.seq_lens_cpu[:13], b.seq_lens_cpu) and (v.seq_lens_cpu[13:] == 1).all()
    assert torch.equal(v.mrope_positions[:, :13], b.mrope_positions) and (v.mrope_positions[:, 13:] == 0).all()
    assert v.num_token_non_padded.item() == 13 and v.global_num_tokens_gpu.tolist() == [13, 5]
    assert (reg.buffer("positions")[16:] == -3).all()


def test_refill_with_other_batch_is_not_stale_and_async_copies_complete():
    reg = build_decode_registry(64, "cuda", BufferPool(), dp_size=2, register_global_num_tokens=True)
    batches = [gpu_batch(bs) for bs in (3, 17, 9, 40)]
    for b in batches:
        reg.fill(b, b.batch_size, 48)
        v = reg.view(b, 48)
        got = (v.input_ids[: b.batch_size].clone(), v.global_num_tokens_gpu.clone(), v.num_token_non_padded.clone())
        torch.cuda.synchronize()
        assert torch.equal(got[0], b.input_ids)
        assert got[1].tolist() == b.global_num_tokens_cpu and got[2].item() == b.batch_size


def test_pool_storage_writable_in_and_out_of_inference_mode_on_cuda():
    pool = BufferPool()
    with torch.inference_mode():
        reg = build_decode_registry(8, "cuda", pool)
        reg.fill(gpu_batch(4, dp=1), 4, 8)
    reg.fill(gpu_batch(4, dp=1), 4, 8)
    assert not reg.buffer("input_ids").is_inference()


def test_graph_reads_registry_storage_after_refill():
    reg = build_decode_registry(16, "cuda", BufferPool(), dp_size=1)
    b = gpu_batch(8, dp=1)
    reg.fill(b, 8, 8)
    v = reg.view(b, 8)
    out = torch.empty(8, dtype=torch.int64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(v.input_ids * 2 + v.seq_lens)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out.copy_(v.input_ids * 2 + v.seq_lens)
    for bs in (5, 8, 2):
        nb = gpu_batch(bs, dp=1)
        reg.fill(nb, bs, 8)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[:bs], nb.input_ids * 2 + nb.seq_lens)
        assert (out[bs:] == reg.buffer("input_ids")[bs:8] * 2 + 1).all()
