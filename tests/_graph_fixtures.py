"""Shared helpers of the graph/ tests: a tiny plan type, a model stack and its runners.

The model is the reference model (``dp_runtime.model.qwen3_moe``) with random weights
(``tests/support/local_model.py``) at small shapes, on one rank: its dispatcher is the local
one, so every plan handed to it must list one rank. The StepPlan of dp_runtime is read
duck-typed by graph/ and by the dispatcher: ``Plan`` here is the smallest thing that satisfies
both.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from buffers import BufferPool, build_decode_registry, build_prefill_registry
from dp_runtime.attention import TorchSDPABackend
from dp_runtime.model.model_config import ModelConfig
from dp_runtime.model.qwen3_moe import Qwen3MoeModel
from dp_runtime.serving.forward_batch import capture_batch
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.kv_cache import KVCache
from graph import EagerRunner, GraphRunner, bucket_for
from tests.support.local_model import local_model


class Padding(Enum):
    MAX_LEN = 1
    SUM_LEN = 2


@dataclass(frozen=True)
class Plan:
    graph_bucket: int | None
    padding: Padding
    runtime_max_tokens_per_rank: int
    global_num_tokens_cpu: tuple[int, ...]

    @property
    def is_max_len(self) -> bool:
        return self.padding is Padding.MAX_LEN

    @property
    def fingerprint(self) -> int:
        return zlib.crc32(repr((self.global_num_tokens_cpu, self.runtime_max_tokens_per_rank)).encode())


def graph_plan(bucket: int, counts: tuple[int, ...] | None = None) -> Plan:
    """The plan of a graph step at ``bucket`` (what dp_runtime's plan_step gives: MAX_LEN,
    ``bucket`` tokens per rank)."""
    return Plan(bucket, Padding.MAX_LEN, bucket, counts if counts is not None else (bucket,))


def agreed_plan(n: int, sizes, counts: tuple[int, ...] | None = None) -> Plan:
    """A plan whose ``graph_bucket`` is the DP-agreed size ``n`` itself (the max over ranks, not
    yet rounded to a captured size); its baked values are those of the bucket the runner picks."""
    return Plan(n, Padding.MAX_LEN, bucket_for(tuple(sizes), n), counts if counts is not None else (n,))


TINY = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    num_experts=4,
    top_k=2,
    moe_intermediate_size=16,
    max_position_embeddings=256,
)

# GPU tests: bf16 and FlashInfer-supported head dim 128 (the bench's FlashInfer kernels too).
SMALL_GPU = ModelConfig(
    vocab_size=512,
    hidden_size=256,
    num_layers=3,
    num_heads=8,
    num_kv_heads=2,
    head_dim=128,
    num_experts=8,
    top_k=2,
    moe_intermediate_size=128,
    max_position_embeddings=512,
)


@dataclass
class Stack:
    config: ModelConfig
    cache: KVCache
    allocator: KVAllocator
    backend: Any
    model: Qwen3MoeModel
    pool: BufferPool = field(default_factory=BufferPool)

    @property
    def device(self) -> torch.device:
        return self.cache.device


def make_stack(
    *,
    config: ModelConfig = TINY,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    backend: str = "sdpa",
    max_reqs: int = 64,
    max_context_len: int = 96,
    num_slots: int = 4096,
    seed: int = 0,
    deterministic: bool = False,
    flashinfer_module: Any = None,
) -> Stack:
    """A KV cache, its allocator, an attention backend over it and the model calling it.
    ``flashinfer_module``: FlashInfer itself (None) or a stand-in (``flashinfer_emulator``)."""
    cache = KVCache(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        num_slots=num_slots,
        max_reqs=max_reqs,
        max_context_len=max_context_len,
        dtype=dtype,
        device=device,
    )
    heads = {"num_q_heads": config.num_heads, "num_kv_heads": config.num_kv_heads, "head_dim": config.head_dim}
    if backend == "sdpa":
        attn = TorchSDPABackend(cache, **heads)
    elif backend == "flashinfer":
        from dp_runtime.attention import FlashInferBackend

        attn = FlashInferBackend(cache, deterministic=deterministic, flashinfer_module=flashinfer_module, **heads)
    else:
        raise ValueError(backend)
    # No step writes more tokens than the cache has slots: a bound for every test's steps.
    model = local_model(config, attn, dtype=dtype, device=device, seed=seed, max_tokens_per_rank=num_slots)
    return Stack(config, cache, KVAllocator(cache), attn, model)


def make_graph_runner(stack: Stack, sizes, *, backend: Any = None, forward=None, dp_size: int = 1, **kw) -> GraphRunner:
    registry = build_decode_registry(max(sizes), stack.device, stack.pool, dp_size=dp_size)

    def plan_for(bucket: int) -> Plan:
        return graph_plan(bucket, (bucket,) * dp_size)

    return GraphRunner(
        forward if forward is not None else stack.model.forward,
        backend if backend is not None else stack.backend,
        registry,
        sizes,
        capture_batch=functools.partial(capture_batch, device=stack.device),
        capture_plan=plan_for,
        show_progress=False,
        **kw,
    )


def make_eager_runner(
    stack: Stack, *, no_copy: bool = False, max_bs: int = 1, max_num_tokens: int = 1, dp_size: int = 1
) -> EagerRunner:
    def factory(bs: int, tokens: int):
        # A pool of the eager runner's own per build: growth never meets materialized storage.
        return build_prefill_registry(
            bs, tokens, stack.device, BufferPool(), register_input_embeds=False, dp_size=dp_size, user="eager"
        )

    return EagerRunner(stack.model.forward, stack.backend, factory, no_copy=no_copy, max_bs=max_bs, max_num_tokens=max_num_tokens)


def assert_same_greedy(graph_logits: torch.Tensor, eager_logits: torch.Tensor) -> None:
    """Greedy tokens agree wherever the logits can decide them.

    Each row's argmax may only differ where the eager top-2 margin is within twice that row's
    measured difference: no tolerance can settle a tie, so such rows are reported, not failed.
    """
    assert graph_logits.shape == eager_logits.shape
    diff = (graph_logits - eager_logits).abs().amax(dim=-1)
    top2 = eager_logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    differ = graph_logits.argmax(-1) != eager_logits.argmax(-1)
    undecided = margin <= 2 * diff
    bad = differ & ~undecided
    assert not bool(bad.any()), (
        f"greedy tokens differ at rows {bad.nonzero().flatten().tolist()} "
        f"(margins {margin[bad].tolist()}, diffs {diff[bad].tolist()})"
    )
    if bool((differ & undecided).any()):
        print(f"near-tie rows with different greedy tokens: {(differ & undecided).nonzero().flatten().tolist()}")
