"""Building a dispatcher, and the collective check of whether FlashInfer's can run.

``make_dispatcher(kind, config, ...)`` with ``kind`` one of ``"local"``, ``"all_gather"``,
``"all_to_all"``, ``"flashinfer"``: the kind is chosen above this layer
(``dp_runtime.choices.resolve_choices``, which the runtime and the planner share). What that
rule needs to know of the machine, whether every EP rank can run FlashInfer's MoeAlltoAll (one
host, CUDA, NVLink, flashinfer imports), is ``flashinfer_dispatch_verdict``: one object
all-gather over the CPU group, so every rank gets the same answer.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import torch

from dispatcher.all_gather import AllGatherDispatcher
from dispatcher.all_to_all import AllToAllDispatcher
from dispatcher.config import DispatcherConfig
from dispatcher.groups import EPGroup, default_device
from dispatcher.local import LocalDispatcher
from dispatcher.protocol import Dispatcher

__all__ = ["DISPATCHER_KINDS", "flashinfer_dispatch_verdict", "make_dispatcher"]

DISPATCHER_KINDS = ("local", "all_gather", "all_to_all", "flashinfer")

logger = logging.getLogger("dispatcher")


def _local_flashinfer_verdict(device: torch.device) -> tuple[str, bool, str]:
    """(hostname, can this rank run FlashInfer MoeAlltoAll, why not)."""
    host = socket.gethostname()
    if device.type != "cuda" or not torch.cuda.is_available():
        return host, False, f"hidden states are on {device}, not CUDA"
    try:
        from dispatcher.flashinfer_a2a import import_flashinfer_moe_a2a

        import_flashinfer_moe_a2a()
    except Exception as exc:  # any import failure means "not usable here"
        return host, False, f"flashinfer does not import ({type(exc).__name__}: {exc})"
    try:
        from flashinfer.comm.mnnvl import MnnvlMemory

        with torch.cuda.device(device):
            nvlink = bool(MnnvlMemory.supports_mnnvl())
    except Exception as exc:
        return host, False, f"NVLink query failed ({type(exc).__name__}: {exc})"
    if not nvlink:
        return host, False, f"GPU {device} has no P2P NVLink, or not all its links are up"
    return host, True, ""


def flashinfer_dispatch_verdict(ep: EPGroup, device: torch.device) -> tuple[bool, str]:
    """(every EP rank can run FlashInfer's MoeAlltoAll, why not). Collective over the EP group's
    CPU group when it is distributed; ``(False, reason)`` at world size 1."""
    if not ep.distributed:
        return False, "no process group (world size 1)"
    verdicts = ep.all_gather_object(_local_flashinfer_verdict(device))
    hosts = sorted({host for host, _, _ in verdicts})
    unusable = [f"rank {r}: {why}" for r, (_, ok, why) in enumerate(verdicts) if not ok]
    if unusable:
        return False, "FlashInfer unusable on " + "; ".join(unusable)
    if len(hosts) > 1:
        return False, f"EP ranks span hosts {hosts}; FlashInfer's POSIX-fd handles need one node"
    return True, f"all {ep.size} EP ranks on {hosts[0]} with CUDA, NVLink and flashinfer"


def make_dispatcher(kind: str, config: DispatcherConfig, *, ep: EPGroup | None = None,
                    device: torch.device | str | None = None, **backend_kwargs: Any) -> Dispatcher:
    """Build the dispatcher ``kind`` names (one of ``DISPATCHER_KINDS``).

    Takes the kind, the config, the EP group (default: world size 1), the device of the hidden
    states (default: CUDA's current device if available, else CPU) and backend-specific keyword
    arguments (``buffers``, the rank's DP buffer service, for all_gather). Returns the
    dispatcher; logs it once at INFO on EP rank 0. Collective for ``"flashinfer"``.
    """
    if kind not in DISPATCHER_KINDS:
        raise ValueError(f"unknown dispatcher kind {kind!r}; expected one of {DISPATCHER_KINDS}")
    ep = ep if ep is not None else EPGroup.local()
    dev = torch.device(device) if device is not None else default_device()
    if ep.rank == 0:
        logger.info("MoE dispatcher: %s; ep_size=%d, max_tokens_per_rank=%d", kind, ep.size, config.max_tokens_per_rank)
    if kind == "all_gather":
        return AllGatherDispatcher(config, ep, device=dev, **backend_kwargs)
    if backend_kwargs:
        raise ValueError(f"{kind} dispatcher takes no extra arguments, got {sorted(backend_kwargs)}")
    if kind == "local":
        return LocalDispatcher(config, ep, device=dev)
    if kind == "all_to_all":
        return AllToAllDispatcher(config, ep, device=dev)
    from dispatcher.flashinfer_a2a import FlashInferDispatcher  # imports flashinfer lazily

    return FlashInferDispatcher(config, ep, device=dev)
