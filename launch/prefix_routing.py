"""The engine's routing: each request to the rank left with the least outstanding tokens; at
DP > 1 with prefix caching, counting the prompt tokens a rank's cache would spare it, as far as
the engine knows where it sent earlier prompts (SGLang's router and vLLM's prefix-aware routing
do the same).

Each rank caches the prompts it served (dp_runtime/serving/prefix_cache.py), so a request whose
prompt starts like an earlier one's prefills less on that earlier request's rank. The engine
cannot see the ranks' caches; it remembers instead where it sent each prompt: a prompt's
``BLOCK``-token prefixes (the first block, the first two, ...) each map to the ranks that took a
prompt with that prefix (a bit per rank). The map is bounded (least recently used out first),
and a rank may have evicted what the map still names: then the request just prefills, as it
would have.

``PrefixRouter.pick(prompt, load, routed)`` chooses the rank that leaves the least work
outstanding after this request: ``load[r]`` (the engine's outstanding tokens on rank r) plus
the prompt tokens rank r would prefill, the prompt less its longest prefix remembered for r.
So a shared prefix draws requests to the ranks that took it until they are busier than the
others by more than the prefix saves; ties go to the rank with fewer routed requests.
Without prefix caching, or with one rank, nothing is remembered (``remember`` False) and the
rule is the least outstanding tokens. Pure host bookkeeping, no device work; not thread-safe
(the engine calls it under its lock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["BLOCK", "MAX_BLOCKS", "PrefixRouter", "prefix_router"]

# Tokens per remembered prefix step: a prompt of n tokens records n // BLOCK prefixes. 32 keeps a
# 4096-token prompt at 128 entries and still sees a short shared system prompt.
BLOCK = 32
# Prefixes remembered at most (about 20 MB of Python ints at this size).
MAX_BLOCKS = 1 << 17


class PrefixRouter:
    """See the module docstring. ``world_size`` ranks; ``remember``: record prompts' prefixes
    (else every match is empty); ``max_blocks`` bounds the map."""

    def __init__(self, world_size: int, *, remember: bool = True, block: int = BLOCK,
                 max_blocks: int = MAX_BLOCKS):
        if world_size < 1 or block < 1 or max_blocks < 1:
            raise ValueError(
                f"PrefixRouter: world_size, block and max_blocks must be >= 1, got "
                f"{world_size}, {block}, {max_blocks}"
            )
        self.world_size, self.block, self.max_blocks = world_size, block, max_blocks
        self.remember = remember
        self._ranks_of: OrderedDict[int, int] = OrderedDict()  # prefix key -> bit per rank

    def _keys(self, prompt: Sequence[int]) -> list[int]:
        """One key per whole block of ``prompt``: a hash of every id up to that block's end.
        Empty where nothing is remembered: a DP-1 engine's submits hash nothing."""
        if not self.remember:
            return []
        keys, h = [], 0
        for end in range(self.block, len(prompt) + 1, self.block):
            h = hash((h, tuple(prompt[end - self.block : end])))
            keys.append(h)
        return keys

    def matched(self, prompt: Sequence[int]) -> list[int]:
        """Per rank, the length of ``prompt``'s longest prefix remembered for it (whole blocks;
        0 where none)."""
        return self._matched(self._keys(prompt))

    def pick(self, prompt: Sequence[int], load: Sequence[int], routed: Sequence[int]) -> int:
        """The rank for ``prompt`` given each rank's outstanding tokens (``load``) and routed
        request counts (``routed``, the tie-break); see the module docstring. Does not record:
        ``record`` does."""
        return self._pick(len(prompt), self.matched(prompt), load, routed)

    def route(self, prompt: Sequence[int], load: Sequence[int], routed: Sequence[int]) -> int:
        """``pick``, then ``record`` the pick, hashing the prompt's prefixes once."""
        keys = self._keys(prompt)
        rank = self._pick(len(prompt), self._matched(keys), load, routed)
        self._record(keys, rank)
        return rank

    def record(self, prompt: Sequence[int], rank: int) -> None:
        """``rank`` took ``prompt``: each of its whole-block prefixes now names ``rank`` too."""
        self._record(self._keys(prompt), rank)

    def _matched(self, keys: list[int]) -> list[int]:
        out, alive = [0] * self.world_size, (1 << self.world_size) - 1
        for i, key in enumerate(keys):
            alive &= self._ranks_of.get(key, 0)
            if not alive:
                break
            for r in range(self.world_size):
                if alive >> r & 1:
                    out[r] = (i + 1) * self.block
        return out

    def _pick(self, n: int, cached: list[int], load: Sequence[int], routed: Sequence[int]) -> int:
        return min(range(self.world_size), key=lambda r: (load[r] + n - cached[r], routed[r]))

    def _record(self, keys: list[int], rank: int) -> None:
        for key in keys:
            self._ranks_of[key] = self._ranks_of.get(key, 0) | 1 << rank
            self._ranks_of.move_to_end(key)
        while len(self._ranks_of) > self.max_blocks:
            self._ranks_of.popitem(last=False)

    def __len__(self) -> int:
        return len(self._ranks_of)


def prefix_router(world_size: int, prefix_caching: bool) -> PrefixRouter:
    """A gang's router (a new one per gang: a new gang's caches are empty); it remembers
    prefixes only where that can help: prefix caching on, more than one rank."""
    return PrefixRouter(world_size, remember=prefix_caching and world_size > 1)
