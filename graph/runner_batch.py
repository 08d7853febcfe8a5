"""What the runners read from a batch, as a Protocol (ForwardBatch lives in dp_runtime)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from graph.forward_mode import ForwardMode

__all__ = ["RunnerBatch"]


@runtime_checkable
class RunnerBatch(Protocol):
    """A dataclass batch with registry-named tensor fields (``input_ids``, ``seq_lens``...) plus:

    - ``batch_size``: live requests on this rank (0 for IDLE);
    - ``num_tokens``: live tokens on this rank (0 for IDLE);
    - ``forward_mode``: a ``graph.ForwardMode``;
    - ``plan``: the step's plan (``StepPlanView``); a graph replays with its capture plan.
    """

    batch_size: int
    forward_mode: ForwardMode
    plan: Any

    @property
    def num_tokens(self) -> int: ...
