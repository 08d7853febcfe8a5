"""One choice of an ``n`` request failing fails the whole request and aborts its siblings
(launch/server/choices.py, respond.py), on a real in-process engine (one local rank).

The HTTP tests of ``n`` (seeds, usage, streams, 429, a client leaving) run against a real server
in test_serve_openai.py; a single choice cannot be made to fail from a client there (all choices
share the sampling fields), so here the engine itself aborts one choice, as a shutdown would.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from starlette.requests import Request

from dp_runtime.rank_spec import RankSpec
from launch.engine import Engine
from launch.server.app import ServerState
from launch.server.choices import submit_choices
from launch.server.metrics import ServerMetrics
from launch.server.prompt_encoder import PromptEncoder
from launch.server.protocol import ApiError, Sampling
from launch.server.respond import whole_response
from tests.hf_reference import write_tiny_checkpoint

pytest.importorskip("transformers")

CONTEXT = 96


class _Recorded:
    """The engine, with each ``abort(rid)`` the server makes and what it returned (True: the
    request was still in flight)."""

    def __init__(self, engine):
        self._engine, self.aborts = engine, []

    def abort(self, rid):
        self.aborts.append((rid, self._engine.abort(rid)))
        return self.aborts[-1][1]

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("choices_ckpt"))
    spec = RankSpec.create(str(ckpt), max_running_requests=2, chunked_prefill_size=16,
                           dtype="float32", device="cpu", max_context_len=CONTEXT)
    with Engine(spec).start() as eng:
        yield eng


async def _never_disconnects():
    await asyncio.Event().wait()


def test_a_choice_aborted_by_the_engine_is_503_and_its_sibling_is_aborted(engine):
    server = _Recorded(engine)
    state = ServerState(server, None, PromptEncoder(None, engine.model_name), ServerMetrics(engine))
    prompt = [1, 2, 3]
    sampling = Sampling(max_new_tokens=CONTEXT - len(prompt), temperature=1.0, top_p=1.0, top_k=0,
                        seed=3, stop_token_ids=(), ignore_eos=True)

    async def request():
        choices = submit_choices(state, "r", [(prompt, sampling)], 2, seeded=True)
        engine.abort("r-1")  # the engine ends choice 1 itself (as a shutdown does)
        http = Request({"type": "http", "method": "POST", "headers": []}, _never_disconnects)
        try:
            await whole_response(choices, http, "completion", "r", "m", 0)
        finally:  # the aborted sibling's last output is drained in this loop
            await asyncio.gather(*state.tasks)

    with pytest.raises(ApiError) as info:
        asyncio.run(request())
    assert info.value.status == 503 and info.value.code == "engine_unavailable"
    assert server.aborts == [("r-0", True)]  # the sibling, still running, aborted by the server
    deadline = time.monotonic() + 10
    while engine.stats().ranks[0].get("in_flight") != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats().ranks[0]["in_flight"] == 0
