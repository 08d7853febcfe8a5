"""Where each weight of a layer lives in a Hugging Face checkpoint, per model family.

The loader (``weights.expected_shapes``) and the model (``qwen3_moe.Qwen3MoeModel``) both name
tensors through these two functions, so a family is added in one place.

===========  ===============================  ==================================================
family       router                           expert ``e`` (gate, up, down)
===========  ===============================  ==================================================
qwen3_moe    ``mlp.gate.weight``              ``mlp.experts.{e}.{gate_proj,up_proj,down_proj}``
mixtral      ``block_sparse_moe.gate.weight``  ``block_sparse_moe.experts.{e}.{w1,w3,w2}``
===========  ===============================  ==================================================

Both share the attention names (``self_attn.{q,k,v,o}_proj``) and the norms
(``input_layernorm``, ``post_attention_layernorm``); only Qwen3 has ``self_attn.{q,k}_norm``, and
with ``attention_bias`` the biases ``self_attn.{q,k,v,o}_proj.bias``.
"""

from __future__ import annotations

from dp_runtime.model.model_config import ModelConfig

__all__ = ["FAMILIES", "expert_names", "layer_names"]

_MOE = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
FAMILIES = tuple(_MOE)


def layer_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """``{role: tensor name}`` of layer ``i`` except its experts. Roles: attn_norm, mlp_norm,
    q_proj, k_proj, v_proj, o_proj, q_norm and k_norm (when the family has them), q_bias,
    k_bias, v_bias, o_bias (with ``attention_bias``), router (a sparse layer) or mlp_gate, mlp_up,
    mlp_down (a dense layer)."""
    p = f"model.layers.{i}."
    names = {
        "attn_norm": p + "input_layernorm.weight",
        "mlp_norm": p + "post_attention_layernorm.weight",
        **{proj: f"{p}self_attn.{proj}.weight"
           for proj in ("q_proj", "k_proj", "v_proj", "o_proj")},
    }
    if cfg.attention_bias:
        names.update({f"{proj[0]}_bias": f"{p}self_attn.{proj}.bias"
                      for proj in ("q_proj", "k_proj", "v_proj", "o_proj")})
    if cfg.qk_norm:
        names["q_norm"] = p + "self_attn.q_norm.weight"
        names["k_norm"] = p + "self_attn.k_norm.weight"
    if cfg.is_sparse(i):
        names["router"] = f"{p}{_MOE[cfg.family][0]}.gate.weight"
    else:
        names.update({f"mlp_{part}": f"{p}mlp.{part}_proj.weight"
                      for part in ("gate", "up", "down")})
    return names


def expert_names(cfg: ModelConfig, i: int, e: int) -> tuple[str, str, str]:
    """The (gate, up, down) tensor names of global expert ``e`` in layer ``i``."""
    block, parts = _MOE[cfg.family]
    return tuple(f"model.layers.{i}.{block}.experts.{e}.{part}.weight"  # type: ignore[return-value]
                 for part in parts)
