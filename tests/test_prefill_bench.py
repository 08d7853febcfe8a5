"""The forward FLOP count MFU is measured with (against a hand count), the GPU peak lookup by
device name, and bench/prefill.py as a CPU smoke test (one rank, and every rank under torchrun)."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from dp_runtime.model.flops import forward_flops
from dp_runtime.model.model_config import ModelConfig
from launch.gpu_specs import GPUS, gpu_spec_for_device
from tests.support.bench_scripts import load_bench

TINY = ModelConfig.preset("tiny")  # H 64, 2 layers, 4 q / 2 kv heads of 16, 8 experts top-2 of 32, V 256


def test_flops_of_one_fresh_prompt_by_hand():
    f = forward_flops(TINY, [(0, 3)])
    # q,k,v: 2*64*(4+2*2)*16 = 16384, o: 2*(4*16)*64 = 8192; per token and layer, 3 tokens x 2 layers.
    assert f.projections == (16384 + 8192) * 3 * 2
    # Causal: positions 0, 1, 2 see 1 + 2 + 3 = 6 keys; 4 * 4 heads * 16 per key, 2 layers.
    assert f.attention == 4 * 4 * 16 * 6 * 2
    assert f.router == 2 * 64 * 8 * 3 * 2
    assert f.experts == 2 * (3 * 2 * 64 * 32) * 3 * 2  # top-2, gate/up/down of 64 x 32
    assert f.dense_mlp == 0
    assert f.lm_head == 2 * 64 * 256  # one sampled row
    assert f.total == 147456 + 3072 + 6144 + 147456 + 32768 == 336896


def test_flops_with_a_prefix_and_a_dense_layer_by_hand():
    cfg = ModelConfig.preset("tiny", mlp_only_layers=(0,))  # layer 0 dense (I 128), layer 1 sparse
    f = forward_flops(cfg, [(5, 2), (0, 1)])
    assert f.projections == 24576 * 3 * 2
    assert f.attention == 4 * 4 * 16 * (6 + 7 + 1) * 2  # positions 5 and 6 after the prefix, then 0
    assert f.router == 2 * 64 * 8 * 3 * 1
    assert f.experts == 24576 * 3 * 1
    assert f.dense_mlp == 3 * 2 * 64 * 128 * 3 * 1
    assert f.lm_head == 2 * 2 * 64 * 256
    assert forward_flops(cfg, [(5, 2), (0, 1)], logit_rows=0).lm_head == 0


def test_attention_flops_add_up_over_chunks_and_decode_sees_the_context():
    cfg = ModelConfig.preset("qwen3-30b-a3b")
    whole = forward_flops(cfg, [(0, 8192)])
    chunks = [forward_flops(cfg, [(c, 1024)]) for c in range(0, 8192, 1024)]
    assert whole.attention == sum(f.attention for f in chunks)
    assert whole.experts == sum(f.experts for f in chunks)
    assert forward_flops(cfg, [(99, 1)]).attention == 48 * 4 * 32 * 128 * 100
    with pytest.raises(ValueError, match=r"prefix_len >= 0 and new_tokens >= 1, got \(0, 0\)"):
        forward_flops(cfg, [(0, 0)])


@pytest.mark.parametrize("name, key", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
                                       ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA H100 NVL", None),
                                       ("Tesla T4", None)])
def test_gpu_spec_for_a_device_name(name, key):
    assert gpu_spec_for_device(name) is (GPUS[key] if key else None)
    assert GPUS["h200"].bf16_dense_tflops == GPUS["h100"].bf16_dense_tflops == 989.4


def _prefill(capsys, *argv):
    code = load_bench("prefill").main(["--device", "cpu", "--model", "tiny", "--iters", "2", "--warmup", "1", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_prefill_smoke_on_cpu(capsys):
    code, out, _ = _prefill(capsys, "--shapes", "1x48,4x12", "--peak-tflops", "0.5", "--json")
    assert code == 0
    report = json.loads(out)
    assert [r["shape"] for r in report["rows"]] == ["1x48", "4x12"]
    for r in report["rows"]:
        b, n = r["prompts"], r["prompt_len"]
        assert r["tokens_per_rank"] == b * n and r["tok_s"] == r["tok_s_per_gpu"]
        assert r["tok_s"] == pytest.approx(b * n / (r["step_ms"] / 1e3))
        assert r["tflops_per_rank"] == forward_flops(TINY, [(0, n)] * b).total / 1e12
        assert r["mfu_pct"] == pytest.approx(100 * r["tflop_s_per_gpu"] / 0.5)
        assert r["stream_ms"] is None  # only with --stream


def test_prefill_stream_times_back_to_back_extend_steps(capsys):
    # Every streamed step must be an extend step of the shape and every prompt must finish
    # (streamed_prefill raises otherwise); the rows carry the median step time.
    code, out, _ = _prefill(capsys, "--shapes", "1x24,3x8", "--stream", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [r["shape"] for r in rows] == ["1x24", "3x8"]
    assert all(r["stream_ms"] > 0 for r in rows)


def test_prefill_without_a_known_peak_reports_no_mfu_and_bad_shapes_are_one_line(capsys):
    code, out, _ = _prefill(capsys, "--shapes", "2x8", "--iters", "1")
    assert code == 0 and "no peak known: no MFU" in out
    code, _, err = _prefill(capsys, "--shapes", "2y8")
    assert code == 2 and err == "error: --shapes takes BxN items (B prompts of N tokens), comma-separated; got '2y8'\n"
    code, _, err = _prefill(capsys, "--save-routing", "r.pt")
    assert code == 2 and err == "error: --save-routing r.pt: saves the profiled step's routing; give --profile too\n"


@pytest.mark.dist
def test_prefill_on_torchrun(dist_group, capsys):
    code, out, _ = _prefill(capsys, "--shapes", "2x16", "--stream", "--json")
    assert code == 0
    if dist.get_rank() != 0:
        assert out == ""
        return
    (row,) = json.loads(out)["rows"]
    world = dist.get_world_size()
    assert json.loads(out)["header"]["world_size"] == world
    assert row["tok_s"] == pytest.approx(world * row["tok_s_per_gpu"])
    assert row["stream_ms"] > 0
