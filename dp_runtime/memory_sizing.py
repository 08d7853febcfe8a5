"""Bytes a rank allocates, as pure functions: the runtime sizes with them, the planner predicts
with them (launch/planner.py), so a plan cannot drift from what is allocated.

No function here touches a GPU or reads a file; each takes shapes and returns bytes or counts.
Pool-backed sizes (DP buffers, graph inputs) are computed by building the runtime's own users of
the pool on the ``meta`` device, which allocates nothing: the bytes come from the same
declarations the runtime makes, not from a copy of their shapes.

Two components have no allocator function: the CUDA-graph memory pool and the eager activation
peak. ``graph_pool_bytes_estimate`` and ``activation_peak_bytes_estimate`` are documented
*estimates* of them (``dp-runtime plan --measure`` prints them beside measured values). CUDA
context and NCCL overheads are constants with their provenance (``CUDA_CONTEXT_BYTES``,
``NCCL_COMMUNICATOR_BYTES``).

Legend: ``T`` tokens of a forward, ``R`` logit rows, ``H`` hidden, ``E`` experts, ``K`` top-k,
``I`` expert intermediate size, ``V`` vocab, ``Hq``/``Hkv`` heads, ``D`` head dim, ``e`` bytes
per element of the model dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from buffers.builders import build_decode_registry, build_prefill_registry
from buffers.pool import BufferPool
from dispatcher.sizing import (
    all_to_all_buffer_bytes,
    flashinfer_workspace_bytes_per_rank,
)
from dp_runtime.config import RuntimeConfig
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.model.weights import expected_shapes
from dp_runtime.sync.dp_buffer import DPBufferService, dp_buffer_layout
from dp_runtime.sync.padding_mode import PaddingMode

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "NCCL_COMMUNICATOR_BYTES",
    "TRANSIENT_WORKSPACE_DISPATCHERS",
    "activation_peak_bytes_estimate",
    "cuda_context_bytes",
    "dispatcher_gathers",
    "dispatcher_step_bytes",
    "dispatcher_workspace_bytes",
    "dp_buffer_bytes",
    "dp_gathered_rows",
    "dtype_bytes",
    "forward_peak_bytes_estimate",
    "graph_input_bytes",
    "graph_input_bytes_by_name",
    "graph_pool_bytes_estimate",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "kv_slots_for_budget",
    "kv_slots_for_rank",
    "nccl_communicators",
    "nccl_overhead_bytes",
    "weight_bytes_per_rank",
]

_MIB = 1 << 20
_FP32 = 4
_INT64 = 8
# Estimated device memory one process loses to its CUDA context before torch allocates
# anything: the context itself, lazily loaded kernel modules (CUDA_MODULE_LOADING=LAZY, the
# default since CUDA 11.7) and cuBLAS/cuBLASLt workspaces. ~0.5 GiB is what nvidia-smi shows for
# a torch process on an H100 that has run a few GEMMs and attention kernels; it is an estimate,
# not something torch reports (memory_allocated() never sees it).
CUDA_CONTEXT_BYTES = 512 * _MIB
# Estimated device memory of one NCCL communicator on one rank, NVLS (multicast) off as on our
# GPU machines (NCCL_NVLS_ENABLE=0; NVLS adds buffers of its own, ~1 GiB+). NCCL's default
# NCCL_BUFFSIZE is 4 MiB per channel and direction; with up to 32 channels on NVLink nodes that
# is 4 MiB x 32 x 2 = 256 MiB, plus small work FIFOs. P2P (all-to-all) buffers are allocated
# per peer on first use and are included in this round figure only roughly.
NCCL_COMMUNICATOR_BYTES = 256 * _MIB
# Dispatchers whose ``workspace_bytes_per_rank()`` is the peak of buffers allocated per step
# (live only during a step's MoE section), not memory held between steps as FlashInfer's is.
TRANSIENT_WORKSPACE_DISPATCHERS = ("all_to_all",)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def weight_bytes_per_rank(cfg: ModelConfig, dtype: torch.dtype, ep_rank: int = 0, ep_size: int = 1) -> int:
    """Bytes of the weights EP rank ``ep_rank`` holds: every shared tensor plus its experts."""
    total = 0
    for shape in expected_shapes(cfg, ep_rank, ep_size).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total * dtype_bytes(dtype)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)


def kv_cache_bytes(cfg: ModelConfig, dtype: torch.dtype, num_slots: int, max_reqs: int, max_context_len: int) -> int:
    """What ``KVCache`` allocates: ``num_slots + 1`` token slots per layer (slot 0 is the padding
    target) and an int32 ``req_to_token`` table of ``max_reqs + 1`` rows (row 0 likewise)."""
    return (num_slots + 1) * kv_bytes_per_token(cfg, dtype) + (max_reqs + 1) * max_context_len * 4


def kv_slots_for_budget(cfg: ModelConfig, dtype: torch.dtype, budget_bytes: int, max_reqs: int,
                        max_context_len: int) -> int:
    """The most token slots whose ``kv_cache_bytes`` fits ``budget_bytes`` (0 when nothing fits)."""
    table = (max_reqs + 1) * max_context_len * 4
    slots = (budget_bytes - table) // kv_bytes_per_token(cfg, dtype) - 1
    return max(0, int(slots))


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
    slots = kv_slots_for_budget(mc, cfg.dtype, int(free * spec.kv_mem_fraction), cfg.max_running_requests,
                                spec.context_len)
    if slots < spec.context_len:
        raise RuntimeError(
            f"RankWorker: {free / 2**30:.2f} GiB free after the weights gives {slots} KV slots "
            f"(kv_mem_fraction={spec.kv_mem_fraction}); one request of max_context_len={spec.context_len} needs more"
        )
    return slots


# -- pool-backed sizes (the runtime's own declarations, on the meta device) ----------------------
def _device_bytes_by_name(pool: BufferPool) -> dict[str, int]:
    # Host-side slots (seq_lens_cpu) live in CPU memory: not GPU bytes.
    return {e.name: e.nbytes for e in pool.report() if e.device.type != "cpu"}


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
    return sum(_device_bytes_by_name(pool).values())


def dispatcher_gathers(kind: str) -> bool:
    """Whether the dispatcher ``kind`` gathers through the DP buffer service (only all_gather)."""
    return kind == "all_gather"


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
    largest of its declarations. Each registry is built by its builder into a meta pool of its own and the
    per-name maxima are taken, which is what one shared pool materializes whatever the order.

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
    by_name = graph_input_bytes_by_name(config, decode_graphs=decode_graphs, input_embeds=input_embeds)
    return sum(by_name.values())


# -- dispatcher -----------------------------------------------------------------------------------
def dispatcher_workspace_bytes(kind: str, ep_size: int, max_tokens_per_rank: int, hidden_size: int,
                               top_k: int, dtype: torch.dtype) -> int:
    """What the dispatcher's ``workspace_bytes_per_rank()`` reports, by kind, from dispatcher/sizing.

    ``flashinfer``: the MoeAlltoAll workspace, allocated once and kept. ``all_gather``: 0 (its
    gathered storage is the DP buffer service's, counted in ``dp_buffer_bytes``; the experts
    write over the gathered rows). ``all_to_all`` (``TRANSIENT_WORKSPACE_DISPATCHERS``): the
    peak of the buffers one step allocates at full capacity, live only during the MoE section of
    a full step (so the same bytes are part of the activation peak). Raises ValueError for
    another kind.
    """
    args = (ep_size, max_tokens_per_rank, hidden_size, top_k, dtype)
    if kind == "flashinfer":
        return flashinfer_workspace_bytes_per_rank(*args)
    if kind in ("local", "all_gather"):
        return 0
    if kind == "all_to_all":
        return all_to_all_buffer_bytes(*args)
    raise ValueError(f"unknown dispatcher kind {kind!r}; expected local, all_gather, all_to_all or flashinfer")


def dispatcher_step_bytes(kind: str, ep_size: int, num_tokens: int, hidden_size: int,
                          top_k: int, dtype: torch.dtype) -> int:
    """Transient bytes one dispatch + combine allocates at ``num_tokens`` per rank, outside any
    persistent workspace: ``all_gather`` / ``all_to_all``: their step buffers at that size (the
    sizing functions at ``max_tokens_per_rank = num_tokens``); ``local`` and ``all_gather``: 0
    (nothing beyond the DP buffers, which the experts write over); ``flashinfer``: 0 (payloads live
    in the persistent workspace; the combined output is the layer's MoE output, which the
    forward estimate counts). 0 tokens: 0. Raises ValueError for another kind.
    """
    if kind in ("local", "all_gather", "flashinfer"):
        return 0
    if kind not in TRANSIENT_WORKSPACE_DISPATCHERS:
        raise ValueError(f"unknown dispatcher kind {kind!r}; expected local, all_gather, all_to_all or flashinfer")
    if num_tokens <= 0:
        return 0
    return dispatcher_workspace_bytes(kind, ep_size, num_tokens, hidden_size, top_k, dtype)


# -- estimates (checked by `dp-runtime plan --measure`) -------------------------------------------
def forward_peak_bytes_estimate(cfg: ModelConfig, dtype: torch.dtype, num_tokens: int,
                                num_logit_rows: int) -> int:
    """ESTIMATE of the largest set of intermediate tensors live at once in one forward.

    Takes the model, its dtype, ``T`` tokens and ``R`` rows that reach the LM head. Returns
    ``max(layer, head)`` bytes, where (see the module legend)::

        residual  = 2*T*H*e                      hidden stream + its normed copy
        attention = T*(Hq + 2*Hkv)*D*e           fused qkv
                  + T*Hq*D*e                     attention output
        moe       = T*E*4                        router probabilities (fp32)
                  + T*K*(4 + 8)                  top-k weights (fp32) and ids (int64)
                  + max(T*K*(H + 2I)*e,          grouped GEMM: sorted rows + gate/up rows,
                        T*K*H*(e + 4))           or its output put back in (token, k) order
                                                 while its fp32 copy (the weighted terms) is made
                  (``dp_runtime.model.experts.local_expert_sum`` frees each intermediate when used)
        layer     = residual + max(attention, moe)      (a layer's attention and MoE
                                                         intermediates are not live together)
        head      = T*H*e + R*V*(e + 4)          normed hidden + logits in dtype and fp32

    An estimate: the caching allocator rounds blocks, and kernels take workspaces of their own.
    """
    t, r = int(num_tokens), int(num_logit_rows)
    e = dtype_bytes(dtype)
    h, k, i = cfg.hidden_size, cfg.top_k, cfg.moe_intermediate_size
    residual = 2 * t * h * e
    attention = t * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * e
    attention += t * cfg.num_heads * cfg.head_dim * e
    moe = t * cfg.num_experts * _FP32 + t * k * (_FP32 + _INT64)
    moe += max(t * k * (h + 2 * i) * e, t * k * h * (e + _FP32))
    head = t * h * e + r * cfg.vocab_size * (e + _FP32)
    return max(residual + max(attention, moe), head)


# FlashInfer's decode wrapper allocates an 8 MiB int workspace on the device
# (flashinfer/decode.py, BatchDecodeWithPagedKVCacheWrapper.__init__); the graph runner creates
# one wrapper per captured bucket, during capture.
FLASHINFER_WRAPPER_INT_WORKSPACE_BYTES = 8 << 20


def graph_pool_bytes_estimate(cfg: ModelConfig, dtype: torch.dtype, max_graph_bs: int,
                              dispatcher_step_bytes: int = 0, capture_sizes: tuple[int, ...] = (),
                              per_bucket_bytes: int = FLASHINFER_WRAPPER_INT_WORKSPACE_BYTES) -> int:
    """ESTIMATE of the memory that graph capture adds: graphs are captured largest first into
    one shared pool, so about one decode forward at the largest bucket ``B`` (``T = R = B``:
    every decode row is sampled) plus the dispatcher's step buffers inside the graph
    (``dispatcher_step_bytes(kind, ep, B, ...)``); then what the graphs keep for as long as they
    live: the float32 logits of the largest bucket (``B x V x 4``: every bucket writes its rows
    there, ``GraphRunner._into_shared``) and ``per_bucket_bytes`` of attention-wrapper state per
    bucket (FlashInfer's int workspace). 0 without graphs (``B == 0``).
    """
    if max_graph_bs <= 0:
        return 0
    sizes = tuple(capture_sizes) or (max_graph_bs,)
    kept = max(sizes) * cfg.vocab_size * _FP32 + len(sizes) * per_bucket_bytes
    return forward_peak_bytes_estimate(cfg, dtype, max_graph_bs, max_graph_bs) + dispatcher_step_bytes + kept


def activation_peak_bytes_estimate(cfg: ModelConfig, dtype: torch.dtype, max_tokens_per_rank: int,
                                   max_running_requests: int, dispatcher_step_bytes: int = 0) -> int:
    """ESTIMATE of the eager activation peak: the largest eager step, ``T = max_tokens_per_rank``
    tokens (a full prefill chunk, or a decode batch of ``max_running_requests``), with logits for
    the last token of each request only (``R = min(max_running_requests, T)``), plus the
    dispatcher's transient step buffers at ``T`` (``dispatcher_step_bytes(kind, ep, T, ...)``):
    what the rank worker measures as the allocation growth over one eager step.
    """
    t = int(max_tokens_per_rank)
    return forward_peak_bytes_estimate(cfg, dtype, t, min(int(max_running_requests), t)) + dispatcher_step_bytes


# -- fixed overheads --------------------------------------------------------------------------------
def cuda_context_bytes(device_type: str = "cuda") -> int:
    """``CUDA_CONTEXT_BYTES`` for one process on a CUDA device (0 elsewhere). An estimate."""
    return CUDA_CONTEXT_BYTES if device_type == "cuda" else 0


def nccl_communicators(dp_size: int, ep_size: int) -> int:
    """NCCL communicators one rank holds: the world/DP device group when ``dp_size > 1``, and an
    EP subgroup when ``1 < ep_size < dp_size`` (an EP group as large as the world is the world
    group). World size 1 has no process group, hence none."""
    return int(dp_size > 1) + int(1 < ep_size < dp_size)


def nccl_overhead_bytes(dp_size: int, ep_size: int) -> int:
    """``nccl_communicators(...) * NCCL_COMMUNICATOR_BYTES``: an estimate (see the constant)."""
    return nccl_communicators(dp_size, ep_size) * NCCL_COMMUNICATOR_BYTES
