"""config.json to ModelConfig: transformers' defaults, and every refusal naming the file, the
field and the value (issue 15)."""

from __future__ import annotations

import pytest

from dp_runtime.model.model_config import ModelConfig, ModelConfigError
from dp_runtime.rank_spec import RankSpec
from tests.hf_reference import TINY, TINY_MIXTRAL

transformers = pytest.importorskip("transformers")


def _qwen(**kw):
    return {**TINY, "model_type": "qwen3_moe", **kw}


def _mixtral(**kw):
    return {**TINY_MIXTRAL, "model_type": "mixtral", **kw}


@pytest.mark.parametrize("family, config_cls", [("qwen3_moe", "Qwen3MoeConfig"), ("mixtral", "MixtralConfig")])
def test_omitted_fields_take_transformers_defaults(family, config_cls):
    full = getattr(transformers, config_cls)().to_dict()  # every field, at transformers' defaults
    assert ModelConfig.from_hf({"model_type": family}) == ModelConfig.from_hf(full)


def test_config_written_by_transformers_reads_back(tmp_path):
    transformers.Qwen3MoeConfig(**{**TINY, "attention_bias": True, "decoder_sparse_step": 2}).save_pretrained(tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.attention_bias and cfg.decoder_sparse_step == 2 and cfg.mlp_only_layers == (1,)
    assert cfg.rope_theta == 10000.0 and cfg.rope_yarn is None and cfg.sliding_window is None
    assert cfg.num_experts == 8 and cfg.head_dim == 16  # num_experts is saved as num_local_experts


FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}

REFUSED = [
    (_qwen(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (_mixtral(hidden_act="relu"), r"hidden_act='relu' is not supported"),
    (_qwen(rope_parameters={"rope_type": "linear", "factor": 2.0}), r"rope_parameters\.rope_type='linear' is not supported"),
    (_qwen(rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope_scaling\.rope_type='dynamic' is not supported"),
    (_mixtral(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}),
     r"rope_parameters\.low_freq_factor=1\.0 is not a RoPE parameter"),
    (_qwen(rope_parameters={"rope_type": "longrope", "short_factor": [1.0]}), r"rope_parameters\.short_factor="),
    (_qwen(rope_parameters={"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.5}),
     r"rope_parameters\.partial_rotary_factor=0\.5 is not supported"),
    (_qwen(partial_rotary_factor=0.5), r"partial_rotary_factor=0\.5 is not supported"),
    (_qwen(rope_parameters={"rope_type": "yarn", "factor": 0.5}), r"YaRN factor must be >= 1, got 0\.5"),
    (_qwen(rope_parameters={"full_attention": {"rope_type": "default"}}), r"per-layer-type RoPE"),
    (_qwen(quantization_config={"quant_method": "fp8"}), r"quantization_config\.weight_block_size=None is not "
     r"supported \(supported: \[128, 128\]"),
    (_qwen(quantization_config={**FP8, "quant_method": "awq"}), r"quantization_config\.quant_method='awq' is not supported"),
    (_qwen(quantization_config={**FP8, "fmt": "e5m2"}), r"quantization_config\.fmt='e5m2' is not supported"),
    (_qwen(quantization_config={**FP8, "weight_block_size": [64, 64]}),
     r"quantization_config\.weight_block_size=\[64, 64\] is not supported"),
    (_qwen(quantization_config={**FP8, "activation_scheme": "static"}),
     r"quantization_config\.activation_scheme='static' is not supported"),
    (_qwen(quantization_config={**FP8, "modules_to_not_convert": "lm_head"}),
     r"quantization_config\.modules_to_not_convert='lm_head' must be a list"),
    (_qwen(quantization_config="fp8"), r"quantization_config must be an object, got 'fp8'"),
    (_mixtral(attention_bias=True), r"attention_bias=True is not supported for mixtral"),
    (_qwen(hidden_size="64"), r"hidden_size='64' must be an integer"),
    (_qwen(num_experts_per_tok=2.0), r"num_experts_per_tok=2\.0 must be an integer"),
    (_qwen(norm_topk_prob="yes"), r"norm_topk_prob='yes' must be true or false"),
    (_qwen(mlp_only_layers=[1, "2"]), r"mlp_only_layers=\[1, '2'\] must be a list of layer indices"),
    (_qwen(num_experts=0), r"num_experts must be > 0, got 0"),
    (_qwen(head_dim=15, num_attention_heads=4), r"head_dim must be even"),
]


@pytest.mark.parametrize("hf, message", REFUSED, ids=[m for _, m in REFUSED])
def test_unsupported_fields_are_refused_naming_field_and_value(hf, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf(hf)


def test_refusal_names_the_file(tmp_path):
    transformers.Qwen3MoeConfig(**{**TINY, "hidden_act": "gelu_new"}).save_pretrained(tmp_path)
    with pytest.raises(ModelConfigError, match=rf"^{tmp_path}/config\.json: hidden_act='gelu_new' is not supported"):
        ModelConfig.from_dir(tmp_path)


def test_training_only_fields_are_accepted():
    cfg = ModelConfig.from_hf(_mixtral(router_jitter_noise=0.1, attention_dropout=0.1, output_router_logits=True,
                                       router_aux_loss_coef=0.5))
    assert cfg == ModelConfig.from_hf(_mixtral())


def test_malformed_json_is_named_with_line_and_column(tmp_path):
    (tmp_path / "config.json").write_text('{\n  "model_type": "qwen3_moe",\n  "hidden_size": 64,,\n}\n')
    with pytest.raises(ModelConfigError, match=rf"{tmp_path}/config\.json is not valid JSON: .* line 3 column 21"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match=r"config\.json must hold a JSON object, got list"):
        ModelConfig.from_dir(tmp_path)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(tmp_path)
    supported = r"supported: qwen3_moe \(Qwen3MoeForCausalLM\), mixtral \(MixtralForCausalLM\)"
    with pytest.raises(ModelConfigError, match=rf"config\.json: model_type 'llama' is not supported; {supported}"):
        RankSpec.create(str(tmp_path), dtype="float32", device="cpu")
    with pytest.raises(ModelConfigError, match=rf"has no model_type \(architectures \['GPT2LMHeadModel'\]\); {supported}"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"]})
    # Without model_type, a supported architecture name is enough.
    assert ModelConfig.from_hf({"architectures": ["MixtralForCausalLM"]}).family == "mixtral"


def test_unknown_preset_is_neither_a_preset_nor_a_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelConfigError,
                       match=r"model 'qwen3-7b' is neither a preset \(qwen3-235b-a22b, qwen3-30b-a3b, tiny\) nor a checkpoint directory"):
        RankSpec.create("qwen3-7b", dtype="float32", device="cpu")
    with pytest.raises(ModelConfigError, match=r"no config\.json in checkpoint directory"):
        ModelConfig.load(str(tmp_path))
    transformers.Qwen3MoeConfig(**TINY).save_pretrained(tmp_path)
    assert ModelConfig.load(str(tmp_path / "config.json")) == ModelConfig.load(str(tmp_path))
