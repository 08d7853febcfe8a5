"""dispatcher/: MoE token dispatch and combine over the EP group, and their buffer sizing.

Backends: local (world size 1), all-gather + reduce-scatter through the DP buffer service,
variable-split all-to-all (torch.distributed), and FlashInfer's MoeAlltoAll (imported lazily). See
docs/dispatcher.md.
"""

from dispatcher.all_gather import AllGatherDispatcher, AllGatherHandle, GatherBuffers
from dispatcher.all_to_all import AllToAllDispatcher, AllToAllHandle
from dispatcher.config import DispatcherConfig
from dispatcher.experts import (
    ExpertFn,
    ExpertInputs,
    SwiGLUExperts,
    reference_moe,
    run_local_experts,
)
from dispatcher.factory import DISPATCHER_KINDS, flashinfer_dispatch_verdict, make_dispatcher
from dispatcher.groups import EPGroup
from dispatcher.local import LocalDispatcher, LocalHandle
from dispatcher.partition import INVALID_EXPERT_ID, ExpertPartition
from dispatcher.plan import FixedPlan, StepPlanLike
from dispatcher.protocol import Dispatcher, DispatchResult, moe_forward
from dispatcher.sizing import (
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
    "GatherBuffers",
    "LocalDispatcher",
    "LocalHandle",
    "StepPlanLike",
    "SwiGLUExperts",
    "all_to_all_buffer_bytes",
    "barrier_with_timeout",
    "flashinfer_dispatch_verdict",
    "flashinfer_workspace_bytes_per_rank",
    "flashinfer_workspace_bytes_total",
    "make_dispatcher",
    "max_tokens_per_rank",
    "moe_forward",
    "reference_moe",
    "run_local_experts",
    "verify_plan_agreement",
]
