"""A Hugging Face ``config.json`` turned into ModelConfig fields, or refused.

The rule: the model computes what transformers 5's ``Qwen3MoeForCausalLM`` /
``MixtralForCausalLM`` computes for the config, or the config is refused with a
ModelConfigError naming the file, the field and its value. Each field transformers reads at
inference is either used, refused, or (training only) ignored; docs/model.md lists them. A field
the config omits takes transformers' default for that class (``_DEFAULTS``), so an abbreviated
config.json means what it means to transformers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dp_runtime.model.config_parts import ModelConfigError, YarnScaling
from dp_runtime.model.quant_config import quant_config_from_hf

__all__ = ["SUPPORTED_ARCHITECTURES", "model_fields_from_hf", "read_json_object"]

SUPPORTED_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}

# transformers 5's Qwen3MoeConfig / MixtralConfig class defaults of the fields read here.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, hidden_act="silu",
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_theta=10000.0, attention_bias=False, use_sliding_window=False, sliding_window=4096,
        decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
        norm_topk_prob=False,
    ),
    "mixtral": dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_theta=1_000_000.0, num_experts_per_tok=2, num_local_experts=8,
    ),
}
_SILU = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU
_ROPE_TYPES = ("default", "yarn")
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor",
              "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
              "mscale", "mscale_all_dim", "truncate"}


def _supported() -> str:
    return ", ".join(f"{t} ({a})" for t, a in SUPPORTED_ARCHITECTURES.items())


def read_json_object(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``. ModelConfigError naming the file when it cannot be read, is not
    valid JSON (with line and column) or is not an object."""
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ModelConfigError(f"{file} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ModelConfigError(f"cannot read {file}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelConfigError(f"{file} is not valid JSON: {exc.msg} at line {exc.lineno} "
                               f"column {exc.colno}") from None
    if not isinstance(doc, dict):
        raise ModelConfigError(f"{file} must hold a JSON object, got {type(doc).__name__}")
    return doc


class _Fields:
    """Typed reads of one config dict: a missing or null field takes the family default; a value
    of the wrong type is a ModelConfigError naming the field and the value."""

    def __init__(self, hf: dict[str, Any], family: str, source: str) -> None:
        self.hf, self.defaults, self.source = hf, _DEFAULTS[family], source

    def fail(self, field: str, value: Any, why: str) -> ModelConfigError:
        return ModelConfigError(f"{self.source}: {field}={value!r} {why}")

    def raw(self, key: str) -> Any:
        value = self.hf.get(key)
        return self.defaults[key] if value is None else value

    def int(self, key: str, value: Any = None) -> int:
        value = self.raw(key) if value is None else value
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, value, "must be an integer")
        return value

    def float(self, key: str, value: Any = None) -> float:
        value = self.raw(key) if value is None else value
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value)):
            raise self.fail(key, value, "must be a finite number")
        return float(value)

    def bool(self, key: str) -> bool:
        value = self.raw(key)
        if not isinstance(value, bool):
            raise self.fail(key, value, "must be true or false")
        return value


def _family(hf: dict[str, Any], source: str) -> str:
    model_type, archs = hf.get("model_type"), hf.get("architectures") or []
    if model_type is None:
        for family, arch in SUPPORTED_ARCHITECTURES.items():
            if arch in archs:
                return family
        raise ModelConfigError(f"{source} has no model_type (architectures {archs}); "
                               f"supported: {_supported()}")
    if model_type not in SUPPORTED_ARCHITECTURES:
        shown = f" (architectures {archs})" if archs else ""
        raise ModelConfigError(f"{source}: model_type {model_type!r}{shown} is not supported; "
                               f"supported: {_supported()}")
    return model_type


def _rope(f: _Fields, max_positions: int) -> tuple[float, YarnScaling | None]:
    """``(rope_theta, YaRN or None)`` as transformers resolves them: ``rope_scaling`` wins over
    ``rope_parameters``; a ``rope_theta`` inside the dict wins over the top-level one."""
    hf = f.hf
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = hf.get(field) or {}
    if not isinstance(params, dict):
        raise f.fail(field, params, "must be an object")
    if any(isinstance(v, dict) for v in params.values()):
        raise f.fail(field, params,
                     "holds per-layer-type RoPE parameters, which these models do not have")
    unknown = sorted(set(params) - _ROPE_KEYS)
    if unknown:
        raise f.fail(f"{field}.{unknown[0]}", params[unknown[0]],
                     "is not a RoPE parameter this model supports")
    theta = f.float("rope_theta", params.get("rope_theta"))
    for where, value in ((f"{field}.partial_rotary_factor", params.get("partial_rotary_factor")),
                         ("partial_rotary_factor", hf.get("partial_rotary_factor"))):
        if value is not None and value != 1.0:
            raise f.fail(where, value,
                         "is not supported (the rotary embedding covers the whole head)")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _ROPE_TYPES:
        raise f.fail(f"{field}.rope_type", rope_type,
                     f"is not supported (supported: {', '.join(_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    # transformers prefers a top-level original_max_position_embeddings (Phi-3 style), then the
    # dict's, then max_position_embeddings.
    original = (hf.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings") or max_positions)
    original = f.int(f"{field}.original_max_position_embeddings", original)
    factor = params.get("factor")
    factor = max_positions / original if factor is None else f.float(f"{field}.factor", factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (mscale(factor, m) / mscale(factor, m_all) if m and m_all
                            else mscale(factor))
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise f.fail(f"{field}.truncate", truncate, "must be true or false")
    try:
        return theta, YarnScaling(
            factor=factor, original_max_position_embeddings=original,
            beta_fast=f.float(f"{field}.beta_fast", params.get("beta_fast") or 32),
            beta_slow=f.float(f"{field}.beta_slow", params.get("beta_slow") or 1),
            attention_factor=f.float(f"{field}.attention_factor", attention_factor),
            truncate=truncate,
        )
    except ModelConfigError as exc:
        raise ModelConfigError(f"{f.source}: {field}: {exc}") from None


def model_fields_from_hf(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The ModelConfig fields of a Qwen3-MoE or Mixtral config dict (``ModelConfig.from_hf``
    builds the config); ModelConfigError (naming ``source``, the field and its value) for another
    architecture or a field the model does not compute."""
    if not isinstance(hf, dict):
        raise ModelConfigError(f"{source} must hold a JSON object, got {type(hf).__name__}")
    family = _family(hf, source)
    f = _Fields(hf, family, source)
    qc = hf.get("quantization_config")
    quantization = None if qc is None else quant_config_from_hf(qc, source)
    act = f.raw("hidden_act")
    if act not in _SILU:
        raise f.fail("hidden_act", act,
                     f"is not supported (the experts are SwiGLU: {', '.join(_SILU)})")
    heads = f.int("num_attention_heads")
    # Absent: the class default; null: one KV head per query head (MixtralConfig's rule).
    kv_heads = (heads if "num_key_value_heads" in hf and hf["num_key_value_heads"] is None
                else f.int("num_key_value_heads"))
    hidden = f.int("hidden_size")
    max_positions = f.int("max_position_embeddings")
    rope_theta, yarn = _rope(f, max_positions)
    common = dict(
        vocab_size=f.int("vocab_size"), hidden_size=hidden, num_layers=f.int("num_hidden_layers"),
        num_heads=heads, num_kv_heads=kv_heads,
        head_dim=f.int("head_dim", hf.get("head_dim") or hidden // max(heads, 1)),
        top_k=f.int("num_experts_per_tok"), rms_norm_eps=f.float("rms_norm_eps"),
        rope_theta=rope_theta, tie_word_embeddings=f.bool("tie_word_embeddings"),
        max_position_embeddings=max_positions, rope_yarn=yarn, quantization=quantization,
    )
    if family == "mixtral":
        if hf.get("attention_bias"):
            raise f.fail("attention_bias", hf["attention_bias"],
                         "is not supported for mixtral (transformers' MixtralAttention has no "
                         "biases)")
        window = hf.get("sliding_window")
        extra = dict(
            # Every layer sparse; the softmax over the top-k logits equals renormalised top-k.
            num_experts=f.int("num_local_experts"),
            moe_intermediate_size=f.int("intermediate_size"),
            norm_topk_prob=True, family="mixtral", qk_norm=False,
            sliding_window=None if window is None else f.int("sliding_window", window),
        )
    else:
        # Qwen3MoeConfig drops the window unless use_sliding_window is set; an absent window is
        # its default (4096), an explicit null none.
        window = None
        if f.bool("use_sliding_window"):
            window = hf.get("sliding_window", f.defaults["sliding_window"])
        mlp_only = hf.get("mlp_only_layers") or []
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                     for i in mlp_only):
            raise f.fail("mlp_only_layers", mlp_only, "must be a list of layer indices")
        experts = (hf["num_experts"] if hf.get("num_experts") is not None
                   else hf.get("num_local_experts"))
        extra = dict(
            num_experts=f.int("num_experts", experts),
            moe_intermediate_size=f.int("moe_intermediate_size"),
            intermediate_size=f.int("intermediate_size"), norm_topk_prob=f.bool("norm_topk_prob"),
            decoder_sparse_step=f.int("decoder_sparse_step"), mlp_only_layers=tuple(mlp_only),
            attention_bias=f.bool("attention_bias"),
            sliding_window=None if window is None else f.int("sliding_window", window),
        )
    return {**common, **extra}
