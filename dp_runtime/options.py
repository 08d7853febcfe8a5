"""Options: what a user chooses about the ranks they start, with the one default of each.

Every door takes its defaults from here, so they cannot drift apart: ``dp-runtime run``, ``serve``
and ``plan``, the torchrun entry, ``RunConfig`` (which is an ``Options``: the type ``run``,
``serve`` and the torchrun entry check and turn into a RankSpec), ``PlanInput``, ``RankSpec`` /
``RuntimeConfig`` and the engine's ``EngineOptions``. So ``plan`` with no rank options sizes
exactly the rank ``serve`` starts for the same model and GPUs (``tests/test_options.py``).

The defaults are a GPU server's (SGLang's order of magnitude): 256 requests running per rank,
8192-token prefill chunks. On CPU the KV cache is capped (``memory_sizing.CPU_MAX_KV_TOKENS``)
whatever they say. What the options do is documented where they act (``RuntimeConfig``,
``RankSpec``, ``EngineOptions``); the deployment facts (model, dp, device, GPU) are each door's
own: ``plan`` plans a GPU box, ``run``/``serve`` start on whatever this machine has.

Pure: importing it imports no torch (the CLI reads these defaults before anything slow starts).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULTS", "Options"]


@dataclass(frozen=True)
class Options:
    """The rank and gang options shared by every door, at their defaults."""

    max_running_requests: int = 256  # requests running at once per rank (the decode batch cap)
    chunked_prefill_size: int = 8192  # prompt tokens per rank per step
    context_len: int | None = None  # longest prompt + output; None: min(model limit, 4096)
    dispatcher: str = "auto"
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA (what plan plans)
    kv_cache_dtype: str = "auto"  # the model's dtype
    quantization: str = "none"  # weights as the checkpoint stores them (fp8: FP8 blocks)
    schedule_policy: str = "fcfs"
    mixed_step_tokens: int | str = "auto"  # the largest extend graph bucket
    prefix_caching: bool = True
    kv_mem_fraction: float = 0.85  # of the memory left after everything else, for the KV cache
    seed: int = 0
    dp_sync_timeout_s: float = 120.0
    max_restarts: int = 2  # gang restarts after a rank fails (Ray)
    hang_timeout_s: float = 120.0  # a rank with due work whose steps stopped that long is hung


DEFAULTS = Options()
