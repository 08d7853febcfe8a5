"""The reference model of one rank with random weights, for tests and benchmarks that drive it
without a rank worker: the local dispatcher (no communication) and ``iter_random`` weights."""

from __future__ import annotations

from typing import Any

import torch

from dispatcher import DispatcherConfig, LocalDispatcher
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.model.qwen3_moe import Qwen3MoeModel
from dp_runtime.model.weights import iter_random

__all__ = ["local_model"]


def local_model(
    config: ModelConfig, attention: Any, *, dtype: torch.dtype, device: torch.device | str, seed: int = 0,
    max_tokens_per_rank: int,
) -> Qwen3MoeModel:
    """``Qwen3MoeModel`` on one rank calling ``attention``, with ``iter_random(seed)`` weights.

    ``max_tokens_per_rank``: the largest step its dispatcher accepts (the runtime's
    ``max(chunked_prefill_size, max_running_requests)``). The expert-id check is off, as in
    the rank worker: on CUDA it is a host sync in every MoE layer.
    """
    dispatcher = LocalDispatcher(
        DispatcherConfig(num_experts=config.num_experts, top_k=config.top_k, hidden_size=config.hidden_size,
                         dtype=dtype, max_tokens_per_rank=max_tokens_per_rank, check_expert_ids=False),
        device=device,
    )
    weights = iter_random(config, 0, 1, dtype, device, seed)
    return Qwen3MoeModel(config, weights, attention=attention, dispatcher=dispatcher, dtype=dtype, device=device)

