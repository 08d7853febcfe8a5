"""The engine's routing (launch/prefix_routing.py): least outstanding tokens, and at DP > 1 with
prefix caching the rank that last took a prompt's prefix while that leaves less work. The engine
on a real 2-rank gang with shared prefixes is in tests/test_engine_ray.py."""

from __future__ import annotations

import random

import pytest

from launch.prefix_routing import BLOCK, PrefixRouter, prefix_router


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def test_without_memory_the_rule_is_least_outstanding_then_fewest_routed():
    rng = random.Random(0)
    for router in (PrefixRouter(3, remember=False), PrefixRouter(3)):
        for i in range(200):
            load = [rng.randrange(4) * 100 for _ in range(3)]
            routed = [rng.randrange(3) for _ in range(3)]
            prompt = _prompt(i, rng.randrange(1, 3 * BLOCK))  # no prompt shares a block
            want = min(range(3), key=lambda r: (load[r], routed[r]))
            assert router.route(prompt, load, routed) == want
    assert len(PrefixRouter(3, remember=False)) == 0


def test_each_rank_matches_the_longest_prefix_remembered_for_it():
    router = PrefixRouter(4)
    base = _prompt(1, 3 * BLOCK + 5)
    router.record(base, 2)
    assert len(router) == 3  # whole blocks only: the 5 trailing ids are not a prefix step
    assert router.matched(base) == [0, 0, 3 * BLOCK, 0]
    assert router.matched(base[: 2 * BLOCK] + [7] * BLOCK) == [0, 0, 2 * BLOCK, 0]
    changed = [*base[: BLOCK - 1], base[BLOCK - 1] + 1, *base[BLOCK:]]
    assert router.matched(changed) == [0] * 4  # a prefix differs from its first block on
    assert router.matched(base[: BLOCK - 1]) == [0] * 4  # shorter than a block
    router.record(base[: 2 * BLOCK], 0)  # another rank took the first two blocks
    assert router.matched(base) == [2 * BLOCK, 0, 3 * BLOCK, 0]
    router.record(changed, 3)
    assert router.matched(base) == [2 * BLOCK, 0, 3 * BLOCK, 0]  # shares no first block


def test_a_shared_prefix_draws_requests_until_its_rank_is_busier_than_the_prefix_saves():
    router = PrefixRouter(2)
    shared = _prompt(2, 4 * BLOCK)
    router.record([*shared, 1, 2], 1)
    prompt = [*shared, 3, 4, 5]  # 4 * BLOCK of its prefill are cached on rank 1
    assert router.pick(prompt, [0, 0], [5, 0]) == 1
    assert router.pick(prompt, [0, 4 * BLOCK - 1], [0, 0]) == 1  # still less work there
    assert router.pick(prompt, [0, 4 * BLOCK], [0, 0]) == 0  # equal work: fewer routed wins
    assert router.pick(prompt, [0, 4 * BLOCK], [1, 0]) == 1
    assert router.pick(prompt, [0, 4 * BLOCK + 1], [1, 0]) == 0  # busier than the prefix saves
    assert router.pick(_prompt(3, 3), [0, 0], [0, 0]) == 0  # nothing shared: the old rule
    router.record(shared, 0)  # both ranks took the prefix: the load decides again
    assert router.pick(prompt, [10, 0], [0, 0]) == 1
    assert router.pick(prompt, [0, 10], [0, 0]) == 0


def test_the_map_forgets_the_least_recently_used_prefixes_first():
    router = PrefixRouter(2, max_blocks=4)
    a, b, c = _prompt(4, 2 * BLOCK), _prompt(5, 2 * BLOCK), _prompt(6, 2 * BLOCK)
    router.record(a, 0)
    router.record(b, 1)
    router.record(a, 0)  # a used again: b is now the oldest
    router.record(c, 1)
    assert len(router) == 4
    assert router.matched(a) == [2 * BLOCK, 0] and router.matched(c) == [0, 2 * BLOCK]
    assert router.matched(b) == [0, 0]


def test_prefix_router_remembers_only_where_caching_can_help():
    assert not prefix_router(1, True).remember
    assert not prefix_router(2, False).remember
    assert prefix_router(2, True).remember


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"world_size": 0}, "got 0, 32, 131072"),
    ({"world_size": 2, "block": 0}, "got 2, 0, 131072"),
    ({"world_size": 2, "max_blocks": 0}, "got 2, 32, 0"),
])
def test_bad_sizes_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=f"world_size, block and max_blocks must be >= 1, {message}"):
        PrefixRouter(**kwargs)
