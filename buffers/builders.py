"""Builders of the decode and prefill registries: which slots, with which padding, and why.

Padded rows of a graph bucket run through the whole model, so every index they carry must point
at something harmless, and every length must be one the kernels accept:

=================================  ======  ===========  ===========================================
slot                               axis    padding      why
=================================  ======  ===========  ===========================================
input_ids                          tokens  keep (dec.)  any id ever written is a valid vocab index;
                                           zero (pre.)  its output row is discarded
positions                          tokens  zero         position 0 is valid for RoPE
out_cache_loc                      tokens  zero         KV slot 0 is reserved as the padding slot:
                                                        padded rows write their K/V there
req_pool_indices                   bs      zero         req_to_token row 0 is the reserved dummy
seq_lens                           bs      fill(v)      decode kernels need len >= 1 (v = 1)
seq_lens_cpu                       bs      fill(v)      host copy of seq_lens for planners
mrope_positions (3, tokens)        tokens  zero         as positions, per rotary section
extend_seq_lens / prefix_lens      bs      zero         padded requests extend nothing
input_embeds (tokens, hidden)      tokens  computed     written by the embedding stage, never copied
                                                        from the batch; its tail is zeroed
num_token_non_padded               none    computed     the live token count, for MoE/norm masks
global_num_tokens_gpu              none    computed     per-rank token counts from the DP plan
global_num_tokens_for_logprob_gpu  none    computed     idem, for logprob rows
=================================  ======  ===========  ===========================================

The two ``global_num_tokens*`` slots exist only with ``register_global_num_tokens=True``, for a
graph-safe path that needs device-side counts; dp_runtime has none (its graphs gather under
MAX_LEN, the same layout at every replay), so its registries do not register them.

``source=obj`` binds the same-named attributes of an existing object (a missing one raises
AttributeError naming it); ``source=None`` allocates every slot from the pool.
"""

from __future__ import annotations

from typing import Any

import torch

from buffers.pool import BufferPool
from buffers.registry import BufferRegistry
from buffers.slot import KEEP, ZERO, Axis, FillSizes, Slot, fill

__all__ = ["build_decode_registry", "build_prefill_registry"]


class _HostCounts:
    """Small host tensors of per-rank counts, cached by value so each is created once.

    A cached tensor is never written again, so an asynchronous copy from it can never race a
    later step's values; on CUDA machines they are pinned so the copy does not block.
    """

    def __init__(self, dtype: torch.dtype, limit: int = 256) -> None:
        self._dtype, self._limit = dtype, limit
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def get(self, values: Any) -> torch.Tensor:
        key = tuple(values)
        t = self._cache.get(key)
        if t is None:
            if len(self._cache) >= self._limit:
                self._cache.pop(next(iter(self._cache)))
            with torch.inference_mode(False):
                t = torch.tensor([int(v) for v in key], dtype=self._dtype)
                if torch.cuda.is_available():
                    t = t.pin_memory()
            self._cache[key] = t
        return t


def _counts_slot(name: str, field: str, dp_size: int) -> Slot:
    host = _HostCounts(torch.int32)

    def compute(buf: torch.Tensor, batch: Any, sizes: FillSizes) -> torch.Tensor:
        values = getattr(batch, field, None)
        if values is None:
            raise ValueError(f"slot {name!r} is computed from batch.{field}, which is None")
        if len(values) != buf.shape[0]:
            raise ValueError(f"slot {name!r}: batch.{field} has {len(values)} entries, dp_size "
                             f"is {buf.shape[0]}")
        return host.get(values)

    return Slot(name, lambda b, t: (dp_size,), torch.int32, Axis.NONE, compute=compute)


def _num_token_non_padded_slot() -> Slot:
    host = _HostCounts(torch.int32)

    def compute(buf: torch.Tensor, batch: Any, sizes: FillSizes) -> torch.Tensor:
        return host.get((sizes.raw_num_tokens,))

    return Slot("num_token_non_padded", lambda b, t: (1,), torch.int32, Axis.NONE, compute=compute)


def _zero_tail(buf: torch.Tensor, batch: Any, sizes: FillSizes) -> None:
    if sizes.padded_num_tokens > sizes.raw_num_tokens:
        buf[sizes.raw_num_tokens : sizes.padded_num_tokens].zero_()


def _common_slots(
    token_ids_padding, seq_len_fill_value: int, dp_size: int, register_global_num_tokens: bool,
    mrope: bool
) -> list[Slot]:
    slots = [
        Slot("input_ids", lambda b, t: (t,), torch.int64, Axis.TOKENS, token_ids_padding),
        Slot("positions", lambda b, t: (t,), torch.int64, Axis.TOKENS, ZERO),
        Slot("out_cache_loc", lambda b, t: (t,), torch.int64, Axis.TOKENS, ZERO),
        Slot("req_pool_indices", lambda b, t: (b,), torch.int64, Axis.BS, ZERO),
        Slot("seq_lens", lambda b, t: (b,), torch.int64, Axis.BS, fill(seq_len_fill_value)),
        Slot("seq_lens_cpu", lambda b, t: (b,), torch.int64, Axis.BS, fill(seq_len_fill_value),
             device="cpu"),
        _num_token_non_padded_slot(),
    ]
    if mrope:
        slots.append(Slot("mrope_positions", lambda b, t: (3, t), torch.int64, Axis.TOKENS, ZERO,
                          dim=1))
    if register_global_num_tokens:
        slots.append(_counts_slot("global_num_tokens_gpu", "global_num_tokens_cpu", dp_size))
        slots.append(_counts_slot("global_num_tokens_for_logprob_gpu",
                                  "global_num_tokens_for_logprob_cpu", dp_size))
    return slots


def _build(slots: list[Slot], max_bs: int, max_num_tokens: int, device, pool: BufferPool, user: str,
           source: Any) -> BufferRegistry:
    bind = None
    if source is not None:
        bind = {}
        for slot in slots:
            if not hasattr(source, slot.name):
                raise AttributeError(
                    f"{user}: source {type(source).__name__} has no attribute {slot.name!r} to bind"
                )
            bind[slot.name] = getattr(source, slot.name)
    return BufferRegistry(slots, max_bs, max_num_tokens, device, pool, user=user, bind=bind)


def build_decode_registry(
    max_bs: int,
    device: torch.device | str,
    pool: BufferPool,
    *,
    num_tokens_per_bs: int = 1,
    dp_size: int = 1,
    seq_len_fill_value: int = 1,
    register_global_num_tokens: bool = False,
    mrope: bool = False,
    source: Any = None,
    user: str = "decode",
) -> BufferRegistry:
    """The decode registry: ``max_bs`` requests of ``num_tokens_per_bs`` tokens each."""
    slots = _common_slots(KEEP, seq_len_fill_value, dp_size, register_global_num_tokens, mrope)
    return _build(slots, max_bs, max_bs * num_tokens_per_bs, device, pool, user, source)


def build_prefill_registry(
    max_bs: int,
    max_num_tokens: int,
    device: torch.device | str,
    pool: BufferPool,
    *,
    hidden_size: int | None = None,
    embed_dtype: torch.dtype = torch.bfloat16,
    dp_size: int = 1,
    seq_len_fill_value: int = 1,
    register_global_num_tokens: bool = False,
    register_input_embeds: bool = True,
    mrope: bool = False,
    source: Any = None,
    user: str = "prefill",
) -> BufferRegistry:
    """The prefill (extend) registry: up to ``max_bs`` requests, ``max_num_tokens`` tokens."""
    slots = _common_slots(ZERO, seq_len_fill_value, dp_size, register_global_num_tokens, mrope)
    slots += [
        Slot("extend_seq_lens", lambda b, t: (b,), torch.int64, Axis.BS, ZERO),
        Slot("extend_prefix_lens", lambda b, t: (b,), torch.int64, Axis.BS, ZERO),
    ]
    if register_input_embeds:
        if hidden_size is None:
            raise ValueError("build_prefill_registry: register_input_embeds=True needs hidden_size")
        slots.append(
            Slot("input_embeds", lambda b, t: (t, hidden_size), embed_dtype, Axis.TOKENS,
                 compute=_zero_tail)
        )
    return _build(slots, max_bs, max_num_tokens, device, pool, user, source)
