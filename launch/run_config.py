"""RunConfig: what `dp-runtime run` and the torchrun entry were asked to do, frozen.

One object turns the command-line options into the RankSpec every rank receives
(``spec(device)``) and into the requests (``load_requests()``), so the CLI, the torchrun entry
and the tests build them the same way.

``dtype="auto"`` is float32 on CPU (bfloat16 matmuls on CPU are slow and the tiny model's
tests compare float32 tokens) and bfloat16 on CUDA.

Construction checks every field by itself and names it as the command line spells it
(``--max-new-tokens``), raising UsageError; what needs the model or the runtime config (a
checkpoint's config.json, the RuntimeConfig rules) is checked by ``spec()``. Importing this
module imports no torch (the CLI checks options before anything slow starts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dp_runtime.model.model_config import PRESETS, ModelConfig
from dp_runtime.model.quant_config import QUANTIZATION_CHOICES
from dp_runtime.options import Options
from launch.cli_errors import UsageError, check_choice

if TYPE_CHECKING:
    from dp_runtime.rank_spec import RankSpec
    from dp_runtime.serving.request import Request

__all__ = ["DISPATCHERS", "DTYPES", "KV_CACHE_DTYPES", "SCHEDULE_POLICIES", "RunConfig",
           "parse_mixed_step_tokens"]

# The same names as dp_runtime.choices.DISPATCHERS and RuntimeConfig's dtypes (a test
# holds them equal); spelled out here so that checking an option imports no torch.
DISPATCHERS = ("auto", "local", "all_gather", "all_to_all", "flashinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULE_POLICIES = ("fcfs", "lof")  # RuntimeConfig.schedule_policy's, held equal by a test
# RuntimeConfig.kv_cache_dtype's names (auto: the model's dtype; fp8 is fp8_e4m3), held by a test.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
_COUNTS = ("dp", "requests", "prompt_len", "max_new_tokens", "max_running_requests",
           "chunked_prefill_size")


@dataclass(frozen=True)
class RunConfig(Options):
    """The shared ``Options`` (their defaults: ``dp_runtime/options.py``) and what starts them
    here: the model, the ranks, and ``run``'s synthetic workload."""

    dp: int = 2
    model: str = "tiny"
    requests: int = 16
    prompt_len: int = 32
    max_new_tokens: int = 16
    workload: str | None = None

    def __post_init__(self) -> None:
        for name in _COUNTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{_option(name)} must be an integer >= 1, got {value!r}")
        n = self.context_len
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise UsageError(f"--context-len must be an integer >= 1, got {n!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise UsageError(f"--seed must be an integer >= 0, got {self.seed!r}")
        check_choice("--dispatcher", self.dispatcher, DISPATCHERS)
        check_choice("--dtype", self.dtype, DTYPES)
        check_choice("--schedule-policy", self.schedule_policy, SCHEDULE_POLICIES)
        check_choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("--quantization", self.quantization, QUANTIZATION_CHOICES)
        if not isinstance(self.prefix_caching, bool):
            raise UsageError(f"--prefix-caching is a flag (true or false), "
                             f"got {self.prefix_caching!r}")
        mixed = self.mixed_step_tokens
        if mixed != "auto" and (isinstance(mixed, bool) or not isinstance(mixed, int)
                                or not 1 <= mixed <= self.chunked_prefill_size):
            raise UsageError(_mixed_rule(self.chunked_prefill_size, mixed))
        timeout = self.dp_sync_timeout_s
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not (math.isfinite(timeout) and timeout > 0)):
            raise UsageError(f"dp_sync_timeout_s must be a number > 0, got {timeout!r}")
        if self.model not in PRESETS and not Path(self.model).is_dir():
            raise UsageError(f"--model {self.model!r} is neither a preset "
                             f"({', '.join(sorted(PRESETS))}) nor a checkpoint directory")
        if self.workload is not None and not Path(self.workload).is_file():
            raise UsageError(f"--workload file {self.workload!r} does not exist")

    def spec(self, device: str) -> RankSpec:
        """The RankSpec for ranks on ``device`` (``cpu`` or ``cuda``, already resolved). Raises
        UsageError for a ``--context-len`` over the model's limit, ValueError from the model
        config or the RuntimeConfig rules."""
        from dp_runtime.rank_spec import RankSpec

        if self.context_len is not None:
            limit = self.model_config().max_positions
            if self.context_len > limit:
                raise UsageError(f"--context-len {self.context_len} exceeds the model's limit of "
                                 f"{limit} positions ({self.model})")
        dtype = (self.dtype if self.dtype != "auto"
                 else ("bfloat16" if device == "cuda" else "float32"))
        return RankSpec.create(
            self.model, dispatcher=self.dispatcher, dp_size=self.dp, device=device, dtype=dtype,
            max_running_requests=self.max_running_requests,
            chunked_prefill_size=self.chunked_prefill_size,
            dp_sync_timeout_s=self.dp_sync_timeout_s, seed=self.seed,
            max_context_len=self.context_len, schedule_policy=self.schedule_policy,
            mixed_step_tokens=self.mixed_step_tokens, kv_cache_dtype=self.kv_cache_dtype,
            prefix_caching=self.prefix_caching, quantization=self.quantization,
            kv_mem_fraction=self.kv_mem_fraction,
        )

    def model_config(self) -> ModelConfig:
        """The model's config (the preset's, or the checkpoint's config.json)."""
        return (ModelConfig.preset(self.model) if self.model in PRESETS
                else ModelConfig.from_dir(self.model))

    def vocab_size(self) -> int:
        """The model's vocabulary (read from the preset or the checkpoint's config.json)."""
        return self.model_config().vocab_size

    def load_requests(self) -> list[Request]:
        """The workload file's requests (sampling defaults from the options), else the synthetic
        workload; token ids are checked against the model's vocabulary. Raises WorkloadError
        naming the file and line of a bad workload."""
        from dp_runtime.serving.request import SamplingParams
        from launch.workload import SyntheticWorkload, load_jsonl

        vocab = self.vocab_size()
        if self.workload:
            return load_jsonl(self.workload, SamplingParams(max_new_tokens=self.max_new_tokens),
                              vocab_size=vocab)
        return SyntheticWorkload(num_requests=self.requests, prompt_len=self.prompt_len,
                                 max_new_tokens=self.max_new_tokens, vocab_size=vocab,
                                 seed=self.seed).requests()


def parse_mixed_step_tokens(value: int | str, chunked_prefill_size: int) -> int | str:
    """``--mixed-step-tokens`` as typed (``"auto"`` or digits; an int passes) turned into the
    RunConfig value; the range is RunConfig's to check. Raises UsageError for anything else,
    with the rule ``chunked_prefill_size`` sets."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    try:
        return int(str(value).strip())
    except ValueError:
        raise UsageError(_mixed_rule(chunked_prefill_size, value)) from None


def _mixed_rule(chunked_prefill_size: int, value: object) -> str:
    return (f"--mixed-step-tokens must be auto or an integer in [1, {chunked_prefill_size}] "
            f"(at most --chunked-prefill-size), got {value!r}")


def _option(field: str) -> str:
    return "--" + field.replace("_", "-")
