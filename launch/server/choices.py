"""The choices of one HTTP request: an engine request each, a ``Flow`` each, read as one stream.

A request with k prompts (one, or a completion's batch: launch/server/prompts.py) and ``n``
choices per prompt submits k x n engine requests (``prompts.MAX_CHOICES`` at most, ``n``
``protocol.MAX_N`` at most). Choice i of prompt p has index ``p * n + i`` (OpenAI's and vLLM's
order), continues that prompt with its sampling fields; only the seed differs between choices:

- with a request ``seed`` s, the choice of index j samples with seed ``(s + j) mod 2**64`` (as
  vLLM does), so the response is reproducible, choice 0 is what the same request with n = 1
  gives, and prompt p's choices are what prompt p alone gives with seed ``s + p * n``;
- without one, every choice draws its own random seed (the rule for a single request).

Greedy requests (temperature 0) give n identical choices per prompt, as OpenAI and vLLM do.

Each choice is one engine request against the engine's capacity. A request of more choices than
the engine ever holds (``Engine.capacity``) is a 400 naming ``n`` (or ``prompt``). If submitting
choice j is refused (queue full: 429, engine unavailable: 503, a field the engine rejects: 400), the
choices already submitted are aborted and that error is the response. ``Choices.close`` aborts every
choice the engine has not finished: the responses call it when the first choice fails (its siblings
give their KV back), when the client leaves, and when the response is complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Sequence
from typing import Any

from launch.server.protocol import SEED_LIMIT, Sampling, bad
from launch.server.request_flow import Event, Flow, submit

__all__ = ["Choices", "choice_seeds", "submit_choices"]


def choice_seeds(seed: int, count: int, *, seeded: bool) -> list[int]:
    """The seed of each of ``count`` choices by index; ``seed`` is the request's (``seeded``)
    or the random one ``sampling_of`` drew for it (then choices 1.. draw their own)."""
    if seeded:
        return [(seed + j) % SEED_LIMIT for j in range(count)]
    return [seed] + [secrets.randbelow(2**63) for _ in range(count - 1)]


def submit_choices(
    state: Any, rid: str, prompts: Sequence[tuple[list[int], Sampling]], n: int, *, seeded: bool
) -> Choices:
    """Submit ``n`` choices of each of ``prompts`` (a prompt's token ids with its checked
    Sampling), in index order; engine rids ``rid`` for a single choice, else ``rid-0``,
    ``rid-1``, .. by index. Raises ApiError (400/429/503) after aborting the choices already
    submitted."""
    count = len(prompts) * n
    room = state.engine.capacity
    if count > room:  # never admissible: a 429 would have the client retry forever
        raise bad("n" if n > 1 else "prompt",
                  f"the request's {len(prompts)} prompt(s) x n={n} are {count} engine requests; "
                  f"this server holds at most {room} in flight "
                  f"(max_running_requests x ranks + --max-queued)")
    flows: list[Flow] = []
    try:
        for j, seed in enumerate(choice_seeds(prompts[0][1].seed, count, seeded=seeded)):
            ids, sampling = prompts[j // n]
            one = dataclasses.replace(sampling, seed=seed)
            flows.append(submit(state, rid if count == 1 else f"{rid}-{j}", ids, one))
    except BaseException:
        for flow in flows:
            flow.close()
        raise
    return Choices(flows, prompt_tokens=sum(len(ids) for ids, _ in prompts), per_prompt=n)


class Choices:
    """The Events of every choice, in the order they arrive, as ``(index, Event)``.

    One task per choice moves its Flow's events onto a shared queue, so a choice that runs
    ahead (another rank, or its sibling still queued) is never held up by the others."""

    def __init__(self, flows: list[Flow], *, prompt_tokens: int, per_prompt: int = 1):
        self.flows = flows
        self.prompt_tokens = prompt_tokens  # each prompt once, however many choices it has
        self._per_prompt = per_prompt  # flows j*n .. j*n + n-1 are prompt j's choices
        self._open = len(flows)  # choices whose last event has not been read yet
        self._merged: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._pumps = [loop.create_task(self._pump(i, f)) for i, f in enumerate(flows)]

    async def _pump(self, index: int, flow: Flow) -> None:
        try:
            async for ev in flow.events():
                self._merged.put_nowait((index, ev))
        except Exception as e:  # a bug in a choice's text path: raised where the reader waits
            self._merged.put_nowait((index, e))

    @property
    def finished(self) -> bool:
        """Every choice's last event (the one with its finish_reason) has been read."""
        return self._open == 0

    @property
    def completion_tokens(self) -> int:
        return sum(f.completion_tokens for f in self.flows)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, each prompt once (its best choice), as
        ``prompt_tokens`` counts them; a choice that a stop string ended before the engine's
        last output came counts none."""
        n = self._per_prompt
        return sum(max(f.cached_tokens for f in self.flows[i : i + n])
                   for i in range(0, len(self.flows), n))

    async def next(self) -> tuple[int, Event]:
        """The next event of any choice; do not call once ``finished``."""
        index, ev = await self._merged.get()
        if isinstance(ev, Exception):
            raise ev
        if ev.finish_reason is not None:
            self._open -= 1
        return index, ev

    def close(self) -> None:
        """Stop reading and abort every choice the engine has not finished (idempotent)."""
        for task in self._pumps:
            task.cancel()
        for flow in self.flows:
            flow.close()
