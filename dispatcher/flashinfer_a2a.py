"""FlashInfer dispatcher: ``flashinfer.comm.MoeAlltoAll`` (flashinfer-python 0.7.2.post1).

MoeAlltoAll writes each token straight into its destination ranks' workspaces over NVLink
(one-sided), once per distinct destination rank, and the combine kernel reads the partial sums
back from the peers' workspaces and adds them. The workspace (one per rank, mapped into every peer)
is sized for ``max_num_tokens = config.max_tokens_per_rank`` rows from each of ``ep_size`` ranks by
``sizing.flashinfer_workspace_bytes_per_rank`` (our dtype-aware mirror of
``moe_a2a_get_workspace_size_per_rank``), and passed to MoeAlltoAll explicitly.

Every step uses ``P = plan.runtime_max_tokens_per_rank`` rows per source rank in the receive
layout: the same on every rank (a rank using its local count instead would disagree with its peers
on where rows live: NaN or illegal memory access), ``>=`` local tokens, ``<= max_num_tokens``
(checked before any communication). Received rows past a source rank's count are padding; the
library's sanitize step rewrites their expert ids to ``INVALID_EXPERT_ID`` so experts skip them.
``expert_output_buffer`` returns the combine payload region of the workspace, so experts write
their outputs in place and combine skips the staging copy.

Handles for the memory exchange: FABRIC where the GPUs support it, else POSIX file descriptors
over a Unix socket, which only works with every EP rank on one host (FlashInfer checks hostnames).
The handle exchange and barriers run on the EP group's gloo ``cpu_group`` through FlashInfer's
``TorchDistBackend``. flashinfer is imported only when this dispatcher is built.

``MoeAlltoAll`` is marked deprecated in 0.7.1+ in favour of ``flashinfer.moe_ep``'s
``NVLinkOneSidedAlltoAll``, which wraps the same class the same way; we use the class directly
(with its DeprecationWarning silenced) to control sizing and the communicator.

Legend: ``T`` local tokens, ``P`` rows per source rank this step, ``R`` EP ranks,
``N = R*P`` received rows, ``K`` top-k, ``D`` hidden size.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from dispatcher.config import DispatcherConfig
from dispatcher.experts import ExpertInputs
from dispatcher.groups import EPGroup, default_device
from dispatcher.kind import DispatcherKind
from dispatcher.partition import INVALID_EXPERT_ID, ExpertPartition
from dispatcher.plan import StepPlanLike
from dispatcher.protocol import DispatchResult
from dispatcher.sizing import FLASHINFER_MAX_RANKS, dtype_bytes, flashinfer_workspace_bytes_per_rank
from dispatcher.startup import FirstStepGuard, warmup_round
from dispatcher.validate import check_combine_input, check_step

__all__ = ["FLASHINFER_TOP_K", "FlashInferDispatcher", "FlashInferHandle",
           "import_flashinfer_moe_a2a"]

# Top-k values the 0.7.2.post1 combine kernel is instantiated for (SWITCH_TOP_K in
# moeAlltoAllKernels.cu); any other value fails inside the library at the first combine.
FLASHINFER_TOP_K = (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 22)
# Hidden dtypes its combine accepts without quantization (toNvDataType).
_COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def import_flashinfer_moe_a2a() -> Any:
    """Import the FlashInfer classes this backend uses (MoeAlltoAll, Mapping, MnnvlConfig,
    TorchDistBackend) and return them as attributes of one frozen object.

    Raises ``ImportError`` with the install hint when flashinfer (or its cuda-python/pynvml
    dependencies) is missing.
    """
    try:
        from flashinfer.comm.comm_backend import TorchDistBackend
        from flashinfer.comm.mapping import Mapping
        from flashinfer.comm.mnnvl import MnnvlConfig
        from flashinfer.comm.trtllm_moe_alltoall import MoeAlltoAll
    except ImportError as exc:
        raise ImportError(
            "the flashinfer dispatcher needs flashinfer-python (0.7.2.post1 API): "
            f"pip install 'dp-runtime[gpu]' ({exc})"
        ) from exc
    return _FlashInferApi(MoeAlltoAll=MoeAlltoAll, Mapping=Mapping, MnnvlConfig=MnnvlConfig,
                          TorchDistBackend=TorchDistBackend)


def check_cuda_device(device: torch.device) -> None:
    """Raise ``ValueError`` unless ``device`` is a usable CUDA device (MoeAlltoAll is CUDA-only)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"the flashinfer dispatcher runs on CUDA, got device {device} "
                         f"(CUDA available: {torch.cuda.is_available()})")


def _on_device(device: torch.device):
    # MnnvlMemory maps the workspace on the current CUDA device.
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass(frozen=True)
class _FlashInferApi:
    MoeAlltoAll: Any
    Mapping: Any
    MnnvlConfig: Any
    TorchDistBackend: Any


@dataclass(frozen=True)
class FlashInferHandle:
    """What combine needs from a FlashInfer dispatch (the library keeps the rest in its state)."""

    dispatcher_id: int
    sequence: int
    num_tokens: int
    runtime_max_tokens_per_rank: int
    fingerprint: int


class FlashInferDispatcher(DispatcherKind):
    """Dispatch and combine through FlashInfer's MoeAlltoAll (see the module docstring)."""

    kind = "flashinfer"
    combine_is_identity = False
    cuda_only = True
    auto_order = 1  # the fastest where every EP rank can run it
    package = "flashinfer"
    install_hint = "pip install 'dp-runtime[gpu]'"

    @classmethod
    def auto_reason(cls, world_size: int, flashinfer_dispatch: tuple[bool, str],
                    graphs_on_cuda: bool) -> str | None:
        return ("auto: every EP rank can run FlashInfer's MoeAlltoAll" if flashinfer_dispatch[0]
                else None)

    @classmethod
    def workspace_bytes(cls, ep_size: int, max_tokens_per_rank: int, hidden_size: int, top_k: int,
                        dtype: torch.dtype) -> int:
        # The MoeAlltoAll workspace, allocated once and kept.
        return flashinfer_workspace_bytes_per_rank(ep_size, max_tokens_per_rank, hidden_size, top_k,
                                                   dtype)

    def __init__(self, config: DispatcherConfig, ep: EPGroup, *,
                 device: torch.device | str | None = None) -> None:
        """Takes the config and the EP group (with a process group: the workspace handles are
        exchanged over ``ep.cpu_group``) and the CUDA device (default: the current one).
        Collective: every EP rank must construct its dispatcher at the same time. JIT-compiles the
        kernels on first use (about 100 s cold) and allocates the workspace."""
        fi = import_flashinfer_moe_a2a()
        if not ep.distributed:
            raise ValueError("the flashinfer dispatcher needs an initialized process group (even "
                             "at ep_size 1)")
        if config.top_k not in FLASHINFER_TOP_K:
            raise ValueError(f"flashinfer MoeAlltoAll supports top_k in {FLASHINFER_TOP_K}, "
                             f"got {config.top_k}")
        if config.dtype not in _COMBINE_DTYPES:
            raise ValueError(f"flashinfer MoeAlltoAll combines {_COMBINE_DTYPES}, "
                             f"got {config.dtype}")
        if config.hidden_size * dtype_bytes(config.dtype) % 4:
            raise ValueError("flashinfer dispatcher: hidden_size * dtype bytes must be a multiple "
                             "of 4 (the int32 payload follows the hidden rows), got "
                             f"hidden_size={config.hidden_size}")
        if ep.size > FLASHINFER_MAX_RANKS:
            raise ValueError(f"flashinfer MoeAlltoAll supports ep_size <= {FLASHINFER_MAX_RANKS}, "
                             f"got {ep.size}")
        self.config = config
        self.ep = ep
        self.partition = ExpertPartition(config.num_experts, ep.size)
        self.device = torch.device(device) if device is not None else default_device()
        check_cuda_device(self.device)
        self._guard = FirstStepGuard(ep, f"{self.kind} dispatcher")
        self._workspace_bytes = flashinfer_workspace_bytes_per_rank(
            ep.size, config.max_tokens_per_rank, config.hidden_size, config.top_k, config.dtype)
        # Pure-EP mapping over the EP group, as flashinfer.moe_ep's NVLinkOneSidedAlltoAll builds
        # it.
        mapping = fi.Mapping(world_size=ep.size, rank=ep.rank, gpus_per_node=ep.size,
                             tp_size=ep.size, moe_ep_size=ep.size)
        mnnvl_config = fi.MnnvlConfig(comm_backend=fi.TorchDistBackend(group=ep.cpu_group))
        with _on_device(self.device), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "MoeAlltoAll is deprecated", DeprecationWarning)
            self._a2a = fi.MoeAlltoAll(
                mapping,
                max_num_tokens=config.max_tokens_per_rank,
                top_k=config.top_k,
                num_experts=config.num_experts,
                workspace_size_per_rank=self._workspace_bytes,
                mnnvl_config=mnnvl_config,
            )
        self._sequence = 0
        self._inflight: FlashInferHandle | None = None
        self._combine_buffer_ptr: int | None = None

    @property
    def moe_alltoall(self) -> Any:
        """The underlying ``flashinfer.comm.MoeAlltoAll`` (for benchmarks and debugging)."""
        if self._a2a is None:
            raise RuntimeError("FlashInferDispatcher is closed")
        return self._a2a

    def workspace_bytes_per_rank(self) -> int:
        return self._workspace_bytes

    def warmup(self) -> None:
        warmup_round(self, self._guard, self.config.first_step_timeout_s)

    def close(self) -> None:
        """Drop this dispatcher's reference to MoeAlltoAll. The workspace itself stays in
        FlashInfer's process-wide cache (shared by instances of the same geometry) until exit."""
        self._a2a = None
        self._inflight = None

    def dispatch(self, hidden_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, plan: StepPlanLike) -> DispatchResult:
        cfg, ep = self.config, self.ep
        check_step(hidden_TD, topk_ids_TK, topk_weights_TK, plan, config=cfg, ep=ep,
                   backend=self.kind)
        if self._inflight is not None:
            raise RuntimeError("flashinfer dispatcher: dispatch called twice without combine")
        self._guard.before_step(plan, self.warmup)
        a2a = self.moe_alltoall
        t, p = hidden_TD.shape[0], int(plan.runtime_max_tokens_per_rank)
        if p == 0:
            # No rank has tokens (p is the same everywhere): nothing to send, and the library
            # refuses runtime_max_tokens_per_rank == 0.
            handle = self._new_handle(t, p, plan)
            self._inflight = handle
            empty = hidden_TD.new_empty((0, cfg.hidden_size))
            ids = torch.empty((0, cfg.top_k), dtype=torch.int32, device=hidden_TD.device)
            return DispatchResult(handle, ExpertInputs(empty, ids, ids.float(),
                                                       self.partition.num_local(ep.rank),
                                                       self.partition.first(ep.rank)))
        ids_TK = topk_ids_TK.to(torch.int32).contiguous()
        weights_TK = topk_weights_TK.to(torch.float32).contiguous()
        # Payload order hidden, ids, weights, as flashinfer.moe_ep sends them. The library checks
        # that each payload starts at a multiple of its element size: the int32 ids follow
        # R*P*D*dtype_bytes bytes, a multiple of 4 by the constructor's hidden-size check.
        # Ids at index 1 are what sanitize rewrites to INVALID_EXPERT_ID in padded rows.
        recv = a2a.dispatch(ids_TK, [hidden_TD.contiguous(), ids_TK, weights_TK], p,
                            invalid_token_expert_id=INVALID_EXPERT_ID, expert_id_payload_index=1)
        hidden_RPD, ids_RPK, weights_RPK = recv
        handle = self._new_handle(t, p, plan)
        self._inflight = handle
        self._combine_buffer_ptr = None
        ids_NK = ids_RPK.flatten(0, 1)
        inputs = ExpertInputs(
            hidden_ND=hidden_RPD.flatten(0, 1),
            expert_ids_NK=ids_NK,
            weights_NK=weights_RPK.flatten(0, 1),
            num_local_experts=self.partition.num_local(ep.rank),
            first_expert=self.partition.first(ep.rank),
        )
        return DispatchResult(handle, inputs)

    def expert_output_buffer(self, handle: FlashInferHandle) -> torch.Tensor:
        """The workspace's combine payload region as ``N x D`` (writing expert outputs here saves
        combine's staging copy). Valid between this dispatch and its combine."""
        self._check_handle(handle)
        d = self.config.hidden_size
        if handle.runtime_max_tokens_per_rank == 0:
            return torch.empty((0, d), dtype=self.config.dtype, device=self.device)
        buf_RPD = self.moe_alltoall.get_combine_payload_tensor_in_workspace(
            handle.runtime_max_tokens_per_rank, d, self.config.dtype)
        self._combine_buffer_ptr = buf_RPD.data_ptr()
        return buf_RPD.flatten(0, 1)

    def combine(self, expert_out_ND: torch.Tensor, handle: FlashInferHandle) -> torch.Tensor:
        self._check_handle(handle)
        p, d = handle.runtime_max_tokens_per_rank, self.config.hidden_size
        check_combine_input(expert_out_ND, self.ep.size * p, self.config)
        self._inflight = None
        if p == 0:
            return expert_out_ND.new_empty((0, d))
        in_workspace = (self._combine_buffer_ptr is not None
                        and expert_out_ND.data_ptr() == self._combine_buffer_ptr)
        self._combine_buffer_ptr = None
        payload_RPD = expert_out_ND.contiguous().view(self.ep.size, p, d)
        # Our own output tensor: allocated by torch (graph-pool aware under capture) rather than
        # inside the library. An idle rank (no tokens) lets the library make the empty result.
        out_TD = expert_out_ND.new_empty((handle.num_tokens, d)) if handle.num_tokens > 0 else None
        return self.moe_alltoall.combine(payload_RPD, p, payload_in_workspace=in_workspace,
                                         output=out_TD)

    def _new_handle(self, t: int, p: int, plan: StepPlanLike) -> FlashInferHandle:
        self._sequence += 1
        return FlashInferHandle(id(self), self._sequence, t, p, int(plan.fingerprint))

    def _check_handle(self, handle: FlashInferHandle) -> None:
        if not isinstance(handle, FlashInferHandle) or handle.dispatcher_id != id(self):
            raise ValueError("combine got a handle that this FlashInferDispatcher did not return")
        if handle is not self._inflight:
            raise ValueError(
                f"flashinfer dispatcher: handle #{handle.sequence} is not the dispatch in flight "
                f"({'none' if self._inflight is None else '#' + str(self._inflight.sequence)}); "
                "each dispatch must be combined exactly once, in order"
            )
