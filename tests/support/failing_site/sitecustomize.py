"""Imported by Python at the start of a process whose PYTHONPATH begins with this folder (a
``dp-runtime serve`` started by a test: tests/support/failing_worker.py ``server_env``): every
``EngineOptions`` built without a ``worker_factory`` gets ranks that fail the requests seeded
from ``$DP_RUNTIME_TEST_FAIL_SEED`` on (tests/support/failing_worker.py)."""

import os

if os.environ.get("DP_RUNTIME_TEST_FAIL_SEED"):
    from launch.engine_types import EngineOptions
    from tests.support.failing_worker import SEED_ENV, failing_factory

    _post_init = EngineOptions.__post_init__

    def _with_failing_ranks(self):
        if self.worker_factory is None:  # frozen: set as its constructor would
            object.__setattr__(self, "worker_factory", failing_factory(int(os.environ[SEED_ENV])))
        _post_init(self)

    EngineOptions.__post_init__ = _with_failing_ranks
