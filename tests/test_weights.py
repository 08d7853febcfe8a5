"""Model config and weights: real checkpoints written by transformers (issue: reference model)."""

from __future__ import annotations

import json

import pytest
import torch

from dp_runtime.model.model_config import ModelConfig, ModelConfigError
from dp_runtime.model.weights import checkpoint_index, expected_shapes, load_weights, random_weights

transformers = pytest.importorskip("transformers")


def tiny_hf_config(**kw):
    base = dict(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
        max_position_embeddings=128, norm_topk_prob=True,
    )
    base.update(kw)
    return transformers.Qwen3MoeConfig(**base)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3-MoE saved by transformers in sharded safetensors (several files + index)."""
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(tiny_hf_config())
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path, safe_serialization=True, max_shard_size="20KB")
    return path, model


def test_config_from_checkpoint(checkpoint):
    path, _ = checkpoint
    cfg = ModelConfig.from_dir(path)
    assert (cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.head_dim) == (32, 6, 2, 8)
    assert cfg.norm_topk_prob and cfg.num_kv_heads == 2


def test_checkpoint_is_sharded_and_indexed(checkpoint):
    path, _ = checkpoint
    assert (path / "model.safetensors.index.json").is_file()
    assert len(set(checkpoint_index(path).values())) > 1


@pytest.mark.parametrize("ep_size", [1, 2, 3, 4])
def test_rank_loads_exactly_its_experts_equal_to_the_model(checkpoint, ep_size):
    from safetensors.torch import load_file

    path, _ = checkpoint
    cfg = ModelConfig.from_dir(path)
    ref = {}
    for file in path.glob("*.safetensors"):  # read every shard whole, independently of ours
        ref.update(load_file(str(file)))
    seen = set()
    for rank in range(ep_size):
        w = load_weights(path, cfg, rank, ep_size)
        experts = {int(n.split(".")[5]) for n in w if ".experts." in n}
        assert not experts & seen
        seen |= experts
        for name, t in w.items():
            assert torch.equal(t, ref[name]), name
    assert seen == set(range(cfg.num_experts))
    assert len(expected_shapes(cfg)) == len(ref)  # nothing in the checkpoint is left unread


def test_missing_tensor_names_tensor_and_directory(checkpoint, tmp_path):
    path, _ = checkpoint
    cfg = ModelConfig.from_dir(path)
    bigger = ModelConfig.preset("tiny").__class__(**{**cfg.to_dict(), "num_layers": 3})
    with pytest.raises(ModelConfigError, match=r"model\.layers\.2\..*is in no safetensors file"):
        load_weights(path, bigger)


def test_misshaped_tensor_names_tensor_file_and_shapes(checkpoint):
    path, _ = checkpoint
    cfg = ModelConfig.from_dir(path)
    wrong = cfg.__class__(**{**cfg.to_dict(), "moe_intermediate_size": 17})
    with pytest.raises(ModelConfigError, match=r"tensor 'model\.layers\.0\.mlp\.experts\.0\.\w+_proj\.weight' in '[^']*model-\d+-of-\d+\.safetensors' has shape"):
        load_weights(path, wrong)


def test_missing_directory_config_and_shard(tmp_path, checkpoint):
    with pytest.raises(ModelConfigError, match="does not exist"):
        checkpoint_index(tmp_path / "nope")
    with pytest.raises(ModelConfigError, match=r"no config\.json"):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(ModelConfigError, match=r"no \*\.safetensors"):
        checkpoint_index(tmp_path)
    path, _ = checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    index = json.loads((path / "model.safetensors.index.json").read_text())
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelConfigError, match="names shard"):
        checkpoint_index(broken)


def test_random_weights_agree_across_ranks_and_shapes():
    cfg = ModelConfig.preset("tiny")
    full = random_weights(cfg, 0, 1, seed=3)
    assert {n: tuple(t.shape) for n, t in full.items()} == expected_shapes(cfg)
    for rank in range(2):
        part = random_weights(cfg, rank, 2, seed=3)
        for name, t in part.items():
            assert torch.equal(t, full[name])
    assert not torch.equal(random_weights(cfg, seed=4)["lm_head.weight"], full["lm_head.weight"])


def test_unknown_preset_and_bad_config():
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelConfig.preset("huge")
    with pytest.raises(ValueError, match="top_k=9 exceeds num_experts=8"):
        ModelConfig.preset("tiny", top_k=9)


def _copy(checkpoint, tmp_path):
    import shutil

    path, _ = checkpoint
    dst = tmp_path / "copy"
    shutil.copytree(path, dst)
    return dst, ModelConfig.from_dir(dst)


def _shard_of(path, name):
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def _rewrite(file, name, fn):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(file))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_integer_tensor_is_refused_naming_tensor_and_file(checkpoint, tmp_path):
    path, cfg = _copy(checkpoint, tmp_path)
    file = _shard_of(path, "model.norm.weight")
    _rewrite(file, "model.norm.weight", lambda t: t.to(torch.int64))
    with pytest.raises(ModelConfigError, match=rf"tensor 'model\.norm\.weight' in '{file}' has dtype I64; weights must "
                                               r"be a float type \(F16, BF16, F32, F64\)"):
        load_weights(path, cfg)


def test_half_precision_tensor_is_cast(checkpoint, tmp_path):
    path, cfg = _copy(checkpoint, tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    _rewrite(_shard_of(path, name), name, lambda t: t.to(torch.bfloat16))
    w = load_weights(path, cfg)
    assert w[name].dtype == torch.float32
    assert torch.equal(w[name], checkpoint[1].state_dict()[name].to(torch.bfloat16).float())


@pytest.mark.parametrize("damage", ["truncated", "corrupt header", "empty"])
def test_damaged_shard_is_named(checkpoint, tmp_path, damage):
    path, cfg = _copy(checkpoint, tmp_path)
    file = _shard_of(path, "model.layers.1.mlp.experts.3.up_proj.weight")
    data = file.read_bytes()
    if damage == "truncated":
        file.write_bytes(data[: len(data) - 100])
    elif damage == "corrupt header":
        file.write_bytes(b"\xff" * 16 + data[16:])
    else:
        file.write_bytes(b"")
    with pytest.raises(ModelConfigError, match=rf"safetensors file '{file}' is unreadable"):
        load_weights(path, cfg)
    # Without an index the loader scans the shards, and names the damaged one as well.
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(ModelConfigError, match=rf"safetensors file '{file}' is unreadable"):
        checkpoint_index(path)


def test_malformed_index_is_named(checkpoint, tmp_path):
    path, cfg = _copy(checkpoint, tmp_path)
    index = path / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-20])
    with pytest.raises(ModelConfigError, match=rf"{index} is not valid JSON: .* line \d+ column \d+"):
        load_weights(path, cfg)
