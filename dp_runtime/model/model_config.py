"""ModelConfig: the shape of a Qwen3-MoE-style model (or Mixtral), from a Hugging Face config or
a preset; ModelConfigError, the one error type of a model that cannot be loaded as given.

Presets: ``tiny`` (CPU tests: a few layers, a handful of experts), ``qwen3-30b-a3b`` and
``qwen3-235b-a22b`` (the dimensions of Qwen3-30B-A3B and Qwen3-235B-A22B, for GPU benchmarks
with random weights).

``ModelConfig.load(model)`` takes what a user types for ``--model``: a preset name or a
checkpoint directory. Reading a ``config.json`` (which fields count, which are refused) lives in
``dp_runtime.model.hf_config``, which knows ModelConfig's fields but not the class (it returns
them as a dict); the error type and YaRN's parameters, which both need, live below both in
``config_parts`` (no import cycle).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dp_runtime.model.checkpoint_files import checkpoint_index, has_weights
from dp_runtime.model.config_parts import ModelConfigError, YarnScaling
from dp_runtime.model.hf_config import model_fields_from_hf, read_json_object
from dp_runtime.model.quant_config import QuantConfig

logger = logging.getLogger(__name__)

__all__ = ["PRESETS", "ModelConfig", "ModelConfigError", "YarnScaling"]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int = 0  # dense MLP of layers that are not sparse (mlp_only_layers)
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    max_position_embeddings: int = 40960
    family: str = "qwen3_moe"  # tensor names: dp_runtime.model.tensor_names
    qk_norm: bool = True  # per-head RMSNorm of q and k (Qwen3; not Mixtral)
    attention_bias: bool = False  # biases on q/k/v/o projections (Qwen3-MoE's attention_bias)
    rope_yarn: YarnScaling | None = None  # None: plain RoPE
    # The attention window as transformers applies it (None: full causal attention). The model
    # has no windowed attention: RankSpec refuses a window shorter than the context it allows.
    sliding_window: int | None = None
    # FP8 block-quantized weights (a checkpoint's quantization_config, or --quantization fp8);
    # None: every weight in the model dtype.
    quantization: QuantConfig | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_yarn, dict):  # to_dict() output fed back in
            object.__setattr__(self, "rope_yarn", YarnScaling(**self.rope_yarn))
        if isinstance(self.quantization, dict):
            object.__setattr__(self, "quantization", QuantConfig(**self.quantization))
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "num_experts", "top_k", "moe_intermediate_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ModelConfigError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads={self.num_heads} must be a multiple of "
                                   f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(
                f"head_dim must be even for the rotary embedding, got {self.head_dim}")
        if self.top_k > self.num_experts:
            raise ModelConfigError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.family not in ("qwen3_moe", "mixtral"):
            raise ModelConfigError(
                f"ModelConfig.family must be 'qwen3_moe' or 'mixtral', got {self.family!r}")
        if self.decoder_sparse_step <= 0:
            raise ModelConfigError(
                f"decoder_sparse_step must be > 0, got {self.decoder_sparse_step}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelConfigError(f"sliding_window must be > 0 or None, got {self.sliding_window}")

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` has experts (Qwen3-MoE's decoder_sparse_step / mlp_only_layers
        rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @property
    def max_positions(self) -> int:
        """The longest context the model's positions cover: ``max_position_embeddings``, or with
        YaRN at least ``factor * original_max_position_embeddings`` (the context YaRN extends
        to; Qwen3's published configs keep ``max_position_embeddings`` at the native length)."""
        if self.rope_yarn is None:
            return self.max_position_embeddings
        extended = int(self.rope_yarn.factor * self.rope_yarn.original_max_position_embeddings)
        return max(self.max_position_embeddings, extended)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """From a Hugging Face Qwen3-MoE or Mixtral ``config.json`` dict (by ``model_type``).
        Raises ModelConfigError naming ``source``, the field and its value for anything the model
        would not compute as transformers does (``dp_runtime.model.hf_config``)."""
        fields = model_fields_from_hf(hf, source)
        try:
            return cls(**fields)
        except ModelConfigError as exc:
            raise ModelConfigError(f"{source}: {exc}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """From ``path/config.json``. ModelConfigError when ``path`` does not exist (naming the
        presets too: a mistyped preset arrives here), has no config.json, or its config.json is
        not valid JSON (line and column) or not a supported model. ``tie_word_embeddings`` comes
        out false when the checkpoint carries its own ``lm_head.weight`` (transformers' rule)."""
        root = Path(path)
        if not root.exists():
            raise ModelConfigError(
                f"model {str(path)!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a "
                "checkpoint directory")
        file = root / "config.json"
        if not file.is_file():
            raise ModelConfigError(f"no config.json in checkpoint directory {str(path)!r}")
        cfg = cls.from_hf(read_json_object(file), str(file))
        if (cfg.tie_word_embeddings and has_weights(root)
                and "lm_head.weight" in checkpoint_index(root)):
            # transformers 5 does not tie a head the checkpoint carries (it warns when the values
            # differ; equal values tie to the same logits): the checkpoint's head is the head.
            logger.warning("%s: tie_word_embeddings is true but the checkpoint carries its own "
                           "lm_head.weight; using that head, as transformers does", file)
            cfg = replace(cfg, tie_word_embeddings=False)
        return cfg

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ModelConfigError(
                f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return replace(PRESETS[name], **overrides)

    @classmethod
    def load(cls, model: str, **overrides: Any) -> ModelConfig:
        """What ``--model`` names: a preset (``overrides`` replace its fields), or a checkpoint
        directory or its config.json (no overrides). ModelConfigError otherwise."""
        if model in PRESETS:
            return cls.preset(model, **overrides)
        if overrides:
            raise ModelConfigError(
                f"model overrides apply to presets only; {model!r} is a checkpoint")
        path = Path(model)
        if path.name == "config.json" and path.is_file():
            path = path.parent
        elif path.is_file():
            raise ModelConfigError(f"model {model!r} is a file; give a preset, a checkpoint "
                                   "directory or its config.json")
        return cls.from_dir(path)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        num_experts=8, top_k=2, moe_intermediate_size=32, intermediate_size=128,
        norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=2048,
    ),
    # Qwen3-30B-A3B: 48 layers, hidden 2048, 32 query / 4 KV heads of 128, 128 experts, top-8,
    # expert intermediate 768 (the published config.json).
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=768, intermediate_size=6144,
        norm_topk_prob=True, rope_theta=1_000_000.0, max_position_embeddings=40960,
    ),
    # Qwen3-235B-A22B: 94 layers, hidden 4096, 64 query / 4 KV heads of 128, 128 experts, top-8,
    # expert intermediate 1536 (the published config.json). 438 GiB in bf16, 219 GiB in FP8:
    # it needs several GPUs (plan says which).
    "qwen3-235b-a22b": ModelConfig(
        vocab_size=151936, hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4,
        head_dim=128, num_experts=128, top_k=8, moe_intermediate_size=1536, intermediate_size=12288,
        norm_topk_prob=True, rope_theta=1_000_000.0, max_position_embeddings=40960,
    ),
}
