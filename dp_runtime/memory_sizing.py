"""Bytes a rank allocates, as pure functions: the runtime sizes with them, the planner predicts
with them (launch/planner.py), so a plan cannot drift from what is allocated.

No function here touches a GPU or reads a file; each takes shapes and returns bytes or counts.
Pool-backed sizes (DP buffers, graph inputs) are computed by building the runtime's own users of
the pool on the ``meta`` device, which allocates nothing: the bytes come from the same
declarations the runtime makes, not from a copy of their shapes.

Two components have no allocator function: the memory that capturing the graphs adds and
the largest step's peak. ``dp_runtime/memory_estimates.py`` holds their documented *estimates*
(``dp-runtime plan --measure`` prints them beside the rank's measured values). The rules a rank
sizes its KV cache by are here (``largest_step_tokens``, ``kv_budget_bytes``), so the planner
applies the same ones. CUDA context and NCCL overheads are constants with their provenance
(``CUDA_CONTEXT_BYTES``, ``NCCL_COMMUNICATOR_BYTES``); ``allocator_segment_bytes`` is torch's
caching allocator's segment rule.

Legend: ``T`` tokens of a forward, ``R`` logit rows, ``H`` hidden, ``E`` experts, ``K`` top-k,
``I`` expert intermediate size, ``V`` vocab, ``Hq``/``Hkv`` heads, ``D`` head dim, ``e`` bytes
per element of the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from buffers.builders import build_decode_registry, build_prefill_registry
from buffers.pool import BufferPool
from dispatcher.factory import KINDS, dispatcher_kind
from dp_runtime.config import RuntimeConfig
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.model.weight_groups import layer_groups
from dp_runtime.model.weights import expected_shapes
from dp_runtime.serving.penalty_counts import PenaltyCounts
from dp_runtime.sync.dp_buffer import DPBufferService, dp_buffer_layout
from dp_runtime.sync.padding_mode import PaddingMode

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "NCCL_COMMUNICATOR_BYTES",
    "TRANSIENT_WORKSPACE_DISPATCHERS",
    "allocator_segment_bytes",
    "cuda_context_bytes",
    "dispatcher_gathers",
    "dispatcher_step_bytes",
    "dispatcher_transient",
    "dispatcher_workspace_bytes",
    "dp_buffer_bytes",
    "dp_gathered_rows",
    "dtype_bytes",
    "graph_input_bytes",
    "graph_input_bytes_by_name",
    "kv_budget_bytes",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "kv_slots_for_budget",
    "kv_slots_for_rank",
    "largest_step_tokens",
    "nccl_communicators",
    "nccl_overhead_bytes",
    "penalty_count_bytes",
    "pool_device_bytes",
    "weight_bytes_per_rank",
]

_MIB = 1 << 20
# Device memory one process holds outside torch's allocator: the CUDA context and the kernel
# modules loaded lazily (CUDA_MODULE_LOADING=LAZY, the default since CUDA 11.7): torch's,
# cuBLAS's, FlashInfer's and Triton's. Measured: 0.671 GiB on a qwen3-30b-a3b rank (DP 1, one
# H100 80GB, session 13, `dp-runtime plan --measure` at 64 and 256 running, docs/BENCHMARKS.md),
# ``memory_report()["cuda_context"]``: total - free - torch's reserved when it sizes its KV cache.
# (It was 1.1 GiB, inferred from KV sizes; that also carried loading's cached 0.58 GiB segment.)
CUDA_CONTEXT_BYTES = round(0.67 * (1 << 30))
# Estimated device memory of one NCCL communicator on one rank, NVLS (multicast) off as on our
# GPU machines (NCCL_NVLS_ENABLE=0; NVLS adds buffers of its own, ~1 GiB+). NCCL's default
# NCCL_BUFFSIZE is 4 MiB per channel and direction; with up to 32 channels on NVLink nodes that
# is 4 MiB x 32 x 2 = 256 MiB, plus small work FIFOs. P2P (all-to-all) buffers are allocated
# per peer on first use and are included in this round figure only roughly.
NCCL_COMMUNICATOR_BYTES = 256 * _MIB
# torch's CUDA caching allocator (default settings, no expandable segments): a request of at
# most 1 MiB takes a 2 MiB segment, one under 10 MiB a 20 MiB segment, a larger one a segment of
# its own size rounded up to 2 MiB.
_SMALL_REQUEST, _SMALL_SEGMENT = 1 * _MIB, 2 * _MIB
_MEDIUM_REQUEST, _MEDIUM_SEGMENT = 10 * _MIB, 20 * _MIB
# Dispatchers whose ``workspace_bytes_per_rank()`` is the peak of buffers allocated per step
# (live only during a step's MoE section), not memory held between steps as FlashInfer's is.
TRANSIENT_WORKSPACE_DISPATCHERS = tuple(kind for kind, cls in KINDS.items()
                                        if cls.transient_workspace)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes_per_rank(cfg: ModelConfig, dtype: torch.dtype, ep_rank: int = 0,
                          ep_size: int = 1) -> int:
    """Bytes of the weights EP rank ``ep_rank`` holds: every shared tensor plus its experts, the
    groups ``weight_groups`` stores FP8 at a byte per value plus their float32 block scales."""
    b = dtype_bytes(dtype)
    total = sum(math.prod(shape) for shape in expected_shapes(cfg, ep_rank, ep_size).values()) * b
    for i in range(cfg.num_layers):
        for g in layer_groups(cfg, i, ep_rank, ep_size).values():
            total += g.nbytes(b) - g.numel * b
    return total


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)


def kv_cache_bytes(cfg: ModelConfig, dtype: torch.dtype, num_slots: int, max_reqs: int,
                   max_context_len: int) -> int:
    """What ``KVCache`` allocates: ``num_slots + 1`` token slots per layer (slot 0 is the padding
    target) and an int32 ``req_to_token`` table of ``max_reqs + 1`` rows (row 0 likewise)."""
    return (num_slots + 1) * kv_bytes_per_token(cfg, dtype) + (max_reqs + 1) * max_context_len * 4


def kv_slots_for_budget(cfg: ModelConfig, dtype: torch.dtype, budget_bytes: int, max_reqs: int,
                        max_context_len: int) -> int:
    """The most token slots whose ``kv_cache_bytes`` fits ``budget_bytes`` (0 when nothing fits)."""
    table = (max_reqs + 1) * max_context_len * 4
    slots = (budget_bytes - table) // kv_bytes_per_token(cfg, dtype) - 1
    return max(0, int(slots))


def largest_step_tokens(cfg: RuntimeConfig, context_len: int) -> tuple[int, int]:
    """``(tokens, requests)`` of the largest step a rank can be given: the token budget
    (``max_tokens_per_rank``) over at most ``max_running_requests`` requests, none longer than
    ``context_len``. The rank profiles this step before sizing its KV cache."""
    tokens = min(cfg.max_tokens_per_rank, cfg.max_running_requests * context_len)
    return tokens, min(tokens, cfg.max_running_requests)


def kv_budget_bytes(free_bytes: int, peak_bytes: int, reserve_bytes: int, fraction: float) -> int:
    """Bytes a rank's KV cache may take (dp_runtime/rank_memory.py): ``fraction``
    (``kv_mem_fraction``) of what is free once the largest step has run, less that step's peak
    and the graphs' reserve; never negative. The rest is the rank's headroom."""
    return max(0, int((free_bytes - peak_bytes - reserve_bytes) * fraction))


# A CPU rank's KV cache when no size is given: enough for tests and the tiny preset.
CPU_MAX_KV_TOKENS = 65536


def kv_slots_for_rank(spec, device: torch.device) -> int:
    """The KV slots a rank allocates: ``spec.kv_cache_tokens`` if given; on CPU
    ``min(max_running_requests * context_len, CPU_MAX_KV_TOKENS)``; on CUDA what
    ``kv_mem_fraction`` of the free memory holds (``kv_slots_for_budget``). Raises RuntimeError
    when that is less than one request of ``context_len``."""
    cfg, mc = spec.runtime, spec.model_config()
    if spec.kv_cache_tokens is not None:
        return spec.kv_cache_tokens
    if device.type != "cuda":
        return min(cfg.max_running_requests * spec.context_len, CPU_MAX_KV_TOKENS)
    free, _ = torch.cuda.mem_get_info(device)
    slots = kv_slots_for_budget(mc, cfg.kv_cache_dtype, int(free * spec.kv_mem_fraction),
                                cfg.max_running_requests, spec.context_len)
    if slots < spec.context_len:
        raise RuntimeError(
            f"RankWorker: {free / 2**30:.2f} GiB free after the weights gives {slots} KV "
            f"slots (kv_mem_fraction={spec.kv_mem_fraction}); one request of "
            f"max_context_len={spec.context_len} needs more"
        )
    return slots


# -- pool-backed sizes (the runtime's own declarations, on the meta device) ----------------------
def _device_bytes_by_name(pool: BufferPool) -> dict[str, int]:
    # Host-side slots (seq_lens_cpu) live in CPU memory: not GPU bytes.
    return {e.name: e.nbytes for e in pool.report() if e.device.type != "cpu"}


def pool_device_bytes(pool: BufferPool) -> int:
    """Device bytes ``pool`` holds (its host-side slots left out): what the planner counts for a
    pool built on the meta device, and what a rank's real pool holds through torch's allocator."""
    return sum(_device_bytes_by_name(pool).values())


def dp_buffer_bytes(config: RuntimeConfig, dispatcher: str, top_k: int) -> int:
    """Device bytes the rank's ``DPBufferService`` requests from its pool with ``dispatcher``
    (a resolved kind): for the gather-style ``all_gather``, the gathered hidden buffer
    (``max_global_tokens x H``), the local one (``max_tokens_per_rank x H``) and the gathered
    routing (``max_global_tokens x 2 top_k`` int32); for all-to-all dispatchers nothing. Built on
    the meta device with the service itself, so nothing is allocated and nothing can drift.
    """
    if not dispatcher_gathers(dispatcher):
        return 0  # no service at all: the rank builds one only for a gathering dispatcher
    pool = BufferPool()
    DPBufferService(config, pool, rank=0, device="meta", routing_top_k=top_k)
    return pool_device_bytes(pool)


def dispatcher_transient(kind: str) -> bool:
    """Whether the dispatcher ``kind``'s workspace is per-step buffers (its class says)."""
    return dispatcher_kind(kind).transient_workspace


def dispatcher_gathers(kind: str) -> bool:
    """Whether the dispatcher ``kind`` gathers through the DP buffer service (its class says)."""
    return dispatcher_kind(kind).gathers


def dp_gathered_rows(num_tokens_per_rank: Sequence[int], padding: PaddingMode,
                     max_tokens_per_rank: int) -> int:
    """Rows of the gathered DP buffer a step uses, by the layout rule of ``dp_buffer_layout``.

    Takes each rank's token count, the padding mode and the per-rank limit; returns
    ``global_dp_buffer_len``: MAX_LEN ``max(n) * dp_size`` (every rank padded to the longest),
    SUM_LEN ``sum(n)``. The values are checked by ``dp_buffer_layout`` (ValueError over a limit).
    """
    counts = tuple(int(n) for n in num_tokens_per_rank)
    dp = len(counts)
    if padding is PaddingMode.MAX_LEN:
        local = max(counts)
        global_len = local * dp
    else:
        local, global_len = counts[0], sum(counts)
    layout = dp_buffer_layout(global_len, local, padding is PaddingMode.MAX_LEN, counts, rank=0,
                              dp_size=dp, max_tokens_per_rank=max_tokens_per_rank)
    return layout.global_dp_buffer_len


def graph_input_bytes_by_name(config: RuntimeConfig, *, decode_graphs: bool = True,
                              input_embeds: bool = False) -> dict[str, int]:
    """Device bytes of the rank's pooled graph-input buffers, per pool name.

    The decode registry (``max_bs`` = the largest ``cuda_graph_bs``; only when ``decode_graphs``
    and there are capture sizes) and the eager/prefill registry (``max_bs`` =
    ``max_running_requests``, ``max_num_tokens`` = ``max_tokens_per_rank``; with
    ``input_embeds``, a ``max_num_tokens x H`` slot of ``config.dtype``, which the rank worker's
    eager registry does not register) share storage by name in one pool, so each name costs the
    largest of its declarations. Each registry is built by its builder into a meta pool of its own
    and the per-name maxima are taken, which is what one shared pool materializes whatever the
    order.

    Difference from CUDA, bounded: there a registry packs its computed per-step counter
    (``num_token_non_padded``) into one block of its own instead of sharing it by name, which
    adds 4 bytes per registry.
    """
    prefill_pool = BufferPool()
    build_prefill_registry(
        config.max_running_requests, config.max_tokens_per_rank, "meta", prefill_pool,
        hidden_size=config.hidden_size, embed_dtype=config.dtype, dp_size=config.dp_size,
        register_input_embeds=input_embeds,
    )
    per_registry = [prefill_pool]
    if decode_graphs and config.cuda_graph_bs:
        decode_pool = BufferPool()
        build_decode_registry(config.cuda_graph_bs[-1], "meta", decode_pool, dp_size=config.dp_size)
        per_registry.append(decode_pool)
    out: dict[str, int] = {}
    for pool in per_registry:
        for name, nbytes in _device_bytes_by_name(pool).items():
            out[name] = max(out.get(name, 0), nbytes)
    return out


def graph_input_bytes(config: RuntimeConfig, *, decode_graphs: bool = True,
                      input_embeds: bool = False) -> int:
    """The sum of ``graph_input_bytes_by_name``: device bytes of the pooled graph inputs."""
    by_name = graph_input_bytes_by_name(config, decode_graphs=decode_graphs,
                                        input_embeds=input_embeds)
    return sum(by_name.values())


def penalty_count_bytes(config: RuntimeConfig, vocab_size: int) -> int:
    """Device bytes of the rank's penalty tables (``serving/penalty_counts.py``): float32 counts
    and bool marks, a row of ``vocab_size`` each for each KV request row, ``max_running_requests
    + 1`` (5 bytes a token a row). Built on the meta device by the class itself."""
    return PenaltyCounts.for_runtime(config.max_running_requests, vocab_size, "meta").nbytes


# -- dispatcher -----------------------------------------------------------------------------------
def dispatcher_workspace_bytes(kind: str, ep_size: int, max_tokens_per_rank: int, hidden_size: int,
                               top_k: int, dtype: torch.dtype) -> int:
    """What the dispatcher's ``workspace_bytes_per_rank()`` reports, by kind, from
    dispatcher/sizing.

    ``flashinfer``: the MoeAlltoAll workspace, allocated once and kept. ``all_gather``: 0 (its
    gathered storage is the DP buffer service's, counted in ``dp_buffer_bytes``; the experts
    write over the gathered rows). ``all_to_all`` (``TRANSIENT_WORKSPACE_DISPATCHERS``): the
    peak of the buffers one step allocates at full capacity, live only during the MoE section of
    a full step (so the same bytes are part of the activation peak). Raises ValueError for
    another kind.
    """
    return dispatcher_kind(kind).workspace_bytes(ep_size, max_tokens_per_rank, hidden_size, top_k,
                                                 dtype)


def dispatcher_step_bytes(kind: str, ep_size: int, num_tokens: int, hidden_size: int,
                          top_k: int, dtype: torch.dtype) -> int:
    """Transient bytes one dispatch + combine allocates at ``num_tokens`` per rank, outside any
    persistent workspace: ``all_gather`` / ``all_to_all``: their step buffers at that size (the
    sizing functions at ``max_tokens_per_rank = num_tokens``); ``local`` and ``all_gather``: 0
    (nothing beyond the DP buffers, which the experts write over); ``flashinfer``: 0 (payloads live
    in the persistent workspace; the combined output is the layer's MoE output, which the
    forward estimate counts). 0 tokens: 0. Raises ValueError for another kind.
    """
    return dispatcher_kind(kind).step_bytes(ep_size, num_tokens, hidden_size, top_k, dtype)


# -- fixed overheads -------------------------------------------------------------------------------
def cuda_context_bytes(device_type: str = "cuda") -> int:
    """``CUDA_CONTEXT_BYTES`` for one process on a CUDA device (0 elsewhere). An estimate."""
    return CUDA_CONTEXT_BYTES if device_type == "cuda" else 0


def allocator_segment_bytes(nbytes: int) -> int:
    """The segment torch's CUDA caching allocator reserves for a request of ``nbytes`` that no
    cached block holds (the rule in the comment at ``_SMALL_REQUEST``)."""
    if nbytes <= _SMALL_REQUEST:
        return _SMALL_SEGMENT
    if nbytes < _MEDIUM_REQUEST:
        return _MEDIUM_SEGMENT
    return -(-nbytes // _SMALL_SEGMENT) * _SMALL_SEGMENT


def nccl_communicators(dp_size: int, ep_size: int) -> int:
    """NCCL communicators one rank holds: the world/DP device group when ``dp_size > 1``, and an
    EP subgroup when ``1 < ep_size < dp_size`` (an EP group as large as the world is the world
    group). World size 1 has no process group, hence none."""
    return int(dp_size > 1) + int(1 < ep_size < dp_size)


def nccl_overhead_bytes(dp_size: int, ep_size: int) -> int:
    """``nccl_communicators(...) * NCCL_COMMUNICATOR_BYTES``: an estimate (see the constant)."""
    return nccl_communicators(dp_size, ep_size) * NCCL_COMMUNICATOR_BYTES
