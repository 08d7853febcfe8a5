"""ModelConfig: the shape of a Qwen3-MoE-style model (or Mixtral), from a Hugging Face config or
a preset.

Presets: ``tiny`` (CPU tests: a few layers, a handful of experts) and ``qwen3-30b-a3b`` (the
dimensions of Qwen3-30B-A3B, for GPU benchmarks with random weights).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "ModelConfig"]


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

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts", "top_k", "moe_intermediate_size")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.family not in ("qwen3_moe", "mixtral"):
            raise ValueError(f"ModelConfig.family must be 'qwen3_moe' or 'mixtral', got {self.family!r}")
        if self.decoder_sparse_step <= 0:
            raise ValueError(f"decoder_sparse_step must be > 0, got {self.decoder_sparse_step}")

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` has experts (Qwen3-MoE's decoder_sparse_step / mlp_only_layers rule)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face Qwen3-MoE or Mixtral ``config.json`` dict (by ``model_type``)."""
        rope = hf.get("rope_theta")
        if rope is None:
            rope = (hf.get("rope_parameters") or hf.get("rope_scaling") or {}).get("rope_theta", 1_000_000.0)
        heads = hf["num_attention_heads"]
        common = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            top_k=hf["num_experts_per_tok"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 40960),
        )
        model_type = hf.get("model_type", "qwen3_moe")
        if model_type == "mixtral":
            # Every layer sparse; the softmax over the top-k logits equals renormalised top-k.
            return cls(**common, num_experts=hf["num_local_experts"], moe_intermediate_size=hf["intermediate_size"],
                       norm_topk_prob=True, family="mixtral", qk_norm=False)
        if model_type != "qwen3_moe":
            raise ValueError(f"config.json model_type {model_type!r} is not supported (qwen3_moe, mixtral)")
        return cls(
            **common,
            num_experts=hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            intermediate_size=hf.get("intermediate_size", 0),
            norm_topk_prob=hf.get("norm_topk_prob", False),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """From ``path/config.json``; a missing file is FileNotFoundError naming it."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"no config.json in checkpoint directory {str(path)!r}")
        return cls.from_hf(json.loads(file.read_text()))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return replace(PRESETS[name], **overrides)

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
        vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        num_experts=128, top_k=8, moe_intermediate_size=768, intermediate_size=6144,
        norm_topk_prob=True, rope_theta=1_000_000.0, max_position_embeddings=40960,
    ),
}
