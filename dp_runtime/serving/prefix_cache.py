"""The prefix cache of one rank: a radix tree from token ids to the KV slots holding their K/V,
so a request whose prompt starts with ids an earlier request ran reuses those slots instead of
prefilling them (SGLang's RadixAttention, vLLM's automatic prefix caching; page size 1, so at
token granularity). On by default: ``RuntimeConfig.prefix_caching``.

A node holds a run of token ids and their slots (one slot per token); its children are keyed
by the first id of their run; the path from the root to a node spells a cached prefix. A node
counts the running requests that use it (``lock``; a request locks the path of its match, so a
locked node's ancestors are locked too): a locked node is never evicted. Unlocked leaves are
evicted least recently used first (``last_use``: a counter bumped by every match and insert
through the node, no clock).

Ownership of a slot: the tree owns the slots it holds, the KVAllocator the free ones, a running
request the ones it allocated. At its end a request gives its slots to ``insert``, which keeps
those at positions the tree did not hold and returns the others (duplicates of a run the tree
already has) for the caller to free; the request's matched prefix is the tree's own slots,
neither kept twice nor freed.

Sizes (tokens): ``cached_tokens`` held in all, ``locked_tokens`` those under a lock (in use by
a running request), ``evictable_tokens`` the rest, which ``evict`` can free.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

__all__ = ["PrefixCache", "PrefixMatch"]

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(eq=False)
class _Node:
    ids: np.ndarray  # int64 token ids of the run
    slots: np.ndarray  # int64 KV slot of each
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    locks: int = 0
    last_use: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    """A prompt's cached prefix: its first ``n`` tokens live in ``slots`` (host int64, ``n``
    of them); ``node`` ends the match (the root for none): ``lock``/``unlock`` take it."""

    n: int
    slots: torch.Tensor
    node: _Node


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    k = min(a.size, b.size)
    diff = np.flatnonzero(a[:k] != b[:k])
    return int(diff[0]) if diff.size else k


class PrefixCache:
    """The radix tree of one rank (module docstring)."""

    def __init__(self) -> None:
        self._root = _Node(_EMPTY, _EMPTY, None)
        self._clock = itertools.count(1)
        self.cached_tokens = 0
        self.locked_tokens = 0

    @property
    def evictable_tokens(self) -> int:
        return self.cached_tokens - self.locked_tokens

    def match(self, ids: Sequence[int]) -> PrefixMatch:
        """The longest cached prefix of ``ids`` short of the whole of them: at least the last
        id must be computed, so the request gets the logits of its last prompt token. Splits
        a node where the match ends inside it (so the match ends at a node, lockable as a
        whole); marks the matched nodes used now."""
        want = np.asarray(ids, dtype=np.int64)[: max(len(ids) - 1, 0)]
        node, pos, parts, now = self._root, 0, [], next(self._clock)
        while pos < want.size and (child := node.children.get(int(want[pos]))) is not None:
            k = _common(child.ids, want[pos:])
            if k < child.ids.size:
                child = self._split(child, k)
            child.last_use = now
            parts.append(child.slots)
            pos, node = pos + k, child
        slots = np.concatenate(parts) if parts else _EMPTY
        return PrefixMatch(pos, torch.from_numpy(slots), node)

    def lock(self, node: _Node) -> None:
        """One more running request uses the path from the root to ``node``."""
        while node is not self._root:
            if node.locks == 0:
                self.locked_tokens += node.ids.size
            node.locks += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        """Undo one ``lock(node)``."""
        while node is not self._root:
            node.locks -= 1
            if node.locks == 0:
                self.locked_tokens -= node.ids.size
            node = node.parent

    def insert(self, ids: Sequence[int], slots: torch.Tensor) -> torch.Tensor:
        """Cache ``ids`` whose K/V live in ``slots`` (one each, host). Returns the slots the
        tree did not take (host int64): the caller's duplicates of runs the tree already holds
        in other slots. Where the tree holds the very slot (the caller's matched prefix), the
        slot is neither taken nor returned."""
        ids_a = np.asarray(ids, dtype=np.int64)
        slots_a = slots.to(torch.int64).numpy()
        if ids_a.size != slots_a.size:
            raise ValueError(f"PrefixCache.insert: {ids_a.size} ids for {slots_a.size} slots")
        node, pos, dups, now = self._root, 0, [], next(self._clock)
        while pos < ids_a.size:
            child = node.children.get(int(ids_a[pos]))
            if child is None:
                new = _Node(ids_a[pos:].copy(), slots_a[pos:].copy(), node, last_use=now)
                node.children[int(ids_a[pos])] = new
                self.cached_tokens += new.ids.size
                break
            k = _common(child.ids, ids_a[pos:])
            if k < child.ids.size:
                child = self._split(child, k)
            theirs = slots_a[pos : pos + k]
            dups.append(theirs[theirs != child.slots])
            child.last_use = now
            pos, node = pos + k, child
        return torch.from_numpy(np.concatenate(dups) if dups else _EMPTY.copy())

    def evict(self, n: int) -> torch.Tensor:
        """Free at least ``n`` cached tokens (fewer only when fewer are evictable), unlocked
        leaves least recently used first, a whole node at a time. Returns their slots (host
        int64) for the caller to free."""
        order = itertools.count()
        heap = [(x.last_use, next(order), x) for x in self._nodes()
                if not x.children and x.locks == 0]
        heapq.heapify(heap)
        freed, count = [], 0
        while count < n and heap:
            _, _, x = heapq.heappop(heap)
            freed.append(x.slots)
            count += x.ids.size
            parent = x.parent
            del parent.children[int(x.ids[0])]
            if parent is not self._root and not parent.children and parent.locks == 0:
                heapq.heappush(heap, (parent.last_use, next(order), parent))
        self.cached_tokens -= count
        return torch.from_numpy(np.concatenate(freed) if freed else _EMPTY.copy())

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after its first ``k`` ids: a new parent holds them (with the node's
        locks and use, so the locked tokens do not change); returns that parent."""
        front = _Node(node.ids[:k], node.slots[:k], node.parent, locks=node.locks,
                      last_use=node.last_use)
        node.parent.children[int(node.ids[0])] = front
        node.ids, node.slots, node.parent = node.ids[k:], node.slots[k:], front
        front.children[int(node.ids[0])] = node
        return front

    def _nodes(self):
        """Every node but the root."""
        stack = list(self._root.children.values())
        while stack:
            x = stack.pop()
            yield x
            stack.extend(x.children.values())
