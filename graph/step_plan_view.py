"""What graph/ reads from the DP step plan, as a Protocol (the plan class lives in dp_runtime,
which graph/ must not import)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["StepPlanView", "padding_name"]


@runtime_checkable
class StepPlanView(Protocol):
    """The fields of the frozen StepPlan the runners use.

    - ``graph_bucket``: the DP-agreed number of requests per rank for a graph replay (the max
      over ranks, or already a captured size), or None when the step runs eager;
    - ``padding``: an enum whose ``.name`` is ``"MAX_LEN"`` or ``"SUM_LEN"``;
    - ``runtime_max_tokens_per_rank``: the per-rank token count the gathered buffers use;
    - ``global_num_tokens_cpu``: every rank's live token count.
    """

    @property
    def graph_bucket(self) -> int | None: ...

    @property
    def padding(self) -> Any: ...

    @property
    def runtime_max_tokens_per_rank(self) -> int: ...

    @property
    def global_num_tokens_cpu(self) -> tuple[int, ...]: ...


def padding_name(plan: StepPlanView) -> str:
    """The padding mode's name (``"MAX_LEN"``/``"SUM_LEN"``): enums compare by name, so graph/
    needs no import of the plan's enum. A plain string is accepted as its own name."""
    padding = plan.padding
    return padding if isinstance(padding, str) else padding.name
