"""The DP buffer service: ``set_dp_buffer_len`` and the gathered buffers of a rank.

Shapes (legend): ``G`` = global_dp_buffer_len (rows of the gathered buffer), ``L`` =
local_dp_buffer_len (rows of this rank's local buffer), ``D`` = hidden_size, ``R`` = dp_size,
``K`` = the MoE top-k of the routing rows.

A rank builds the service only when its dispatcher gathers (all_gather), and that dispatcher
is its one user: in every dispatch it lays the buffers out from the plan it is handed
(``set_from_plan``, which calls ``set_dp_buffer_len``), gathers hidden rows and routing into
them and reduce-scatters its expert outputs back through the service. So the layout follows the
plan of the forward that runs (an eager step, a graph capture, the runners' eager stand-in) and
nobody lays it out ahead. Storage comes from the rank's ``buffers.BufferPool`` once, at the
largest size the config allows. Layouts only take views of it, so addresses never move and a
graph may keep them; laying out allocates nothing (safe during a capture); the views are valid
until the next layout.

Layout (``dp_buffer_layout``, pure): MAX_LEN ``G = L * R``, rank ``r`` at ``r * L``, its first
``global_num_tokens[r]`` rows live; SUM_LEN ``G = sum(global_num_tokens)``, rank ``r`` after the
counts before it, ``L`` = its count.

Hazard (as for the pool): the buffers are shared by every forward of the rank, which is safe
because those forwards run one after another on one stream. The story: docs/dp_sync.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from buffers.pool import BufferPool
from dp_runtime.checks import require_int
from dp_runtime.config import RuntimeConfig
from dp_runtime.sync.dp_gather import dp_gather, dp_reduce_scatter, dp_scatter
from dp_runtime.sync.padding_mode import PaddingMode

__all__ = ["DPBufferLayout", "DPBufferService", "dp_buffer_layout", "dp_buffer_shapes"]


@dataclass(frozen=True, slots=True)
class DPBufferLayout:
    """Where each rank's rows lie in the gathered buffer this step (see the module docstring)."""

    padding: PaddingMode
    rank: int
    global_dp_buffer_len: int
    local_dp_buffer_len: int
    global_num_tokens: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def dp_size(self) -> int:
        return len(self.global_num_tokens)

    @property
    def is_max_len(self) -> bool:
        return self.padding is PaddingMode.MAX_LEN

    @property
    def offset(self) -> int:
        """The first row of this rank in the gathered buffer."""
        return self.offsets[self.rank]

    @property
    def num_tokens(self) -> int:
        """This rank's live rows."""
        return self.global_num_tokens[self.rank]


def dp_buffer_layout(
    global_dp_buffer_len: int,
    local_dp_buffer_len: int,
    is_max_len: bool,
    global_num_tokens_cpu: Sequence[int],
    *,
    rank: int,
    dp_size: int,
    max_tokens_per_rank: int,
) -> DPBufferLayout:
    """The layout of a step's gathered buffer, after checking the arguments agree.

    Takes the lengths and counts of ``set_dp_buffer_len``, this rank, dp_size and the per-rank
    limit. Returns a DPBufferLayout. Raises ValueError naming the value and the limit when:
    a length or count is not an int (2.7 tokens is refused, not read as 2);
    the count list's length != dp_size; a count is negative or over ``max_tokens_per_rank``;
    MAX_LEN: ``local < max(counts)``, ``local > max_tokens_per_rank`` or ``global != local *
    dp_size``; SUM_LEN: ``global != sum(counts)`` or ``local != counts[rank]``.
    """
    counts = tuple(require_int(n, f"set_dp_buffer_len: global_num_tokens_cpu[{r}]")
                   for r, n in enumerate(global_num_tokens_cpu))
    g = require_int(global_dp_buffer_len, "set_dp_buffer_len: global_dp_buffer_len")
    loc = require_int(local_dp_buffer_len, "set_dp_buffer_len: local_dp_buffer_len")
    if len(counts) != dp_size:
        raise ValueError(
            f"set_dp_buffer_len: global_num_tokens_cpu has {len(counts)} entries, dp_size "
            f"is {dp_size}"
        )
    if not 0 <= rank < dp_size:
        raise ValueError(f"set_dp_buffer_len: rank {rank} is not in [0, dp_size={dp_size})")
    for r, n in enumerate(counts):
        if not 0 <= n <= max_tokens_per_rank:
            raise ValueError(
                f"set_dp_buffer_len: global_num_tokens_cpu[{r}]={n} is not in [0, "
                f"max_tokens_per_rank={max_tokens_per_rank}]"
            )
    limit = max_tokens_per_rank * dp_size
    if not 0 <= g <= limit:
        raise ValueError(
            f"set_dp_buffer_len: global_dp_buffer_len={g} is not in [0, max_global_tokens={limit}]"
        )
    if is_max_len:
        if not max(counts) <= loc <= max_tokens_per_rank:
            raise ValueError(
                f"set_dp_buffer_len (MAX_LEN): local_dp_buffer_len={loc} must be "
                f"in [max(global_num_tokens_cpu)={max(counts)}, "
                f"max_tokens_per_rank={max_tokens_per_rank}]"
            )
        if g != loc * dp_size:
            raise ValueError(
                f"set_dp_buffer_len (MAX_LEN): global_dp_buffer_len={g} != local_dp_buffer_len * "
                f"dp_size = {loc} * {dp_size} = {loc * dp_size}"
            )
        offsets = tuple(range(0, g, loc)) if loc else (0,) * dp_size
        return DPBufferLayout(PaddingMode.MAX_LEN, rank, g, loc, counts, offsets)
    if g != sum(counts):
        raise ValueError(
            f"set_dp_buffer_len (SUM_LEN): global_dp_buffer_len={g} != "
            f"sum(global_num_tokens_cpu)={sum(counts)} (counts {list(counts)})"
        )
    if loc != counts[rank]:
        raise ValueError(
            f"set_dp_buffer_len (SUM_LEN): local_dp_buffer_len={loc} != "
            f"global_num_tokens_cpu[{rank}]={counts[rank]}"
        )
    offsets, acc = [], 0
    for n in counts:
        offsets.append(acc)
        acc += n
    return DPBufferLayout(PaddingMode.SUM_LEN, rank, g, loc, counts, tuple(offsets))


_MAX_CACHED_VIEWS = 1024


def _prefix(cache: dict[int, torch.Tensor], full: torch.Tensor, rows: int) -> torch.Tensor:
    view = cache.get(rows)
    if view is None:
        if len(cache) >= _MAX_CACHED_VIEWS:  # bounded: many SUM_LEN lengths would pile up
            cache.clear()
        # Outside inference mode, so the cached view can be written in place in and out of it.
        with torch.inference_mode(False):
            view = cache[rows] = full[:rows]
    return view


def dp_buffer_shapes(config: RuntimeConfig,
                     routing_top_k: int) -> dict[str, tuple[tuple[int, int], torch.dtype]]:
    """What a service with storage requests from its pool: name -> (shape, dtype). Pure; the
    planner sizes ``dp_buffers`` with it. ``routing_top_k`` 0: no routing buffer."""
    rows, local, d = config.max_global_tokens, config.max_tokens_per_rank, config.hidden_size
    shapes = {"dp_global_hidden": ((rows, d), config.dtype),
              "dp_local_hidden": ((local, d), config.dtype)}
    if routing_top_k:
        # ids and fp32 weights bit-cast, side by side: one gather carries both.
        shapes["dp_global_routing"] = ((rows, 2 * routing_top_k), torch.int32)
    return shapes


class DPBufferService:
    """The rank's gathered DP buffers and their per-step sizing (see the module docstring).

    Args:
        config: dp_size, hidden_size, dtype, device, max_tokens_per_rank come from it.
        pool: the rank's BufferPool; storage is requested from it once, here.
        rank: this rank's index in the DP group.
        group: the device process group of the gathers (None: default group / none at world 1).
        device: overrides ``config.device`` (e.g. ``cuda:LOCAL_RANK``).
        routing_top_k: also hold a routing buffer of ``2 * routing_top_k`` int32 per row.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        pool: BufferPool,
        rank: int,
        *,
        group: Any = None,
        device: torch.device | str | None = None,
        routing_top_k: int = 0,
        user: str = "dp_buffer",
    ) -> None:
        if not 0 <= rank < config.dp_size:
            raise ValueError(
                f"DPBufferService: rank {rank} is not in [0, dp_size={config.dp_size})"
            )
        self.config, self.rank, self.group = config, rank, group
        device = config.device if device is None else device
        full = {name: pool.request(name, shape, dtype, device, user)
                for name, (shape, dtype) in dp_buffer_shapes(config, routing_top_k).items()}
        self._full = full
        self._key: tuple | None = None
        self._plan: Any = None  # the plan the buffers were last laid out from (set_from_plan)
        # Row-prefix views by length, made once: slicing costs ~1.5 us a step, a lookup ~0.1 us.
        self._views: dict[str, dict[int, torch.Tensor]] = {name: {} for name in full}
        self._step: dict[str, torch.Tensor] = {}
        self.set_dp_buffer_len(0, 0, True, (0,) * config.dp_size)

    # -- sizing ----------------------------------------------------------------------------------
    def set_dp_buffer_len(
        self,
        global_dp_buffer_len: int,
        local_dp_buffer_len: int,
        is_max_len: bool,
        global_num_tokens_cpu: Sequence[int],
    ) -> DPBufferLayout:
        """Size this step's buffers; returns the layout (rules and errors: ``dp_buffer_layout``).

        Repeating the previous step's arguments costs one tuple comparison.
        """
        self._plan = None
        key = (
            global_dp_buffer_len,
            local_dp_buffer_len,
            bool(is_max_len),
            tuple(global_num_tokens_cpu),
        )
        if key == self._key:
            return self.layout
        cfg = self.config
        layout = dp_buffer_layout(
            *key, rank=self.rank, dp_size=cfg.dp_size, max_tokens_per_rank=cfg.max_tokens_per_rank
        )
        self.layout = layout
        for name, full in self._full.items():
            rows = (layout.local_dp_buffer_len if name == "dp_local_hidden"
                    else layout.global_dp_buffer_len)
            self._step[name] = _prefix(self._views[name], full, rows)
        self._key = key
        return layout

    def set_from_plan(self, plan: Any) -> DPBufferLayout:
        """Lay the buffers out for ``plan`` (a ``dispatcher.StepPlanLike``: the counts,
        ``runtime_max_tokens_per_rank`` and ``is_max_len``) as ``plan_step`` sizes a step: MAX_LEN
        slots of ``runtime_max_tokens_per_rank`` rows, or SUM_LEN live rows. Returns the layout.

        The all-gather dispatcher calls it in every sparse layer with the forward's plan: the
        plan it was last given costs one identity check (plans are frozen).
        """
        if plan is self._plan:
            return self.layout
        counts = plan.global_num_tokens_cpu
        if plan.is_max_len:
            rows = plan.runtime_max_tokens_per_rank
            layout = self.set_dp_buffer_len(rows * len(counts), rows, True, counts)
        else:
            # A count list of the wrong length is refused by dp_buffer_layout, naming dp_size.
            own = counts[self.rank] if len(counts) == self.config.dp_size else 0
            layout = self.set_dp_buffer_len(sum(counts), own, False, counts)
        self._plan = plan
        return layout

    # -- views -----------------------------------------------------------------------------------
    def _buffer(self, name: str) -> torch.Tensor:
        view = self._step.get(name)
        if view is None:
            raise RuntimeError(f"DPBufferService: no {name!r} storage (the service was built with "
                               "routing_top_k=0)")
        return view

    def _local_storage(self) -> torch.Tensor:
        return self._full["dp_local_hidden"]

    def get_global_buffer(self) -> torch.Tensor:
        """The gathered hidden buffer of this step: [G, D], a view of pool storage."""
        return self._buffer("dp_global_hidden")

    def get_local_buffer(self) -> torch.Tensor:
        """This rank's local buffer of this step: [L, D], a view of pool storage."""
        return self._buffer("dp_local_hidden")

    def get_global_routing(self) -> torch.Tensor:
        """The gathered routing rows of this step: [G, 2K] int32 (ids, then fp32 weight bits)."""
        return self._buffer("dp_global_routing")

    @property
    def global_dp_buffer_len(self) -> int:
        return self.layout.global_dp_buffer_len

    @property
    def local_dp_buffer_len(self) -> int:
        return self.layout.local_dp_buffer_len

    @property
    def is_max_len(self) -> bool:
        return self.layout.is_max_len

    @property
    def offset(self) -> int:
        """This rank's first row in the gathered buffer."""
        return self.layout.offset

    @property
    def offsets(self) -> tuple[int, ...]:
        """Each rank's first row in the gathered buffer."""
        return self.layout.offsets

    @property
    def global_num_tokens(self) -> tuple[int, ...]:
        """Each rank's live rows this step."""
        return self.layout.global_num_tokens

    # -- data movement ---------------------------------------------------------------------------
    def gather(self, local_TD: torch.Tensor) -> torch.Tensor:
        """Gather every rank's rows into the global buffer; returns it ([G, D]).

        ``local_TD``: this rank's live rows first, ``T <=`` its slot (the rest of the slot is
        sent as zeros). A collective over ``group``.
        """
        return dp_gather(self.get_global_buffer(), local_TD, self.layout, self.group)

    def gather_routing(self, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                       invalid_id: int) -> torch.Tensor:
        """Gather every rank's routing rows; returns the [G, 2K] int32 buffer.

        Row ``t`` of this rank's slot gets ``ids_TK[t]`` and the bits of ``weights_TK[t]`` (fp32);
        the slot's padding rows get ``invalid_id`` with weight 0, so no expert serves them. A
        collective over ``group``.
        """
        global_GK2 = self.get_global_routing()
        lay, k = self.layout, ids_TK.shape[1]
        t = ids_TK.shape[0]
        start = lay.offsets[lay.rank]
        rows = lay.local_dp_buffer_len if lay.is_max_len else lay.num_tokens
        slot = global_GK2[start : start + rows]
        slot[:t, :k] = ids_TK
        slot[:t, k:] = weights_TK.float().view(torch.int32)
        if t < rows:
            slot[t:, :k] = invalid_id
            slot[t:, k:] = 0
        return dp_gather(global_GK2, slot, lay, self.group)

    def scatter(
        self, global_GD: torch.Tensor | None = None, *, num_rows: int | None = None
    ) -> torch.Tensor:
        """This rank's rows of ``global_GD`` (default: the global buffer), copied into the local
        buffer; returns ``[num_rows or global_num_tokens[rank], D]``. Not a collective.
        """
        out = dp_scatter(
            self.get_global_buffer() if global_GD is None else global_GD,
            self.layout,
            out_TD=self._local_storage(),
        )
        return out if num_rows is None else out[:num_rows]

    def reduce_scatter(
        self, global_GD: torch.Tensor, *, num_rows: int | None = None
    ) -> torch.Tensor:
        """Sum ``global_GD`` over ranks and return this rank's rows (in the local buffer).

        A collective (the MoE combine); what moves follows the padding mode (``dp_reduce_scatter``).
        """
        out = dp_reduce_scatter(global_GD, self.layout, self.group, out_TD=self._local_storage())
        return out if num_rows is None else out[:num_rows]
