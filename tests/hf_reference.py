"""A tiny Qwen3-MoE (or Mixtral) checkpoint written by Hugging Face transformers, and its greedy
reference.

The checkpoint has the ``tiny`` preset's shape, one dense (``mlp_only_layers``) layer besides
the sparse ones, and weights re-drawn at ``1/sqrt(fan_in)`` scale (transformers' default 0.02
makes nearly flat logits, whose greedy ties no tolerance can settle). Written with
``save_pretrained`` (safetensors, sharded so the index path is exercised).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
    norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=512, mlp_only_layers=[1],
    decoder_sparse_step=1, tie_word_embeddings=False, rms_norm_eps=1e-6,
)


TINY_MIXTRAL = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, rope_theta=10000.0,
    max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
)


def write_tiny_checkpoint(path: Path, seed: int = 0, *, family: str = "qwen3_moe", **overrides) -> Path:
    """Save a seeded tiny Qwen3MoeForCausalLM (or MixtralForCausalLM) to ``path``; returns it."""
    import transformers

    if family == "mixtral":
        config_cls, model_cls, base = transformers.MixtralConfig, transformers.MixtralForCausalLM, TINY_MIXTRAL
    else:
        config_cls, model_cls, base = transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, TINY
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**base, **overrides})).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):  # attention biases: large enough to move the tokens
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                scale = 3.0 if name == "lm_head.weight" else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * scale * p.shape[-1] ** -0.5)
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size="200KB")
    return path


def load_reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def greedy_reference(model, prompt: list[int], max_new_tokens: int, **generate: Any) -> tuple[list[int], torch.Tensor]:
    """Transformers' greedy tokens for ``prompt`` and the logits (float32, one row per new
    token) they were chosen from (the raw ones, before ``generate``'s processors, e.g. a
    ``repetition_penalty`` given here)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        # An explicit all-ones mask: without one, generate masks every prompt token that equals
        # the pad id as if it were padding.
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                             **generate)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack([step[0] for step in out.logits]).float()
    return tokens, logits
