"""DPStepSync: the per-step agreement of the DP ranks — one exchange, then the pure plan.

Each step, every rank calls ``sync(local)``. That is ONE exchange (an all-gather of one int64
row per rank, over shared memory on one node or gloo otherwise: ``dp_runtime.sync.exchange``) whose
row holds, in this order::

    num_tokens, num_tokens_for_logprob, can_run_graph, is_extend, forward_mode,   (the report)
    kind, step, previous_fingerprint                                              (the checks)

and then ``plan_step(table, config)``, which every rank computes on the same table.

Fingerprint check without an extra collective: each rank sends the fingerprint of the plan it
computed at the previous step; when the gathered values differ, every rank sees the same
difference in the same table and raises DPPlanMismatchError naming the ranks and values. All
ranks have finished the exchange when they raise, so no rank is left inside a collective.
``kind`` catches a rank calling ``verify`` while another calls ``sync``; ``step`` catches ranks
that count steps differently. The check is one step late by design (it costs no collective):
call ``verify()`` after the last step (or in tests) to compare the latest plan's fingerprint
immediately. Configs are compared once, at init (``open_exchange``).

After a mismatch or a timeout the sync is unusable: later calls raise at once (DPSyncError)
rather than joining an exchange that the other ranks may never join.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dp_runtime.config import RuntimeConfig
from dp_runtime.sync.errors import DPPlanMismatchError, DPSyncError
from dp_runtime.sync.exchange import StepExchange, open_exchange
from dp_runtime.sync.step_plan import StepPlan, plan_step
from dp_runtime.sync.step_table import ROW_WIDTH, LocalStepInfo, StepTable

__all__ = ["DPStepSync"]

NCOLS = ROW_WIDTH + 3
_KIND, _STEP, _FINGERPRINT = ROW_WIDTH, ROW_WIDTH + 1, ROW_WIDTH + 2
_KIND_STEP, _KIND_VERIFY = 1, 2
_CHECKS = (
    ("exchange kind (1: sync, 2: verify)", _KIND),
    ("step counter", _STEP),
    ("previous plan fingerprint", _FINGERPRINT),
)
_IDLE_ROW = LocalStepInfo(0).to_row()


class DPStepSync:
    """The step sync of one rank (see the module docstring).

    Args:
        config: the frozen RuntimeConfig (dp_size must equal the group's size).
        group: the DP CPU (gloo) group; None: the default group, or no group at world size 1.
        exchange: a ready StepExchange (tests, tools); default ``open_exchange(config, group)``,
            which is a collective over ``group``.
        plan_fn: the planning function (default ``plan_step``; tests inject a faulty one).
    """

    def __init__(
        self,
        config: RuntimeConfig,
        group: Any = None,
        *,
        exchange: StepExchange | None = None,
        plan_fn: Callable[[StepTable, RuntimeConfig], StepPlan] = plan_step,
    ) -> None:
        self.config = config
        self._exchange = exchange if exchange is not None else open_exchange(config, group, NCOLS)
        if self._exchange.world != config.dp_size:
            raise ValueError(
                f"DPStepSync: the group has {self._exchange.world} ranks, config.dp_size "
                f"is {config.dp_size}"
            )
        if self._exchange.ncols != NCOLS:
            raise ValueError(
                f"DPStepSync: the exchange has {self._exchange.ncols} columns, needs {NCOLS}"
            )
        self._plan_fn = plan_fn
        self._step = 0
        self._last_fingerprint = 0
        self.last_plan: StepPlan | None = None
        self._broken: BaseException | None = None

    @property
    def rank(self) -> int:
        return self._exchange.rank

    @property
    def dp_size(self) -> int:
        return self._exchange.world

    @property
    def exchange_kind(self) -> str:
        """The path this sync took: "shm", "gloo" or "local"."""
        return self._exchange.kind

    @property
    def steps(self) -> int:
        """The number of exchanges (syncs and verifies) done."""
        return self._step

    def sync(self, local: LocalStepInfo) -> StepPlan:
        """Exchange this rank's report, check the previous fingerprints, plan the step.

        Takes this rank's LocalStepInfo; returns the StepPlan every rank gets. A collective:
        every rank of the group calls it once per step, idle ranks included. Raises
        DPPlanMismatchError (every rank alike) when the ranks' previous plans differed,
        DPSyncTimeoutError when a rank does not join, ValueError when a report is out of limits.
        """
        rows = self._exchange_checked(
            (*local.to_row(), _KIND_STEP, self._step, self._last_fingerprint)
        )
        plan = self._plan_fn(StepTable.from_rows(rows), self.config)
        self._last_fingerprint = plan.fingerprint
        self.last_plan = plan
        return plan

    def verify(self) -> None:
        """Compare the latest plan's fingerprint across ranks now (a collective; one exchange).

        Raises DPPlanMismatchError on every rank when they differ.
        """
        self._exchange_checked((*_IDLE_ROW, _KIND_VERIFY, self._step, self._last_fingerprint))

    def _exchange_checked(self, row: tuple[int, ...]) -> list[tuple[int, ...]]:
        if self._broken is not None:
            raise DPSyncError(
                f"DP step sync of rank {self.rank} is unusable after an earlier "
                f"error: {self._broken}"
            )
        try:
            rows = self._exchange.exchange(row)
        except DPSyncError as e:
            self._broken = e
            raise
        self._step += 1
        if len({r[ROW_WIDTH:] for r in rows}) != 1:
            self._raise_mismatch(rows)
        return rows

    def _raise_mismatch(self, rows: list[tuple[int, ...]]) -> None:
        for name, col in _CHECKS:
            values = {rank: r[col] for rank, r in enumerate(rows)}
            if len(set(values.values())) > 1:
                mine = self.last_plan.describe() if self.last_plan is not None else "none"
                err = DPPlanMismatchError(name, values, f"Rank {self.rank}'s previous plan: {mine}")
                self._broken = err
                raise err
        raise AssertionError("unreachable: rows differ in a check column")

    def abandon(self) -> None:
        """This rank will join no further exchange (its step raised): on the shared-memory path
        the peers waiting for its row raise at once; the gloo path has no such signal (peers
        wait ``dp_sync_timeout_s``). Later calls here raise DPSyncError. Not a collective."""
        mark = getattr(self._exchange, "abandon", None)
        if mark is not None:
            mark()
        if self._broken is None:
            self._broken = DPSyncError("this rank abandoned the step sync after its step raised")

    def close(self) -> None:
        """Release the exchange (unmaps the shared file). Not a collective."""
        self._exchange.close()

    def __enter__(self) -> DPStepSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
