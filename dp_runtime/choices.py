"""The "auto" rules of a rank, in one pure function: dispatcher, CUDA graphs, attention backend.

The rank worker calls ``resolve_choices`` with what it found on its machine (the collective
FlashInfer verdict of its EP group, whether flashinfer imports); the planner calls it with what
it assumes of the GPUs it plans for (NVLink or not). Same rules, so a plan cannot pick another
backend than the runtime would.

Rules:

- graphs: ``use_cuda_graph`` if set, else on for CUDA; never without capture sizes.
- dispatcher: a named kind is taken as it is (one that is not ``capturable``, all_to_all, with
  graphs is refused: it reads its split sizes on the host). ``auto``: the table's rule
  (``dispatcher.factory.auto_kind``, each kind stating when it fits): world size 1 -> ``local``
  (nothing to exchange); every EP rank able to run FlashInfer's MoeAlltoAll -> ``flashinfer``;
  otherwise ``all_to_all``, or ``all_gather`` when graphs are on (the capturable one).
- attention: ``flashinfer`` where its kernels exist for the geometry (CUDA, 16-bit, head dim 64,
  128 or 256) and flashinfer imports, else ``sdpa``; naming ``flashinfer`` where it cannot run is
  refused with the reasons.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from dispatcher.factory import KINDS, auto_kind, dispatcher_kind
from dp_runtime.attention.backend import flashinfer_unsupported

__all__ = ["CAPTURABLE_DISPATCHERS", "DISPATCHERS", "Choices", "check_kv_cache_dtype",
           "rank_choices", "resolve_choices"]

DISPATCHERS = ("auto", *KINDS)
# Kinds a CUDA graph can hold (each class says: ``DispatcherKind.capturable``).
CAPTURABLE_DISPATCHERS = tuple(kind for kind, cls in KINDS.items() if cls.capturable)


@dataclass(frozen=True)
class Choices:
    """What a rank runs, each with the reason (shown in metrics, the run table and the plan)."""

    dispatcher: str
    dispatcher_reason: str
    graphs: bool
    graphs_reason: str
    attention: str
    attention_reason: str


def resolve_choices(
    *,
    dispatcher: str,
    use_cuda_graph: bool | None,
    attention: str,
    world_size: int,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    capture_sizes: tuple[int, ...],
    flashinfer_dispatch: tuple[bool, str],
    flashinfer_importable: bool,
) -> Choices:
    """The rank's choices (module docstring). ``flashinfer_dispatch``: (every EP rank can run
    MoeAlltoAll, why not) — only read for ``dispatcher="auto"`` at world size > 1. Raises
    ValueError naming the option for a choice that cannot run."""
    if dispatcher != "auto" and dispatcher not in KINDS:
        raise ValueError(f"dispatcher must be one of {', '.join(('auto', *KINDS))}; "
                         f"got {dispatcher!r}")
    if use_cuda_graph is False:
        graphs, graphs_why = False, "use_cuda_graph is False"
    elif not capture_sizes:
        graphs, graphs_why = False, "no capture sizes"
    elif use_cuda_graph is None and device_type != "cuda":
        graphs, graphs_why = False, f"auto: {device_type} has no CUDA graphs"
    else:
        graphs, graphs_why = True, f"{len(capture_sizes)} buckets up to {capture_sizes[-1]}"

    if dispatcher != "auto" and dispatcher_kind(dispatcher).single_rank and world_size != 1:
        raise ValueError(f"dispatcher {dispatcher!r} runs only at world size 1, got {world_size}")
    if dispatcher != "auto":
        kind, why = dispatcher, "configured"
        if graphs and device_type == "cuda" and not KINDS[kind].capturable:
            multi = [k for k, cls in KINDS.items() if cls.capturable and not cls.single_rank]
            raise ValueError(f"dispatcher {kind!r} reads its counts on the host and cannot be "
                             f"captured in a CUDA graph; pick {' or '.join(multi)}, or turn graphs "
                             "off")
    else:
        kind, why = auto_kind(world_size, flashinfer_dispatch, graphs and device_type == "cuda")

    unsupported = flashinfer_unsupported(device_type, dtype, head_dim)
    if attention == "flashinfer" and unsupported:
        raise ValueError("attention 'flashinfer' cannot run here: " + "; ".join(unsupported))
    if attention not in ("auto", "sdpa", "flashinfer"):
        raise ValueError(f"attention must be auto, sdpa or flashinfer; got {attention!r}")
    if attention != "auto":
        attn, attn_why = attention, "configured"
    elif unsupported:
        attn, attn_why = "sdpa", "auto: " + "; ".join(unsupported)
    elif not flashinfer_importable:
        attn, attn_why = "sdpa", "auto: flashinfer does not import"
    else:
        attn, attn_why = "flashinfer", "auto: FlashInfer kernels exist for this geometry"
    return Choices(kind, why, graphs, graphs_why, attn, attn_why)


def check_kv_cache_dtype(kv_dtype: torch.dtype, device_type: str,
                         capability: tuple[int, int] | None, gpu: str = "") -> None:
    """An FP8 KV cache on CUDA needs compute capability 8.9 or newer (Ada, Hopper): the Triton
    kernels that store and read it have no e4m3 type below. ValueError naming the field, the
    GPU and its capability; CPU (SDPA upcasts in torch) and other dtypes pass."""
    if (kv_dtype == torch.float8_e4m3fn and device_type == "cuda" and capability is not None
            and capability < (8, 9)):
        raise ValueError("kv_cache_dtype float8_e4m3fn needs a GPU of compute capability 8.9 or "
                         f"newer (Ada, Hopper); {gpu or 'this GPU'} "
                         f"is {capability[0]}.{capability[1]}: use kv_cache_dtype auto")


def rank_choices(spec: Any, head_dim: int, world_size: int, device: torch.device,
                 ep: Any) -> Choices:
    """``resolve_choices`` for a rank built from ``spec`` (a RankSpec), after
    ``check_kv_cache_dtype`` on its device. A collective when the dispatcher is "auto" over
    several ranks: every rank asks FlashInfer's dispatcher together."""
    from dispatcher import flashinfer_dispatch_verdict

    cuda = device.type == "cuda"
    check_kv_cache_dtype(spec.runtime.kv_cache_dtype, device.type,
                         torch.cuda.get_device_capability(device) if cuda else None,
                         torch.cuda.get_device_name(device) if cuda else "")

    verdict = (False, "not asked")
    if spec.dispatcher == "auto" and world_size > 1:
        verdict = flashinfer_dispatch_verdict(ep, device)
    return resolve_choices(
        dispatcher=spec.dispatcher, use_cuda_graph=spec.use_cuda_graph, attention=spec.attention,
        world_size=world_size, device_type=device.type, dtype=spec.runtime.dtype, head_dim=head_dim,
        capture_sizes=spec.runtime.cuda_graph_bs, flashinfer_dispatch=verdict,
        flashinfer_importable=importlib.util.find_spec("flashinfer") is not None,
    )
