"""The frozen configuration every dispatcher backend takes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DispatcherConfig"]


@dataclass(frozen=True)
class DispatcherConfig:
    """What a dispatcher must know about the model and the runtime's limits.

    - ``num_experts``, ``top_k``, ``hidden_size``, ``dtype``: the MoE layer's shape and the dtype
      of the hidden states that travel (expert outputs come back in the same dtype).
    - ``max_tokens_per_rank``: the largest step one rank can issue,
      ``max(chunked_prefill_size, max_running_requests)`` (see ``for_runtime``). Steps whose
      ``runtime_max_tokens_per_rank`` exceeds it are refused before any communication.
    - ``check_expert_ids``: check that routed expert ids lie in ``[0, num_experts)`` before
      communicating. On CUDA this reads a min/max back to the host (a sync), and it is skipped
      while a CUDA graph is being captured; a runtime that trusts its router can turn it off.
    - ``first_step_timeout_s``: how long the host-side barrier before the first real step (and in
      ``warmup``) waits for slow peers before failing with a clear error.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    dtype: torch.dtype
    max_tokens_per_rank: int
    check_expert_ids: bool = True
    first_step_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "max_tokens_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DispatcherConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"DispatcherConfig.top_k={self.top_k} exceeds "
                             f"num_experts={self.num_experts}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError("DispatcherConfig.dtype must be a floating torch.dtype, "
                             f"got {self.dtype!r}")
        if self.first_step_timeout_s <= 0:
            raise ValueError("DispatcherConfig.first_step_timeout_s must be > 0, "
                             f"got {self.first_step_timeout_s}")
