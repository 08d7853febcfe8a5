"""The ``n`` choices of one HTTP request: n engine requests, each a ``Flow``, read as one stream.

A request with ``n = k`` (``protocol.MAX_N`` at most) submits k engine requests with the same
prompt and sampling fields; only the seed differs:

- with a request ``seed`` s, choice i samples with seed ``(s + i) mod 2**64`` (as vLLM does),
  so the response is reproducible and choice 0 is what the same request with n = 1 gives;
- without one, every choice draws its own random seed (the rule for a single request).

Greedy requests (temperature 0) give k identical choices, as OpenAI and vLLM do.

Each choice is one engine request against the engine's capacity. If submitting choice j is
refused (queue full: 429, engine unavailable: 503, a field the engine rejects: 400), the choices
already submitted are aborted and that error is the response. ``Choices.close`` aborts every
choice the engine has not finished: the responses call it when the first choice fails (its
siblings give their KV back), when the client leaves, and when the response is complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from typing import Any

from launch.server.protocol import SEED_LIMIT, Sampling
from launch.server.request_flow import Event, Flow, submit

__all__ = ["Choices", "choice_seeds", "submit_choices"]


def choice_seeds(seed: int, n: int, *, seeded: bool) -> list[int]:
    """The seed of each of ``n`` choices; ``seed`` is the request's (``seeded``) or the random
    one ``sampling_of`` drew for it (then choices 1.. draw their own)."""
    if seeded:
        return [(seed + i) % SEED_LIMIT for i in range(n)]
    return [seed] + [secrets.randbelow(2**63) for _ in range(n - 1)]


def submit_choices(
    state: Any, rid: str, prompt_ids: list[int], sampling: Sampling, n: int, *, seeded: bool
) -> Choices:
    """Submit the ``n`` engine requests of one HTTP request (engine rids ``rid`` for n = 1,
    else ``rid-0`` .. ``rid-{n-1}``). Raises ApiError (400/429/503) after aborting the choices
    already submitted."""
    flows: list[Flow] = []
    try:
        for i, seed in enumerate(choice_seeds(sampling.seed, n, seeded=seeded)):
            one = dataclasses.replace(sampling, seed=seed)
            flows.append(submit(state, rid if n == 1 else f"{rid}-{i}", prompt_ids, one))
    except BaseException:
        for flow in flows:
            flow.close()
        raise
    return Choices(flows)


class Choices:
    """The Events of every choice, in the order they arrive, as ``(index, Event)``.

    One task per choice moves its Flow's events onto a shared queue, so a choice that runs
    ahead (another rank, or its sibling still queued) is never held up by the others."""

    def __init__(self, flows: list[Flow]):
        self.flows = flows
        self.prompt_len = flows[0].prompt_len
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
