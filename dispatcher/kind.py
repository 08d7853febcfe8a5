"""What a dispatcher kind states about itself: ``DispatcherKind``, the base of every dispatcher
class. The planner, the rank's choices and the CLI read these facts through the factory's one
table (``dispatcher.factory.KINDS``), never by testing a kind's name; a new dispatcher is one
new file (its class, stating its facts) plus one row in that table.

Sizing here is pure (numbers in, bytes out) and importable without a GPU: the runtime and the
planner call the same functions (``dp_runtime/memory_sizing.py``, ``memory_estimates.py``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

__all__ = ["DispatcherKind"]


class DispatcherKind:
    """Facts and sizing of one dispatcher kind, as class attributes and class methods (the
    defaults below are a dispatcher with no workspace that moves every EP rank's rows)."""

    kind: ClassVar[str]
    capturable: ClassVar[bool] = True  # dispatch + combine can live in a CUDA graph
    gathers: ClassVar[bool] = False  # gathers through the DP buffer service (takes ``buffers``)
    single_rank: ClassVar[bool] = False  # runs at world size 1 only (it exchanges nothing)
    cuda_only: ClassVar[bool] = False  # its hidden states must be on CUDA
    package: ClassVar[str | None] = None  # a module it needs, imported when it is built
    install_hint: ClassVar[str] = ""
    # The experts write a separate N x H output (not over rows the dispatcher already holds).
    separate_expert_output: ClassVar[bool] = False
    # ``workspace_bytes`` is the peak of per-step buffers, live only during a step's MoE
    # section (so also part of the activation peak), not memory held between steps.
    transient_workspace: ClassVar[bool] = False
    auto_order: ClassVar[int] = 99  # ``auto`` asks the kinds in this order (``auto_reason``)

    @classmethod
    def auto_reason(cls, world_size: int, flashinfer_dispatch: tuple[bool, str],
                    graphs_on_cuda: bool) -> str | None:
        """Why ``dispatcher="auto"`` takes this kind here, or None when it does not (kinds are
        asked in the table's order, the first to answer wins)."""
        return None

    @classmethod
    def expert_rows(cls, dp_size: int, ep_size: int, num_tokens: int) -> int:
        """``N``: the rows a rank's experts run on when every rank has ``num_tokens`` (up to
        every EP rank's by default)."""
        return int(num_tokens) * ep_size

    @classmethod
    def workspace_bytes(cls, ep_size: int, max_tokens_per_rank: int, hidden_size: int, top_k: int,
                        dtype: torch.dtype) -> int:
        """What the dispatcher's ``workspace_bytes_per_rank()`` reports at these sizes."""
        return 0

    @classmethod
    def step_bytes(cls, ep_size: int, num_tokens: int, hidden_size: int, top_k: int,
                   dtype: torch.dtype) -> int:
        """Transient bytes one dispatch + combine allocates at ``num_tokens`` per rank, outside
        any persistent workspace (0 tokens: 0)."""
        if not cls.transient_workspace or num_tokens <= 0:
            return 0
        return cls.workspace_bytes(ep_size, num_tokens, hidden_size, top_k, dtype)
