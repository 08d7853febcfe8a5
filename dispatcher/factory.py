"""The one table of dispatcher kinds, building a dispatcher, and the collective check of
whether FlashInfer's can run.

``KINDS`` maps each kind's name to its class, which states its facts and sizing
(``dispatcher/kind.py``); everything above this layer asks the table (``dispatcher_kind``,
``auto_kind``), never tests a name. A new dispatcher is one new file plus one row here.

``make_dispatcher(kind, config, ...)`` builds one; the kind is chosen above this layer
(``dp_runtime.choices.resolve_choices``, which the runtime and the planner share, with
``auto_kind`` for ``"auto"``). What that rule needs to know of the machine, whether every EP
rank can run FlashInfer's MoeAlltoAll (one host, CUDA, NVLink, flashinfer imports), is
``flashinfer_dispatch_verdict``: one object all-gather over the CPU group, so every rank gets
the same answer.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

import torch

from dispatcher.all_gather import AllGatherDispatcher
from dispatcher.all_to_all import AllToAllDispatcher
from dispatcher.config import DispatcherConfig
from dispatcher.flashinfer_a2a import FlashInferDispatcher  # imports flashinfer only when built
from dispatcher.groups import EPGroup, default_device
from dispatcher.kind import DispatcherKind
from dispatcher.local import LocalDispatcher
from dispatcher.protocol import Dispatcher

__all__ = ["DISPATCHER_KINDS", "KINDS", "auto_kind", "dispatcher_kind",
           "flashinfer_dispatch_verdict", "make_dispatcher"]

# The one table of kinds (``auto`` asks them in their ``auto_order``).
KINDS: dict[str, type[DispatcherKind]] = {
    cls.kind: cls for cls in (LocalDispatcher, AllGatherDispatcher, AllToAllDispatcher,
                              FlashInferDispatcher)
}
DISPATCHER_KINDS = tuple(KINDS)


def dispatcher_kind(kind: str) -> type[DispatcherKind]:
    """The class of dispatcher ``kind`` (its facts and sizing). Raises ValueError for a name
    not in ``KINDS``."""
    if kind not in KINDS:
        raise ValueError(f"unknown dispatcher kind {kind!r}; expected one of {', '.join(KINDS)}")
    return KINDS[kind]


def auto_kind(world_size: int, flashinfer_dispatch: tuple[bool, str],
              graphs_on_cuda: bool) -> tuple[str, str]:
    """``(kind, why)`` that ``dispatcher="auto"`` takes: the first kind, by ``auto_order``, that
    says it fits (``DispatcherKind.auto_reason``)."""
    for kind, cls in sorted(KINDS.items(), key=lambda item: item[1].auto_order):
        why = cls.auto_reason(world_size, flashinfer_dispatch, graphs_on_cuda)
        if why is not None:
            return kind, why
    raise ValueError("no dispatcher kind fits; the last by auto_order must always fit")

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
    cls = dispatcher_kind(kind)
    ep = ep if ep is not None else EPGroup.local()
    dev = torch.device(device) if device is not None else default_device()
    if ep.rank == 0:
        logger.info("MoE dispatcher: %s; ep_size=%d, max_tokens_per_rank=%d", kind, ep.size,
                    config.max_tokens_per_rank)
    if backend_kwargs and not cls.gathers:  # ``buffers``: the DP buffer service it gathers through
        raise ValueError(
            f"{kind} dispatcher takes no extra arguments, got {sorted(backend_kwargs)}")
    return cls(config, ep, device=dev, **backend_kwargs)
