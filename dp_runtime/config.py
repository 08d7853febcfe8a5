"""RuntimeConfig: the one frozen configuration of a rank, "auto" values resolved at construction.

Construct it with keywords; every ``"auto"`` is replaced by a concrete value before the object
is frozen, so code below never sees ``"auto"``. An invalid combination raises ValueError at
construction, naming the rule and the values.

Rules (checked in this order):

===============================  ===================================================  ==============
field                            rule                                                 "auto"
===============================  ===================================================  ==============
dp_size, attn_tp_size            >= 1; ``world_size = dp_size * attn_tp_size``
ep_size                          >= 1 and divides ``world_size`` (experts are         world_size
                                 spread over EP groups of ``ep_size`` ranks that
                                 tile the world)
max_running_requests             >= 1
chunked_prefill_size             >= 1
hidden_size                      >= 1
cuda_graph_max_bs                0 <= value <= max_running_requests, a multiple of    min(mrr, 256)
                                 ``attn_tp_size`` (a graph is captured at an          rounded down
                                 aligned per-rank size); 0 disables graphs            to attn_tp
cuda_graph_bs (capture sizes,    strictly increasing, each > 0 and a multiple of      graph/'s
tokens per rank)                 ``attn_tp_size``; the last equals                    capture_sizes
                                 ``cuda_graph_max_bs``; empty iff that is 0           policy
cuda_graph_extend_tokens (token  strictly increasing, each > 0, a multiple of         16, 32, 64,
buckets of extend graphs)        ``attn_tp_size`` and <= max_tokens_per_rank;         128, 256,
                                 empty: extend steps run eager                        384, 512,
                                                                                      768, 1024,
                                                                                      capped
dp_padding                       None / "auto" (the rule) / "max_len" / "sum_len"     None
dp_sync_exchange                 "auto" (same node: shm, else gloo) / "shm" / "gloo"  env or auto
dp_sync_timeout_s                > 0                                                  (120)
dp_sync_shm_dir                  a directory                                          env, /dev/shm
eager_input_no_copy              bool / "auto": the eager runner's no-copy escape     env, False
                                 hatch (the batch's own tensors, no registry)
flashinfer_checks                bool / "auto": host checks of every FlashInfer plan  env, False
overlap_schedule                 bool: the host schedules step N+1 while the GPU      (True)
                                 runs step N (docs/model.md, "Overlapped steps")
mixed_steps                      bool: a step carries every decode row with the       (True)
                                 prefill chunks (docs/model.md, "Mixed steps");
                                 False: a step prefills or decodes, never both
mixed_step_tokens                1 <= value <= chunked_prefill_size: the most tokens  the largest
                                 a mixed step brings, its decode rows included        extend bucket
                                                                                      (else the
                                                                                      chunk)
schedule_policy                  "fcfs" (arrival order) / "lof" (longest output       ("fcfs")
                                 first: the arrived request with the most
                                 max_new_tokens is admitted first)
prefix_caching                   bool: reuse the K/V of cached prompt prefixes        (True)
                                 (serving/prefix_cache.py)
dtype                            a torch.dtype or a name: bfloat16, bf16, float16,    (bfloat16)
                                 fp16, float32, fp32
kv_cache_dtype                   ``dtype`` or float8_e4m3fn (names: fp8, fp8_e4m3):   dtype
                                 what the KV cache stores; fp8 halves its bytes per
                                 token (twice the slots, half the bytes a decode
                                 step's attention reads), K/V rounded to e4m3 at
                                 scale 1 (saturating at +-448), read back in
                                 ``dtype``
quantization                     "none" (weights as stored) / "fp8": float weights    ("none")
                                 quantized at load to FP8 128x128 blocks
                                 (``model.quant_config``)
device                           anything ``torch.device`` takes                      cuda if
                                                                                      available
===============================  ===================================================  ==============

``dp_sync_exchange == "auto"`` stays "auto" after resolution unless DP_RUNTIME_DP_SYNC_EXCHANGE
sets it: which path "auto" takes depends on where the ranks run, which only the step sync
learns (hostnames exchanged once at init).

Derived sizes (pure, used by the runtime and by the planner alike):
``max_tokens_per_rank = align_up(max(chunked_prefill_size, max_running_requests), attn_tp_size)``
and ``max_global_tokens = max_tokens_per_rank * dp_size`` (the largest gathered buffer). A
mixed step counts its decode rows against ``chunked_prefill_size`` (it is formed only when they
leave room), so it never brings more than ``max_tokens_per_rank`` tokens either.

Extending: add a field with a default, resolve it in ``_resolve``, check it in ``_validate``.
``plan_fields`` (compared across ranks at init) covers every field except the rank-local ones
it lists; add a new rank-local field there.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from dispatcher.sizing import max_tokens_per_rank
from dp_runtime.env import read_env
from dp_runtime.model.quant_config import QUANTIZATION_CHOICES
from dp_runtime.options import DEFAULTS
from dp_runtime.sync.padding_mode import PaddingMode
from graph.capture_sizes import capture_sizes

__all__ = ["SCHEDULE_POLICIES", "RuntimeConfig", "align_up"]

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}
# KV cache storage other than the model's dtype: FP8 e4m3 (vLLM's and SGLang's "fp8" KV cache).
_KV_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
              "float8_e4m3fn": torch.float8_e4m3fn}
_EXCHANGES = ("auto", "shm", "gloo")
# The scheduler's admission orders (dp_runtime/serving/scheduler.py, module docstring).
SCHEDULE_POLICIES = ("fcfs", "lof")
_AUTO_GRAPH_MAX_BS = 256
# Token buckets of extend graphs: eager extend steps of the 48-layer model are bound by host
# time (about 46-50 ms on an H100) up to about 1024 tokens, and mixed steps (the running decode
# rows plus a few prompts) land there all the time under load. Past 1024 the GPU work hides the
# host. 384 and 768 halve the padding of the mixed steps between 256 and 1024 tokens (the running
# decode rows and a prompt or two). A bucket costs little graph memory: its pieces' q/k/v and its
# logits go back to the pool (graph/piecewise_runner.py).
_AUTO_EXTEND_TOKENS = (16, 32, 64, 128, 256, 384, 512, 768, 1024)


def align_up(value: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` (>= 1) that is >= ``value`` (>= 0)."""
    return -(-value // alignment) * alignment


def _fail(rule: str, **values: Any) -> ValueError:
    shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
    return ValueError(f"RuntimeConfig: {rule} (got {shown})")


@dataclass(frozen=True)
class RuntimeConfig:
    """The frozen configuration of one rank (rules and "auto" values: see the module docstring)."""

    dp_size: int = 1
    attn_tp_size: int = 1
    ep_size: int | str = "auto"
    max_running_requests: int = DEFAULTS.max_running_requests
    chunked_prefill_size: int = DEFAULTS.chunked_prefill_size
    cuda_graph_max_bs: int | str = "auto"
    cuda_graph_bs: tuple[int, ...] | str = "auto"
    cuda_graph_extend_tokens: tuple[int, ...] | str = "auto"
    hidden_size: int = 4096
    dtype: torch.dtype | str = torch.bfloat16
    kv_cache_dtype: torch.dtype | str = "auto"
    device: torch.device | str = "auto"
    dp_padding: PaddingMode | str | None = None
    dp_sync_exchange: str = "auto"
    dp_sync_timeout_s: float = DEFAULTS.dp_sync_timeout_s
    dp_sync_shm_dir: str = "auto"
    eager_input_no_copy: bool | str = "auto"
    flashinfer_checks: bool | str = "auto"
    overlap_schedule: bool = True
    mixed_steps: bool = True
    mixed_step_tokens: int | str = DEFAULTS.mixed_step_tokens
    schedule_policy: str = DEFAULTS.schedule_policy
    prefix_caching: bool = DEFAULTS.prefix_caching
    quantization: str = DEFAULTS.quantization

    def __post_init__(self) -> None:
        self._check_ints()
        for name, value in self._resolve().items():
            object.__setattr__(self, name, value)
        self._validate()

    # -- resolution ------------------------------------------------------------------------------
    def _check_ints(self) -> None:
        for name in (
            "dp_size",
            "attn_tp_size",
            "max_running_requests",
            "chunked_prefill_size",
            "hidden_size",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _fail(f"{name} must be an int >= 1", **{name: value})

    def _resolve(self) -> dict[str, Any]:
        """The concrete value of every field that may be given as "auto" or as a name."""
        env = read_env()
        out: dict[str, Any] = {}
        world = self.dp_size * self.attn_tp_size
        out["ep_size"] = world if self.ep_size == "auto" else self.ep_size
        max_bs = self.cuda_graph_max_bs
        if max_bs == "auto":
            capped = min(self.max_running_requests, _AUTO_GRAPH_MAX_BS)
            max_bs = capped // self.attn_tp_size * self.attn_tp_size
        out["cuda_graph_max_bs"] = max_bs
        bs = self.cuda_graph_bs
        if bs == "auto":
            # graph/'s policy, so the sizes planned here are the sizes the runner captures.
            usable = isinstance(max_bs, int) and max_bs >= self.attn_tp_size
            bs = capture_sizes(max_bs, alignment=self.attn_tp_size) if usable else ()
        elif isinstance(bs, str):
            raise _fail('cuda_graph_bs must be "auto" or a sequence of ints', cuda_graph_bs=bs)
        out["cuda_graph_bs"] = tuple(bs)
        ext = self.cuda_graph_extend_tokens
        if ext == "auto":
            cap = max_tokens_per_rank(self.chunked_prefill_size, self.max_running_requests,
                                      self.attn_tp_size)
            ext = tuple(n for n in _AUTO_EXTEND_TOKENS if n <= cap and n % self.attn_tp_size == 0)
        elif isinstance(ext, str):
            raise _fail('cuda_graph_extend_tokens must be "auto" or a sequence of ints',
                        cuda_graph_extend_tokens=ext)
        out["cuda_graph_extend_tokens"] = tuple(ext)
        dtype = self.dtype
        if isinstance(dtype, str):
            if dtype.lower() not in _DTYPES:
                raise _fail(f"dtype must be a torch.dtype or one of {sorted(_DTYPES)}", dtype=dtype)
            dtype = _DTYPES[dtype.lower()]
        out["dtype"] = dtype
        kv = self.kv_cache_dtype
        if isinstance(kv, str):
            names = {**_DTYPES, **_KV_DTYPES, "auto": dtype}
            if kv.lower() not in names:
                raise _fail('kv_cache_dtype must be "auto", a torch.dtype or one '
                            f'of {sorted(_KV_DTYPES)}',
                            kv_cache_dtype=kv)
            kv = names[kv.lower()]
        out["kv_cache_dtype"] = kv
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        out["device"] = torch.device(device)
        padding = self.dp_padding
        if isinstance(padding, str) and padding.strip().lower() == "auto":
            padding = None
        out["dp_padding"] = None if padding is None else PaddingMode.parse(padding)
        exchange = str(self.dp_sync_exchange).strip().lower()
        if exchange == "auto" and env.dp_sync_exchange is not None:
            exchange = env.dp_sync_exchange
        out["dp_sync_exchange"] = exchange
        shm_dir = self.dp_sync_shm_dir
        if shm_dir == "auto":
            shm_dir = env.shm_dir or (
                "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            )
        out["dp_sync_shm_dir"] = shm_dir
        for name in ("eager_input_no_copy", "flashinfer_checks"):
            value = getattr(self, name)
            if value == "auto":
                value = bool(getattr(env, name))
            elif not isinstance(value, bool):
                raise _fail(f'{name} must be a bool or "auto"', **{name: value})
            out[name] = value
        if not isinstance(self.overlap_schedule, bool):
            raise _fail("overlap_schedule must be a bool", overlap_schedule=self.overlap_schedule)
        for name in ("mixed_steps", "prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise _fail(f"{name} must be a bool", **{name: getattr(self, name)})
        mixed = self.mixed_step_tokens
        if mixed == "auto":
            # A mixed step within the largest extend bucket replays graphs: past it the step runs
            # eager, host-bound, while every running request waits for its next token.
            mixed = min(ext[-1], self.chunked_prefill_size) if ext else self.chunked_prefill_size
        out["mixed_step_tokens"] = mixed
        return out

    def _validate(self) -> None:
        world = self.world_size
        ep = self.ep_size
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1 or world % ep:
            raise _fail(
                "ep_size must be an int >= 1 that divides world_size = dp_size * attn_tp_size",
                ep_size=ep,
                dp_size=self.dp_size,
                attn_tp_size=self.attn_tp_size,
                world_size=world,
            )
        max_bs = self.cuda_graph_max_bs
        if (
            isinstance(max_bs, bool)
            or not isinstance(max_bs, int)
            or not 0 <= max_bs <= self.max_running_requests
        ):
            raise _fail(
                "cuda_graph_max_bs must be an int in [0, max_running_requests]",
                cuda_graph_max_bs=max_bs,
                max_running_requests=self.max_running_requests,
            )
        if max_bs % self.attn_tp_size:
            raise _fail(
                "cuda_graph_max_bs must be a multiple of attn_tp_size (graphs run aligned sizes)",
                cuda_graph_max_bs=max_bs,
                attn_tp_size=self.attn_tp_size,
            )
        self._validate_capture_sizes()
        self._validate_extend_tokens()
        mixed = self.mixed_step_tokens
        if (isinstance(mixed, bool) or not isinstance(mixed, int)
                or not 1 <= mixed <= self.chunked_prefill_size):
            raise _fail("mixed_step_tokens must be an int in [1, chunked_prefill_size] or \"auto\"",
                        mixed_step_tokens=mixed, chunked_prefill_size=self.chunked_prefill_size)
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise _fail(f"schedule_policy must be one of {SCHEDULE_POLICIES}",
                        schedule_policy=self.schedule_policy)
        if self.dp_sync_exchange not in _EXCHANGES:
            raise _fail(
                f"dp_sync_exchange must be one of {_EXCHANGES}",
                dp_sync_exchange=self.dp_sync_exchange,
            )
        timeout = self.dp_sync_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise _fail("dp_sync_timeout_s must be a number > 0", dp_sync_timeout_s=timeout)
        if self.dtype not in set(_DTYPES.values()):
            raise _fail("dtype must be bfloat16, float16 or float32", dtype=self.dtype)
        if self.quantization not in QUANTIZATION_CHOICES:
            raise _fail(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}",
                        quantization=self.quantization)
        if self.kv_cache_dtype not in (self.dtype, torch.float8_e4m3fn):
            raise _fail("kv_cache_dtype must be the model's dtype or float8_e4m3fn (fp8)",
                        kv_cache_dtype=self.kv_cache_dtype, dtype=self.dtype)

    def _check_sizes(self, name: str) -> tuple[int, ...]:
        """A list of graph sizes: ints, strictly increasing, > 0, multiples of attn_tp_size."""
        sizes, tp = getattr(self, name), self.attn_tp_size
        if any(isinstance(s, bool) or not isinstance(s, int) for s in sizes):
            raise _fail(f"{name} must hold ints", **{name: sizes})
        if any(b <= a for a, b in pairwise(sizes)) or any(s <= 0 for s in sizes):
            raise _fail(f"{name} must be strictly increasing and > 0", **{name: sizes})
        unaligned = [s for s in sizes if s % tp]
        if unaligned:
            raise _fail(f"every {name} size must be a multiple of attn_tp_size",
                        unaligned=unaligned, attn_tp_size=tp)
        return sizes

    def _validate_capture_sizes(self) -> None:
        sizes, max_bs = self._check_sizes("cuda_graph_bs"), self.cuda_graph_max_bs
        if (sizes[-1] if sizes else 0) != max_bs:
            raise _fail(
                "the largest cuda_graph_bs size must equal cuda_graph_max_bs (no sizes iff 0)",
                cuda_graph_bs=sizes,
                cuda_graph_max_bs=max_bs,
            )

    def _validate_extend_tokens(self) -> None:
        sizes = self._check_sizes("cuda_graph_extend_tokens")
        if sizes and sizes[-1] > self.max_tokens_per_rank:
            raise _fail("cuda_graph_extend_tokens must not exceed max_tokens_per_rank",
                        cuda_graph_extend_tokens=sizes,
                        max_tokens_per_rank=self.max_tokens_per_rank)

    # -- derived sizes ---------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """dp_size * attn_tp_size: the ranks of one DP-attention job."""
        return self.dp_size * self.attn_tp_size

    @property
    def max_tokens_per_rank(self) -> int:
        """The most tokens one rank can bring to a step (prefill chunk or decode batch), aligned
        (``dispatcher.sizing.max_tokens_per_rank``, the one definition)."""
        return max_tokens_per_rank(self.chunked_prefill_size, self.max_running_requests,
                                   self.attn_tp_size)

    @property
    def max_global_tokens(self) -> int:
        """The rows of the largest gathered DP buffer: max_tokens_per_rank * dp_size."""
        return self.max_tokens_per_rank * self.dp_size

    def plan_fields(self) -> dict[str, Any]:
        """The fields every rank must agree on (checked once at step-sync init), as plain values."""
        skip = {"device", "dp_sync_timeout_s", "dp_sync_shm_dir"}
        out = {}
        for f in dataclasses.fields(self):
            if f.name in skip:
                continue
            value = getattr(self, f.name)
            out[f.name] = str(value) if isinstance(value, (torch.dtype, PaddingMode)) else value
        return out

    def replace(self, **changes: Any) -> RuntimeConfig:
        """A copy with ``changes`` applied, resolved and validated again.

        Fields not in ``changes`` keep their *resolved* values: pass ``"auto"`` again for a field
        that should be re-derived (e.g. ``replace(dp_size=4, ep_size="auto")``).
        """
        return dataclasses.replace(self, **changes)
