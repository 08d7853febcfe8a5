"""Config features the model computes as transformers does (YaRN rope scaling, attention biases),
each against transformers on a tiny checkpoint written by ``save_pretrained``, and the sliding
window rule (issue 15)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dp_runtime.model.layers import RotaryEmbedding, yarn_inv_freq
from dp_runtime.model.model_config import ModelConfig, ModelConfigError
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.hf_reference import (
    TINY,
    TINY_MIXTRAL,
    greedy_reference,
    load_reference,
    write_tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")

NEW = 6
# Prompts well past YaRN's original context (32 positions below), so the interpolated low
# frequencies matter as well as the attention factor.
PROMPT_LENS = (45, 90)


def _prompts(vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _ours(ckpt, prompts, **kw):
    spec = RankSpec.create(str(ckpt), dp_size=1, max_running_requests=2, chunked_prefill_size=64, dtype="float32",
                           device="cpu", max_context_len=128, **kw)
    with RankWorker(spec, keep_logits=True) as w:
        results = w.generate([Request(f"r{i}", p, SamplingParams(max_new_tokens=NEW)) for i, p in enumerate(prompts)])
        logits = [torch.stack(w.sampled_logits[r.rid]) for r in results]
        return [r.output_ids for r in results], logits, w


def _assert_same_as_transformers(ours, refs):
    tokens, logits, _ = ours
    for got_tokens, got_logits, (ref_tokens, ref_logits) in zip(tokens, logits, refs, strict=True):
        assert got_tokens == tuple(ref_tokens)
        torch.testing.assert_close(got_logits, ref_logits, rtol=1e-4, atol=1e-4)


def _differs(refs_a, refs_b) -> bool:
    """Whether two references disagree clearly (some token, or logits by far more than 1e-4)."""
    return any(ta != tb or (la - lb).abs().max() > 1e-2 for (ta, la), (tb, lb) in zip(refs_a, refs_b, strict=True))


YARN_CONFIGS = {
    # factor and original context only: attention_factor = 0.1 ln(4) + 1, beta 32/1, truncated ramp
    "plain": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    # every optional field: beta bounds, mscale/mscale_all_dim for the attention factor, no truncation
    "tuned": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 8.0,
              "beta_slow": 2.0, "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
}


@pytest.mark.parametrize("name", list(YARN_CONFIGS))
def test_yarn_rope_scaling_matches_transformers(tmp_path, name):
    rope = {**YARN_CONFIGS[name], "rope_theta": 10000.0}
    ckpt = write_tiny_checkpoint(tmp_path / "yarn", rope_parameters=rope, max_position_embeddings=128)
    assert json.loads((ckpt / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    prompts = _prompts()
    refs = [greedy_reference(load_reference(ckpt), p, NEW) for p in prompts]
    ours = _ours(ckpt, prompts)
    assert ours[2].model_config.rope_yarn is not None
    _assert_same_as_transformers(ours, refs)

    # The same weights without scaling compute something else: the test above can fail.
    plain = tmp_path / "plain"
    shutil.copytree(ckpt, plain)
    doc = json.loads((plain / "config.json").read_text())
    doc["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (plain / "config.json").write_text(json.dumps(doc))
    assert _differs(refs, [greedy_reference(load_reference(plain), p, NEW) for p in prompts])


@pytest.mark.parametrize("name", list(YARN_CONFIGS))
def test_yarn_frequencies_and_attention_factor_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {**YARN_CONFIGS[name], "rope_theta": 10000.0}
    hf = transformers.Qwen3MoeConfig(**{**TINY, "max_position_embeddings": 128, "rope_parameters": rope})
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    cfg = ModelConfig.from_hf(hf.to_dict())
    got_freq, got_factor = yarn_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_yarn)
    torch.testing.assert_close(got_freq.float(), want_freq, rtol=1e-6, atol=0)
    assert got_factor == pytest.approx(want_factor, rel=1e-12) and got_factor != 1.0
    # The cos/sin table (what FlashInfer's rope kernel reads) carries the factor.
    table = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope_theta, "cpu", yarn=cfg.rope_yarn).cos_sin_PD
    cos, sin = table.chunk(2, dim=-1)
    torch.testing.assert_close(cos.pow(2) + sin.pow(2), torch.full_like(cos, want_factor**2))


def test_legacy_rope_scaling_field_reads_like_rope_parameters():
    base = {**TINY, "model_type": "qwen3_moe", "max_position_embeddings": 128}
    base.pop("rope_theta")
    new = ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 5e5,
                                                           "original_max_position_embeddings": 32}})
    old = ModelConfig.from_hf({**base, "rope_theta": 5e5,
                               "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}})
    assert new == old and new.rope_theta == 5e5 and new.rope_yarn.attention_factor == pytest.approx(1.1386294361)
    assert ModelConfig(**new.to_dict()) == new  # the nested YaRN dataclass round-trips


def test_yarn_extends_the_context_the_spec_allows(tmp_path):
    # Qwen3's published recipe: add YaRN, keep max_position_embeddings at the native length.
    transformers.Qwen3MoeConfig(**{**TINY, "max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}}
    ).save_pretrained(tmp_path)
    spec = RankSpec.create(str(tmp_path), dtype="float32", device="cpu", max_context_len=256)
    assert spec.model_config().max_positions == 256
    with pytest.raises(ValueError, match="max_context_len=257 exceeds the model's YaRN-extended context=256"):
        RankSpec.create(str(tmp_path), dtype="float32", device="cpu", max_context_len=257)


def test_attention_bias_matches_transformers(tmp_path):
    from dp_runtime import memory_sizing as ms

    ckpt = write_tiny_checkpoint(tmp_path, attention_bias=True)
    hf = load_reference(ckpt)
    biases = [n for n, _ in hf.named_parameters() if n.endswith("_proj.bias")]
    assert {n.split(".")[-2] for n in biases} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    prompts = _prompts()
    refs = [greedy_reference(hf, p, NEW) for p in prompts]
    ours = _ours(ckpt, prompts)
    _assert_same_as_transformers(ours, refs)
    w = ours[2]
    assert w.memory_report()["weights"] == ms.weight_bytes_per_rank(w.model_config, torch.float32)

    with torch.no_grad():  # without its biases the model computes something else
        for name, p in hf.named_parameters():
            if name.endswith("_proj.bias"):
                p.zero_()
    assert _differs(refs, [greedy_reference(hf, p, NEW) for p in prompts])


def _save_config(path, family="qwen3_moe", **overrides):
    cls, base = ((transformers.MixtralConfig, TINY_MIXTRAL) if family == "mixtral"
                 else (transformers.Qwen3MoeConfig, TINY))
    cls(**{**base, **overrides}).save_pretrained(path)
    return str(path)


def _spec(model, **kw):
    return RankSpec.create(model, dtype="float32", device="cpu", **kw)


@pytest.mark.parametrize("family, window", [("qwen3_moe", dict(use_sliding_window=True, sliding_window=64)),
                                            ("mixtral", dict(sliding_window=64))])
def test_a_sliding_window_shorter_than_the_context_is_refused(tmp_path, family, window):
    model = _save_config(tmp_path, family, **window)
    with pytest.raises(ModelConfigError, match=r"sliding_window=64, shorter than max_context_len=128.*not supported"):
        _spec(model, max_context_len=128)
    # A window as long as the context masks nothing (a query sees at most context-1 keys back).
    assert _spec(model, max_context_len=64).context_len == 64
    assert _spec(model).context_len == 64  # the default context stops at the window


def test_a_window_that_is_off_or_null_is_full_attention(tmp_path):
    # Qwen3MoeConfig drops sliding_window unless use_sliding_window is set; Mixtral's null is none.
    qwen = _save_config(tmp_path / "q", use_sliding_window=False, sliding_window=16)
    mixtral = _save_config(tmp_path / "m", "mixtral", sliding_window=None)
    for model in (qwen, mixtral):
        assert ModelConfig.from_dir(model).sliding_window is None
        assert _spec(model, max_context_len=256).context_len == 256


def _tied_config(ckpt) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))


def _drop_head(ckpt) -> None:
    """Remove lm_head.weight from the (sharded) checkpoint and its index."""
    from safetensors.torch import load_file, save_file

    index_file = ckpt / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = ckpt / index["weight_map"].pop("lm_head.weight")
    tensors = load_file(str(shard))
    del tensors["lm_head.weight"]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))


def test_tied_config_with_a_checkpoint_head_uses_that_head_as_transformers_does(tmp_path):
    # transformers 5 keeps a head the checkpoint carries (it warns "we will NOT tie them");
    # before, dp-runtime silently used the embedding as the head: other logits, other tokens.
    with_head = write_tiny_checkpoint(tmp_path / "head")  # lm_head drawn apart from the embedding
    _tied_config(with_head)
    without_head = tmp_path / "tied"
    shutil.copytree(with_head, without_head)
    _drop_head(without_head)
    assert ModelConfig.from_dir(with_head).tie_word_embeddings is False
    assert ModelConfig.from_dir(without_head).tie_word_embeddings is True
    prompts = _prompts()[:1]
    refs = {}
    for name, ckpt in (("head", with_head), ("tied", without_head)):
        model = load_reference(ckpt)
        refs[name] = [greedy_reference(model, p, NEW) for p in prompts]
    assert _differs(refs["head"], refs["tied"])  # the test can tell the two heads apart
    _assert_same_as_transformers(_ours(with_head, prompts), refs["head"])


def test_tied_config_without_weights_stays_tied(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "qwen3_moe", "tie_word_embeddings": True}))
    assert ModelConfig.from_dir(tmp_path).tie_word_embeddings is True  # a config alone (planning)
