"""StepPlan: the rank-invariant geometry of one DP step, and ``plan_step``, the pure function
that computes it from the gathered table.

Every rank calls ``plan_step`` on the same table with the same config, so every rank holds the
same plan; nothing in it comes from local state. ``fingerprint`` is a cheap hash of all of it,
which ranks compare (see ``step_sync``) because a disagreement would otherwise surface as an
illegal memory access or a hang inside a collective.

What ``plan_step`` decides, in order:

1. Validation: a count over ``config.max_tokens_per_rank``, a negative count, more logprob rows
   than tokens, an unknown mode, or IDLE reported with tokens raises ValueError naming the
   rank, the value and the limit (no silent truncation).
2. All ranks empty: ``skip`` — every rank skips the step together (no forward, no collective).
3. Per-rank mode: IDLE for an empty rank (it joins every collective with zero rows), else the
   mode it reported. ``global_num_tokens_cpu``: each count aligned up to ``attn_tp_size``.
   ``is_extend``: some rank with tokens extends. A rank whose step is mixed (decode rows and
   prefill chunks in one EXTEND batch, serving/scheduler.py) reports EXTEND with all its tokens,
   so a step where it prefills while another rank only decodes is an extend step with modes
   EXTEND and DECODE: the decoding rank runs its rows as an extend batch of one-token requests
   (``forward_batch.decode_as_extend``), so every rank replays the extend pieces at one bucket
   (rule 4), and the padding rule treats the step as extend.
   Its count is at most ``chunked_prefill_size`` (its decode rows count against it), so the
   limit of rule 1 and every buffer sized from ``max_tokens_per_rank`` cover it.
4. Graph bucket: the smallest capture size >= the max aligned count, only when every rank that
   has work reports ``can_run_graph`` (an IDLE rank replays the graph with zero live rows) and
   the max fits the largest capture size; else None
   (eager). The sizes are ``cuda_graph_bs`` for a decode step and ``cuda_graph_extend_tokens``
   (token buckets of the extend graphs) for an extend step.
5. Padding: ``choose_padding_mode`` (rule table in ``dp_runtime.sync.padding_mode``).
6. Sizes: with a bucket ``B``: MAX_LEN, ``B`` rows per rank, ``global_dp_buffer_len = B * dp``,
   ``runtime_max_tokens_per_rank = B``. Eager MAX_LEN: ``M = max(aligned)`` rows per rank,
   ``M * dp`` global. SUM_LEN: each rank its aligned count, ``sum(aligned)`` global,
   ``runtime_max_tokens_per_rank = M``.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from dp_runtime.config import RuntimeConfig, align_up
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.sync.padding_mode import PaddingMode, choose_padding_mode
from dp_runtime.sync.step_table import CODE_MODES, MODE_CODES, StepTable

__all__ = ["StepPlan", "plan_step"]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The geometry of one step, identical on every rank (fields: see the module docstring).

    ``raw_num_tokens``: the reported counts; ``global_num_tokens_cpu``: aligned to attn_tp_size
    (the rows each rank occupies in a SUM_LEN buffer); ``local_dp_buffer_lens``: the rows of each
    rank's local buffer (MAX_LEN: the padded length; SUM_LEN: its aligned count).
    ``fingerprint`` is computed from every other field (``dataclasses.replace`` recomputes it).
    """

    forward_modes: tuple[ForwardMode, ...]
    raw_num_tokens: tuple[int, ...]
    global_num_tokens_cpu: tuple[int, ...]
    global_num_tokens_for_logprob_cpu: tuple[int, ...]
    padding: PaddingMode
    global_dp_buffer_len: int
    local_dp_buffer_lens: tuple[int, ...]
    graph_bucket: int | None
    runtime_max_tokens_per_rank: int
    skip: bool
    is_extend: bool
    fingerprint: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        # Only ints, bools and tuples of them: their hashes are not salted per process (str and
        # bytes are, and hash(None) is an address before Python 3.12), so every rank computes
        # the same value for the same plan.
        key = (
            tuple(MODE_CODES[m] for m in self.forward_modes),
            self.raw_num_tokens,
            self.global_num_tokens_cpu,
            self.global_num_tokens_for_logprob_cpu,
            int(self.padding),
            self.global_dp_buffer_len,
            self.local_dp_buffer_lens,
            -1 if self.graph_bucket is None else self.graph_bucket,
            self.runtime_max_tokens_per_rank,
            self.skip,
            self.is_extend,
        )
        object.__setattr__(self, "fingerprint", hash(key))

    @property
    def dp_size(self) -> int:
        return len(self.global_num_tokens_cpu)

    @property
    def is_max_len(self) -> bool:
        return self.padding is PaddingMode.MAX_LEN

    def local_dp_buffer_len(self, rank: int) -> int:
        """The rows of ``rank``'s local DP buffer this step."""
        return self.local_dp_buffer_lens[rank]

    def describe(self) -> str:
        """A one-line summary for logs and error messages."""
        return (
            f"StepPlan(skip={self.skip}, padding={self.padding.name}, "
            f"counts={list(self.global_num_tokens_cpu)}, global_len={self.global_dp_buffer_len}, "
            f"bucket={self.graph_bucket}, runtime_max={self.runtime_max_tokens_per_rank}, "
            f"extend={self.is_extend}, fingerprint={self.fingerprint})"
        )


def _checked_modes(
    table: StepTable, config: RuntimeConfig
) -> tuple[tuple[ForwardMode, ...], bool, bool]:
    """Validate every rank's report; return the per-rank modes (IDLE where empty), whether every
    rank with tokens can run a graph, and whether one extends. One pass: this runs every step."""
    if table.dp_size != config.dp_size:
        raise ValueError(
            f"step table has {table.dp_size} ranks, config.dp_size is {config.dp_size}"
        )
    limit = config.max_tokens_per_rank
    idle = ForwardMode.IDLE
    modes, graph_ok, extend = [], True, False
    rows = zip(
        table.num_tokens,
        table.num_tokens_for_logprob,
        table.forward_modes,
        table.can_run_graph,
        table.is_extend,
        strict=True,
    )
    for rank, (n, lp, code, can_graph, is_extend) in enumerate(rows):
        mode = CODE_MODES.get(code)
        if type(n) is not int or type(lp) is not int:  # exchanged rows hold ints; a float is a bug
            bad = ("num_tokens", n) if type(n) is not int else ("num_tokens_for_logprob", lp)
            raise ValueError(f"rank {rank} reported {bad[0]}={bad[1]!r}; it must be an int")
        if not 0 <= n <= limit:
            raise ValueError(
                f"rank {rank} reported num_tokens={n}; it must be in [0, "
                f"max_tokens_per_rank={limit}] (max(chunked_prefill_size, max_running_requests) "
                "aligned to attn_tp_size)"
            )
        if not 0 <= lp <= n:
            raise ValueError(
                f"rank {rank} reported num_tokens_for_logprob={lp}; it must be in [0, "
                f"num_tokens={n}]"
            )
        if mode is None:
            raise ValueError(f"rank {rank} reported forward mode {code}, not a ForwardMode")
        if n == 0:
            # An IDLE rank replays a graph with zero live rows and extends nothing: its flags
            # neither veto a bucket nor make the step an extend step.
            modes.append(idle)
            continue
        if mode is idle:
            raise ValueError(f"rank {rank} reported forward mode IDLE with num_tokens={n}")
        modes.append(mode)
        graph_ok = graph_ok and can_graph
        extend = extend or is_extend
    return tuple(modes), graph_ok, extend


def _skip_plan(dp_size: int, logprob: tuple[int, ...]) -> StepPlan:
    zeros = (0,) * dp_size
    return StepPlan(
        forward_modes=(ForwardMode.IDLE,) * dp_size,
        raw_num_tokens=zeros,
        global_num_tokens_cpu=zeros,
        global_num_tokens_for_logprob_cpu=logprob,
        padding=PaddingMode.MAX_LEN,
        global_dp_buffer_len=0,
        local_dp_buffer_lens=zeros,
        graph_bucket=None,
        runtime_max_tokens_per_rank=0,
        skip=True,
        is_extend=False,
    )


def plan_step(table: StepTable, config: RuntimeConfig) -> StepPlan:
    """The StepPlan of the step whose gathered reports are ``table`` (rules: module docstring).

    Takes the table of every rank's report (rank order) and the config (dp_size, attn_tp_size,
    cuda_graph_bs capture sizes, dp_padding override, max_tokens_per_rank). Returns a frozen
    StepPlan. Pure: the same inputs give the same plan on every rank. Raises ValueError on a
    report outside the limits (naming the rank, the value and the limit).
    """
    modes, graph_ok, is_extend = _checked_modes(table, config)
    counts = table.num_tokens
    dp = len(counts)
    if not any(counts):
        return _skip_plan(dp, table.num_tokens_for_logprob)

    tp = config.attn_tp_size
    aligned = counts if tp == 1 else tuple(align_up(n, tp) for n in counts)
    max_n = max(aligned)

    bucket = None
    sizes = config.cuda_graph_extend_tokens if is_extend else config.cuda_graph_bs
    if graph_ok and sizes and max_n <= sizes[-1]:
        bucket = sizes[bisect_left(sizes, max_n)]

    padding = choose_padding_mode(aligned, is_extend, bucket is not None, config.dp_padding)
    if padding is PaddingMode.MAX_LEN:
        per_rank = max_n if bucket is None else bucket
        global_len, local_lens, runtime_max = per_rank * dp, (per_rank,) * dp, per_rank
    else:
        global_len, local_lens, runtime_max = sum(aligned), aligned, max_n

    return StepPlan(
        forward_modes=modes,
        raw_num_tokens=counts,
        global_num_tokens_cpu=aligned,
        global_num_tokens_for_logprob_cpu=table.num_tokens_for_logprob,
        padding=padding,
        global_dp_buffer_len=global_len,
        local_dp_buffer_lens=local_lens,
        graph_bucket=bucket,
        runtime_max_tokens_per_rank=runtime_max,
        skip=False,
        is_extend=is_extend,
    )
