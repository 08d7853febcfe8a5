"""The prefix cache's radix tree (dp_runtime/serving/prefix_cache.py): a match never covers a
whole prompt; runs split where matches and inserts diverge; insert keeps new positions and
returns duplicate slots (never the caller's matched ones); locks pin a path and the sizes
follow; eviction takes unlocked leaves, least recently used first, never a locked node."""

from __future__ import annotations

import torch

from dp_runtime.serving.prefix_cache import PrefixCache


def _slots(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def test_a_match_stops_short_of_the_whole_prompt():
    t = PrefixCache()
    assert t.insert([1, 2, 3, 4], _slots(11, 12, 13, 14)).numel() == 0
    m = t.match([1, 2, 3, 4])
    assert (m.n, m.slots.tolist()) == (3, [11, 12, 13])  # the last token is computed: logits
    m = t.match([1, 2, 3, 4, 5])
    assert (m.n, m.slots.tolist()) == (4, [11, 12, 13, 14])
    assert t.match([1]).n == 0 and t.match([]).n == 0 and t.match([9, 1, 2]).n == 0
    m = t.match([1, 2, 7, 8])  # diverges inside the run: the run splits there
    assert (m.n, m.slots.tolist()) == (2, [11, 12])
    assert t.cached_tokens == 4 and t.match([1, 2, 3, 4, 5]).slots.tolist() == [11, 12, 13, 14]


def test_insert_keeps_new_positions_and_returns_duplicates():
    t = PrefixCache()
    t.insert([1, 2, 3], _slots(11, 12, 13))
    # A second request computed the same [1, 2] in its own slots and went on to [5, 6].
    dup = t.insert([1, 2, 5, 6], _slots(21, 22, 25, 26))
    assert sorted(dup.tolist()) == [21, 22]
    assert t.cached_tokens == 5
    assert t.match([1, 2, 5, 6, 0]).slots.tolist() == [11, 12, 25, 26]
    assert t.match([1, 2, 3, 0]).slots.tolist() == [11, 12, 13]
    # A request that matched [1, 2, 5] (the tree's own slots) and computed [7]: nothing to free.
    m = t.match([1, 2, 5, 7])
    t.lock(m.node)
    assert t.insert([1, 2, 5, 7], torch.cat([m.slots, _slots(27)])).numel() == 0
    t.unlock(m.node)
    assert t.cached_tokens == 6 and t.match([1, 2, 5, 7, 0]).slots.tolist() == [11, 12, 25, 27]


def test_locks_pin_a_path_and_the_sizes_follow():
    t = PrefixCache()
    t.insert([1, 2, 3, 4], _slots(11, 12, 13, 14))
    t.insert([1, 2, 8], _slots(11, 12, 18))
    assert (t.cached_tokens, t.locked_tokens, t.evictable_tokens) == (5, 0, 5)
    a = t.match([1, 2, 3, 4, 9])
    b = t.match([1, 2, 3, 0])  # splits a's [3, 4]: a's node is now [4], under [3]
    t.lock(a.node)
    assert (t.locked_tokens, t.evictable_tokens) == (4, 1)
    t.lock(b.node)
    c = t.match([1, 2, 3, 0])
    assert c.n == 3 and c.node is b.node and t.locked_tokens == 4
    t.lock(c.node)
    t.unlock(a.node)
    assert t.locked_tokens == 3  # [1, 2, 3] still used by b and c
    assert sorted(t.evict(10).tolist()) == [14, 18]  # everything unlocked, the locked path stays
    assert (t.cached_tokens, t.locked_tokens) == (3, 3)
    t.unlock(b.node)
    t.unlock(c.node)
    assert (t.locked_tokens, t.evictable_tokens) == (0, 3)
    assert t.evict(1).tolist() == [13]  # the leaf first, a node at a time
    assert t.evict(1).tolist() == [11, 12] and t.cached_tokens == 0


def test_eviction_is_least_recently_used_first():
    t = PrefixCache()
    t.insert([1, 1], _slots(1, 2))
    t.insert([2, 2, 2], _slots(3, 4, 5))
    t.insert([3, 3], _slots(6, 7))
    t.match([1, 1, 0])  # [1, 1] used after the others: evicted last
    assert t.evict(1).tolist() == [3, 4, 5]  # a whole node at a time
    assert t.evict(2).tolist() == [6, 7]
    assert t.cached_tokens == 2 and t.evict(5).tolist() == [1, 2] and t.evict(1).numel() == 0
    # A parent whose children are all evicted becomes an evictable leaf in its turn.
    t.insert([4], _slots(8))
    t.insert([5, 6, 7], _slots(1, 2, 3))
    t.insert([5, 6, 9], _slots(1, 2, 4))
    t.match([5, 6, 7, 0])
    assert t.evict(1).tolist() == [8]
    assert t.evict(2).tolist() == [4, 3]  # the [9] branch, older, then [7]
    assert t.evict(1).tolist() == [1, 2] and t.cached_tokens == 0
