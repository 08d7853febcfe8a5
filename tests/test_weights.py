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
