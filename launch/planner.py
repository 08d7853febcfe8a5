"""The capacity planner: what one rank of a DP-attention / EP-MoE job allocates, and whether it
fits.

``plan_capacity(PlanInput) -> CapacityPlan``. Every number comes from the sizing functions the
runtime allocates with (``dp_runtime.memory_sizing``, ``dispatcher.sizing``, the registry
builders and the DP buffer service on the meta device); the graph memory and the largest
step's peak are documented estimates (``dp_runtime.memory_estimates``) that
``dp-runtime plan --measure`` checks on a GPU. The inputs go through ``RankSpec.create`` (and
so ``RuntimeConfig``): an invalid combination raises the runtime's own ValueError.

The rank planned is EP rank 0, which holds the most experts when they do not divide evenly
(``ExpertPartition`` gives the remainder to the first ranks). Its KV cache is sized by the rank's
own rule (``dp_runtime/rank_memory.py``, with the same functions): of what is free when it sizes the
cache (the GPU less the CUDA context, NCCL, the weights, the DP buffers, a persistent dispatcher
workspace, the graph inputs, the penalties' count and mark tables and what else torch holds then,
the RoPE table and a cuBLAS workspace, ``memory_estimates.allocator_cache_bytes``),
``memory_sizing.kv_budget_bytes`` takes ``kv_mem_fraction`` after the largest step's peak and the
graphs' reserve (``memory_estimates.graph_reserve_bytes``), and ``kv_slots_for_budget`` turns it
into slots.

Fit rule: the plan fits when that KV cache holds at least ``max_running_requests *
kv_tokens_per_request`` token slots (default ``kv_tokens_per_request = context_len``: every
running request can reach its full context at once, with no preemption) and one request of
``context_len`` (less, and the rank refuses to start). ``largest_max_running_requests`` is the
largest value for which that holds with every other input unchanged, found by bisection (the
rule is monotone: a larger max_running_requests needs more KV and never less of anything else).

JSON: ``CapacityPlan.to_dict()`` / ``to_json()``, schema ``dp-runtime.plan/5`` (keys:
docs/planner.md). The input lives in ``plan_input.py``, the result types in ``plan_result.py``,
the GPU table in ``gpu_specs.py``; all are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dispatcher.partition import ExpertPartition
from dp_runtime import memory_estimates as me
from dp_runtime import memory_sizing as ms
from dp_runtime.choices import Choices, resolve_choices
from dp_runtime.config import RuntimeConfig
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.sync.padding_mode import PaddingMode
from launch.gpu_specs import GIB, GPUS, GpuSpec, gpu_spec
from launch.plan_input import PlanInput
from launch.plan_result import (
    COMPONENTS,
    MEASURED_COMPONENTS,
    SCHEMA,
    CapacityPlan,
    ComparisonRow,
    Components,
    GatheredRows,
    KVCapacity,
    compare_measured,
)

__all__ = [
    "COMPONENTS",
    "GPUS",
    "MEASURED_COMPONENTS",
    "SCHEMA",
    "CapacityPlan",
    "ComparisonRow",
    "Components",
    "GatheredRows",
    "GpuSpec",
    "KVCapacity",
    "PlanInput",
    "compare_measured",
    "gpu_spec",
    "largest_max_running_requests",
    "plan_capacity",
    "plan_choices",
]


# -- resolution rules: the runtime's own (dp_runtime.choices) -------------------------------------
def plan_choices(inp: PlanInput, rt: RuntimeConfig, head_dim: int) -> Choices:
    """What the ranks of ``inp`` would run, by ``resolve_choices``: on CUDA, with flashinfer
    importable, and FlashInfer's MoeAlltoAll usable exactly when the GPUs share NVLink."""
    return resolve_choices(
        dispatcher=inp.dispatcher, use_cuda_graph=inp.use_cuda_graph, attention="auto",
        world_size=rt.world_size, device_type="cuda", dtype=rt.dtype, head_dim=head_dim,
        capture_sizes=tuple(rt.cuda_graph_bs),
        flashinfer_dispatch=(inp.nvlink, "one NVLink node assumed" if inp.nvlink
                             else "the GPUs have no NVLink"),
        flashinfer_importable=True,
    )


def _gib_text(nbytes: int) -> str:
    return f"{nbytes / GIB:.2f} GiB"


# -- the plan ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Fixed:
    """What does not depend on max_running_requests, computed once per plan."""

    cfg: ModelConfig
    kv_bytes_per_token: int
    ep_rank: int
    local_experts: int
    weights_bytes: int
    context_len: int
    kv_tokens_per_request: int


def _fixed(inp: PlanInput) -> _Fixed:
    spec = inp.rank_spec()
    cfg, rt = spec.model_config(), spec.runtime
    part = ExpertPartition(cfg.num_experts, rt.ep_size)
    # The rank with the most experts (the first ones when they do not divide evenly).
    ep_rank = max(range(rt.ep_size), key=part.num_local)
    ctx = spec.context_len
    tpr = ctx if inp.kv_tokens_per_request is None else inp.kv_tokens_per_request
    if tpr > ctx:
        raise ValueError(f"kv_tokens_per_request={tpr} exceeds context_len={ctx}")
    return _Fixed(cfg, ms.kv_bytes_per_token(cfg, rt.kv_cache_dtype), ep_rank,
                  part.num_local(ep_rank),
                  ms.weight_bytes_per_rank(cfg, rt.dtype, ep_rank, rt.ep_size), ctx, tpr)


def _evaluate(inp: PlanInput, fixed: _Fixed, max_running_requests: int) -> CapacityPlan:
    """The plan at ``max_running_requests`` (largest_max_running_requests left at -1)."""
    rt = inp.rank_spec(max_running_requests).runtime
    cfg, mrr, ctx = fixed.cfg, rt.max_running_requests, fixed.context_len
    choices = plan_choices(inp, rt, cfg.head_dim)
    graphs, graphs_reason = choices.graphs, choices.graphs_reason
    dispatcher, dispatcher_reason = choices.dispatcher, choices.dispatcher_reason
    moe = (cfg.hidden_size, cfg.top_k, rt.dtype)
    graph_pool = me.rank_graph_pool_bytes_estimate(cfg, rt, ctx, attention=choices.attention,
                                                   graphs=graphs)
    fixed_parts = dict(
        weights_bytes=fixed.weights_bytes,
        dp_buffers_bytes=ms.dp_buffer_bytes(rt, dispatcher, cfg.top_k),
        dispatcher_workspace_bytes=ms.dispatcher_workspace_bytes(dispatcher, rt.ep_size,
                                                                 rt.max_tokens_per_rank, *moe),
        graph_inputs_bytes=ms.graph_input_bytes(rt, decode_graphs=graphs),
        penalty_counts_bytes=ms.penalty_count_bytes(rt, cfg.vocab_size),
        graph_pool_bytes=graph_pool,
        activation_peak_bytes=me.largest_step_bytes_estimate(cfg, rt, ctx,
                                                             attention=choices.attention,
                                                             dispatcher=dispatcher),
        allocator_cache_bytes=me.allocator_cache_bytes(cfg),
        nccl_bytes=ms.nccl_overhead_bytes(rt.dp_size, rt.ep_size),
        cuda_context_bytes=ms.cuda_context_bytes("cuda"),
    )
    transient = ms.dispatcher_transient(dispatcher)
    gpu = inp.gpu_mem_bytes
    # What the rank holds when it sizes its KV cache: not the graphs (captured after it), not the
    # step's transients (a transient workspace is one of them), not the cache.
    held = sum(v for k, v in fixed_parts.items()
               if k not in ("graph_pool_bytes", "activation_peak_bytes"))
    held -= fixed_parts["dispatcher_workspace_bytes"] if transient else 0
    reserve = me.graph_reserve_bytes(graph_pool)
    peak = fixed_parts["activation_peak_bytes"]
    budget = ms.kv_budget_bytes(gpu - held, peak, reserve, inp.kv_mem_fraction)
    slots = ms.kv_slots_for_budget(cfg, rt.kv_cache_dtype, budget, mrr, ctx) if budget > 0 else 0
    kv_bytes = ms.kv_cache_bytes(cfg, rt.kv_cache_dtype, slots, mrr, ctx) if slots > 0 else 0
    kv = KVCapacity(fixed.kv_bytes_per_token, slots, slots // ctx,
                    mrr * fixed.kv_tokens_per_request)
    components = Components(kv_cache_bytes=kv_bytes, dispatcher_workspace_transient=transient,
                            **fixed_parts)
    fits, reason = _verdict(components, kv, gpu, reserve, fixed, mrr, inp.kv_mem_fraction)
    return CapacityPlan(
        input=inp, runtime=rt, model=cfg, world_size=rt.world_size, ep_rank=fixed.ep_rank,
        local_experts=fixed.local_experts, dispatcher=dispatcher,
        dispatcher_reason=dispatcher_reason,
        cuda_graphs=graphs, cuda_graphs_reason=graphs_reason, context_len=ctx,
        kv_tokens_per_request=fixed.kv_tokens_per_request, components=components,
        dp_buffer_modes=_dp_buffer_modes(rt, cfg.top_k), kv=kv, graph_reserve_bytes=reserve,
        headroom_bytes=gpu - held - peak - reserve - kv_bytes, fits=fits, reason=reason,
        largest_max_running_requests=-1,
    )


def _verdict(c: Components, kv: KVCapacity, gpu: int, reserve: int, fixed: _Fixed, mrr: int,
             fraction: float) -> tuple[bool, str]:
    others = {k: v for k, v in c.as_dict().items() if k != "kv_cache"}
    if c.dispatcher_workspace_transient:
        others.pop("dispatcher_workspace")
    outside = c.cuda_context_bytes + c.nccl_bytes
    if c.weights_bytes + outside > gpu:
        return False, (f"weights alone are {_gib_text(c.weights_bytes)} on EP rank "
                       f"{fixed.ep_rank} ({fixed.local_experts} experts), over the GPU's "
                       f"{_gib_text(gpu)} less {_gib_text(outside)} of CUDA context and NCCL")
    if kv.slots < 1 or kv.slots < kv.needed_slots or kv.slots < fixed.context_len:
        largest = max(others, key=others.__getitem__)
        need = (f"max_running_requests {mrr} x {fixed.kv_tokens_per_request} tokens needs "
                f"{kv.needed_slots}"
                if kv.slots < kv.needed_slots
                else f"one request of context_len {fixed.context_len} needs more: "
                "the rank refuses to start")
        return False, (f"the KV cache gets {kv.slots} token slots, {need} (other components "
                       f"{_gib_text(sum(others.values()))}, "
                       f"largest: {largest} {_gib_text(others[largest])}; "
                       f"graphs' reserve {_gib_text(reserve)}; kv_mem_fraction {fraction:g})")
    return True, (f"the KV cache holds {kv.slots} tokens ({kv.requests_at_full_context} requests "
                  f"at full context {fixed.context_len}); {kv.needed_slots} needed")


def _dp_buffer_modes(rt: RuntimeConfig, top_k: int) -> tuple[GatheredRows, ...]:
    p, dp = rt.max_tokens_per_rank, rt.dp_size
    # A gathered row: the hidden state and its routing (top-k int32 ids and fp32 weights).
    row_bytes = rt.hidden_size * ms.dtype_bytes(rt.dtype) + 8 * top_k
    one_full, all_full = (p,) + (0,) * (dp - 1), (p,) * dp
    out = []
    for mode in (PaddingMode.MAX_LEN, PaddingMode.SUM_LEN):
        one = ms.dp_gathered_rows(one_full, mode, p)
        every = ms.dp_gathered_rows(all_full, mode, p)
        out.append(GatheredRows(mode.name.lower(), one, one * row_bytes, every, every * row_bytes))
    return tuple(out)


def _search_floor(inp: PlanInput) -> int:
    # Explicit capture sizes need max_running_requests >= the largest (RuntimeConfig's rule).
    if isinstance(inp.cuda_graph_bs, str) or not inp.cuda_graph_bs:
        return 1
    return max(1, max(inp.cuda_graph_bs))


def _largest(inp: PlanInput, fixed: _Fixed) -> int:
    lo = _search_floor(inp)
    if not _evaluate(inp, fixed, lo).fits:
        return 0
    # Past this the needed KV alone exceeds the GPU: certainly does not fit.
    hi = inp.gpu_mem_bytes // (fixed.kv_tokens_per_request * fixed.kv_bytes_per_token) + 1
    while hi - lo > 1:  # invariant: fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        if _evaluate(inp, fixed, mid).fits:
            lo = mid
        else:
            hi = mid
    return lo


def largest_max_running_requests(inp: PlanInput) -> int:
    """The largest max_running_requests that fits (the module docstring's rule) with every other
    input of ``inp`` unchanged; 0 when none does."""
    return _largest(inp, _fixed(inp))


def plan_capacity(inp: PlanInput) -> CapacityPlan:
    """The capacity plan of one rank for ``inp``.

    Raises ValueError (RankSpec's or RuntimeConfig's message) for an invalid combination, and
    FileNotFoundError for a checkpoint directory without config.json.
    """
    fixed = _fixed(inp)
    plan = _evaluate(inp, fixed, inp.max_running_requests)
    return replace(plan, largest_max_running_requests=_largest(inp, fixed))
