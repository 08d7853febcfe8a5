"""EagerRunner: decode, extend and IDLE batches without graphs, through a registry.

Every step ``fill(batch)`` copies the live rows into registry storage and ``view()`` hands the
model a batch whose tensors are registry views, at the live sizes (no padding: nothing is
captured). Going through the same storage as the graphs means the model sees one kind of input
on both paths, and inputs that must stay put (e.g. bound by a kernel's setup) stay put.

The registry grows on demand: a batch over its capacity rebuilds it, through the caller's
factory, at the next power of two on each axis (never smaller than before). A pool never
reallocates materialized storage, so the factory must take growth from a pool that still has
room (one sized up front, or a pool of the eager runner's own); growth it cannot serve raises
the pool's error, with the sizes asked for.

Escape hatch: ``no_copy`` (``RuntimeConfig.eager_input_no_copy``, or
``DP_RUNTIME_EAGER_INPUT_NO_COPY=1`` through it) hands the model the batch's
own tensors via ``dataclasses.replace`` and copies nothing. Computed slots
(``num_token_non_padded``, ``global_num_tokens_gpu``...) are then whatever the batch carries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from buffers import BufferRegistry
from graph.attention_protocol import AttentionMetadataBackend
from graph.runner_batch import RunnerBatch

__all__ = ["EagerRunner", "next_power_of_two"]

RegistryFactory = Callable[[int, int], BufferRegistry]  # (max_bs, max_num_tokens) -> registry


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


class EagerRunner:
    """Runs ``forward`` eagerly on registry views of each batch (module docstring).

    Args:
        forward: ``forward(batch) -> output``.
        backend: the attention backend; ``init_forward_metadata(view)`` runs before each forward.
        registry_factory: ``(max_bs, max_num_tokens) -> BufferRegistry``; unused with no_copy.
        no_copy: skip the registry (the caller passes ``RuntimeConfig.eager_input_no_copy``).
        max_bs, max_num_tokens: the initial capacity (built at construction).
    """

    def __init__(
        self,
        forward: Callable[[Any], Any],
        backend: AttentionMetadataBackend,
        registry_factory: RegistryFactory | None = None,
        *,
        no_copy: bool = False,
        max_bs: int = 1,
        max_num_tokens: int = 1,
    ) -> None:
        self.forward = forward
        self.backend = backend
        self.no_copy = bool(no_copy)
        self._factory = registry_factory
        self.registry: BufferRegistry | None = None
        self.growths = 0  # registry rebuilds after the first (for tests and reports)
        if not self.no_copy:
            if registry_factory is None:
                raise ValueError("EagerRunner: a registry_factory is needed unless no_copy is set")
            self.registry = self._build(max(1, max_bs), max(1, max_num_tokens))

    def _build(self, max_bs: int, max_num_tokens: int) -> BufferRegistry:
        assert self._factory is not None
        try:
            return self._factory(max_bs, max_num_tokens)
        except ValueError as e:
            raise ValueError(
                f"EagerRunner: building the registry for max_bs={max_bs}, "
                f"max_num_tokens={max_num_tokens} failed: {e}"
            ) from e

    def ensure_capacity(self, bs: int, num_tokens: int) -> BufferRegistry:
        """The registry, rebuilt first if ``bs`` or ``num_tokens`` exceed its capacity."""
        registry = self.registry
        assert registry is not None, "no registry in no_copy mode"
        if bs <= registry.max_bs and num_tokens <= registry.max_num_tokens:
            return registry
        new_bs = max(registry.max_bs, next_power_of_two(bs))
        new_tokens = max(registry.max_num_tokens, next_power_of_two(num_tokens))
        self.registry = self._build(new_bs, new_tokens)
        self.growths += 1
        return self.registry

    def prepare(self, batch: RunnerBatch) -> Any:
        """The batch the model will see: registry views of ``batch`` (or its own tensors)."""
        if self.no_copy:
            return dataclasses.replace(batch)
        bs, n = batch.batch_size, batch.num_tokens
        registry = self.ensure_capacity(bs, n)
        registry.fill(batch, bs, bs, n, n)
        return registry.view(batch, bs, n)

    def run(self, batch: RunnerBatch) -> Any:
        """Fill, view, prepare attention metadata and run the forward; return its output."""
        view = self.prepare(batch)
        self.backend.init_forward_metadata(view)
        with torch.inference_mode():
            return self.forward(view)
