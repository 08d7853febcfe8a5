"""The model's fused weight groups and which of them are stored FP8: one pure rule that the model
(its storage), the weight sizing (``memory_sizing``) and the planner share.

A group is one GEMM's weight: ``qkv`` (q, k and v stacked), ``o``, and per layer either the
experts' ``w13`` (gate and up of each local expert) and ``w2`` (down), or a dense MLP's ``w13``
and ``w2``. With a QuantConfig a group is FP8 when none of its modules is listed in
``modules_to_not_convert`` and each member but the last ends on a whole block of rows (a
member's block grid must be the fused group's: q_proj at 4096 rows is, a 64-row k_proj of a toy
model is not); otherwise it keeps the model dtype, and a checkpoint's FP8 tensors in it are
dequantized at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dispatcher.partition import ExpertPartition
from dp_runtime.model.fp8_blocks import scale_shape
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.model.tensor_names import expert_names, layer_names

__all__ = ["WeightGroup", "layer_groups", "module_of"]


@dataclass(frozen=True)
class WeightGroup:
    """``key`` (qkv, o, w13, w2), ``shape`` ((N, K), or (L, N, K) for local experts), the tensor
    names of its members (every local expert's), the members' row counts, and ``fp8``."""

    key: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    member_rows: tuple[int, ...]
    fp8: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes(self, dtype_bytes: int) -> int:
        """Bytes of its storage: FP8 values and float32 scales, or ``dtype_bytes`` per element."""
        if not self.fp8:
            return self.numel * dtype_bytes
        return self.numel + 4 * math.prod(scale_shape(self.shape))


def module_of(name: str) -> str:
    """The module of a tensor name: ``model.layers.0.self_attn.q_proj.weight`` -> ``...q_proj``."""
    return name.rsplit(".", 1)[0]


def _fp8(cfg: ModelConfig, names: list[str], member_rows: list[int]) -> bool:
    q = cfg.quantization
    if q is None or any(q.skips(module_of(n)) for n in names):
        return False
    return all(rows % q.block[0] == 0 for rows in member_rows[:-1])


def layer_groups(cfg: ModelConfig, i: int, ep_rank: int = 0,
                 ep_size: int = 1) -> dict[str, WeightGroup]:
    """``{key: WeightGroup}`` of layer ``i`` on EP rank ``ep_rank`` of ``ep_size``."""
    names = layer_names(cfg, i)
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    groups: dict[str, tuple[tuple[int, ...], list[str], list[int]]] = {
        "qkv": ((q + 2 * kv, h), [names["q_proj"], names["k_proj"], names["v_proj"]], [q, kv, kv]),
        "o": ((h, q), [names["o_proj"]], [h]),
    }
    if cfg.is_sparse(i):
        part = ExpertPartition(cfg.num_experts, ep_size)
        first, n_local = part.first(ep_rank), part.num_local(ep_rank)
        size = cfg.moe_intermediate_size
        experts = [expert_names(cfg, i, e) for e in range(first, first + n_local)]
        groups["w13"] = ((n_local, 2 * size, h), [n for g, u, _ in experts for n in (g, u)],
                         [size, size])
        groups["w2"] = ((n_local, h, size), [dn for _, _, dn in experts], [h])
    else:
        size = cfg.intermediate_size
        groups["w13"] = ((2 * size, h), [names["mlp_gate"], names["mlp_up"]], [size, size])
        groups["w2"] = ((h, size), [names["mlp_down"]], [h])
    return {key: WeightGroup(key, shape, tuple(members), tuple(rows), _fp8(cfg, members, rows))
            for key, (shape, members, rows) in groups.items()}
