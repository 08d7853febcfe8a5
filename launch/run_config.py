"""RunConfig: what `dp-runtime run` and the torchrun entry were asked to do, frozen.

One object turns the command-line options into the RankSpec every rank receives
(``spec(device)``) and into the requests (``load_requests()``), so the CLI, the torchrun entry
and the tests build them the same way.

``dtype="auto"`` is float32 on CPU (bfloat16 matmuls on CPU are slow and the tiny model's
tests compare float32 tokens) and bfloat16 on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

from dp_runtime.model.model_config import PRESETS, ModelConfig
from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.request import Request, SamplingParams
from launch.workload import SyntheticWorkload, load_jsonl

__all__ = ["RunConfig"]


@dataclass(frozen=True)
class RunConfig:
    dp: int = 2
    model: str = "tiny"
    dispatcher: str = "auto"
    requests: int = 16
    prompt_len: int = 32
    max_new_tokens: int = 16
    workload: str | None = None
    dtype: str = "auto"
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    seed: int = 0
    dp_sync_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("dp", "requests", "prompt_len", "max_new_tokens", "max_running_requests", "chunked_prefill_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")

    def spec(self, device: str) -> RankSpec:
        """The RankSpec for ranks on ``device`` (``cpu`` or ``cuda``, already resolved)."""
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
        return RankSpec.create(
            self.model, dispatcher=self.dispatcher, dp_size=self.dp, device=device, dtype=dtype,
            max_running_requests=self.max_running_requests, chunked_prefill_size=self.chunked_prefill_size,
            dp_sync_timeout_s=self.dp_sync_timeout_s, seed=self.seed,
        )

    def vocab_size(self) -> int:
        """The model's vocabulary (read from the preset or the checkpoint's config.json)."""
        if self.model in PRESETS:
            return ModelConfig.preset(self.model).vocab_size
        return ModelConfig.from_dir(self.model).vocab_size

    def load_requests(self) -> list[Request]:
        """The workload file's requests (sampling defaults from the options), else the synthetic
        workload; token ids are checked against the model's vocabulary. Raises WorkloadError
        naming the file and line of a bad workload."""
        vocab = self.vocab_size()
        if self.workload:
            return load_jsonl(self.workload, SamplingParams(max_new_tokens=self.max_new_tokens), vocab_size=vocab)
        return SyntheticWorkload(num_requests=self.requests, prompt_len=self.prompt_len,
                                 max_new_tokens=self.max_new_tokens, vocab_size=vocab, seed=self.seed).requests()
