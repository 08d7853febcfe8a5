"""BufferRegistry: the graph-resident inputs of one runner, filled then viewed every step.

``fill(batch, raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)`` checks capacity (raw <=
padded <= the slot's maximum), resets each slot's padded tail ``[raw:padded)`` by its padding
policy and copies the live rows ``[0:raw)`` from the batch as grouped copies (one
``torch._foreach_copy_`` per device and dtype, pads read from small constant tensors so they
travel in the same launch), then runs the computed slots' post-fill hooks. Rows at or beyond
``padded`` are never written; a refused fill writes nothing. The plan of each size is built once
(``fill_plan.py``, bounded cache).

``view(template, padded_bs, padded_num_tokens)`` returns ``dataclasses.replace(template, ...)``
with slot fields as views of the storage and ``batch_size=padded_bs``: a plain slot the last
fill found None stays None, computed slots are always exposed, dotted (nested) slots are read
with ``views(...)``. Only ``fill`` writes these buffers; the storage belongs to the
``BufferPool`` (or to the object a builder bound them from). docs/buffers.md has the rest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from buffers import fill_plan as fp
from buffers.pool import BufferPool, checked_shape
from buffers.slot import Axis, FillSizes, Slot

__all__ = ["BufferRegistry"]

class BufferRegistry:
    """The named input buffers of one runner (see the module docstring).

    Args:
        slots: the slot declarations; names must be unique.
        max_bs, max_num_tokens: the capacity of the ``bs`` and ``tokens`` axes.
        device: the default device of slots that name none.
        pool: storage comes from this pool (shared with other runners of the rank); slots
            adopted with ``bind`` do not touch it.
        user: the name this registry declares under in the pool report.
        bind: ``{slot name: tensor}`` to adopt instead of allocating (see ``bind``).
    """

    def __init__(
        self,
        slots: Iterable[Slot],
        max_bs: int,
        max_num_tokens: int,
        device: torch.device | str,
        pool: BufferPool,
        user: str = "registry",
        bind: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.slots: dict[str, Slot] = {}
        for slot in slots:
            if slot.name in self.slots:
                raise ValueError(f"duplicate slot name {slot.name!r} in registry {user!r}")
            self.slots[slot.name] = slot
        self.max_bs = fp.count_arg(max_bs, f"registry {user!r}: max_bs")
        self.max_num_tokens = fp.count_arg(max_num_tokens, f"registry {user!r}: max_num_tokens")
        self.device = torch.device(device)
        self.user = user
        self._pool = pool
        self._buffers: dict[str, torch.Tensor] = {}
        # Per-size caches, bounded: an eager runner sees every prefill size from 1 to the chunk,
        # and each entry holds views; the hot sizes of a serving loop stay, the rest are evicted.
        self._plans: fp.BoundedCache[tuple[int, int, int | None, int | None], fp.FillPlan] = (
            fp.BoundedCache(fp.PER_SIZE_CACHE))
        self._padded: fp.BoundedCache[tuple[int, int], dict[str, torch.Tensor]] = fp.BoundedCache(
            fp.PER_SIZE_CACHE)
        self._pad_sources: dict[str, torch.Tensor] = {}
        self._packs = []
        self._once_done: set[str] = set()
        self._present: frozenset[str] | None = None  # plain slots the last fill found

        bind = dict(bind or {})
        unknown = set(bind) - set(self.slots)
        if unknown:
            raise KeyError(f"registry {user!r}: bind names unknown slots {sorted(unknown)}")
        for name, tensor in bind.items():
            self.bind(name, tensor)
        # All or nothing: a slot refused half-way (a dtype clash with another user, a bad shape)
        # must not leave the earlier slots declared in the shared pool.
        with pool.atomic():
            self._allocate(pool, user)

    def _allocate(self, pool: BufferPool, user: str) -> None:
        to_allocate = [s for s in self.slots.values() if s.name not in self._buffers]
        packed: dict[torch.dtype, list[Slot]] = {}
        for slot in to_allocate:
            if slot.computed and slot.axis is Axis.NONE and self.slot_device(slot).type == "cuda":
                packed.setdefault(slot.dtype, []).append(slot)
        packed = {dtype: members for dtype, members in packed.items() if len(members) > 1}
        for slot in to_allocate:
            if slot not in packed.get(slot.dtype, ()):
                pool.declare(slot.name, self.full_shape(slot), slot.dtype, self.slot_device(slot),
                             user)
        for dtype, members in packed.items():
            numel = sum(math.prod(self.full_shape(m)) for m in members)
            pool.declare(self._pack_name(dtype), (numel,), dtype, self.device, user)
        pool.materialize()
        self._packs: list[fp.PackedSlots] = []
        for dtype, members in packed.items():
            numel = sum(math.prod(self.full_shape(m)) for m in members)
            block = pool.view(self._pack_name(dtype), (numel,))
            start, views = 0, []
            for m in members:
                n = math.prod(self.full_shape(m))
                self._buffers[m.name] = block[start : start + n].view(self.full_shape(m))
                views.append((m, self._buffers[m.name]))
                start += n
            self._packs.append(fp.PackedSlots(block, views, {}))
        for slot in to_allocate:
            if slot.name not in self._buffers:
                self._buffers[slot.name] = pool.view(slot.name, self.full_shape(slot))

    def _pack_name(self, dtype: torch.dtype) -> str:
        # Per registry, not shared by name: these hold per-step values no other runner reads.
        return f"{self.user}.computed.{str(dtype).removeprefix('torch.')}"

    # -- shapes and storage --------------------------------------------------------------------
    def slot_device(self, slot: Slot) -> torch.device:
        return torch.device(slot.device) if slot.device is not None else self.device

    def full_shape(self, slot: Slot) -> tuple[int, ...]:
        shape = checked_shape(slot.shape(self.max_bs, self.max_num_tokens),
                              f"registry {self.user!r}: slot {slot.name!r} has shape")
        if slot.axis is not Axis.NONE and not -len(shape) <= slot.dim < len(shape):
            raise ValueError(f"slot {slot.name!r}: dim {slot.dim} is outside its shape {shape}")
        return shape

    def capacity(self, slot: Slot) -> int:
        """How many rows the slot holds along its axis (the full shape for axis none)."""
        shape = self._buffers[slot.name].shape
        return shape[slot.dim] if slot.axis is not Axis.NONE else shape[0] if shape else 1

    def buffer(self, name: str) -> torch.Tensor:
        """The whole buffer of slot ``name`` (for capture, hooks and tests)."""
        return self._buffers[name]

    def bind(self, name: str, tensor: torch.Tensor) -> None:
        """Adopt ``tensor`` as the storage of slot ``name`` (its data_ptr is kept).

        Raises KeyError for an unknown slot and ValueError when the tensor's shape, dtype or
        device differ from the slot's declaration.
        """
        if name not in self.slots:
            raise KeyError(f"registry {self.user!r} has no slot {name!r}")
        slot = self.slots[name]
        want = self.full_shape(slot)
        device = self.slot_device(slot)
        if (tuple(tensor.shape) != want or tensor.dtype != slot.dtype
                or tensor.device.type != device.type):
            raise ValueError(
                f"cannot bind slot {name!r}: it needs {want} {slot.dtype} on {device}, "
                f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
            )
        self._buffers[name] = tensor
        for pack in self._packs:
            pack.members = [(m, b) for m, b in pack.members if m.name != name]
        self._plans.clear()
        self._padded.clear()
        self._pad_sources.pop(name, None)

    # -- fill ----------------------------------------------------------------------------------
    def _sizes(self, raw_bs: int, padded_bs: int, raw_num_tokens: int | None,
               padded_num_tokens: int | None) -> FillSizes:
        return fp.checked_fill_sizes(self.user, raw_bs, padded_bs, raw_num_tokens,
                                     padded_num_tokens,
                                     [(slot, self.capacity(slot)) for slot in self.slots.values()])

    def _index(self, slot: Slot, start: int, stop: int) -> tuple[slice, ...]:
        dim = slot.dim % self._buffers[slot.name].dim()
        return (slice(None),) * dim + (slice(start, stop),)

    def _pad_source(self, slot: Slot) -> torch.Tensor:
        """A constant tensor of the slot's shape holding its pad value (cached per slot)."""
        src = self._pad_sources.get(slot.name)
        if src is None:
            buf = self._buffers[slot.name]
            value = 0 if slot.padding.kind == "zero" else slot.padding.value
            with torch.inference_mode(False):
                src = torch.full_like(buf, value)
            self._pad_sources[slot.name] = src
        return src

    def _build_plan(self, sizes: FillSizes) -> fp.FillPlan:
        groups: dict[tuple[torch.device, torch.dtype, bool], int] = {}
        plan = fp.FillPlan(sizes, [], [], [], [], frozenset())

        def place(dst: torch.Tensor, src: torch.Tensor | None) -> tuple[int, int]:
            key = (dst.device, dst.dtype, dst.is_contiguous())
            if key not in groups:
                groups[key] = len(plan.groups)
                plan.groups.append(fp.CopyGroup([], []))
            group = plan.groups[groups[key]]
            group.dsts.append(dst)
            group.srcs.append(src)
            return groups[key], len(group.dsts) - 1

        packed = {m.name for pack in self._packs for m, _ in pack.members}
        for slot in self.slots.values():
            buf = self._buffers[slot.name]
            if slot.computed:
                if slot.name not in packed:
                    plan.computed.append((slot, buf))
                continue
            if slot.axis is Axis.NONE:
                plan.live.append(fp.LiveSlot(slot, buf.shape, buf.dtype, (place(buf, None),), (),
                                             False))
                continue
            raw, padded = sizes.raw(slot.axis), sizes.padded(slot.axis)
            kind = slot.padding.kind
            pads = padded > raw and kind != "keep"
            if pads and slot.padding.value is None and kind in ("fill", "fill_once"):
                raise ValueError(
                    f"registry {self.user!r}: slot {slot.name!r} has padding {kind} without a "
                    f"value, and this fill has a tail to pad (raw {raw}, padded {padded})"
                )
            if pads and kind == "fill_once":
                plan.fill_once.append((slot, buf))
                pads = False
            live, tail = buf[self._index(slot, 0, raw)], self._index(slot, raw, padded)
            split = buf.dim() == 2 and slot.dim % 2 == 1 and buf.shape[0] <= 16
            rows = range(buf.shape[0]) if split else [None]
            pick = (lambda t, r: t[r]) if split else (lambda t, r: t)
            lives = tuple(place(pick(live, r), None) for r in rows)
            pad_at = ()
            if pads:
                pad_src = self._pad_source(slot)[tail]
                pad_at = tuple(place(pick(buf[tail], r), pick(pad_src, r)) for r in rows)
            plan.live.append(fp.LiveSlot(slot, live.shape, buf.dtype, lives, pad_at, split))
        plan.plain = frozenset(s.name for s in self.slots.values() if not s.computed)
        return plan

    def _padded_views(self, padded_bs: int, padded_num_tokens: int) -> dict[str, torch.Tensor]:
        key = (padded_bs, padded_num_tokens)
        views = self._padded.get(key)
        if views is None:
            self._sizes(padded_bs, padded_bs, padded_num_tokens, padded_num_tokens)
            views = {}
            for slot in self.slots.values():
                buf = self._buffers[slot.name]
                if slot.axis is Axis.NONE:
                    views[slot.name] = buf
                else:
                    size = padded_bs if slot.axis is Axis.BS else padded_num_tokens
                    views[slot.name] = buf[self._index(slot, 0, size)]
            self._padded[key] = views
        return views

    def fill(
        self,
        batch: Any,
        raw_bs: int,
        padded_bs: int,
        raw_num_tokens: int | None = None,
        padded_num_tokens: int | None = None,
    ) -> None:
        """Copy ``batch``'s live rows into the registry and pad the tails (module docstring).

        Token sizes default to the batch sizes (decode: one token per request). Raises
        ValueError naming the argument or slot, the limit and the value when a size is not an
        int or is over capacity, and when a batch tensor's dtype or shape does not match its
        slot; a refused fill writes nothing (a pending fill_once slot included).
        """
        key = (raw_bs, padded_bs, raw_num_tokens, padded_num_tokens)
        plan = self._plans.get(key)
        if plan is None:
            # Validation runs once per distinct size; capacities only change through bind(),
            # which drops every cached plan.
            plan = self._plans[key] = self._build_plan(self._sizes(*key))
        missing: list[str] = []
        srcs = [group.srcs.copy() for group in plan.groups]
        dropped: list[tuple[int, int]] = []
        for live in plan.live:
            src = live.slot.read(batch)
            if src is None:
                missing.append(live.slot.name)
                dropped.extend(live.lives)
                dropped.extend(live.pads)
                continue
            if src.shape != live.shape or src.dtype != live.dtype:
                raise ValueError(
                    f"registry {self.user!r}: slot {live.slot.name!r} "
                    f"expects {tuple(live.shape)} {live.dtype} for this fill, batch "
                    f"gives {tuple(src.shape)} {src.dtype}"
                )
            if live.split_rows:
                for (group, at), row in zip(live.lives, src.unbind(0), strict=True):
                    srcs[group][at] = row
            else:
                group, at = live.lives[0]
                srcs[group][at] = src
        # Writes start only now that every source was checked: a refused fill changes nothing.
        for slot, buf in plan.fill_once:
            # a slot the batch lacks is skipped entirely, its one-time fill included
            if slot.name not in self._once_done and slot.read(batch) is not None:
                buf.fill_(slot.padding.value)
                self._once_done.add(slot.name)
        for gi, group in enumerate(plan.groups):
            dsts, gsrcs = group.dsts, srcs[gi]
            if dropped:
                keep = [i for i in range(len(dsts)) if (gi, i) not in dropped]
                dsts, gsrcs = [dsts[i] for i in keep], [gsrcs[i] for i in keep]
            if dsts:
                torch._foreach_copy_(dsts, gsrcs)
        # Post-fill hooks see the copied rows. A hook that returns a tensor (a small immutable
        # host tensor, typically) has it copied into its buffer, asynchronously.
        for pack in self._packs:
            self._fill_pack(pack, batch, plan.sizes)
        dsts, csrcs = [], []
        for slot, buf in plan.computed:
            src = slot.compute(buf, batch, plan.sizes)
            if src is not None:
                dsts.append(buf)
                csrcs.append(src)
        if dsts:
            torch._foreach_copy_(dsts, csrcs, non_blocking=True)
        self._present = plan.plain if not missing else plan.plain.difference(missing)

    def _fill_pack(self, pack: fp.PackedSlots, batch: Any, sizes: FillSizes) -> None:
        outs = [slot.compute(buf, batch, sizes) for slot, buf in pack.members]
        if not all(o is not None and o.device.type == "cpu" for o in outs):
            for (_, buf), out in zip(pack.members, outs, strict=True):
                if out is not None:
                    buf.copy_(out, non_blocking=True)
            return
        key = tuple(map(id, outs))
        entry = pack.cache.get(key)
        if entry is None:
            for (slot, buf), out in zip(pack.members, outs, strict=True):
                if out.numel() != buf.numel() or out.dtype != buf.dtype:
                    raise ValueError(
                        f"registry {self.user!r}: computed slot {slot.name!r} "
                        f"returned {tuple(out.shape)} {out.dtype}, its buffer "
                        f"is {tuple(buf.shape)} {buf.dtype}"
                    )
            host = torch.cat([o.reshape(-1) for o in outs])
            if torch.cuda.is_available():
                host = host.pin_memory()
            if len(pack.cache) >= 256:
                pack.cache.pop(next(iter(pack.cache)))
            # the returned tensors are kept alive with the entry, so their ids stay theirs
            entry = pack.cache[key] = (host, outs)
        pack.block.copy_(entry[0], non_blocking=True)

    # -- view ----------------------------------------------------------------------------------
    def views(self, padded_bs: int,
              padded_num_tokens: int | None = None) -> dict[str, torch.Tensor | None]:
        """``{slot name: view}`` at the padded sizes, None for plain slots the last fill lacked."""
        if self._present is None:
            raise RuntimeError(f"registry {self.user!r}: view() before any fill()")
        pad_t = padded_bs if padded_num_tokens is None else padded_num_tokens
        return {
            name: view if (self.slots[name].computed or name in self._present) else None
            for name, view in self._padded_views(padded_bs, pad_t).items()
        }

    def view(self, template: Any, padded_bs: int, padded_num_tokens: int | None = None) -> Any:
        """``dataclasses.replace(template, ...)`` with slot views and ``batch_size=padded_bs``.

        The template is not mutated. Only top-level slots that are fields of the template are
        replaced; dotted slots are available from ``views()``.
        """
        fields = {f.name for f in dataclasses.fields(template)}
        changes = {
            name: tensor
            for name, tensor in self.views(padded_bs, padded_num_tokens).items()
            if self.slots[name].top_level and name in fields
        }
        if "batch_size" in fields:
            changes["batch_size"] = padded_bs
        return dataclasses.replace(template, **changes)

    # -- reporting -----------------------------------------------------------------------------
    def names(self) -> Sequence[str]:
        return list(self.slots)

    def nbytes(self) -> int:
        """Bytes of the registry's buffers (views into the pool count at their view size)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
