"""RankSpec: everything one DP rank needs to build itself, frozen and picklable.

A launcher (Ray actor, torchrun entry, test) creates one RankSpec and sends the same object to
every rank; each rank adds only its rank index. ``RankSpec.create`` derives the runtime's
``hidden_size`` from the model so the two cannot disagree.

Fields:

- ``runtime``: the RuntimeConfig (dp_size, ep_size, max_running_requests, chunked_prefill_size,
  graph sizes, dtype, device...).
- ``model``: a preset name (``tiny``, ``qwen3-30b-a3b``) for random weights, or a Hugging Face
  checkpoint directory (config.json and *.safetensors).
- ``model_overrides``: ModelConfig fields replaced after loading the config (``num_layers`` for
  a shorter benchmark stack); only with a preset.
- ``dispatcher``: ``auto`` | ``local`` (world size 1) | ``all_gather`` | ``all_to_all`` |
  ``flashinfer`` (``dp_runtime.choices`` resolves ``auto``).
- ``attention``: ``auto`` (FlashInfer on CUDA when it imports, else torch SDPA) | ``sdpa`` |
  ``flashinfer``.
- ``use_cuda_graph``: None for "on for CUDA"; False: eager only (``dp_runtime.choices``).
- ``kv_cache_tokens``: KV slots per rank; None sizes them: on CUDA from ``kv_mem_fraction`` of the
  memory free after weights, on CPU ``max_running_requests * max_context_len`` capped at 65536.
- ``max_context_len``: longest prompt + output of one request (None: the model's limit, capped
  at 4096). The model's limit is ``ModelConfig.max_positions`` (YaRN extends it); a model with a
  sliding attention window allows at most the window (the model has no windowed attention, so
  a context the window would cut is refused, not computed wrong).
- ``seed``: of random weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from dp_runtime.config import RuntimeConfig
from dp_runtime.model.model_config import PRESETS, ModelConfig, ModelConfigError
from dp_runtime.model.quant_config import with_quantization
from dp_runtime.options import DEFAULTS

__all__ = ["ATTENTION_KINDS", "RankSpec"]

ATTENTION_KINDS = ("auto", "sdpa", "flashinfer")
_DEFAULT_MAX_CONTEXT = 4096


@dataclass(frozen=True)
class RankSpec:
    runtime: RuntimeConfig
    model: str = "tiny"
    model_overrides: tuple[tuple[str, Any], ...] = ()
    dispatcher: str = DEFAULTS.dispatcher
    attention: str = "auto"
    use_cuda_graph: bool | None = None
    kv_cache_tokens: int | None = None
    kv_mem_fraction: float = DEFAULTS.kv_mem_fraction
    max_context_len: int | None = None
    seed: int = DEFAULTS.seed

    def __post_init__(self) -> None:
        from dp_runtime.choices import DISPATCHERS

        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"RankSpec.dispatcher must be one of {DISPATCHERS}, "
                             f"got {self.dispatcher!r}")
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"RankSpec.attention must be one of {ATTENTION_KINDS}, "
                             f"got {self.attention!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 1:
            raise ValueError(f"RankSpec.kv_cache_tokens must be >= 1, got {self.kv_cache_tokens}")
        if not 0 < self.kv_mem_fraction <= 1:
            raise ValueError("RankSpec.kv_mem_fraction must be in (0, 1], "
                             f"got {self.kv_mem_fraction}")
        if self.model_overrides and not self.is_preset:
            raise ValueError(f"RankSpec.model_overrides apply to presets only; {self.model!r} is a "
                             "checkpoint")
        cfg = self.model_config()
        if self.runtime.hidden_size != cfg.hidden_size:
            raise ValueError(
                f"RankSpec: runtime.hidden_size={self.runtime.hidden_size} but "
                f"model {self.model!r} has hidden_size={cfg.hidden_size} (use RankSpec.create, "
                "which takes it from the model)"
            )
        if self.context_len > cfg.max_positions:
            what = "max_position_embeddings" if cfg.rope_yarn is None else "YaRN-extended context"
            raise ValueError(
                f"RankSpec.max_context_len={self.context_len} exceeds the "
                f"model's {what}={cfg.max_positions}"
            )
        if cfg.sliding_window is not None and self.context_len > cfg.sliding_window:
            # Keys further back than the window would be masked by the model; ours attends to all.
            raise ModelConfigError(
                f"model {self.model!r} has sliding_window={cfg.sliding_window}, shorter than "
                f"max_context_len={self.context_len}: sliding-window attention is not supported "
                f"(set max_context_len <= {cfg.sliding_window})"
            )

    @classmethod
    def create(cls, model: str = "tiny", *, model_overrides: dict[str, Any] | None = None,
               dispatcher: str = DEFAULTS.dispatcher, attention: str = "auto",
               use_cuda_graph: bool | None = None, kv_cache_tokens: int | None = None,
               kv_mem_fraction: float = DEFAULTS.kv_mem_fraction,
               max_context_len: int | None = None, seed: int = DEFAULTS.seed,
               **runtime: Any) -> RankSpec:
        """A spec whose RuntimeConfig takes ``runtime`` keywords and the model's hidden size."""
        overrides = tuple(sorted((model_overrides or {}).items()))
        cfg = _model_config(model, overrides)
        rt = RuntimeConfig(hidden_size=cfg.hidden_size, **runtime)
        return cls(rt, model, overrides, dispatcher, attention, use_cuda_graph, kv_cache_tokens,
                   kv_mem_fraction, max_context_len, seed)

    @property
    def is_preset(self) -> bool:
        return self.model in PRESETS

    def model_config(self) -> ModelConfig:
        """The model as this rank serves it (``runtime.quantization`` applied)."""
        return self._model

    @functools.cached_property
    def _model(self) -> ModelConfig:
        # A checkpoint's config.json is read once per spec, not at every question about it.
        return with_quantization(_model_config(self.model, self.model_overrides),
                                 self.runtime.quantization)

    @functools.cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The checkpoint's EOS ids (``model/eos.py``): a request stops at one unless its
        sampling says ``ignore_eos``. A preset has none."""
        if self.is_preset:
            return ()
        from dp_runtime.model.eos import checkpoint_eos_ids

        return checkpoint_eos_ids(self.model)

    @property
    def context_len(self) -> int:
        """The resolved ``max_context_len``."""
        if self.max_context_len is not None:
            return self.max_context_len
        cfg = self.model_config()
        limit = min(cfg.max_positions, _DEFAULT_MAX_CONTEXT)
        return limit if cfg.sliding_window is None else min(limit, cfg.sliding_window)


def _model_config(model: str, overrides: tuple[tuple[str, Any], ...]) -> ModelConfig:
    return ModelConfig.load(model, **dict(overrides))
