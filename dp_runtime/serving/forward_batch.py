"""ForwardBatch: what one forward of one rank reads (a minimal start; the model issue grows it).

Tensor fields are named like the registry slots (buffers/builders.py), so ``registry.fill`` and
``registry.view`` work on it by name. Shapes (T = tokens of this rank, B = requests):

    input_ids (T,) int64           positions (T,) int64            out_cache_loc (T,) int64
    req_pool_indices (B,) int64    seq_lens (B,) int64             seq_lens_cpu (B,) int64, CPU
    extend_seq_lens (B,) int64     extend_prefix_lens (B,) int64   (EXTEND only)
    mrope_positions (3, T) int64   input_embeds (T, hidden)        (optional inputs)

``seq_lens`` counts the KV tokens of each request including this step's new ones.
``plan`` is the step's StepPlan (every rank's counts, the padding, the bucket): the one plan the
sync produced, which the MoE dispatcher reads. It is not a registry slot: ``registry.view``
carries it over. The scheduler builds a batch without it; the rank worker makes the step's
batch once, ``dataclasses.replace(batch, plan=plan)``, and never writes the scheduler's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from dp_runtime.forward_mode import ForwardMode

__all__ = ["ForwardBatch", "capture_batch", "decode_as_extend", "idle_batch", "planned_batch"]


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    out_cache_loc: torch.Tensor | None = None
    req_pool_indices: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    num_token_non_padded: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    # Host copies of the extend lengths: attention backends plan on the host without a sync.
    extend_seq_lens_cpu: tuple[int, ...] | None = None
    extend_prefix_lens_cpu: tuple[int, ...] | None = None
    input_embeds: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None
    # The step's StepPlan (dispatcher.StepPlanLike). A captured graph keeps its capture plan,
    # the bucket on every rank, which is what its gathers were recorded with.
    plan: Any = None

    @property
    def num_tokens(self) -> int:
        """Tokens of this rank in this forward (0 for IDLE)."""
        for t in (self.input_ids, self.positions, self.input_embeds):
            if t is not None:
                return int(t.shape[0])
        return 0


def decode_as_extend(batch: ForwardBatch) -> ForwardBatch:
    """A DECODE batch as the EXTEND batch of the same tokens: each request one new token after
    its ``seq_lens - 1`` cached ones (a mixed step's decode rows, with no prompt behind them).
    Under DP, a rank that only decodes while another extends runs this, so that every rank of
    the step replays the extend pieces at one bucket (sync/step_plan.py). No host sync: the
    host lengths come from ``seq_lens_cpu``."""
    bs = batch.batch_size
    prefix_cpu = batch.seq_lens_cpu[:bs] - 1
    return dataclasses.replace(
        batch, forward_mode=ForwardMode.EXTEND, extend_seq_lens=torch.ones_like(batch.seq_lens),
        extend_prefix_lens=batch.seq_lens - 1, extend_seq_lens_cpu=(1,) * bs,
        extend_prefix_lens_cpu=tuple(prefix_cpu.tolist()))


def planned_batch(batch: ForwardBatch, plan: Any) -> ForwardBatch:
    """The step's batch: the scheduler's (never written) with the step's plan, a DECODE batch in
    EXTEND form where the plan is an extend step (another rank extends: ``decode_as_extend``)."""
    batch = dataclasses.replace(batch, plan=plan)
    return (decode_as_extend(batch) if plan.is_extend and batch.forward_mode is ForwardMode.DECODE
            else batch)


def idle_batch(device: torch.device | str, plan: Any) -> ForwardBatch:
    """An IDLE batch: no requests, every token field an empty tensor (not None), so a graph
    replay or an eager fill sees the same inputs as a live batch and pads every row."""
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return ForwardBatch(
        forward_mode=ForwardMode.IDLE,
        batch_size=0,
        input_ids=empty,
        positions=empty,
        out_cache_loc=empty,
        req_pool_indices=empty,
        seq_lens=empty,
        seq_lens_cpu=torch.empty(0, dtype=torch.int64),
        plan=plan,
    )


def capture_batch(
    bs: int,
    num_tokens: int,
    plan,
    *,
    device: torch.device | str,
    forward_mode: ForwardMode = ForwardMode.DECODE,
    seq_len_fill_value: int = 1,
    prefix_len: int = 0,
) -> ForwardBatch:
    """A dummy batch of ``bs`` requests to capture a graph with (``GraphRunner.capture_batch``).

    Every index points at the reserved padding targets (request row 0, KV slot 0) with length
    ``seq_len_fill_value``, so the capture's warm-up runs read and write nothing live. An
    EXTEND batch (extend graphs) spreads ``num_tokens`` new tokens over the ``bs`` requests as
    evenly as it can, each after ``prefix_len`` cached tokens (default none: a request's length
    is its new tokens; the prefix reads slot 0 too).
    """
    device = torch.device(device)
    zeros_t = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    lens = [seq_len_fill_value] * bs
    extend = {}
    if forward_mode is ForwardMode.EXTEND:
        if not 1 <= bs <= num_tokens:
            raise ValueError("capture_batch: an EXTEND batch needs 1 <= bs <= num_tokens, "
                             f"got {bs} and {num_tokens}")
        new = [num_tokens // bs + (i < num_tokens % bs) for i in range(bs)]
        extend = dict(extend_seq_lens=torch.tensor(new, dtype=torch.int64, device=device),
                      extend_prefix_lens=torch.full((bs,), prefix_len, dtype=torch.int64,
                                                    device=device),
                      extend_seq_lens_cpu=tuple(new), extend_prefix_lens_cpu=(prefix_len,) * bs)
        lens = [n + prefix_len for n in new]
    elif prefix_len:
        raise ValueError(f"capture_batch: prefix_len={prefix_len} needs an EXTEND batch")
    return ForwardBatch(
        forward_mode=forward_mode,
        batch_size=bs,
        input_ids=zeros_t,
        positions=zeros_t.clone(),
        out_cache_loc=zeros_t.clone(),
        req_pool_indices=torch.zeros(bs, dtype=torch.int64, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
        seq_lens_cpu=torch.tensor(lens, dtype=torch.int64),
        plan=plan,
        **extend,
    )
