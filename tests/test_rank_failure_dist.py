"""Ranks that cannot work together say so, naming the rank and the reason (dist tier, gloo):

- ranks started with different RankSpecs raise at worker start, before the dispatcher's
  warm-up, every rank alike, naming the field (before: a hang in warm-up, or wrong tokens);
- a rank whose forward raises tells its peers: they raise within the step-sync timeout naming
  it and its error (before: the default group's timeout, with a bare gloo message).

Run: ``torchrun --standalone --nproc-per-node 2 -m pytest -m dist -p no:cacheprovider tests/test_rank_failure_dist.py``
"""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from dp_runtime.sync.peer_failure import PeerRankFailedError
from dp_runtime.sync.spec_check import RankSpecMismatchError

pytestmark = pytest.mark.dist

TIMEOUT_S = 3.0


def _spec(world, **kw):
    base = dict(dp_size=world, max_running_requests=4, chunked_prefill_size=64, dtype="float32", device="cpu",
                max_context_len=64, use_cuda_graph=False, dp_sync_timeout_s=TIMEOUT_S)
    return RankSpec.create("tiny", **{**base, **kw})


def _outcomes(fn):
    """Run ``fn`` on every rank; return every rank's (exception or None, seconds)."""
    t = time.perf_counter()
    try:
        fn()
        err = None
    except Exception as e:
        err = e
    mine = (None if err is None else (type(err).__name__, str(err)), time.perf_counter() - t)
    table = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)
    return err, table


@pytest.mark.parametrize(("field", "per_rank"), [
    ("RankSpec.dispatcher", lambda r: dict(dispatcher=("all_gather", "all_to_all")[r % 2])),
    ("RankSpec.seed", lambda r: dict(seed=r % 2)),
    ("RankSpec.model_overrides", lambda r: dict(model_overrides={"num_layers": 1 + r % 2})),
])
def test_ranks_with_different_specs_raise_at_start_naming_the_field(dist_group, field, per_rank):
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = _spec(world, **per_rank(rank))
    err, table = _outcomes(lambda: RankWorker(spec, rank=rank, world_size=world).close())
    assert isinstance(err, RankSpecMismatchError), table
    assert err.field == field and f"DP ranks disagree on {field}" in str(err)
    assert 1 in err.ranks
    if field == "RankSpec.model_overrides":
        assert "'model config'" in str(err)  # the fingerprint differs too, and is listed
    assert all(t[0] is not None and t[0][0] == "RankSpecMismatchError" for t in table), table  # every rank
    dist.barrier()  # no rank was left inside a collective


def test_a_rank_whose_forward_raises_is_named_by_its_peers(dist_group):
    world, rank = dist.get_world_size(), dist.get_rank()
    w = RankWorker(_spec(world), rank=rank, world_size=world)
    try:
        reqs = [Request(f"r{rank}-{i}", [1 + i, 2, 3], SamplingParams(max_new_tokens=4)) for i in range(2)]
        if rank == 0:
            # Fault injection through a real path: rank 0's scheduler no longer knows the
            # vocabulary, so a token id past it reaches the embedding, which raises IndexError.
            w.scheduler.vocab_size = None
            reqs.append(Request("poison", [5, 100_000, 7], SamplingParams(max_new_tokens=4)))
        w.submit(reqs)
        err, table = _outcomes(w.run_until_idle)
    finally:
        w.close()
    assert all(t[0] is not None for t in table), table
    if rank == 0:
        assert isinstance(err, IndexError)
    else:
        assert isinstance(err, PeerRankFailedError), repr(err)
        assert err.rank == 0 and "IndexError" in err.error
        assert "DP rank 0 failed in step" in str(err) and "IndexError" in str(err)
        # Within the step-sync timeout (plus slack for a loaded CI box), not the group's 120 s.
        assert table[rank][1] < TIMEOUT_S + 10, table
    dist.barrier()  # the default group is still usable
