"""launch_local: world size 1 in this process, no Ray and no process group.

The same RankSession as a Ray actor holds, polled the same way (so the CLI's progress bar and
report work alike); there is no gang to restart: an error in the step loop is raised here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from dp_runtime.rank_spec import RankSpec
from dp_runtime.serving.admission import admit
from dp_runtime.serving.request import Request
from launch.rank_session import DONE, ERROR, RankSession
from launch.run_report import PollEvent, RunReport

__all__ = ["launch_local"]


def launch_local(spec: RankSpec, requests: Sequence[Request], *, poll_interval_s: float = 0.1,
                 on_poll: Callable[[PollEvent], None] | None = None, show_progress: bool = False,
                 worker_factory: Callable[[RankSpec, int, int], Any] | None = None,
                 on_phase: Callable[[str], None] | None = None) -> RunReport:
    """Run ``requests`` on one in-process rank (``spec.runtime.world_size`` must be 1); returns
    the RunReport. ``on_phase`` hears the rank's set-up phases (``loading weights``, ...) and
    ``running``; ``on_poll`` every poll. A request refused at the door
    (``admission.check_request``) gets a result with its error and is never queued. Raises
    ValueError for a multi-rank spec, duplicate rids or a request that never fits the KV cache,
    and RuntimeError carrying the rank's traceback when its step loop raises."""
    if spec.runtime.world_size != 1:
        raise ValueError(f"the local launcher runs world size 1, the spec has {spec.runtime.world_size} "
                         f"(use the Ray launcher or torchrun for more ranks)")
    accepted, refused = admit(requests, spec.model_config().vocab_size, spec.context_len)
    t0 = time.perf_counter()
    session = RankSession(spec, 0, 1, show_progress=show_progress, worker_factory=worker_factory,
                          on_phase=on_phase)
    max_tokens = sum(r.sampling.max_new_tokens for r in requests)
    try:
        setup_s = time.perf_counter() - t0
        if on_phase is not None:
            on_phase("running")
        session.submit(accepted)
        session.start()
        results: dict[str, Any] = {r.rid: r for r in refused}
        while True:
            st = session.collect()
            for res in st.results:
                results.setdefault(res.rid, res)
            if on_poll is not None:
                on_poll(PollEvent(0, len(results), len(requests), (), (st,),
                                  tokens=int(st.metrics.get("generated_tokens", 0)), total_tokens=max_tokens))
            if st.state == ERROR:
                raise RuntimeError(f"rank 0: the step loop raised:\n{st.error}")
            if st.state == DONE:
                break
            time.sleep(poll_interval_s)
    finally:
        session.close()
    order = [r.rid for r in requests if r.rid in results]
    return RunReport(
        results=tuple(results[rid] for rid in order), world_size=1, launcher="local",
        device=spec.runtime.device.type, wall_s=time.perf_counter() - t0, run_s=st.loop_s, setup_s=setup_s,
        rank_metrics=(dict(st.metrics),),
    )
