"""The reference Qwen3-MoE model of one DP rank: DP attention on the rank's own requests, EP MoE
through a dispatcher. Mixtral is the same computation without the q/k norm (its family in
``ModelConfig``; tensor names in ``tensor_names``).

Per decoder layer (Hugging Face ``Qwen3MoeForCausalLM`` arithmetic):

    x = rms_norm(h);  q, k, v = x @ [Wq; Wk; Wv] (+ [bq; bk; bv])   (one fused GEMM)
    q, k = rms_norm per head (q_norm, k_norm);  q, k = RoPE(q, k, positions)   (plain or YaRN)
    store this step's k, v in the KV cache;  h = h + attention(q) @ Wo (+ bo)   (the backend reads)
    x = rms_norm(h)
    sparse layer: softmax router, top-k, optional renormalisation; dispatch -> the rank's experts
                  (SwiGLU, grouped GEMM on CUDA sm90+ bf16, a dense loop elsewhere) -> combine
    dense layer (``mlp_only_layers`` / ``decoder_sparse_step``): a SwiGLU MLP on the rank
    h = h + moe_or_mlp(x)

then a final RMSNorm and the LM head. RMSNorm and RoPE run as FlashInfer's fused kernels on CUDA in
bf16/fp16 (``dp_runtime.model.elementwise_ops``), as torch ops elsewhere. ``forward(batch)`` returns
float32 logits of the rows that sample: every token of a decode batch (one per request), the last
token of each request of an extend batch. The forward never syncs with the host on the decode path,
so it can be captured.

The model is bound once to its attention and that attention's KV cache (``bind_attention``;
``with_attention`` gives a copy bound to another, weights shared): its attention block is the
cache's one writer, storing each layer's K/V before the backend attends (which only reads).

Every EP rank calls dispatch and combine in every sparse layer of every step, IDLE ranks with
zero rows included: the step loop makes sure an IDLE rank still runs this forward.

The dispatch plan is ``batch.plan``, the step's StepPlan (``dispatcher.StepPlanLike``); a
captured graph holds its capture plan, the bucket on every rank. Without a plan (one rank, a
direct call) the batch's own tokens are the only ones.

Shapes: T tokens, H hidden, Hq/Hkv heads, D head dim, K top-k, N rows delivered to this rank's
experts, L local experts, I expert size, V vocab, B requests.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from dispatcher.partition import ExpertPartition
from dispatcher.plan import FixedPlan
from dp_runtime.forward_mode import ForwardMode
from dp_runtime.model.elementwise_ops import elementwise_ops
from dp_runtime.model.expert_path import expert_path
from dp_runtime.model.fp8_blocks import Fp8BlockWeight
from dp_runtime.model.layers import RotaryEmbedding, qk_norm_attention
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.model.tensor_names import expert_names, layer_names
from dp_runtime.model.weight_groups import layer_groups
from dp_runtime.model.weights import expected_shapes

__all__ = ["Qwen3MoeModel"]

Weight = torch.Tensor | Fp8BlockWeight  # a GEMM weight: model dtype, or FP8 blocks (weight_groups)


def _rows(w: Weight, start: int, stop: int) -> Weight:
    return w.rows(start, stop) if isinstance(w, Fp8BlockWeight) else w[..., start:stop, :]


def _index(w: Weight, i: int) -> Weight:
    return w.select(i) if isinstance(w, Fp8BlockWeight) else w[i]


def _fill(target: Weight, src: Weight) -> None:
    """Copy a loaded weight into its storage: an FP8 one as it is (or dequantized into float
    storage), a float one as it is (or quantized into FP8 storage)."""
    if isinstance(src, Fp8BlockWeight) and not isinstance(target, Fp8BlockWeight):
        src = src.dequantize(target.dtype)
    target.copy_(src)


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    w_qkv: Weight  # (Hq*D + 2*Hkv*D, H); the GEMM weights may be FP8 blocks (weight_groups)
    q_norm: torch.Tensor | None  # None: the family has no q/k norm (Mixtral)
    k_norm: torch.Tensor | None
    w_o: Weight
    mlp_norm: torch.Tensor
    sparse: bool
    b_qkv: torch.Tensor | None = None  # (Hq*D + 2*Hkv*D,) with attention_bias
    b_o: torch.Tensor | None = None  # (H,) with attention_bias
    w_router: torch.Tensor | None = None  # (E, H)
    w13: Weight | None = None  # sparse: (L, 2I, H) local experts; dense: (2I, H)
    w2: Weight | None = None  # sparse: (L, H, I); dense: (H, I)


class Qwen3MoeModel:
    """The model of one rank (module docstring).

    Args:
        cfg: the model's shape.
        weights: ``(name, tensor)`` pairs with Hugging Face names, covering exactly
            ``expected_shapes(cfg, ep_rank, ep_size)`` (``dp_runtime.model.weights.iter_*``).
            Each is copied into the model's own storage, so a generator holds one at a time.
        attention: the attention backend (``dp_runtime.attention``) or None, bound later with
            ``bind_attention``.
        dispatcher: the EP dispatcher (``dispatcher.make_dispatcher``); its EP group decides
            which experts this rank holds.
        dtype, device: of the weights and hidden states.
        expert_kernels: None for the fastest that runs here (``expert_path``), else ``triton``,
            ``grouped_mm`` or ``dense``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        attention,
        dispatcher,
        dtype: torch.dtype,
        device: torch.device | str,
        expert_kernels: str | None = None,
    ) -> None:
        device = torch.device(device)
        self.cfg, self.dispatcher = cfg, dispatcher
        self.attention: Any = None
        self.kv_cache: Any = None
        self.dtype, self.device = dtype, device
        ep_rank, ep_size = dispatcher.ep.rank, dispatcher.ep.size
        self.partition = ExpertPartition(cfg.num_experts, ep_size)
        self.first_expert = self.partition.first(ep_rank)
        self.num_local_experts = self.partition.num_local(ep_rank)
        self.experts = expert_path(device, dtype, cfg.top_k, cfg.norm_topk_prob, expert_kernels)
        self._allocate()
        self._load(weights, expected_shapes(cfg, ep_rank, ep_size))
        if device.type == "cuda":
            # Loading's temporaries are gone (``_load`` returned) but their segments stay cached
            # in torch's allocator: hand them back before anything lasting lands in one (the RoPE
            # table next, then the cuBLAS workspace), or the KV sizing counts the largest (the
            # embedding's, 594 MiB on qwen3-30b-a3b) as taken although ~540 MiB of it is free.
            torch.cuda.empty_cache()
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_positions, cfg.rope_theta, device,
                                      yarn=cfg.rope_yarn)
        self.ops = elementwise_ops(device, dtype)
        if attention is not None:
            self.bind_attention(attention)

    def _load(self, weights: Iterable[tuple[str, torch.Tensor]],
              want: dict[str, tuple[int, ...]]) -> None:
        """Copy every weight into its place (``_target``), checking names and shapes; in a
        function of its own so that the last temporary dies with its frame."""
        ep = f"EP rank {self.dispatcher.ep.rank} of {self.dispatcher.ep.size}"
        seen: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in want:
                    raise KeyError(f"weight {name!r} is not a tensor of this rank's model ({ep})")
                if tuple(tensor.shape) != want[name]:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}; the config "
                                     f"needs {want[name]}")
                _fill(self._target(name), tensor)
                seen.add(name)
        missing = sorted(set(want) - seen)
        if missing:
            raise KeyError(f"weights are missing {len(missing)} tensors, first {missing[0]!r}")

    # -- attention binding ----------------------------------------------------------------------
    def bind_attention(self, attention: Any) -> None:
        """Attend through ``attention`` (a backend, or the ``graph.AttentionSplit`` over one) and
        store each layer's K/V into its ``kv_cache``, the cache it reads: one binding for both,
        so the model cannot write one cache while its attention reads another. Once per model
        (RuntimeError on a second: graphs captured with the first would keep writing it)."""
        if self.attention is not None:
            raise RuntimeError("Qwen3MoeModel: attention is bound already; with_attention() gives "
                               "a copy bound to another")
        self.attention, self.kv_cache = attention, attention.kv_cache

    def with_attention(self, attention: Any) -> Qwen3MoeModel:
        """A shallow copy bound to ``attention`` and its KV cache (``bind_attention``): the same
        weights, dispatcher and kernels; this model keeps its own binding (or none)."""
        other = copy.copy(self)
        other.attention = other.kv_cache = None
        other.bind_attention(attention)
        return other

    # -- storage ---------------------------------------------------------------------------------
    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _allocate(self) -> None:
        """Model storage, and ``self._targets``: each Hugging Face tensor name mapped to the slice
        of storage it fills (QKV fused, local experts stacked). The GEMM weights of a group that
        ``weight_groups`` marks FP8 are Fp8BlockWeight storage (values and block scales)."""
        c = self.cfg
        h, d = c.hidden_size, c.head_dim
        ep = self.dispatcher.ep
        self.embed = self._empty(c.vocab_size, h)
        self.final_norm = self._empty(h)
        self.lm_head = self.embed if c.tie_word_embeddings else self._empty(c.vocab_size, h)
        targets = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.final_norm}
        if not c.tie_word_embeddings:
            targets["lm_head.weight"] = self.lm_head
        q, kv = c.num_heads * d, c.num_kv_heads * d
        self.layers: list[_Layer] = []
        for i in range(c.num_layers):
            groups = layer_groups(c, i, ep.rank, ep.size)
            w = {key: (Fp8BlockWeight.empty(*g.shape, device=self.device) if g.fp8
                       else self._empty(*g.shape))
                 for key, g in groups.items()}
            layer = _Layer(
                attn_norm=self._empty(h), w_qkv=w["qkv"],
                q_norm=self._empty(d) if c.qk_norm else None,
                k_norm=self._empty(d) if c.qk_norm else None, w_o=w["o"], mlp_norm=self._empty(h),
                sparse=c.is_sparse(i), b_qkv=self._empty(q + 2 * kv) if c.attention_bias else None,
                b_o=self._empty(h) if c.attention_bias else None, w13=w["w13"], w2=w["w2"],
            )
            size = c.moe_intermediate_size if layer.sparse else c.intermediate_size
            if layer.sparse:
                layer.w_router = self._empty(c.num_experts, h)
                for local in range(self.num_local_experts):
                    gate, up, down = expert_names(c, i, self.first_expert + local)
                    w13, w2 = _index(layer.w13, local), _index(layer.w2, local)
                    targets[gate], targets[up] = _rows(w13, 0, size), _rows(w13, size, 2 * size)
                    targets[down] = w2
            by_role = {
                "attn_norm": layer.attn_norm, "mlp_norm": layer.mlp_norm, "q_norm": layer.q_norm,
                "k_norm": layer.k_norm, "o_proj": layer.w_o, "q_proj": _rows(layer.w_qkv, 0, q),
                "k_proj": _rows(layer.w_qkv, q, q + kv),
                "v_proj": _rows(layer.w_qkv, q + kv, q + 2 * kv), "router": layer.w_router,
            }
            if not layer.sparse:
                by_role.update(mlp_gate=_rows(layer.w13, 0, size),
                               mlp_up=_rows(layer.w13, size, 2 * size), mlp_down=layer.w2)
            if c.attention_bias:
                by_role.update(q_bias=layer.b_qkv[:q], k_bias=layer.b_qkv[q : q + kv],
                               v_bias=layer.b_qkv[q + kv :], o_bias=layer.b_o)
            for role, name in layer_names(c, i).items():
                targets[name] = by_role[role]
            self.layers.append(layer)
        self._targets = targets

    def _target(self, name: str) -> torch.Tensor | Fp8BlockWeight:
        """The slice of model storage that the Hugging Face tensor ``name`` fills."""
        return self._targets[name]

    def weight_bytes(self) -> int:
        """Bytes of this rank's weights (``memory_sizing.weight_bytes_per_rank`` predicts it)."""
        tensors = [self.embed, self.final_norm] + ([] if self.cfg.tie_word_embeddings
                                                   else [self.lm_head])
        for layer in self.layers:
            tensors += [t for t in (layer.attn_norm, layer.w_qkv, layer.q_norm, layer.k_norm,
                                    layer.w_o, layer.b_qkv, layer.b_o, layer.mlp_norm,
                                    layer.w_router, layer.w13, layer.w2) if t is not None]
        return sum(t.nbytes if isinstance(t, Fp8BlockWeight) else t.numel() * t.element_size()
                   for t in tensors)

    # -- forward ---------------------------------------------------------------------------------
    def _moe(self, layer: _Layer, x_TH: torch.Tensor, plan, extend: bool, live_rows,
             add_norm=None) -> torch.Tensor:
        """The sparse block's output; with ``add_norm=(h_TH, weight, eps)`` (``_fuses_add_norm``)
        the next norm's input instead, ``h_TH`` updated in place: ``ops.add_rms_norm`` done.
        ``live_rows`` (``_live_rows``): rows from it on are padding, routed to no expert."""
        weights_TK, ids_TK = self.experts.route(self.ops.linear(x_TH, layer.w_router), live_rows)
        d = self.dispatcher
        handle, inputs = d.dispatch(x_TH, ids_TK, weights_TK, plan)
        out_ND = self.experts.experts(inputs.hidden_ND, inputs.shifted_expert_ids_NK,
                                      inputs.weights_NK, layer.w13, layer.w2,
                                      out_ND=d.expert_output_buffer(handle), extend=extend,
                                      add_norm=add_norm)
        return d.combine(out_ND, handle)

    @property
    def _fuses_add_norm(self) -> bool:
        """Whether a sparse layer's expert sum also does the next layer's add+RMSNorm: the
        combine must be the identity (one rank) for the sum's rows to be the residual's, and the
        expert path must offer it."""
        return self.dispatcher.combine_is_identity and self.experts.fuses_add_norm

    def _live_rows(self, batch) -> torch.Tensor | None:
        """The batch's live row count on the device (a graph replay's ``num_token_non_padded``)
        when the experts see exactly this rank's rows (the local dispatch); else None. A padded
        bucket's rows then cost no expert GEMM: they all share one hidden state, so they would
        fill whole blocks of the same top-k experts (a 320-token mixed step in the 512 bucket:
        24 extra 64-row blocks a layer). A gathering dispatch marks other ranks' padding itself."""
        live = getattr(batch, "num_token_non_padded", None)
        return live if live is not None and self.dispatcher.combine_is_identity else None

    def _mlp(self, layer: _Layer, x_TH: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(self.ops.silu_and_mul(self.ops.linear(x_TH, layer.w13)), layer.w2)

    @staticmethod
    def _logit_rows(batch) -> torch.Tensor | None:
        """The rows that sample: each extend request's last token; None for every row."""
        if batch.forward_mode is ForwardMode.EXTEND:
            return torch.cumsum(batch.extend_seq_lens[: batch.batch_size], 0) - 1
        return None

    def forward(self, batch) -> torch.Tensor:
        """Logits (float32) of the sampling rows of ``batch`` (module docstring): (B, V)."""
        c = self.cfg
        t = batch.input_ids.shape[0]
        plan = batch.plan if batch.plan is not None else FixedPlan.from_counts((t,))
        ops, eps = self.ops, c.rms_norm_eps
        extend = batch.forward_mode is ForwardMode.EXTEND
        fuse_norm = self._fuses_add_norm
        live = self._live_rows(batch)
        # The residual stream ``h`` is added into the next norm (one fused kernel on CUDA):
        # ``x, h = add_rms_norm(out, h, w)`` is ``h = h + out; x = norm(h)``.
        h_TH = self.embed[batch.input_ids]
        x_TH = ops.rms_norm(h_TH, self.layers[0].attn_norm, eps)
        for i, layer in enumerate(self.layers):
            a_TH = qk_norm_attention(
                x_TH, layer.w_qkv, layer.q_norm, layer.k_norm,
                layer.w_o, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                eps=eps, rotary=self.rotary, attention=self.attention, kv_cache=self.kv_cache,
                layer_id=i, batch=batch, ops=ops, b_qkv=layer.b_qkv, b_o=layer.b_o,
            )
            x_TH, h_TH = ops.add_rms_norm(a_TH, h_TH, layer.mlp_norm, eps)
            if layer.sparse and fuse_norm and i + 1 < len(self.layers):
                # the sum's launch adds into h and writes the next layer's normed input
                x_TH = self._moe(layer, x_TH, plan, extend, live,
                                 add_norm=(h_TH, self.layers[i + 1].attn_norm, eps))
                continue
            m_TH = (self._moe(layer, x_TH, plan, extend, live) if layer.sparse
                    else self._mlp(layer, x_TH))
            if i + 1 < len(self.layers):
                x_TH, h_TH = ops.add_rms_norm(m_TH, h_TH, self.layers[i + 1].attn_norm, eps)
        # Only the sampling rows need the last add, the final norm and the LM head.
        rows = self._logit_rows(batch)
        if rows is not None:
            m_TH, h_TH = m_TH[rows], h_TH[rows]
        x_BH, _ = ops.add_rms_norm(m_TH, h_TH, self.final_norm, eps)
        return (x_BH @ self.lm_head.T).float()
