"""The rank's CUDA graphs, captured once at start-up: decode batches per request bucket
(``graph.GraphRunner``) and extend steps per token bucket in pieces around attention
(``graph.PiecewiseRunner``), both reading inputs from registries of the rank's one pool and
sharing one graph memory pool. The capture plans come from ``plan_step``, the function every
step is planned with, so what a graph bakes in is what a step at its bucket agrees on; each
capture batch carries its plan into the forward, whose dispatcher lays out its buffers from it
(the runners know nothing of DP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from buffers import BufferPool, build_decode_registry, build_prefill_registry
from dp_runtime import memory_sizing as ms
from dp_runtime.config import RuntimeConfig
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.serving.forward_batch import capture_batch
from dp_runtime.sync.step_plan import StepPlan, plan_step
from dp_runtime.sync.step_table import StepTable
from graph import AttentionSplit, GraphRunner, PiecewiseRunner

__all__ = ["RankGraphs", "capture_plan", "capture_rank_graphs", "extend_capture_tokens"]


@dataclass
class RankGraphs:
    decode: GraphRunner | None
    extend: PiecewiseRunner | None
    # Device memory the captures left reserved, the backend's graph state (init_capture)
    # included; the registries are the pool's (graph inputs), not counted here.
    memory_bytes: int

    def destroy(self) -> None:
        """Extend pieces, then decode graphs (before the process groups go)."""
        if self.extend is not None:
            self.extend.destroy()
            self.extend = None
        if self.decode is not None:
            self.decode.destroy()
            self.decode = None


def capture_plan(cfg: RuntimeConfig, bucket: int, *, extend: bool = False) -> StepPlan:
    """The plan of a step in which every rank runs ``bucket`` (tokens of an extend step, or
    requests of a decode step)."""
    return plan_step(StepTable.from_counts([bucket] * cfg.dp_size, can_run_graph=True,
                                           is_extend=extend), cfg)


def extend_capture_tokens(cfg: RuntimeConfig, max_context_len: int) -> tuple[int, ...]:
    """The extend token buckets a rank captures: ``cfg.cuda_graph_extend_tokens`` less any whose
    capture batch (its tokens over at most ``max_running_requests`` requests) would need a
    request longer than ``max_context_len``: no step could fill it either."""
    mrr = cfg.max_running_requests
    return tuple(t for t in cfg.cuda_graph_extend_tokens if -(-t // min(t, mrr)) <= max_context_len)


def _reserved(device: torch.device) -> int:
    """torch's reserved memory with its free cached blocks handed back: what the graphs' pool
    holds counts (its free blocks included: a replay writes there), the default pool's cache
    does not. Reserved, not allocated: the extend pieces give their q/k/v back to the pool
    (graph/piecewise_runner.py), so the pool holds more than its live tensors."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def capture_rank_graphs(*, cfg: RuntimeConfig, forward: Callable[[Any], Any], split: AttentionSplit,
                        attention: Any, pool: BufferPool, device: torch.device,
                        max_context_len: int, show_progress: bool,
                        on_phase: Callable[[str], None]) -> RankGraphs:
    """Capture the decode buckets (``cfg.cuda_graph_bs``) and the extend token buckets
    (``extend_capture_tokens``; none: extend steps stay eager). ``memory_bytes``: the device
    memory this left reserved beyond the registries' device storage in the pool (``_reserved``)."""
    use_cuda = device.type == "cuda"
    on_phase("capturing graphs")
    # No graph path reads device-side counts (a graph always gathers MAX_LEN), so no registry
    # holds a global_num_tokens_gpu slot.
    sizes = cfg.cuda_graph_bs
    registry = build_decode_registry(sizes[-1], device, pool, dp_size=cfg.dp_size,
                                     register_global_num_tokens=False, user="decode_graph")
    decode = GraphRunner(
        forward, attention, registry, sizes,
        capture_batch=lambda bs, n, plan: capture_batch(bs, n, plan, device=device),
        capture_plan=lambda bucket: capture_plan(cfg, bucket), use_cuda_graph=use_cuda,
        show_progress=show_progress,
    )
    graphs = RankGraphs(decode, None, 0)
    before, pool_before = _reserved(device), ms.pool_device_bytes(pool)
    try:
        decode.capture()  # the runner's own count starts after the backend's init_capture: not used
        mrr = cfg.max_running_requests
        tokens = extend_capture_tokens(cfg, max_context_len)
        if tokens:
            registry = build_prefill_registry(min(tokens[-1], mrr), tokens[-1], device, pool,
                                              dp_size=cfg.dp_size, register_input_embeds=False,
                                              register_global_num_tokens=False, user="extend_graph")
            graphs.extend = PiecewiseRunner(
                forward, split, attention, registry, tokens, max_requests=mrr,
                capture_batch=lambda bs, n, plan: capture_batch(bs, n, plan, device=device,
                                                               forward_mode=ForwardMode.EXTEND),
                capture_plan=lambda bucket: capture_plan(cfg, bucket, extend=True),
                pool=decode.graph_pool, use_cuda_graph=use_cuda, show_progress=show_progress,
            )
            graphs.extend.capture()
    except BaseException:
        graphs.destroy()
        raise
    if use_cuda:
        graphs.memory_bytes = (_reserved(device) - before
                               - (ms.pool_device_bytes(pool) - pool_before))
    return graphs
