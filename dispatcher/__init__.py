"""dispatcher/: MoE token dispatch and combine over the EP group, and their buffer sizing.

Backends: all-gather + reduce-scatter, variable-split all-to-all (torch.distributed), and
FlashInfer's MoeAlltoAll (imported lazily). See docs/dispatcher.md.
"""

from dispatcher.all_gather import AllGatherDispatcher, AllGatherHandle, GatherFn
from dispatcher.all_to_all import AllToAllDispatcher, AllToAllHandle
from dispatcher.config import DispatcherConfig
from dispatcher.experts import (
    ExpertFn,
    ExpertInputs,
    SwiGLUExperts,
    reference_moe,
    run_local_experts,
)
from dispatcher.factory import (
    DISPATCHER_KINDS,
    KindChoice,
    make_dispatcher,
    resolve_dispatcher_kind,
)
from dispatcher.groups import EPGroup
from dispatcher.partition import INVALID_EXPERT_ID, ExpertPartition
from dispatcher.plan import FixedPlan, StepPlanLike
from dispatcher.protocol import Dispatcher, DispatchResult, moe_forward
from dispatcher.sizing import (
    all_gather_buffer_bytes,
    all_to_all_buffer_bytes,
    flashinfer_workspace_bytes_per_rank,
    flashinfer_workspace_bytes_total,
    max_tokens_per_rank,
)
from dispatcher.startup import DispatcherStartupError, barrier_with_timeout, verify_plan_agreement

__all__ = [
    "DISPATCHER_KINDS",
    "INVALID_EXPERT_ID",
    "AllGatherDispatcher",
    "AllGatherHandle",
    "AllToAllDispatcher",
    "AllToAllHandle",
    "DispatchResult",
    "Dispatcher",
    "DispatcherConfig",
    "DispatcherStartupError",
    "EPGroup",
    "ExpertFn",
    "ExpertInputs",
    "ExpertPartition",
    "FixedPlan",
    "GatherFn",
    "KindChoice",
    "StepPlanLike",
    "SwiGLUExperts",
    "all_gather_buffer_bytes",
    "all_to_all_buffer_bytes",
    "barrier_with_timeout",
    "flashinfer_workspace_bytes_per_rank",
    "flashinfer_workspace_bytes_total",
    "make_dispatcher",
    "max_tokens_per_rank",
    "moe_forward",
    "reference_moe",
    "resolve_dispatcher_kind",
    "run_local_experts",
    "verify_plan_agreement",
]
