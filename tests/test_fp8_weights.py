"""FP8 block-quantized weights on the CPU: the block format, which groups the model stores FP8,
FP8 checkpoints (Qwen3-MoE and Mixtral, written by the test in the format of the published FP8
releases) against transformers on their dequantized float32 twins, ``--quantization fp8``,
the refusals, and the weights' sizing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dp_runtime import memory_sizing as ms
from dp_runtime.model.fp8_blocks import (
    FP8_MAX,
    Fp8BlockWeight,
    dequantize_blocks,
    quantize_blocks,
    scale_shape,
)
from dp_runtime.model.model_config import ModelConfig, ModelConfigError
from dp_runtime.model.quant_config import QuantConfig, with_quantization
from dp_runtime.model.weight_groups import layer_groups
from dp_runtime.model.weights import load_weights
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.fp8_checkpoint import NOT_CONVERTED, write_fp8_pair
from tests.hf_reference import greedy_reference, load_reference
from tests.support.cli_probe import probe_cli

pytest.importorskip("transformers")
NEW = 6


def test_blocks_round_trip_within_e4m3_precision_with_edge_blocks():
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 200)  # columns of very different scales
    values, scales = quantize_blocks(w)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (3, 2) == scale_shape((300, 200))
    assert values.float().abs().max() <= FP8_MAX
    back = dequantize_blocks(values, scales)
    # e4m3 keeps 3 mantissa bits: half a step is 1/16 of a value; each block's scale bounds the rest
    block_scale = scales.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((back - w).abs() <= w.abs() / 16 + block_scale * 2**-9).all()
    zeros = quantize_blocks(torch.zeros(2, 3, 130))  # an expert stack; zero blocks get scale 1
    assert zeros[1].shape == (2, 1, 2) and (zeros[1] == 1).all() and (zeros[0].float() == 0).all()


def test_weight_views_and_their_alignment():
    w = Fp8BlockWeight.quantize(torch.randn(4, 384, 130))
    assert w.select(2).values.shape == (384, 130) and w.select(2).scales.shape == (3, 2)
    rows = w.select(1).rows(128, 384)
    assert rows.scales.shape == (2, 2)
    assert torch.equal(rows.dequantize(), w.select(1).dequantize()[128:384])
    with pytest.raises(ValueError, match=r"rows\(64, 128\): not aligned to 128-row blocks"):
        w.rows(64, 128)
    with pytest.raises(ValueError, match=r"scales must be torch\.float32"):
        Fp8BlockWeight(w.values, w.scales.double())


def test_modules_to_not_convert_matching():
    q = QuantConfig(modules_to_not_convert=("lm_head", "model.layers.3.mlp.experts", "mlp.gate"))
    assert q.skips("lm_head") and q.skips("model.layers.3.mlp.experts.7.up_proj")
    assert q.skips("model.layers.0.mlp.gate") and not q.skips("model.layers.0.mlp.gate_proj")
    assert not q.skips("model.layers.13.mlp.experts.7.up_proj")


def test_fp8_groups_need_whole_row_blocks():
    tiny = with_quantization(ModelConfig.preset("tiny"), "fp8")  # q 64 rows, expert 32 rows
    fp8 = {key: g.fp8 for key, g in layer_groups(tiny, 0).items()}
    assert fp8 == {"qkv": False, "o": True, "w13": False, "w2": True}
    big = with_quantization(ModelConfig.preset("qwen3-30b-a3b"), "fp8")
    groups = layer_groups(big, 0, ep_rank=1, ep_size=2)
    assert all(g.fp8 for g in groups.values()) and groups["w13"].shape == (64, 1536, 2048)
    assert with_quantization(ModelConfig.preset("tiny"), "none").quantization is None


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_fp8_pair(tmp_path_factory.mktemp("fp8_qwen"))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 13, 30)]


def _spec(path, **kw):
    base = dict(max_running_requests=3, chunked_prefill_size=16, dtype="float32", device="cpu",
                max_context_len=96)
    return RankSpec.create(str(path), **{**base, **kw})


def _generate(spec, prompts):
    with RankWorker(spec, keep_logits=True) as w:
        results = w.generate([Request(f"r{i}", p, SamplingParams(max_new_tokens=NEW)) for i, p in enumerate(prompts)])
        return w, results


def _check_against(deq, w, results, prompts):
    hf = load_reference(deq)
    for res, p in zip(results, prompts, strict=True):
        tokens, logits = greedy_reference(hf, p, NEW)
        assert res.output_ids == tuple(tokens), res.rid
        torch.testing.assert_close(torch.stack(w.sampled_logits[res.rid]), logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("dispatcher", "graphs"), [("local", False), ("all_to_all", True)])
def test_fp8_checkpoint_generates_the_dequantized_models_tokens(pair, prompts, dispatcher, graphs):
    _, fp8, deq = pair
    w, results = _generate(_spec(fp8, dispatcher=dispatcher, use_cuda_graph=graphs), prompts)
    layers = w.model.layers
    assert all(isinstance(t, Fp8BlockWeight) for t in (layers[0].w_qkv, layers[0].w_o, layers[0].w13, layers[0].w2))
    assert isinstance(layers[1].w2, torch.Tensor)  # modules_to_not_convert: the dense layer's down_proj
    assert isinstance(layers[1].w13, Fp8BlockWeight) and layers[0].w_router.dtype == torch.float32
    assert w.metrics()["quantization"] == "fp8"
    _check_against(deq, w, results, prompts)


def test_fp8_mixtral_checkpoint(tmp_path, prompts):
    _, fp8, deq = write_fp8_pair(tmp_path, family="mixtral")
    w, results = _generate(_spec(fp8), prompts)
    assert w.model_config.family == "mixtral" and isinstance(w.model.layers[0].w13, Fp8BlockWeight)
    _check_against(deq, w, results, prompts)


def test_quantization_fp8_on_a_float_checkpoint_stores_the_checkpoints_blocks(pair):
    """``--quantization fp8`` quantizes at load into exactly the blocks the FP8 checkpoint holds."""
    src, fp8, _ = pair
    with RankWorker(_spec(fp8)) as a, RankWorker(_spec(src, quantization="fp8")) as b:
        assert b.model_config.quantization.source == "online"
        for i, (la, lb) in enumerate(zip(a.model.layers, b.model.layers, strict=True)):
            for key in ("w_qkv", "w_o", "w13", "w2"):
                ta, tb = getattr(la, key), getattr(lb, key)
                if f"model.layers.{i}.mlp.down_proj" in NOT_CONVERTED and key == "w2":
                    assert isinstance(tb, Fp8BlockWeight) and isinstance(ta, torch.Tensor)
                    continue
                assert torch.equal(ta.values.view(torch.uint8), tb.values.view(torch.uint8)), (i, key)
                assert torch.equal(ta.scales, tb.scales), (i, key)


def test_weights_and_kv_sizing_follow_the_fp8_storage(pair):
    _, fp8, _ = pair
    spec = _spec(fp8)
    with RankWorker(spec) as w:
        report, model_bytes = w.memory_report(), w.model.weight_bytes()
    cfg = spec.model_config()
    assert report["weights"] == model_bytes == ms.weight_bytes_per_rank(cfg, spec.runtime.dtype)
    float_bytes = ms.weight_bytes_per_rank(ModelConfig.from_dir(pair[0]), torch.float32)
    assert model_bytes < float_bytes
    big, bf16 = ModelConfig.preset("qwen3-30b-a3b"), torch.bfloat16
    assert ms.weight_bytes_per_rank(with_quantization(big, "fp8"), bf16) < 0.52 * ms.weight_bytes_per_rank(big, bf16)


def _copy(pair, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(pair[1], dst)
    return dst


def _rewrite(path, fn):
    from safetensors.torch import load_file, save_file

    for file in path.glob("*.safetensors"):
        tensors = load_file(str(file))
        changed = fn(tensors)
        if changed:
            save_file(tensors, str(file), metadata={"format": "pt"})
            return file
    raise AssertionError("no shard changed")


NAME = "model.layers.0.self_attn.o_proj.weight"


def test_missing_and_misshaped_scales_are_named(pair, tmp_path):
    path = _copy(pair, tmp_path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"][NAME + "_scale_inv"]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = ModelConfig.from_dir(path)
    with pytest.raises(ModelConfigError, match=rf"tensor '{NAME}' in .* is FP8 but its scale '{NAME}_scale_inv' "
                                               r"is in no safetensors file"):
        load_weights(path, cfg)
    path2 = _copy(pair, tmp_path / "b")
    _rewrite(path2, lambda t: NAME + "_scale_inv" in t and t.update({NAME + "_scale_inv": torch.ones(1, 1)}) is None)
    with pytest.raises(ModelConfigError, match=rf"tensor '{NAME}_scale_inv' in .* has shape \(1, 1\); the config "
                                               r"needs \(2, 2\)"):
        load_weights(path2, ModelConfig.from_dir(path2))


def test_fp8_tensor_without_quantization_config_is_refused(pair, tmp_path):
    path = _copy(pair, tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"has dtype F8_E4M3; .*FP8 tensors need quantization_config"):
        load_weights(path, ModelConfig.from_dir(path))


def test_cli_refuses_unsupported_quantization_in_one_line(pair, tmp_path):
    path = _copy(pair, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (path / "config.json").write_text(json.dumps(config))
    out = probe_cli([["run", "--launcher", "local", "--model", str(path), "--requests", "1"],
                     ["run", "--launcher", "local", "--quantization", "int4", "--requests", "1"],
                     ["plan", "--quantization", "nf4"]])
    (code1, err1), (code2, err2), (code3, err3) = out["cases"]
    assert code1 == 2 and "quantization_config.weight_block_size=[64, 64] is not supported" in err1
    assert code2 == 2 and "--quantization" in err2 and "int4" in err2
    assert code3 == 2 and "--quantization" in err3 and "nf4" in err3
    assert all(len(e.strip().splitlines()) == 1 for e in (err1, err2, err3))
