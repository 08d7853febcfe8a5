"""Prefix caching on one rank's scheduler (``RuntimeConfig.prefix_caching``, on by default):
the rank's radix tree (prefix_cache.py) between the scheduler and its KVAllocator.

- **Admission** (``claim``): an arrived request's prompt is matched against the tree (never
  the whole prompt: its last token is computed, for its logits) and the match is locked. Its
  row's first n positions take the cached slots (``place``: the allocator's host record and
  one asynchronous write of ``req_to_token[row, :n]``, no sync) and its ``kv_len`` starts at
  n, so its first chunk is an extend with prefix n (chunked prefill continues as without).
- **The guarantee that a running request can always allocate** (scheduler.py, admission)
  still holds: a request reserves ``max_total_tokens - n``, and the tree's locked slots count
  as taken. With ``reserved`` the running requests' reservations and ``locked`` the tree's
  locked tokens, admission keeps ``reserved + locked <= num_slots``. A running request holds
  at most its reservation of slots of its own, so the free slots plus the tree's unlocked ones
  cover everything the running requests may still allocate; a step short of free slots
  evicts unlocked cached runs, least recently used first (``make_room``), before allocating.
- **Once its prompt is scheduled** (the step of its last chunk; ``share``) a request's whole
  prompt goes into the tree, its slots there locked by it in place of its match (its
  reservation shrinks by as many as the tree's locked slots grow), so requests admitted while
  it runs reuse it (a burst sharing a system prompt). Not where the tree meanwhile holds more
  of the prompt than its match (another request's copy): its slots wait for ``release``.
- **At its end** (stop, length, abort; ``release``) a request's tokens whose K/V are written
  and whose ids are known (its prompt and the outputs fed back: ``min(kv_len, prompt_len +
  len(output))``) go into the tree, its match is unlocked, and the slots the tree did not take
  (duplicates of runs it holds) are freed. After an error only its match is kept (its prompt, once
  shared: a failed draw is the request's own, e.g. its temperature; its outputs are not). The cached
  K/V is final when a later request reads it: every position inserted was scheduled, so the step
  writing it was launched before the request finished (a finished or aborted request's last step may
  still run), and the reader's steps are launched later on the same stream, after it (as
  ``Scheduler.abort`` reasons for reused slots).

Each DP rank has its own tree: requests are not routed to the rank holding their prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.paged_batches import write_prefix
from dp_runtime.serving.prefix_cache import PrefixCache, PrefixMatch

__all__ = ["PrefixReuse"]


class PrefixReuse:
    """The prefix cache of a rank's scheduler (module docstring). ``hit_tokens``: prompt tokens
    served from the cache, in all."""

    def __init__(self, allocator: KVAllocator) -> None:
        self.allocator = allocator
        self.tree = PrefixCache()
        self.hit_tokens = 0

    @property
    def locked_tokens(self) -> int:
        return self.tree.locked_tokens

    @property
    def free_slots(self) -> int:
        """Slots a new token can take: the allocator's free ones and the tree's evictable ones."""
        return self.allocator.num_free_slots + self.tree.evictable_tokens

    def claim(self, prompt_ids: Sequence[int]) -> PrefixMatch:
        """The prompt's cached prefix, locked (``unclaim`` undoes it if it is not admitted)."""
        m = self.tree.match(prompt_ids)
        self.tree.lock(m.node)
        return m

    def unclaim(self, m: PrefixMatch) -> None:
        self.tree.unlock(m.node)

    def place(self, row: int, m: PrefixMatch) -> None:
        """Row ``row`` (an admitted request's) starts with the match's slots."""
        if m.n:
            self.hit_tokens += m.n
            write_prefix(self.allocator, row, m.slots)

    def make_room(self, n: int) -> None:
        """Evict cached runs until ``n`` slots are free (admission keeps enough evictable).
        Once warm the cache holds every slot no request does, so most steps are short: each
        eviction frees at least 1/64 of the cache, as the tree's eviction walks every node."""
        short = n - self.allocator.num_free_slots
        if short > 0:
            self.allocator.free_slots(self.tree.evict(max(short,
                                                          self.allocator.cache.num_slots // 64)))

    def share(self, ids: Sequence[int], slots: torch.Tensor, m: PrefixMatch) -> PrefixMatch | None:
        """A request whose prompt ``ids`` (K/V in ``slots``, its row's, written by the steps
        scheduled so far) just completed, and whose match is ``m``: cache the prompt and return
        its new locked match (``m`` unlocked); None, changing nothing, where the tree holds more
        of the prompt than ``m`` (module docstring)."""
        whole = [*ids, -1]  # an id never cached: the match may cover every prompt token
        if self.tree.match(whole).n != m.n:
            return None
        self.tree.insert(ids, slots)  # no duplicates: the tree's part of the prompt is ``m``
        new = self.tree.match(whole)
        self.tree.lock(new.node)
        self.tree.unlock(m.node)
        return new

    def release(self, ids: Sequence[int], slots: torch.Tensor, m: PrefixMatch) -> torch.Tensor:
        """A finished request's end: ``ids`` (the known tokens to cache, starting with its
        match's) whose K/V live in ``slots[:len(ids)]`` go into the tree, its match ``m`` is
        unlocked; returns the rest of ``slots`` and the duplicates, to free."""
        n = len(ids)
        dups = self.tree.insert(ids, slots[:n])
        self.tree.unlock(m.node)
        return torch.cat([dups, slots[n:].to(torch.int64)])
