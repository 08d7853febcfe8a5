"""What the capacity planner returns: per-rank components, KV capacity, the verdict, the JSON
schema ``dp-runtime.plan/5`` (keys: docs/planner.md), and the predicted-vs-measured rows of
``--measure``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from dp_runtime.config import RuntimeConfig
from dp_runtime.model.model_config import ModelConfig
from launch.plan_input import PlanInput

__all__ = [
    "COMPONENTS",
    "MEASURED_COMPONENTS",
    "SCHEMA",
    "CapacityPlan",
    "ComparisonRow",
    "Components",
    "GatheredRows",
    "KVCapacity",
    "compare_measured",
]

SCHEMA = "dp-runtime.plan/5"
# Every component, in the order of the table and of the JSON.
COMPONENTS = (
    "weights", "kv_cache", "dp_buffers", "dispatcher_workspace", "graph_inputs", "penalty_counts",
    "graph_pool", "activation_peak", "allocator_cache", "nccl", "cuda_context",
)
# The components RankWorker.memory_report() measures, under the same names (activation_peak:
# its profile step; allocator_cache: torch's reserved memory beyond the weights and its pool, and
# cuda_context: the memory outside torch, both when it sizes the KV cache).
MEASURED_COMPONENTS = tuple(c for c in COMPONENTS if c != "nccl")


@dataclass(frozen=True)
class Components:
    """Device bytes of one rank, by component (names: ``COMPONENTS``)."""

    weights_bytes: int
    kv_cache_bytes: int
    dp_buffers_bytes: int
    dispatcher_workspace_bytes: int
    graph_inputs_bytes: int
    penalty_counts_bytes: int
    graph_pool_bytes: int
    activation_peak_bytes: int
    allocator_cache_bytes: int
    nccl_bytes: int
    cuda_context_bytes: int
    # all_gather / all_to_all: the workspace is the peak of per-step buffers, live only inside a
    # step, and so already part of activation_peak (and graph_pool at the bucket size).
    dispatcher_workspace_transient: bool = False

    def as_dict(self) -> dict[str, int]:
        """``{component name: bytes}`` in ``COMPONENTS`` order."""
        return {f.name.removesuffix("_bytes"): getattr(self, f.name) for f in fields(self)
                if f.name.endswith("_bytes")}

    @property
    def total_bytes(self) -> int:
        """Every component, a transient dispatcher workspace counted once (in activation_peak)."""
        total = sum(self.as_dict().values())
        return total - (self.dispatcher_workspace_bytes if self.dispatcher_workspace_transient
                        else 0)


@dataclass(frozen=True)
class GatheredRows:
    """Rows (and bytes) of the gathered DP buffer one step uses under one padding mode, for a
    step where one rank is full and the others idle, and one where every rank is full (the
    per-step worst case: the allocated buffer). MAX_LEN pads every rank to the longest."""

    padding: str
    one_rank_full_rows: int
    one_rank_full_bytes: int
    all_ranks_full_rows: int
    all_ranks_full_bytes: int


@dataclass(frozen=True)
class KVCapacity:
    """The KV cache the remaining memory holds (page size 1: one slot per token)."""

    bytes_per_token: int
    slots: int
    requests_at_full_context: int
    needed_slots: int  # max_running_requests * kv_tokens_per_request

    @property
    def tokens(self) -> int:
        return self.slots


@dataclass(frozen=True)
class CapacityPlan:
    """The plan of one rank (see the module docstring); ``to_dict`` is the JSON schema."""

    input: PlanInput
    runtime: RuntimeConfig
    model: ModelConfig
    world_size: int
    ep_rank: int
    local_experts: int
    dispatcher: str
    dispatcher_reason: str
    cuda_graphs: bool
    cuda_graphs_reason: str
    context_len: int
    kv_tokens_per_request: int
    components: Components
    dp_buffer_modes: tuple[GatheredRows, ...]
    kv: KVCapacity
    graph_reserve_bytes: int  # what the rank sets aside for its graphs before sizing the KV cache
    headroom_bytes: int  # what the rank leaves of the memory its KV cache could have taken
    fits: bool
    reason: str
    largest_max_running_requests: int

    @property
    def gpu_mem_bytes(self) -> int:
        return self.input.gpu_mem_bytes

    @property
    def total_bytes(self) -> int:
        return self.components.total_bytes

    @property
    def free_bytes(self) -> int:
        """GPU memory left after every component: the headroom and what the graphs' reserve
        holds beyond their estimate; negative: over."""
        return self.gpu_mem_bytes - self.total_bytes

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON values, schema ``SCHEMA`` (keys documented in docs/planner.md)."""
        inp, rt = self.input, self.runtime
        graph_bs = (inp.cuda_graph_bs if isinstance(inp.cuda_graph_bs, str)
                    else list(inp.cuda_graph_bs))
        return {
            "schema": SCHEMA,
            "input": {
                "model": inp.model, "dtype": inp.dtype, "kv_cache_dtype": inp.kv_cache_dtype,
                "dp_size": inp.dp_size, "ep_size": inp.ep_size,
                "gpu": inp.gpu_name, "gpu_mem_bytes": inp.gpu_mem_bytes, "nvlink": inp.nvlink,
                "max_running_requests": inp.max_running_requests,
                "chunked_prefill_size": inp.chunked_prefill_size, "cuda_graph_bs": graph_bs,
                "context_len": inp.context_len, "dispatcher": inp.dispatcher,
                "use_cuda_graph": inp.use_cuda_graph,
                "kv_tokens_per_request": inp.kv_tokens_per_request,
                "kv_mem_fraction": inp.kv_mem_fraction, "quantization": inp.quantization,
            },
            "resolved": {
                "world_size": self.world_size, "ep_size": rt.ep_size, "ep_rank": self.ep_rank,
                "local_experts": self.local_experts, "dtype": str(rt.dtype).removeprefix("torch."),
                "kv_cache_dtype": str(rt.kv_cache_dtype).removeprefix("torch."),
                "weights": "fp8" if self.model.quantization is not None else "model dtype",
                "dispatcher": self.dispatcher, "dispatcher_reason": self.dispatcher_reason,
                "dispatcher_workspace_transient": self.components.dispatcher_workspace_transient,
                "cuda_graphs": self.cuda_graphs, "cuda_graphs_reason": self.cuda_graphs_reason,
                "cuda_graph_bs": list(rt.cuda_graph_bs),
                "max_tokens_per_rank": rt.max_tokens_per_rank,
                "max_global_tokens": rt.max_global_tokens, "context_len": self.context_len,
                "kv_tokens_per_request": self.kv_tokens_per_request,
            },
            "components_bytes": self.components.as_dict(),
            "dp_buffer_modes": {
                m.padding: {k: v for k, v in vars(m).items() if k != "padding"}
                for m in self.dp_buffer_modes
            },
            "kv": {
                "bytes_per_token": self.kv.bytes_per_token, "slots": self.kv.slots,
                "tokens": self.kv.tokens,
                "requests_at_full_context": self.kv.requests_at_full_context,
                "needed_slots": self.kv.needed_slots,
            },
            "gpu_mem_bytes": self.gpu_mem_bytes,
            "total_bytes": self.total_bytes,
            "graph_reserve_bytes": self.graph_reserve_bytes,
            "headroom_bytes": self.headroom_bytes,
            "free_bytes": self.free_bytes,
            "fits": self.fits,
            "reason": self.reason,
            "largest_max_running_requests": self.largest_max_running_requests,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


@dataclass(frozen=True)
class ComparisonRow:
    """One component: predicted and measured bytes; ``error_pct = 100 * (predicted - measured) /
    measured`` (None when it cannot be computed: not measured, or measured 0 with predicted > 0)."""

    component: str
    predicted_bytes: int
    measured_bytes: int | None
    error_pct: float | None


def compare_measured(plan: CapacityPlan, measured: Mapping[str, int]) -> list[ComparisonRow]:
    """Rows for ``MEASURED_COMPONENTS`` in order, from the plan and a ``{component: bytes}``
    mapping (``RankWorker.memory_report()``); a missing component has ``measured_bytes=None``."""
    predicted = plan.components.as_dict()
    rows = []
    for name in MEASURED_COMPONENTS:
        want, got = predicted[name], measured.get(name)
        if got is None:
            error = None
        elif got == 0:
            error = 0.0 if want == 0 else None
        else:
            error = 100.0 * (want - got) / got
        rows.append(ComparisonRow(name, want, None if got is None else int(got), error))
    return rows
