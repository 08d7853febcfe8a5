"""Choosing and building a dispatcher from configuration.

``make_dispatcher(kind, config, ...)`` with ``kind`` one of ``"auto"``, ``"all_gather"``,
``"all_to_all"``, ``"flashinfer"``. ``"auto"`` picks FlashInfer when the hidden states live on CUDA,
flashinfer imports, and every EP rank is on one host with CUDA and NVLink (checked by one object
all-gather over the CPU group, so every rank takes the same decision); otherwise all-to-all. The
choice and its reason are logged once per ``make_dispatcher`` call, at INFO on EP rank 0.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from typing import Any

import torch

from dispatcher.all_gather import AllGatherDispatcher
from dispatcher.all_to_all import AllToAllDispatcher
from dispatcher.config import DispatcherConfig
from dispatcher.groups import EPGroup, default_device
from dispatcher.protocol import Dispatcher

__all__ = ["DISPATCHER_KINDS", "KindChoice", "make_dispatcher", "resolve_dispatcher_kind"]

DISPATCHER_KINDS = ("auto", "all_gather", "all_to_all", "flashinfer")

logger = logging.getLogger("dispatcher")


@dataclass(frozen=True)
class KindChoice:
    """The backend ``"auto"`` resolved to, and why."""

    kind: str
    reason: str


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


def resolve_dispatcher_kind(kind: str, ep: EPGroup, device: torch.device) -> KindChoice:
    """Resolve ``kind`` (``"auto"`` or a backend name) to a backend name with a reason.

    ``"auto"`` is collective over the EP group's CPU group (one object all-gather); explicit kinds
    are returned as they are.
    """
    if kind not in DISPATCHER_KINDS:
        raise ValueError(f"unknown dispatcher kind {kind!r}; expected one of {DISPATCHER_KINDS}")
    if kind != "auto":
        return KindChoice(kind, "configured")
    if not ep.distributed:
        return KindChoice("all_to_all", "no process group (world size 1): FlashInfer needs one")
    verdicts = ep.all_gather_object(_local_flashinfer_verdict(device))
    hosts = sorted({host for host, _, _ in verdicts})
    unusable = [f"rank {r}: {why}" for r, (_, ok, why) in enumerate(verdicts) if not ok]
    if unusable:
        return KindChoice("all_to_all", "FlashInfer unusable on " + "; ".join(unusable))
    if len(hosts) > 1:
        return KindChoice("all_to_all", f"EP ranks span hosts {hosts}; FlashInfer's POSIX-fd handles need one node")
    return KindChoice("flashinfer", f"all {ep.size} EP ranks on {hosts[0]} with CUDA, NVLink and flashinfer")


def make_dispatcher(kind: str, config: DispatcherConfig, *, group: Any = None, cpu_group: Any = None,
                    ep: EPGroup | None = None, device: torch.device | str | None = None,
                    **backend_kwargs: Any) -> Dispatcher:
    """Build the dispatcher ``kind`` names (``"auto"`` resolves as the module docstring says).

    Takes the kind, the config, either an ``EPGroup`` or the torch process groups to build one
    from (default: the world group, or world size 1 without a process group), the device of the
    hidden states (default: CUDA's current device if available, else CPU), and backend-specific
    keyword arguments (``gathered_buffer``/``gather_fn`` for all_gather). Returns the dispatcher.
    Collective when the EP group must be built, for ``"auto"`` and for ``"flashinfer"``.
    """
    if ep is None:
        ep = EPGroup.from_torch(group, cpu_group)
    dev = torch.device(device) if device is not None else default_device()
    choice = resolve_dispatcher_kind(kind, ep, dev)
    if ep.rank == 0:
        logger.info("MoE dispatcher: %s (asked %r; %s); ep_size=%d, max_tokens_per_rank=%d",
                    choice.kind, kind, choice.reason, ep.size, config.max_tokens_per_rank)
    if choice.kind == "all_gather":
        return AllGatherDispatcher(config, ep, device=dev, **backend_kwargs)
    if backend_kwargs:
        raise ValueError(f"{choice.kind} dispatcher takes no extra arguments, got {sorted(backend_kwargs)}")
    if choice.kind == "all_to_all":
        return AllToAllDispatcher(config, ep, device=dev)
    from dispatcher.flashinfer_a2a import FlashInferDispatcher  # imports flashinfer lazily

    return FlashInferDispatcher(config, ep, device=dev)
