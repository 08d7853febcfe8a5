"""Which kernels run a rank's MoE layer: routing (softmax, top-k, renormalise) and the routed
experts, chosen once per model and reported by name.

- ``triton``: one routing kernel (``routing_triton``) and the fused expert path
  (``fused_moe_triton``: pick alignment, two grouped GEMMs with SwiGLU and the routing weight in
  their epilogues, a deterministic sum over the top-k) — CUDA, bf16, triton importable.
- ``grouped_mm``: torch routing and ``torch._grouped_mm`` (CUDA sm90+, bf16), the fallback.
- ``dense``: torch routing and every local expert on every row (CPU and everywhere else).

A fused kernel that cannot run is named with the reason in one log line, once per process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dp_runtime.model.experts import grouped_mm_supported, local_expert_sum
from dp_runtime.model.fallback_log import log_fallback
from dp_runtime.model.fused_moe import fused_moe_supported
from dp_runtime.model.routing import softmax_topk

__all__ = ["ExpertPath", "expert_path", "recording_routes"]



@dataclass(frozen=True)
class ExpertPath:
    """The chosen kernels: ``route(logits_TE, live_rows=None) -> (weights_TK fp32, ids_TK int32)``
    (``live_rows``: rows from it on are padding, see ``routing.softmax_topk``) and
    ``experts(x_ND, local_ids_NK, weights_NK, w13, w2, out_ND, extend, add_norm) -> out_ND``
    (``extend``: the rows are prompt tokens, a hint for the kernel's tiles). ``fuses_add_norm``:
    ``experts`` takes ``add_norm=(residual_NH, weight_H, eps)`` and leaves the next layer's
    fused add+RMSNorm done (``fused_moe_triton.fused_local_expert_sum``); a path without it
    refuses anything but None."""

    name: str
    reason: str
    route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    experts: Callable[..., torch.Tensor]
    fuses_add_norm: bool = False


def expert_path(device: torch.device, dtype: torch.dtype, top_k: int, renormalize: bool,
                prefer: str | None = None) -> ExpertPath:
    """The fastest path that runs here (module docstring); ``prefer`` forces one by name."""
    ok, why = fused_moe_supported(device, dtype)
    if prefer not in (None, "triton", "grouped_mm", "dense"):
        raise ValueError(f"expert path must be triton, grouped_mm or dense, got {prefer!r}")
    if prefer == "triton" and not ok:
        raise ValueError(f"expert path 'triton' cannot run here: {why}")
    if (prefer is None and ok) or prefer == "triton":
        from dp_runtime.model.fused_moe_triton import fused_local_expert_sum
        from dp_runtime.model.routing_triton import softmax_topk_triton

        def route_triton(logits_TE: torch.Tensor, live_rows: torch.Tensor | None = None):
            return softmax_topk_triton(logits_TE, top_k, renormalize=renormalize, round_bf16=True,
                                       live_rows=live_rows)

        def fused(x, ids, w, w13, w2, out_ND=None, extend=False, add_norm=None):
            return fused_local_expert_sum(x, ids, w, w13, w2, out_ND=out_ND, extend=extend,
                                          add_norm=add_norm)

        return ExpertPath("triton", why, route_triton, fused, fuses_add_norm=True)

    def route_torch(logits_TE: torch.Tensor, live_rows: torch.Tensor | None = None):
        weights_TK, ids_TK = softmax_topk(logits_TE, top_k, renormalize=renormalize,
                                          live_rows=live_rows)
        # Hugging Face rounds the routing weights to the model dtype before weighting.
        return weights_TK.to(dtype).float(), ids_TK

    grouped = grouped_mm_supported(device, dtype) if prefer is None else prefer == "grouped_mm"
    name = "grouped_mm" if grouped else "dense"

    def unfused(x, ids, w, w13, w2, out_ND=None, extend=False, add_norm=None):
        if add_norm is not None:
            raise ValueError(f"the {name} expert path does not fold the next add+RMSNorm "
                             "(fuses_add_norm is False)")
        return local_expert_sum(x, ids, w, w13, w2, use_grouped_mm=grouped, out_ND=out_ND)

    if prefer is None and device.type == "cuda":
        log_fallback(f"fused MoE kernels not used ({why}): routing and experts run {name}")
    return ExpertPath(name, "configured" if prefer else why, route_torch, unfused)


def recording_routes(path: ExpertPath,
                     record: Callable[[torch.Tensor, torch.Tensor], None]) -> ExpertPath:
    """``path`` whose ``route`` also hands each call's ``(weights_TK, ids_TK)`` to ``record``:
    how a benchmark or a test reads the routing a model chose (set it as ``model.experts``).
    Eager steps only: a graph replay runs no Python."""

    def route(logits_TE: torch.Tensor, live_rows: torch.Tensor | None = None):
        weights_TK, ids_TK = path.route(logits_TE, live_rows)
        record(weights_TK, ids_TK)
        return weights_TK, ids_TK

    return dataclasses.replace(path, route=route)
