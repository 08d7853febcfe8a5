"""What the capacity planner takes (``PlanInput``), apart from the planner (``planner.py``) and
its result types (``plan_result.py``), which both use it: neither imports the other's importer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dp_runtime.model.model_config import PRESETS
from dp_runtime.options import DEFAULTS
from dp_runtime.rank_spec import RankSpec
from launch.gpu_specs import GPUS

__all__ = ["PlanInput"]


@dataclass(frozen=True)
class PlanInput:
    """What the planner takes (the options it shares with ``run``/``serve`` default as theirs:
    ``dp_runtime/options.py``; ``dtype`` is bfloat16, what ``auto`` means on the CUDA rank a plan
    sizes).

    - ``model``: a preset (``tiny``, ``qwen3-30b-a3b``), a checkpoint directory, or its
      ``config.json``.
    - ``dtype``: of weights and hidden states (a RuntimeConfig dtype name);
      ``kv_cache_dtype``: the KV cache's (``"auto"``: ``dtype``; ``"fp8"``/``"fp8_e4m3"``: FP8,
      a byte per element, RuntimeConfig.kv_cache_dtype).
    - ``dp_size``; ``ep_size`` (None: the world size).
    - ``gpu_mem_bytes``: usable memory of one GPU; ``gpu_name`` for display; ``nvlink``: whether
      the GPUs are NVLink-connected (``dispatcher="auto"`` picks FlashInfer only then).
    - ``max_running_requests``, ``chunked_prefill_size``, ``cuda_graph_bs`` (``"auto"`` or
      sizes; ``()`` for no graphs), ``context_len`` (None: the runtime's default),
      ``dispatcher`` (``auto`` | ``all_gather`` | ``all_to_all`` | ``flashinfer``),
      ``use_cuda_graph`` (None: on, as the rank worker on CUDA; False: eager only).
    - ``kv_tokens_per_request``: KV tokens to guarantee each running request (None:
      ``context_len``); the fit rule in the module docstring.
    - ``quantization``: ``none`` (weights as stored) or ``fp8`` (quantized at load; RankSpec
      applies it, so the weights are sized as the rank stores them).
    - ``kv_mem_fraction``: the rank's (``RankSpec.kv_mem_fraction``): the share of the memory
      left after everything else that its KV cache takes; the rest is its headroom.
    """

    model: str = "qwen3-30b-a3b"
    dtype: str = "bfloat16"
    kv_cache_dtype: str = DEFAULTS.kv_cache_dtype
    dp_size: int = 1
    ep_size: int | None = None
    gpu_mem_bytes: int = GPUS["h100"].mem_bytes
    gpu_name: str | None = GPUS["h100"].name
    nvlink: bool = True
    max_running_requests: int = DEFAULTS.max_running_requests
    chunked_prefill_size: int = DEFAULTS.chunked_prefill_size
    cuda_graph_bs: tuple[int, ...] | str = "auto"
    context_len: int | None = DEFAULTS.context_len
    dispatcher: str = DEFAULTS.dispatcher
    use_cuda_graph: bool | None = None
    kv_tokens_per_request: int | None = None
    kv_mem_fraction: float = DEFAULTS.kv_mem_fraction
    quantization: str = DEFAULTS.quantization

    def __post_init__(self) -> None:
        if self.gpu_mem_bytes <= 0:
            raise ValueError(f"PlanInput.gpu_mem_bytes must be > 0, got {self.gpu_mem_bytes}")
        if self.kv_tokens_per_request is not None and self.kv_tokens_per_request < 1:
            raise ValueError(f"PlanInput.kv_tokens_per_request must be >= 1, "
                             f"got {self.kv_tokens_per_request}")

    def rank_spec(self, max_running_requests: int | None = None, *,
                  device: str = "cpu") -> RankSpec:
        """The RankSpec these inputs describe (validated by RankSpec and RuntimeConfig), with
        ``max_running_requests`` replaced when given. ``device`` only matters to a real rank,
        which then sizes its own KV cache (no ``kv_cache_tokens``), by the rule the plan
        predicts."""
        graph_kwargs: dict[str, Any] = {"cuda_graph_bs": "auto", "cuda_graph_max_bs": "auto"}
        if not isinstance(self.cuda_graph_bs, str):
            sizes = tuple(int(s) for s in self.cuda_graph_bs)
            graph_kwargs = {"cuda_graph_bs": sizes, "cuda_graph_max_bs": sizes[-1] if sizes else 0}
        elif self.cuda_graph_bs != "auto":
            raise ValueError(f'PlanInput.cuda_graph_bs must be "auto" or sizes, '
                             f'got {self.cuda_graph_bs!r}')
        return RankSpec.create(
            _model_ref(self.model), dispatcher=self.dispatcher, use_cuda_graph=self.use_cuda_graph,
            kv_mem_fraction=self.kv_mem_fraction, max_context_len=self.context_len,
            dp_size=self.dp_size, ep_size="auto" if self.ep_size is None else self.ep_size,
            max_running_requests=(self.max_running_requests if max_running_requests is None
                                  else max_running_requests),
            chunked_prefill_size=self.chunked_prefill_size, dtype=self.dtype,
            kv_cache_dtype=self.kv_cache_dtype, device=device, quantization=self.quantization,
            **graph_kwargs,
        )


def _model_ref(model: str) -> str:
    """A preset name or a checkpoint directory (a path to its config.json gives the directory)."""
    if model in PRESETS:
        return model
    path = Path(model)
    if path.name == "config.json" and path.is_file():
        return str(path.parent)
    if path.is_file():
        raise ValueError(f"model {model!r} is a file; give a preset, a checkpoint directory or its "
                         "config.json")
    if not path.exists():
        raise ValueError(f"model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) "
                         "nor an existing path")
    return model
