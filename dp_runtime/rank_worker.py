"""RankWorker: one DP rank end to end — requests in, tokens out — with DP sync every step.

Built from a RankSpec (the same object on every rank). Construction is collective when
``world_size > 1`` (sync, dispatcher and graph capture talk to the peers): every rank builds its
worker together, after ``torch.distributed`` is initialised (``launch/process_group.py``).

One step (``step()``), the same sequence on every rank::

    scheduler.next_step()        the rank's batch: decode, extend, mixed (both), or nothing
    sync.sync(LocalStepInfo)     the one exchange of counts; every rank gets the same StepPlan
    plan.skip                    every rank had nothing: all return here, together
    batch.plan = plan            the plan travels with the batch: a gathering dispatcher lays
                                 its DP buffers out from it in the forward (nothing here does)
    graph replay                 when the plan has a bucket: a decode graph (DECODE on every
                                 busy rank) or extend pieces (EXTEND on every busy rank), fits
    or eager                     otherwise (prefill, SUM_LEN, a batch over the largest graph)
    sample                       only on a rank with a batch (serving/step_tokens.py); an
                                 IDLE rank ran the forward with zero rows (it joins the
                                 dispatcher's collectives) and discards the empty logits
    scheduler.advance            the previous step's tokens (overlap), or this step's

Overlap (``RuntimeConfig.overlap_schedule``, on by default): step N's tokens reach the host
asynchronously and are recorded after step N+1 was launched, so the host's work of a step runs
while the GPU computes the one before (docs/model.md, "Overlapped steps").

Teardown (``close``): graphs first (extend pieces, then decode graphs), then the dispatcher,
then the step sync; the process group belongs to whoever created it and is destroyed after.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from buffers import BufferPool, build_prefill_registry
from dispatcher import EPGroup
from dp_runtime import rank_memory as rm
from dp_runtime.attention import make_attention_backend
from dp_runtime.choices import rank_choices
from dp_runtime.graph_setup import RankGraphs, capture_rank_graphs
from dp_runtime.rank_parts import build_moe_exchange, load_model
from dp_runtime.rank_report import rank_report
from dp_runtime.rank_spec import RankSpec
from dp_runtime.serve_loop import run_until_idle
from dp_runtime.serving.forward_batch import idle_batch, planned_batch
from dp_runtime.serving.kv_allocator import KVAllocator
from dp_runtime.serving.outputs import StepOutputs
from dp_runtime.serving.penalty_counts import PenaltyCounts
from dp_runtime.serving.request import Request, RequestResult
from dp_runtime.serving.scheduler import ScheduledStep, Scheduler
from dp_runtime.serving.step_tokens import StepTokens, launch_tokens
from dp_runtime.step_kinds import STEP_COUNTERS, count_step, dp_balance, steps_by_kind
from dp_runtime.step_token_histogram import StepTokenHistogram
from dp_runtime.sync.exchange import LocalExchange
from dp_runtime.sync.peer_failure import FailureNotice
from dp_runtime.sync.rank_groups import rank_groups
from dp_runtime.sync.spec_check import check_rank_specs
from dp_runtime.sync.step_plan import StepPlan
from dp_runtime.sync.step_sync import NCOLS, DPStepSync
from dp_runtime.sync.step_table import LocalStepInfo
from graph import AttentionSplit, EagerRunner, GraphRunner, PiecewiseRunner

__all__ = ["RankWorker"]

logger = logging.getLogger("dp_runtime")

class RankWorker:
    """One DP rank (module docstring).

    Args:
        spec: the RankSpec every rank shares.
        rank, world_size: this rank and the DP world (``spec.runtime.dp_size`` must equal it).
        group: the device process group (default: the world group when world_size > 1).
        show_progress: a progress bar while graphs are captured.
        on_phase: called with the name of each construction phase as it begins ("loading
            weights", "warming up the dispatcher", "capturing graphs"): the launcher's start-up
            line.
        keep_logits: keep a CPU copy of every sampled logits row in ``sampled_logits[rid]``
            (for comparisons against a reference; costs a device-to-host copy per step).
    """

    def __init__(self, spec: RankSpec, *, rank: int = 0, world_size: int = 1, group: Any = None,
                 show_progress: bool = False, keep_logits: bool = False,
                 on_phase: Callable[[str], None] | None = None) -> None:
        cfg = spec.runtime
        if cfg.dp_size != world_size:
            raise ValueError(f"RankWorker: spec.runtime.dp_size={cfg.dp_size} but "
                             f"world_size={world_size}")
        if cfg.attn_tp_size != 1:
            raise ValueError("RankWorker: the reference model runs attn_tp_size=1, "
                             f"got {cfg.attn_tp_size}")
        if cfg.ep_size != world_size:  # the model spreads its experts over every rank
            raise ValueError(f"RankWorker: ep_size must be {world_size}, got {cfg.ep_size}")
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.model_config = spec.model_config()
        device = torch.device(cfg.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._lock = threading.Lock()
        self.outputs = StepOutputs()  # tokens and results for the launcher (serving/outputs.py)
        self._counters = dict.fromkeys(
            ("steps", "graph_steps", "extend_graph_steps", "eager_steps", "idle_steps",
             "skipped_steps", "generated_tokens", "finished_requests", "dp_tokens",
             "dp_max_tokens", "dp_sync_wait_us", *STEP_COUNTERS), 0)
        self._step_tokens = StepTokenHistogram()  # under self._lock, as the counters
        self._memory: dict[str, int] = {}
        self._show_progress = show_progress
        self._on_phase = on_phase or (lambda name: None)
        # Benchmarks compare graph and eager steps on one worker; set it alike on every rank
        # (it only changes what this rank reports, so the plan stays rank-invariant anyway).
        self.graph_enabled = True
        self.sampled_logits: dict[str, list[torch.Tensor]] | None = {} if keep_logits else None
        self.rank_graphs: RankGraphs | None = None
        self.dispatcher = None
        self.sync: DPStepSync | None = None
        self._own_cpu_group = None
        self._pending: StepTokens | None = None  # the last step's tokens, unrecorded (overlap)
        self.penalty_counts: PenaltyCounts | None = None
        try:
            self._build(group)
        except BaseException:
            self.close()
            raise

    @property
    def graphs(self) -> GraphRunner | None:
        """The decode graphs (None without graphs)."""
        return None if self.rank_graphs is None else self.rank_graphs.decode

    @property
    def extend_graphs(self) -> PiecewiseRunner | None:
        """The extend pieces (None without graphs or without extend token buckets)."""
        return None if self.rank_graphs is None else self.rank_graphs.extend

    # -- construction ----------------------------------------------------------------------------
    def _build(self, group: Any) -> None:
        spec, cfg, mc, dev = self.spec, self.spec.runtime, self.model_config, self.device
        device_group, cpu_group, self._own_cpu_group = rank_groups(group, self.world_size,
                                                                   cfg.dp_sync_timeout_s)
        self.cpu_group = cpu_group  # the DP CPU group (None at world size 1)
        # First collective of the build: ranks whose specs differ would hang in the dispatcher's
        # warm-up or give wrong tokens; they raise here, every rank alike, naming the field.
        check_rank_specs(spec, cpu_group)
        exchange = LocalExchange(NCOLS) if self.world_size == 1 else None
        self.sync = DPStepSync(cfg, cpu_group, exchange=exchange)
        self._failure = FailureNotice(cpu_group, abandon=self.sync.abandon)
        ep = (EPGroup.local() if self.world_size == 1
              else EPGroup.from_torch(device_group, cpu_group))
        self.choices = choices = rank_choices(spec, mc.head_dim, self.world_size, dev, ep)
        self.dispatcher_kind = choices.dispatcher

        # The rank's one pool. Its first tenant is the DP buffer service of a gathering dispatcher.
        self.pool = pool = BufferPool()
        self.dispatcher = build_moe_exchange(spec, self.rank, device_group, ep, choices.dispatcher,
                                             pool, dev)
        self._memory["dp_buffers"] = pool.total_bytes()
        self._memory["dispatcher_workspace"] = self.dispatcher.workspace_bytes_per_rank()
        self._on_phase("loading weights")
        self.model = load_model(spec, ep, self.dispatcher, dev)
        self._memory["weights"] = self.model.weight_bytes()
        self._on_phase("warming up the dispatcher")
        self.dispatcher.warmup()
        self.attention_kind = choices.attention

        # Registries share the pool by name. The eager one is built first: it is the larger on
        # every axis (max_running_requests >= cuda_graph_max_bs), and storage never grows.
        pool_before = pool.total_bytes()

        def eager_registry(bs: int, tokens: int):
            return build_prefill_registry(bs, tokens, dev, pool, dp_size=cfg.dp_size,
                                          register_input_embeds=False,
                                          register_global_num_tokens=False, user="eager")

        def eager_runner(model, attention) -> EagerRunner:
            return EagerRunner(model.forward, attention, eager_registry,
                               no_copy=cfg.eager_input_no_copy, max_bs=cfg.max_running_requests,
                               max_num_tokens=cfg.max_tokens_per_rank)

        # Before the KV cache is sized, so its size is measured with the rest that the rank holds.
        self.penalty_counts = PenaltyCounts.for_runtime(cfg.max_running_requests, mc.vocab_size,
                                                        dev)
        self._memory["penalty_counts"] = self.penalty_counts.nbytes
        slots = rm.measured_kv_slots(spec, self.model, dev, choices, eager_runner, pool,
                                     self._memory, self._on_phase)
        self.kv_cache = rm.make_kv_cache(spec, slots, dev)
        self._memory["kv_cache"] = self.kv_cache.nbytes()
        self.attention = make_attention_backend(choices.attention, self.kv_cache, mc,
                                                q_dtype=cfg.dtype,
                                                check_indices=cfg.flashinfer_checks)
        # The model's one binding: it attends through a seam that extend graphs cut their pieces
        # at, and stores K/V into the cache that attention reads.
        self.model.bind_attention(AttentionSplit(self.attention))
        self.scheduler = Scheduler.for_runtime(KVAllocator(self.kv_cache), cfg, rank=self.rank,
                                               vocab_size=mc.vocab_size,
                                               eos_token_ids=spec.eos_token_ids)
        self.eager = eager_runner(self.model, self.attention)
        if choices.graphs:
            self.rank_graphs = capture_rank_graphs(
                cfg=cfg, forward=self.model.forward, split=self.model.attention,
                attention=self.attention, pool=pool, device=dev, max_context_len=spec.context_len,
                show_progress=self._show_progress, on_phase=self._on_phase)
        self._memory["graph_pool"] = self.rank_graphs.memory_bytes if self.rank_graphs else 0
        self._memory["graph_inputs"] = pool.total_bytes() - pool_before
        if "graph_reserve" in self._memory:  # profiled: the largest step must still fit
            self._on_phase("checking the largest step")
            rm.check_largest_step(
                lambda: rm.run_largest_step(self.eager, cfg, dev, spec.context_len), dev,
                self._memory)
            logger.info("rank %d memory (bytes): %s", self.rank, self._memory)

    # -- requests --------------------------------------------------------------------------------
    def submit(self, requests: Iterable[Request]) -> None:
        """Queue requests on this rank: ValueError, all or none, for bad input; a request the KV
        cache can never hold finishes at once with its error (its result comes out as any other)."""
        with self._lock:
            refused = self.scheduler.submit(requests)
        self.outputs.add((), refused)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def pop_finished(self) -> list[RequestResult]:
        """Results finished since the last call (thread-safe)."""
        return self.outputs.pop_finished()

    def abort(self, rids: Iterable[str]) -> None:
        """Finish the named queued or running requests now, finish_reason "abort", freeing their
        KV (thread-safe, between steps; not a collective). Unknown rids are ignored."""
        with self._lock:
            aborted = self.scheduler.abort(rids)
            self._counters["finished_requests"] += len(aborted)
        self.outputs.add((), aborted)

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._counters, steps_by_kind=steps_by_kind(self._counters),
                                       tokens_per_step=self._step_tokens.snapshot())
        out.update(dp_balance=dp_balance(out), dp_sync_wait_s=out["dp_sync_wait_us"] / 1e6)
        return {**out, **rank_report(self)}  # the queue, KV and the build's facts

    def memory_report(self) -> dict[str, int]:
        """Bytes per component as allocated (weights, kv_cache, dp_buffers, dispatcher_workspace,
        graph_inputs, penalty_counts, graph_pool, activation_peak: the largest step's allocation
        growth, 0 unless profiled; when the rank profiled and sized its KV cache on CUDA also
        graph_reserve, allocator_cache and cuda_context, ``rank_memory.measured_kv_slots``)."""
        return dict(self._memory)

    # -- the step loop ---------------------------------------------------------------------------
    def _local_info(self, step: ScheduledStep | None) -> LocalStepInfo:
        if step is None:
            return LocalStepInfo(0)
        if step.is_extend:
            runner, size = self.extend_graphs, step.num_tokens
        else:
            runner, size = self.graphs, step.batch.batch_size
        graph_ok = runner is not None and self.graph_enabled and size <= runner.sizes[-1]
        return LocalStepInfo(step.num_tokens, sum(step.samples), graph_ok, step.is_extend)

    def step(self) -> StepPlan:
        """One DP step (module docstring): a collective that every rank calls the same number of
        times. Returns the step's plan (``plan.skip``: every rank had nothing to do). When it
        raises, the peers are told (sync/peer_failure.py); a rank whose step failed because a
        peer's did raises PeerRankFailedError naming that rank and its error."""
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            # A thread of its own (RankSession) starts on GPU 0; FlashInfer and streams need ours.
            torch.cuda.set_device(self.device)
        try:
            return self._step()
        except Exception as e:
            self._failure.on_step_error(e, self.sync.steps if self.sync is not None else -1)
            raise

    def _step(self) -> StepPlan:
        with self._lock:
            scheduled = self.scheduler.next_step()
        if scheduled is None and self._pending is not None:
            # Nothing to run without the last step's tokens (every request is at its end, or the
            # queue waits for their slots): read them, so a skip still means "nothing to do".
            self.wait_tokens()
            with self._lock:
                scheduled = self.scheduler.next_step()
        t_sync = time.perf_counter()
        plan = self.sync.sync(self._local_info(scheduled))
        c = self._counters
        # DP balance (every rank counts the same table): tokens over (the most a rank had x ranks)
        # summed over steps; and the time this rank waited in the exchange for its slowest peer.
        c["dp_sync_wait_us"] += int((time.perf_counter() - t_sync) * 1e6)
        if not plan.skip:
            c["dp_tokens"] += sum(plan.raw_num_tokens)
            c["dp_max_tokens"] += max(plan.raw_num_tokens) * len(plan.raw_num_tokens)
        lp = plan.global_num_tokens_for_logprob_cpu  # the rows that sample: that peer decodes next
        with self._lock:
            self.scheduler.note_peers_decoding(any(n for r, n in enumerate(lp) if r != self.rank))
        if plan.skip:
            c["skipped_steps"] += 1
            return plan
        # The step's batch, built once: the scheduler's with the plan (never written in place).
        # The plan is all the forward needs of DP: the dispatcher lays its buffers out from it.
        if scheduled is None:
            batch = idle_batch(self.device, plan)
        else:
            batch = planned_batch(scheduled.batch, plan)
        runner = self.extend_graphs if plan.is_extend else self.graphs
        if plan.graph_bucket is not None and runner is not None:
            logits = runner.replay(batch, plan)
            c["graph_steps"] += 1
            c["extend_graph_steps"] += plan.is_extend
        else:
            logits = self._eager(batch)
            c["eager_steps"] += 1
        c["steps"] += 1
        c["idle_steps"] += scheduled is None
        launched = None
        if scheduled is not None:
            launched = launch_tokens(scheduled, logits, self.scheduler.last_tokens,
                                     self.penalty_counts, self.sampled_logits)
        self.wait_tokens()  # the step before's, read while this one runs
        if launched is not None:
            self._pending = launched
            if not self.spec.runtime.overlap_schedule:
                self.wait_tokens()
        return plan

    def _eager(self, batch) -> torch.Tensor:  # a method: bench/gpu_spans.py times it
        return rm.eager_step(self.eager, batch, self.device, self._memory)

    def wait_tokens(self) -> None:
        """Record the tokens of the last step in the scheduler, if not yet (waits for that step's
        copy; not a collective). ``step`` returns before its tokens are read when steps overlap:
        call this to see its results (``pop_finished``) at once."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        scheduled, tokens = pending.scheduled, pending.wait()
        c = self._counters
        # A request that stopped at the step before ran this one for nothing: its token is dropped.
        lps = pending.logprobs or [None] * len(tokens)
        kept = [(r.request.rid, t, lp)
                for r, s, t, lp in zip(scheduled.reqs, scheduled.samples, tokens, lps, strict=True)
                if s and not r.done and isinstance(t, int)]
        with self._lock:
            finished = self.scheduler.advance(scheduled, tokens, pending.logprobs)
            c["finished_requests"] += len(finished)
            c["generated_tokens"] += len(kept)
            count_step(c, scheduled)
            self._step_tokens.observe(scheduled.num_tokens)
        self.outputs.add(kept, finished)

    def run_until_idle(self, stop: threading.Event | None = None,
                       max_steps: int | None = None) -> int:
        """``serve_loop.run_until_idle`` on this worker (a collective; see there)."""
        return run_until_idle(self, stop, max_steps)

    def next_arrival_in(self) -> float | None:
        """Seconds until this rank's earliest queued request arrives (None: its queue is empty)."""
        with self._lock:
            return self.scheduler.next_arrival_in()

    def generate(self, requests: Iterable[Request]) -> list[RequestResult]:
        """Submit ``requests``, run until every rank is idle, return this rank's results in
        submission order. A collective (every rank calls it, with its own requests)."""
        reqs = list(requests)
        self.submit(reqs)
        self.run_until_idle()
        by_rid = {r.rid: r for r in self.pop_finished()}
        return [by_rid[r.rid] for r in reqs]

    # -- teardown --------------------------------------------------------------------------------
    def close(self) -> None:
        """Release graphs, then the dispatcher, then the step sync, then the penalties' tables
        (idempotent; not a collective). The process group is the caller's to destroy, after this."""
        if self.rank_graphs is not None:
            self.rank_graphs.destroy()
            self.rank_graphs = None
        if self.dispatcher is not None:
            self.dispatcher.close()
            self.dispatcher = None
        if self.sync is not None:
            self.sync.close()
            self.sync = None
        if self.penalty_counts is not None:
            self.penalty_counts.close()
        if self._own_cpu_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._own_cpu_group)
            self._own_cpu_group = None

    def __enter__(self) -> RankWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
