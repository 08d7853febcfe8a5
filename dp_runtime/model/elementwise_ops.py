"""RMSNorm (alone and with the residual add), SiLU-and-mul, rotary embedding, the q/k prologue
of attention and the attention block's projections, as torch ops or as fused kernels.

At batch size 1 a decode step of a 48-layer MoE is bound by kernel count, not bytes: written
with torch ops an RMSNorm is about 8 kernels, a residual add one more, a rotary embedding about
15. On CUDA in bf16/fp16 with flashinfer importable, ``FlashInferOps`` uses FlashInfer's
``rmsnorm``, ``fused_add_rmsnorm`` (the residual add folded into the next norm) and
``silu_and_mul``, one launch each, and, with Triton, the q/k prologue of attention (per-head
norm, rotary, KV store) as one kernel (``qk_norm_rope``), and runs the projections of decode
steps without bias as kernels that stream the weight once: a GEMV at 1-2 rows
(``skinny_linear``), a split-K tensor-core GEMM in one launch at 3-16 rows for o_proj and the
router (``stream_linear``); cuBLAS takes 1.4-2.3x the weight's bytes floor at those sizes (a
split-K GEMM plus a reduce kernel for o_proj). F.linear otherwise. ``elementwise_ops(device,
dtype)`` picks once, at model construction; the torch versions serve everywhere else. Both
compute in float32 inside and return the input dtype, rounding at the same points.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from dp_runtime.model.fallback_log import log_fallback
from dp_runtime.model.fp8_blocks import Fp8BlockWeight
from dp_runtime.model.fp8_linear import fp8_linear
from dp_runtime.model.layers import RotaryEmbedding, rms_norm
from dp_runtime.model.skinny_linear import skinny_linear, use_skinny
from dp_runtime.model.stream_linear import StreamLinear

__all__ = ["FlashInferOps", "TorchOps", "decode_linear", "elementwise_ops"]


def decode_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
                  stream: StreamLinear | None) -> torch.Tensor:
    """``F.linear(x, w, b)``; without bias at decode sizes a kernel that streams the weight once:
    ``skinny_linear`` at 1..SKINNY_USE_ROWS rows, ``stream`` where ``StreamLinear.takes`` it
    (3..16 rows of narrow weights; ``use_skinny`` says the rest). An IDLE rank's 0 rows go to
    F.linear, which returns the empty (0, N) output. An FP8 weight goes to ``fp8_linear``."""
    if isinstance(w, Fp8BlockWeight):
        return fp8_linear(x, w, b)
    if use_skinny(x, w, b):
        return skinny_linear(x, w)
    if stream is not None and stream.takes(x, w, b):
        return stream(x, w)
    return F.linear(x, w, b)


class TorchOps:
    """The torch versions (CPU, float32, or without flashinfer)."""

    name = "torch"
    fused_qk_prologue = False  # the attention block stores K/V with KVCache.set_kv

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(residual + x), residual + x)``."""
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rope(rotary: RotaryEmbedding, q_THD: torch.Tensor, k_THD: torch.Tensor,
             positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary.apply(q_THD, k_THD, positions_T)

    @staticmethod
    def linear(x: torch.Tensor, w: torch.Tensor | Fp8BlockWeight,
               b: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_linear(x, w, b) if isinstance(w, Fp8BlockWeight) else F.linear(x, w, b)


class FlashInferOps:
    """FlashInfer's fused kernels (one launch each)."""

    name = "flashinfer"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        import flashinfer

        self._norm = flashinfer.norm.rmsnorm
        self._add_norm = flashinfer.norm.fused_add_rmsnorm
        self._silu_and_mul = flashinfer.activation.silu_and_mul
        self._rope = flashinfer.rope.apply_rope_with_cos_sin_cache_inplace
        self.fused_qk_prologue = importlib.util.find_spec("triton") is not None
        if self.fused_qk_prologue:
            from dp_runtime.model.qk_norm_rope import qk_norm_rope_store

            self.qk_norm_rope_store = qk_norm_rope_store
            # The model's one owner of stream_linear's split-K counters on its device.
            self._stream = StreamLinear(device)
        else:
            self._stream = None
            self.name = "flashinfer (no triton: q/k prologue unfused, F.linear)"

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """In place, one launch: ``residual += x``, then ``x = rms_norm(residual)``."""
        if x.shape[0] == 0:
            return x, residual
        self._add_norm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            return x[:, : x.shape[1] // 2]
        return self._silu_and_mul(x)

    def linear(self, x: torch.Tensor, w: torch.Tensor,
               b: torch.Tensor | None = None) -> torch.Tensor:
        """``decode_linear`` with this model's StreamLinear."""
        return decode_linear(x, w, b, self._stream)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.shape[0] == 0:  # an IDLE rank's eager forward: the kernel refuses an empty grid
            return torch.empty_like(x)
        # q and k arrive as strided views of the fused QKV output: the kernel wants rows.
        return self._norm(x.contiguous(), weight, eps)

    def rope(self, rotary: RotaryEmbedding, q_THD: torch.Tensor, k_THD: torch.Tensor,
             positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = q_THD.contiguous(), k_THD.contiguous()
        t, d = q.shape[0], q.shape[-1]
        if t == 0:
            return q, k
        self._rope(positions_T, q.view(t, -1), k.view(t, -1), d, rotary.cos_sin_PD, is_neox=True)
        return q, k


def elementwise_ops(device: torch.device, dtype: torch.dtype) -> TorchOps | FlashInferOps:
    """FlashInfer's kernels on CUDA in bf16/fp16 when flashinfer imports, else torch's; on CUDA
    a fallback is logged once, naming the kernels and the reason."""
    if device.type != "cuda":
        return TorchOps()
    if dtype not in (torch.bfloat16, torch.float16):
        why = f"dtype {dtype} is not bf16/fp16"
    elif importlib.util.find_spec("flashinfer") is None:
        why = "flashinfer does not import"
    else:
        ops = FlashInferOps(device)
        if not ops.fused_qk_prologue:
            log_fallback("fused q/k norm + RoPE + KV store kernel and skinny linear not used "
                         "(triton does not import): FlashInfer's norm and RoPE, separate KV "
                         "copies, F.linear")
        return ops
    log_fallback(f"fused RMSNorm / add+RMSNorm / SiLU-and-mul / RoPE kernels not used ({why}): "
                 "torch ops")
    return TorchOps()

