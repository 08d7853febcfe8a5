"""ESTIMATES of the two components no allocator function sizes: the largest step's peak (what a
rank's profile step measures, dp_runtime/rank_memory.py) and the memory that capturing the
graphs adds (what the rank measures over its capture, dp_runtime/graph_setup.py); and the
graphs' reserve built on the second. Pure functions of shapes: the rank reserves with them and
the planner (launch/planner.py) predicts with them, one formula for both, and
``dp-runtime plan --measure`` prints each beside the rank's measured value.

Modelled for the path a rank takes on a CUDA GPU in bf16: FlashInfer attention, norms and the
fused q/k prologue, the Triton expert path (``model/fused_moe_triton.py``). Built from what the
code allocates and checked against the session-12 measurements of qwen3-30b-a3b on an H100
(docs/BENCHMARKS.md): graph memory 2.55 GiB at 64 running and 5.28 at 256 (that tree kept every
decode bucket's logits and did not count the backend's graph state), largest step 0.75 and
0.76 GiB; these formulas, applied to those trees, give each within 1%.

Legend: ``T`` tokens of a forward on this rank, ``N`` rows its experts run on, ``R`` logit rows,
``H`` hidden, ``K`` top-k, ``I`` expert intermediate size, ``V`` vocab, ``L`` layers,
``Hq``/``Hkv`` heads, ``D`` head dim, ``B`` the largest decode bucket, ``C`` the context
length, ``e`` bytes per element of the model dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from dispatcher.factory import dispatcher_kind
from dp_runtime import memory_sizing as ms
from dp_runtime.attention.triton_decode import TRITON_DECODE_MIN_BS
from dp_runtime.config import RuntimeConfig
from dp_runtime.graph_setup import extend_capture_tokens
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.serving.sampling import ROW_CHUNK, SORT_CHUNK

__all__ = [
    "CUBLAS_WORKSPACE_BYTES",
    "FLASHINFER_FLOAT_WORKSPACE_BYTES",
    "FLASHINFER_WRAPPER_INT_WORKSPACE_BYTES",
    "GRAPH_RESERVE_MARGIN",
    "allocator_cache_bytes",
    "attention_backend_bytes",
    "attention_graph_state_bytes",
    "draw_phase_bytes",
    "expert_rows",
    "forward_peak_bytes_estimate",
    "forward_phase_bytes",
    "graph_pool_bytes_estimate",
    "graph_reserve_bytes",
    "largest_step_bytes_estimate",
    "rank_graph_pool_bytes_estimate",
]

_MIB = 1 << 20
_FP32 = _INT32 = 4
_INT64 = 8
# torch's cuBLAS workspace, one per (handle, stream) that runs a GEMM, from the caching allocator
# (so counted where it is made): 32 MiB on sm90 (CUBLAS_WORKSPACE_CONFIG ":4096:8"). A rank makes
# one on its stream in the profile step (its first GEMM) and one on each capture stream (decode,
# extend): the tiny preset's 68 MiB of graph memory on an H100 is two of these.
CUBLAS_WORKSPACE_BYTES = 32 * _MIB
# FlashInferBackend's float workspace (its ``workspace_bytes`` default): one for the eager
# wrappers, one more for the graph wrappers (``init_capture``).
FLASHINFER_FLOAT_WORKSPACE_BYTES = 256 * _MIB
# FlashInfer allocates an 8 MiB int workspace on the device in every wrapper's __init__
# (flashinfer 0.7.2 decode.py / prefill.py): the eager backend makes four (decode, paged, ragged,
# ragged for long runs), the graph runner one per decode bucket below TRITON_DECODE_MIN_BS.
FLASHINFER_WRAPPER_INT_WORKSPACE_BYTES = 8 * _MIB
_FLASHINFER_EAGER_WRAPPERS = 4
_FLASHINFER_PAGED_KV_LENS_BYTES = 32768 * _INT32  # the paged prefill wrapper's kv_lens buffer
# The graphs are captured after the KV cache (they bake in its addresses), so they are reserved
# from the estimate. The estimate counts what stays allocated; the graphs' private pool also
# keeps the blocks its largest capture freed (about one extend forward at the largest token
# bucket, ~0.1 GiB for qwen3-30b-a3b) reserved as long as the graphs live: a quarter more.
GRAPH_RESERVE_MARGIN = 1.25


# -- attention backends ---------------------------------------------------------------------------
def attention_backend_bytes(attention: str) -> int:
    """Device bytes an eager attention backend allocates when built: FlashInfer's float workspace,
    its four wrappers' int workspaces and the paged wrapper's kv_lens; SDPA nothing."""
    if attention != "flashinfer":
        return 0
    return (FLASHINFER_FLOAT_WORKSPACE_BYTES
            + _FLASHINFER_EAGER_WRAPPERS * FLASHINFER_WRAPPER_INT_WORKSPACE_BYTES
            + _FLASHINFER_PAGED_KV_LENS_BYTES)


def attention_graph_state_bytes(attention: str, max_bs: int, context_len: int) -> int:
    """What ``init_capture(max_bs)`` allocates for the decode graphs: FlashInfer a second float
    workspace and fixed int32 indptr (B + 1), last-page lengths (B) and indices (B x C); SDPA
    int32 indices and a bool mask, B x C each."""
    if max_bs <= 0:
        return 0
    if attention == "flashinfer":
        return FLASHINFER_FLOAT_WORKSPACE_BYTES + (2 * max_bs + 1 + max_bs * context_len) * _INT32
    return max_bs * context_len * (_INT32 + 1)


# -- the forward -----------------------------------------------------------------------------------
def expert_rows(dispatcher: str, dp_size: int, ep_size: int, num_tokens: int) -> int:
    """``N``: the rows a rank's experts run on when every rank has ``num_tokens``: ``local`` its
    own; ``all_gather`` every DP rank's (the gathered buffer); ``flashinfer`` and
    ``all_to_all`` up to every EP rank's (FlashInfer pads each to the step's largest). The
    fused expert path sizes its intermediates for all ``N x K`` picks, this rank's or not."""
    return dispatcher_kind(dispatcher).expert_rows(dp_size, ep_size, num_tokens)


def forward_peak_bytes_estimate(cfg: ModelConfig, dtype: torch.dtype, num_tokens: int,
                                num_logit_rows: int, *, dispatcher: str = "local", dp_size: int = 1,
                                ep_size: int = 1) -> int:
    """ESTIMATE of the intermediates of one forward live at once, at its peak: the largest of
    its phases (``forward_phase_bytes``)."""
    return max(forward_phase_bytes(cfg, dtype, num_tokens, num_logit_rows, dispatcher=dispatcher,
                                   dp_size=dp_size, ep_size=ep_size))


def forward_phase_bytes(cfg: ModelConfig, dtype: torch.dtype, num_tokens: int, num_logit_rows: int,
                        *, dispatcher: str = "local", dp_size: int = 1,
                        ep_size: int = 1) -> tuple[int, int, int]:
    """ESTIMATE of the intermediates live at once in each phase of a forward, ``(attention, moe,
    head)`` bytes, where (module legend; ``N = expert_rows(...)``)::

        attention = T*(3H + 3(Hq + Hkv)D)*e       residual, normed input, fused qkv (v is a view),
                                                  normed+rotated q and k, attention output, o_proj
        moe       = 2T*H*e                         residual, normed input
                  + N*H*e   (local, all_to_all)    the expert output (else in the dispatcher's
                                                   workspace or the gathered rows)
                  + T*K*8 + N*K*4                  top-k weights (fp32) and ids (int32), the
                                                   pick alignment's slots
                  + N*K*(I + H)*e                  bf16 (Triton path): SwiGLU rows, then the
                                                   down projection's rows, live together
                    N*K*max((H + 2I)*e, H*(2e + 4))  other dtypes (torch path): grouped GEMM
                                                   rows, or the outputs put back in (token, k)
                                                   order beside their fp32 copy
                  + (N*H + N*K*I)*(1 + 4/128)      FP8 experts (W8A8): the two GEMMs' inputs in
                                                   e4m3 with their 1x128 scales
        head      = 2T*H*e + 2R*H*e + R*V*(e + 4)  the last layer's rows, the sampling rows,
                                                   logits in dtype and in fp32

    An estimate: kernels may take workspaces of their own (FlashInfer's are counted with the
    backend, ``attention_backend_bytes``), and the caching allocator rounds blocks.
    """
    t, r = int(num_tokens), int(num_logit_rows)
    n = expert_rows(dispatcher, dp_size, ep_size, t)
    e = ms.dtype_bytes(dtype)
    h, k, i, d = cfg.hidden_size, cfg.top_k, cfg.moe_intermediate_size, cfg.head_dim
    attention = t * (3 * h + 3 * (cfg.num_heads + cfg.num_kv_heads) * d) * e
    moe = 2 * t * h * e + (n * h * e if dispatcher_kind(dispatcher).separate_expert_output else 0)
    moe += t * k * (_FP32 + _INT32) + n * k * _INT32
    if dtype == torch.bfloat16:
        moe += n * k * (i + h) * e
        if cfg.quantization is not None:
            moe += -(-(n * h + n * k * i) * (128 + _FP32) // 128)
    else:
        moe += max(n * k * (h + 2 * i) * e, n * k * h * (2 * e + _FP32))
    head = 2 * t * h * e + 2 * r * h * e + r * cfg.vocab_size * (e + _FP32)
    return attention, moe, head


# Bytes a sorted element of a top-p draw holds at the sort's peak: the float32 copy and the
# sorted values, torch's int64 indices and the sort's double buffers. Fitted: the profile's
# costliest draw over 64-row chunks (81e2ee0, one H200, qwen3-30b-a3b) measured activation_peak
# 0.976 GiB at 256 running and 0.788 at 64, +0.221 and +0.035 over the forward; with the logits
# below, 48 bytes an element gives +0.221 and +0.050.
SORT_BYTES_PER_ELEMENT = 48


def draw_phase_bytes(cfg: ModelConfig, dtype: torch.dtype, num_logit_rows: int,
                     sort_chunk: int = SORT_CHUNK, bias_chunk: int = ROW_CHUNK) -> int:
    """ESTIMATE of what the profile's costliest draw (``step_tokens.worst_case_draw``: every row
    penalized, with a logit_bias and a top-p alone, and every logprob) holds at its peak, after
    the forward::

        R*V*(e + 4)                          the logits in dtype and in fp32
        + V*(4 + 1)                          the profile's one-row count and mark tables (the
                                             rank's own are a component apart: penalty_counts)
        + V*max(min(R, B)*4                  an adjusted copy of B rows (``sampling.ROW_CHUNK``)
                + max(min(R, B)*4,           and its penalties' counts gathered from the table
                      min(R, B)*7,           (adjusted_rows: freed before the draw), or the
                                             repetition penalty's marks, masks and factor, or
                      min(R, S)*48),         a top-p sort's chunk of S rows within it
                                             (``sampling.SORT_CHUNK``),
                min(R, 64)*8)                or a logprobs chunk (the rows and their
                                             log-softmax)

    On CUDA a top-p alone is searched, not sorted (``serving/top_p_search.py``: a few kilobytes),
    so there the sort's term is an upper bound; CPU ranks sort.

    The adjusted copy's and the counts' 4 bytes an element are float32 rows (not measured yet;
    the sort's 48 are); the repetition step's 7 are its bool marks, its ``logits > 0`` mask, a
    third bool mask and a float32 factor (``adjusted_rows._repetition``). Neither raises the
    peak with today's chunks (64 x 4 or 7 bytes a column against a sort's 16 x 48): they are
    here so that stays checked. ``bias_chunk`` 0: a
    draw without a bias or a penalty, as the profile ran before it had them. A ``min_p`` adds
    no term: its threshold needs each row's max, one float a row (``sampling._min_p_thresholds``).
    """
    r, v = int(num_logit_rows), cfg.vocab_size
    adjusted = min(r, bias_chunk) * _FP32
    repetition = min(r, bias_chunk) * (3 + _FP32)
    drawing = adjusted + max(adjusted, repetition, min(r, sort_chunk) * SORT_BYTES_PER_ELEMENT)
    chunk = max(drawing, min(r, ROW_CHUNK) * 2 * _FP32)
    table = v * (_FP32 + 1) if bias_chunk else 0
    return r * v * (ms.dtype_bytes(dtype) + _FP32) + table + v * chunk


def allocator_cache_bytes(cfg: ModelConfig) -> int:
    """ESTIMATE of torch's reserved memory beyond the weights and the rank's pool when the rank
    sizes its KV cache (``memory_report()["allocator_cache"]``): the RoPE table (fp32 cos/sin,
    ``max_positions x head_dim``, built after loading), the cuBLAS workspace of the profile step's
    first GEMM, and one small-pool segment's slack. qwen3-30b-a3b: 20 + 32 + 2 MiB = 0.053 GiB;
    measured 0.053 on an H100 (session 14, ``plan --measure`` at 64 running). Before the model
    handed loading's cached segments back (``Qwen3MoeModel.__init__``) it was 0.582: the RoPE
    table and that workspace pinned the embedding's 594 MiB temporary segment."""
    rope = ms.allocator_segment_bytes(cfg.max_positions * cfg.head_dim * _FP32)
    return rope + CUBLAS_WORKSPACE_BYTES + ms.allocator_segment_bytes(1)


def largest_step_bytes_estimate(cfg: ModelConfig, rt: RuntimeConfig, context_len: int, *,
                                attention: str, dispatcher: str) -> int:
    """ESTIMATE of what the rank's profile step measures (``rank_memory.profile_largest_step``):
    the allocation growth over one eager forward of the largest step
    (``memory_sizing.largest_step_tokens``) on a one-slot KV cache with an attention backend of
    its own, and its costliest draw. That is the larger of the forward's peak
    (``forward_peak_bytes_estimate``) and the draw's (``draw_phase_bytes``), plus the dispatcher's
    step buffers at ``T`` (all_to_all), the backend (``attention_backend_bytes``), the one-slot
    cache (``memory_sizing.kv_cache_bytes``), the eager registry the probe's runner takes from
    the pool (``memory_sizing.graph_input_bytes`` without decode graphs) and the cuBLAS
    workspace of the rank's first GEMM (``CUBLAS_WORKSPACE_BYTES``)."""
    tokens, requests = ms.largest_step_tokens(rt, context_len)
    moe = (cfg.hidden_size, cfg.top_k, rt.dtype)
    peak = max(forward_peak_bytes_estimate(cfg, rt.dtype, tokens, requests, dispatcher=dispatcher,
                                           dp_size=rt.dp_size, ep_size=rt.ep_size),
               draw_phase_bytes(cfg, rt.dtype, requests))
    peak += ms.dispatcher_step_bytes(dispatcher, rt.ep_size, tokens, *moe)
    peak += attention_backend_bytes(attention) + CUBLAS_WORKSPACE_BYTES
    peak += ms.kv_cache_bytes(cfg, rt.kv_cache_dtype, 1, rt.max_running_requests, context_len)
    return peak + ms.graph_input_bytes(rt, decode_graphs=False)


# -- the graphs ------------------------------------------------------------------------------------
def graph_pool_bytes_estimate(cfg: ModelConfig, dtype: torch.dtype, *, capture_sizes: Sequence[int],
                              extend_tokens: Sequence[int], max_running_requests: int,
                              context_len: int, attention: str) -> int:
    """ESTIMATE of the memory that capturing the graphs leaves reserved (what
    ``graph_setup.capture_rank_graphs`` measures). Graphs are captured largest first into one
    private pool, where what a capture frees is reused by the next; the pool keeps what the
    graphs keep plus the free blocks their replays write to: the largest capture's working set.
    Decode buckets (``capture_sizes``, largest ``B``; none: 0)::

        attention_graph_state_bytes(attention, B, C)     init_capture
        + B*V*4                                          the largest bucket's fp32 logits, where
                                                         every bucket writes its rows
        + 8 MiB per bucket below TRITON_DECODE_MIN_BS    FlashInfer's wrapper (none for SDPA)
        + CUBLAS_WORKSPACE_BYTES                         the capture stream's

    and extend token buckets (``extend_tokens``, largest ``T_max``)::

        T_max*Hq*D*e, in its allocator segment          the attention output, one buffer for
                                                         every layer and bucket
        + R*V*(e + 4), R = min(T_max, max_running_requests)  a second bucket's logits (dtype and
                                                         fp32): the buckets' logits share the
                                                         pool's blocks, but not all of them
                                                         (measured, below)
        + CUBLAS_WORKSPACE_BYTES                         the capture stream's

    and the working set of the largest capture (``T_max`` tokens and ``min(T_max,
    max_running_requests)`` logit rows; without extend buckets, ``B`` and ``B``): the sum of the
    forward's phases (``forward_phase_bytes``), not the largest, since a piece spans the end of
    one layer (o_proj, the MoE) and the start of the next (norm, q/k/v), and the last piece the
    head. The pieces' q/k/v and the buckets' logits are part of it, not kept per bucket (and
    layer): the pieces give them back to the pool once captured (graph/piecewise_runner.py).
    qwen3-30b-a3b on an H100, session 15, at 64 / 256 running: 0.641 / 1.115 GiB measured once
    the buckets' logits went to the pool too, against 0.603 / 0.879 without the second bucket's
    logits (their sum was 0.86 GiB at 256 running, and 0.66 of it was saved): the term is fitted
    to that measurement, and gives 0.657 / 1.096 (+2.5% / -1.7%).
    """
    sizes, tokens = tuple(capture_sizes), tuple(extend_tokens)
    if not sizes:
        return 0
    v = cfg.vocab_size
    b = max(sizes)
    total = (attention_graph_state_bytes(attention, b, context_len) + b * v * _FP32
             + CUBLAS_WORKSPACE_BYTES)
    if attention == "flashinfer":
        total += (sum(s < TRITON_DECODE_MIN_BS for s in sizes)
                  * FLASHINFER_WRAPPER_INT_WORKSPACE_BYTES)
    if not tokens:
        return total + sum(forward_phase_bytes(cfg, dtype, b, b))
    t_max, e = max(tokens), ms.dtype_bytes(dtype)
    total += (ms.allocator_segment_bytes(t_max * cfg.num_heads * cfg.head_dim * e)
              + CUBLAS_WORKSPACE_BYTES)
    total += min(t_max, max_running_requests) * v * (e + _FP32)
    return total + sum(forward_phase_bytes(cfg, dtype, t_max, min(t_max, max_running_requests)))


def rank_graph_pool_bytes_estimate(cfg: ModelConfig, rt: RuntimeConfig, context_len: int, *,
                                   attention: str, graphs: bool) -> int:
    """``graph_pool_bytes_estimate`` for the graphs a rank of ``rt`` captures: its decode sizes
    and the extend buckets ``graph_setup.extend_capture_tokens`` keeps; 0 without graphs."""
    if not graphs:
        return 0
    return graph_pool_bytes_estimate(cfg, rt.dtype, capture_sizes=rt.cuda_graph_bs,
                                     extend_tokens=extend_capture_tokens(rt, context_len),
                                     max_running_requests=rt.max_running_requests,
                                     context_len=context_len, attention=attention)


def graph_reserve_bytes(graph_pool_estimate: int) -> int:
    """What a rank sets aside for its graphs before sizing the KV cache: the estimate with
    ``GRAPH_RESERVE_MARGIN`` (see there)."""
    return math.ceil(GRAPH_RESERVE_MARGIN * graph_pool_estimate)
