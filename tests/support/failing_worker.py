"""Real ranks that fail a marked request inside its step: the test seam
``EngineOptions.worker_factory`` (launch/engine_types.py), and the way a ``dp-runtime serve``
process started by a test takes it.

``failing_factory(seed)`` builds real ``RankWorker``s whose scheduler receives, for every token
drawn for a request whose seed is in ``[seed, seed + MARKED_SEEDS)`` (a request's ``n``
choices: the door gives choice j the seed ``seed + j``), a ``RowFailure`` instead: what a row
whose draw failed reports (NaN logits, sampling.py), so the rank fails that request alone in
its step (finish_reason "error", ``INJECTED`` in its error) and goes on serving the others.
Every other request is untouched.

A server process is not built by the test, so it cannot be handed a factory: the test puts
``SITE`` ahead on the server's PYTHONPATH and sets ``SEED_ENV`` (``server_env``). Python then
imports ``SITE/sitecustomize.py`` at start-up, before the CLI runs, and it gives every
``EngineOptions`` of that process without a factory this one. Nothing outside tests/ reads the
variable. (That sitecustomize shadows any other on the path: none is needed here.)
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["FAILING_SEED", "INJECTED", "MARKED_SEEDS", "SEED_ENV", "SITE", "failing_factory", "server_env"]

SEED_ENV = "DP_RUNTIME_TEST_FAIL_SEED"
SITE = Path(__file__).resolve().parent / "failing_site"
MARKED_SEEDS = 16  # the door's most choices per prompt (launch/server/protocol.py MAX_N)
# The tests' mark: the door's random seeds are below 2**63, so a request without one never has it.
FAILING_SEED = 2**64 - MARKED_SEEDS
INJECTED = "failed in its step by tests/support/failing_worker.py"


def server_env(seed: int = FAILING_SEED) -> dict[str, str]:
    """The environment of a server process (``ServeProcess(env=...)``) whose ranks fail the
    requests seeded ``seed`` + j; the repository root stays on the path after ``SITE``."""
    root = str(Path(__file__).resolve().parents[2])
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([str(SITE), root, *rest]), SEED_ENV: str(seed)}


def failing_factory(seed: int):
    """An ``EngineOptions.worker_factory``: real ranks that fail the requests seeded in
    ``[seed, seed + MARKED_SEEDS)`` at each token they draw (module docstring)."""

    def make(spec, rank, world):
        from dp_runtime.rank_worker import RankWorker
        from dp_runtime.serving.sampling import RowFailure

        worker = RankWorker(spec, rank=rank, world_size=world)
        scheduler = worker.scheduler
        advance = scheduler.advance

        def failing_advance(step, tokens, logprobs=None):
            tokens = [RowFailure(f"{INJECTED} (seed {r.request.sampling.seed})")
                      if isinstance(t, int) and 0 <= r.request.sampling.seed - seed < MARKED_SEEDS
                      else t for r, t in zip(step.reqs, tokens, strict=True)]
            return advance(step, tokens, logprobs)

        scheduler.advance = failing_advance
        return worker

    return make
