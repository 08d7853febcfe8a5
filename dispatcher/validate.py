"""Checks that refuse a bad step BEFORE any communication.

A rank that raises after its peers entered a collective leaves them hanging (or, with FlashInfer,
spinning on the GPU); a rank that communicates with a wrong geometry corrupts its peers' buffers.
So every dispatcher runs these checks first. They read only host values (the plan, shapes,
dtypes), except the optional expert-id range check, which reads a min/max back from the device.

Legend: ``T`` local tokens, ``K`` top-k, ``D`` hidden size, ``N`` expert rows.
"""

from __future__ import annotations

import torch

from dispatcher.config import DispatcherConfig
from dispatcher.groups import EPGroup
from dispatcher.partition import INVALID_EXPERT_ID
from dispatcher.plan import StepPlanLike

__all__ = ["check_combine_input", "check_step"]


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_step(hidden_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
               plan: StepPlanLike, *, config: DispatcherConfig, ep: EPGroup, backend: str,
               padding_ids: bool = False) -> None:
    """Raise ``ValueError`` (naming the values and what to change) if the step cannot be dispatched.

    Takes the dispatch inputs, the plan, the dispatcher's config and EP group, and the backend name
    for messages; returns nothing. ``padding_ids``: the backend takes ``INVALID_EXPERT_ID`` for
    the picks of padding rows (the local dispatcher hands them to the experts, which skip them).
    """
    counts = tuple(plan.global_num_tokens_cpu)
    runtime_max = int(plan.runtime_max_tokens_per_rank)
    if len(counts) != ep.size:
        raise ValueError(
            f"plan.global_num_tokens_cpu has {len(counts)} entries but the EP group has {ep.size} "
            "ranks (the plan must list every EP rank's tokens, indexed by EP rank)"
        )
    if runtime_max > config.max_tokens_per_rank:
        raise ValueError(
            f"step refused before communication: plan.runtime_max_tokens_per_rank={runtime_max} "
            f"exceeds the {backend} dispatcher's max_num_tokens={config.max_tokens_per_rank} per "
            "rank (= max(chunked_prefill_size, max_running_requests)); raise chunked_prefill_size "
            f"or max_running_requests to at least {runtime_max}, or split the step"
        )
    if hidden_TD.dim() != 2:
        raise ValueError("hidden_TD must be 2-D [tokens, hidden], got "
                         f"shape {tuple(hidden_TD.shape)}")
    num_tokens, hidden = hidden_TD.shape
    if hidden_TD.dtype != config.dtype:
        raise ValueError(
            f"hidden_TD dtype {hidden_TD.dtype} does not match the dispatcher's "
            f"dtype {config.dtype} (DispatcherConfig.dtype)"
        )
    if hidden != config.hidden_size:
        raise ValueError(f"hidden_TD has hidden size {hidden}, the dispatcher was built "
                         f"for {config.hidden_size}")
    if num_tokens > runtime_max:
        raise ValueError(
            f"local tokens {num_tokens} exceed plan.runtime_max_tokens_per_rank={runtime_max}; "
            "the plan must come from the gathered token counts of this step"
        )
    if num_tokens != counts[ep.rank]:
        raise ValueError(
            f"local tokens {num_tokens} differ from "
            f"plan.global_num_tokens_cpu[{ep.rank}]={counts[ep.rank]} (this rank's entry of the "
            "gathered table)"
        )
    if runtime_max < max(counts, default=0):
        raise ValueError(
            f"plan.runtime_max_tokens_per_rank={runtime_max} is below the largest rank's tokens "
            f"{max(counts)} (global_num_tokens_cpu={counts}); it must be >= every rank's tokens"
        )
    expected = (num_tokens, config.top_k)
    if tuple(topk_ids_TK.shape) != expected:
        raise ValueError(f"topk_ids_TK must have shape {expected} [tokens, top_k], "
                         f"got {tuple(topk_ids_TK.shape)}")
    if tuple(topk_weights_TK.shape) != expected:
        raise ValueError(
            f"topk_weights_TK must have shape {expected} [tokens, top_k], "
            f"got {tuple(topk_weights_TK.shape)}"
        )
    if (topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool
            or topk_ids_TK.is_complex()):
        raise ValueError(f"topk_ids_TK must be an integer tensor, got {topk_ids_TK.dtype}")
    if not topk_weights_TK.dtype.is_floating_point:
        raise ValueError(f"topk_weights_TK must be a floating tensor, got {topk_weights_TK.dtype}")
    for name, t in (("topk_ids_TK", topk_ids_TK), ("topk_weights_TK", topk_weights_TK)):
        if t.device != hidden_TD.device:
            raise ValueError(f"{name} is on {t.device} but hidden_TD is on {hidden_TD.device}")
    if config.check_expert_ids and num_tokens > 0 and not _capturing():
        lo, hi = (int(v) for v in torch.aminmax(topk_ids_TK))
        low = INVALID_EXPERT_ID if padding_ids else 0
        if lo < low or hi >= config.num_experts:
            padding = f", or {INVALID_EXPERT_ID} for a padding row" if padding_ids else ""
            raise ValueError(
                f"expert ids out of range: topk_ids_TK spans [{lo}, {hi}] but valid ids are "
                f"[0, {config.num_experts}) (num_experts={config.num_experts}){padding}"
            )


def check_combine_input(expert_out_ND: torch.Tensor, num_rows: int,
                        config: DispatcherConfig) -> None:
    """Raise ``ValueError`` unless the expert outputs are ``num_rows x hidden`` in the config
    dtype."""
    expected = (num_rows, config.hidden_size)
    if tuple(expert_out_ND.shape) != expected:
        raise ValueError(
            f"expert_out_ND must have shape {expected} (one row per dispatched expert input), "
            f"got {tuple(expert_out_ND.shape)}"
        )
    if expert_out_ND.dtype != config.dtype:
        raise ValueError(f"expert_out_ND dtype {expert_out_ND.dtype} does not match the "
                         f"dispatcher's dtype {config.dtype}")
