"""GraphRunner: capture one CUDA graph per batch-size bucket, replay it with registry inputs.

Lifecycle::

    runner = GraphRunner(forward, backend, registry, sizes, capture_batch=..., capture_plan=...)
    runner.capture()                   # largest to smallest, one shared graph memory pool
    if runner.can_run(batch, plan):    # every step
        out = runner.replay(batch, plan)
    ...
    runner.destroy()                   # before the process groups are destroyed

A replay step: the bucket is the smallest captured size >= the DP-agreed size of the plan
(``plan.graph_bucket``, the same on every rank; never the local batch size, or ranks would pick
different graphs and their collectives would not match); ``registry.fill`` copies the live
rows and pads the tail; the attention backend refreshes the bucket's metadata with ``bs`` (the
bucket) and ``raw_bs`` (the live requests) passed explicitly; the graph replays; every output
whose leading dimension is the padded token (or request) count is sliced to the live rows.
Outputs are views of graph memory: they are overwritten by the next replay of any bucket.

Without CUDA (or with ``use_cuda_graph=False``) capture records the same values and replay
runs the forward eagerly on the same padded registry views, so fill, padding, metadata and
slicing are exercised by CPU tests.

The runner knows nothing of DP: whatever the forward's plan decides (a dispatcher's buffer
layout among it) travels in the batch. At capture the batch carries the capture plan, and the
eager stand-in runs with it too, which is what a captured graph replays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from buffers import BufferRegistry
from graph.attention_protocol import AttentionMetadataBackend
from graph.capture_common import (
    capture_largest_first,
    checked_sizes,
    resolve_cuda_graph,
    slice_rows,
)
from graph.capture_record import CaptureRecord
from graph.capture_sizes import bucket_for
from graph.forward_mode import ForwardMode
from graph.runner_batch import RunnerBatch
from graph.step_plan_view import StepPlanView, padding_name

__all__ = ["GraphRunner", "capture_largest_first", "checked_sizes", "resolve_cuda_graph"]

# (bs, num_tokens, plan) -> a batch of bs requests with valid dummy inputs (request row 0,
# KV slot 0, length 1) and plan.global_num_tokens_cpu as its per-rank counts.
CaptureBatchFn = Callable[[int, int, StepPlanView], Any]


@dataclass
class _Captured:
    record: CaptureRecord
    graph: torch.cuda.CUDAGraph | None  # None: the eager stand-in (no CUDA)
    output: Any  # the graph's output tensors (graph memory), None without CUDA
    plan: Any  # the capture plan: the bucket on every rank, what the graph's gathers recorded


class GraphRunner:
    """Captures ``forward`` per bucket and replays it from ``registry`` (module docstring).

    Args:
        forward: ``forward(batch) -> output`` (a tensor, or a tuple/list/dict of tensors); it
            must not synchronize with the host (it is captured).
        backend: the attention backend (``graph.AttentionMetadataBackend``).
        registry: the graph inputs; it needs ``req_pool_indices`` and ``seq_lens`` slots and
            room for the largest bucket on both axes.
        sizes: the buckets (``graph.capture_sizes``).
        capture_batch: ``(bs, num_tokens, plan) -> batch``, a dummy batch to capture with.
        capture_plan: ``bucket -> plan``, the step plan every rank has when all run that bucket
            (from the same plan function the step loop uses, so the baked values match); the
            capture batch carries it into the forward.
        forward_mode: the mode captured (DECODE); IDLE batches replay it with 0 live rows.
        num_tokens_per_bs: tokens per request in a captured batch (1 for decode).
        use_cuda_graph: None for "when CUDA is available and the registry is on CUDA".
        warmup_runs: eager runs before each capture (lazy init, autotuning, allocator warm-up).
        show_progress: a tqdm bar over the buckets while capturing.
    """

    def __init__(
        self,
        forward: Callable[[Any], Any],
        backend: AttentionMetadataBackend,
        registry: BufferRegistry,
        sizes: Sequence[int],
        *,
        capture_batch: CaptureBatchFn,
        capture_plan: Callable[[int], StepPlanView],
        forward_mode: ForwardMode = ForwardMode.DECODE,
        num_tokens_per_bs: int = 1,
        use_cuda_graph: bool | None = None,
        warmup_runs: int = 2,
        show_progress: bool = True,
    ) -> None:
        self.sizes = checked_sizes("GraphRunner", sizes)
        if forward_mode is ForwardMode.IDLE:
            raise ValueError("GraphRunner: cannot capture IDLE; IDLE batches replay the captured "
                             "mode")
        if num_tokens_per_bs < 1:
            raise ValueError(
                f"GraphRunner: num_tokens_per_bs must be >= 1, got {num_tokens_per_bs}")
        for name in ("req_pool_indices", "seq_lens"):
            if name not in registry.slots:
                raise ValueError(f"GraphRunner: registry {registry.user!r} has no {name!r} slot "
                                 "(the backend reads it)")
        largest = self.sizes[-1]
        if largest > registry.max_bs or largest * num_tokens_per_bs > registry.max_num_tokens:
            raise ValueError(
                f"GraphRunner: largest bucket {largest} ({largest * num_tokens_per_bs} tokens) "
                f"exceeds registry {registry.user!r} capacity max_bs={registry.max_bs}, "
                f"max_num_tokens={registry.max_num_tokens}"
            )
        self.use_cuda_graph = resolve_cuda_graph("GraphRunner", use_cuda_graph, registry)
        self.forward = forward
        self.backend = backend
        self.registry = registry
        self.forward_mode = forward_mode
        self.num_tokens_per_bs = int(num_tokens_per_bs)
        self.warmup_runs = int(warmup_runs)
        self.show_progress = show_progress
        self._capture_batch = capture_batch
        self._capture_plan = capture_plan
        self._captured: dict[int, _Captured] = {}
        self._pool: Any = None
        self._shared_output: torch.Tensor | None = None  # the largest bucket's (_into_shared)
        self.capture_memory_bytes = 0  # torch.cuda.memory_allocated() growth over capture()

    # -- capture -------------------------------------------------------------------------------
    @property
    def captured(self) -> bool:
        return bool(self._captured)

    @property
    def graph_pool(self) -> Any:
        """The one memory pool every bucket's graph was captured into (None without CUDA)."""
        return self._pool

    def record(self, bucket: int) -> CaptureRecord:
        """What bucket ``bucket``'s graph baked in (KeyError when it was not captured)."""
        return self._captured[bucket].record

    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool.

        Largest first: the first capture sizes the pool's blocks, and each smaller graph reuses
        them instead of adding its own. Raises RuntimeError when already captured; on a failure
        the graphs captured so far are released before the error propagates.
        """
        if self._captured:
            raise RuntimeError("GraphRunner.capture: already captured; call destroy() first")
        largest = self.sizes[-1]
        self.backend.init_capture(max_bs=largest, max_num_tokens=largest * self.num_tokens_per_bs)
        if self.use_cuda_graph:
            self._pool = torch.cuda.graph_pool_handle()
        self.capture_memory_bytes = capture_largest_first(
            self.sizes, self._captured, self._capture_one, device=self.registry.device,
            use_cuda_graph=self.use_cuda_graph, label="graphs", show_progress=self.show_progress,
            on_error=self.destroy)

    def _capture_one(self, bs: int, stream: torch.cuda.Stream | None) -> _Captured:
        n = bs * self.num_tokens_per_bs
        plan = self._capture_plan(bs)
        batch = self._capture_batch(bs, n, plan)
        if batch.batch_size != bs or batch.num_tokens != n:
            raise ValueError(
                f"GraphRunner: capture_batch({bs}, {n}) returned a batch of {batch.batch_size} "
                f"requests, {batch.num_tokens} tokens"
            )
        self.registry.fill(batch, bs, bs, n, n)
        views = self.registry.views(bs, n)
        self.backend.init_forward_metadata_capture(
            bs=bs,
            num_tokens=n,
            req_pool_indices=views["req_pool_indices"],
            seq_lens=views["seq_lens"],
            forward_mode=self.forward_mode,
        )
        record = CaptureRecord(
            bucket=bs,
            num_tokens=n,
            forward_mode=self.forward_mode,
            padding=padding_name(plan),
            runtime_max_tokens_per_rank=int(plan.runtime_max_tokens_per_rank),
            fields=self._fields(batch),
        )
        if stream is None:
            return _Captured(record, None, None, plan)
        view = self.registry.view(batch, bs, n)
        # Warm-up on the capture stream, after the fill that the current stream enqueued.
        stream.wait_stream(torch.cuda.current_stream(self.registry.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(self.warmup_runs):
                self.forward(view)
        torch.cuda.synchronize(self.registry.device)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, stream=stream):
            output = self._into_shared(self.forward(view), bs)
        return _Captured(record, graph, output, plan)

    def _into_shared(self, output: Any, rows: int) -> Any:
        """A bucket's per-request output (the logits) is copied, inside its graph, into the first
        rows of the largest bucket's, returned instead: its own is then a pool temporary, not
        memory every bucket keeps (35 buckets up to 256 rows of a 152k vocabulary kept 2.5 GiB);
        the copy costs ~25 us at 64 rows. Replays run in stream order and a step's logits are
        read before the next replay, so shared rows are never overwritten in use."""
        if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != rows:
            return output
        shared = self._shared_output
        if shared is None:  # the largest bucket: captured first, its output is the shared one
            self._shared_output = output
            return output
        if (shared.shape[1:] != output.shape[1:] or shared.dtype != output.dtype
                or shared.shape[0] < rows):
            return output
        return shared[:rows].copy_(output)

    # -- replay --------------------------------------------------------------------------------
    def _fields(self, batch: Any) -> frozenset[str]:
        return frozenset(
            name for name, slot in self.registry.slots.items()
            if not slot.computed and slot.read(batch) is not None
        )

    def bucket_for(self, plan: StepPlanView) -> int:
        """The smallest captured size >= ``plan.graph_bucket`` (the DP-agreed size).

        Raises ValueError when the plan has no bucket or its size exceeds the largest bucket.
        """
        agreed = plan.graph_bucket
        if agreed is None:
            raise ValueError("GraphRunner: the plan has no graph bucket (this step runs eager)")
        return bucket_for(self.sizes, int(agreed))

    def _mismatch(self, batch: RunnerBatch, plan: StepPlanView, captured: _Captured) -> str | None:
        record = captured.record
        reason = record.plan_mismatch(record.bucket, plan)
        if reason:
            return reason
        most = max(plan.global_num_tokens_cpu, default=0)
        if most > record.num_tokens:
            return (f"a rank has {most} tokens in this plan; bucket {record.bucket} holds "
                    f"{record.num_tokens} per rank")
        mode = batch.forward_mode
        if mode is not record.forward_mode and mode is not ForwardMode.IDLE:
            return f"batch mode {mode.name}; graphs were captured for {record.forward_mode.name}"
        if batch.batch_size > record.bucket:
            return (f"batch has {batch.batch_size} requests; bucket {record.bucket} holds "
                    f"{record.bucket}")
        want = batch.batch_size * self.num_tokens_per_bs
        if batch.num_tokens != want:
            return (
                f"batch has {batch.num_tokens} tokens for {batch.batch_size} requests; "
                f"graphs take {self.num_tokens_per_bs} per request"
            )
        return record.fields_mismatch(self._fields(batch))

    def why_not(self, batch: RunnerBatch, plan: StepPlanView) -> str | None:
        """Why ``batch`` under ``plan`` cannot replay a graph, or None when it can.

        The plan conditions (a bucket, within the largest, the baked values) are the same on
        every rank. The batch conditions (mode, size, inputs) hold on every rank of a correct
        plan; a failure there is a bug to surface, not a routing decision to take per rank.
        """
        if not self._captured:
            return "graphs are not captured"
        try:
            bucket = self.bucket_for(plan)
        except ValueError as e:
            return str(e)
        return self._mismatch(batch, plan, self._captured[bucket])

    def can_run(self, batch: RunnerBatch, plan: StepPlanView) -> bool:
        """Whether ``replay(batch, plan)`` can run (see ``why_not`` for the reason it cannot)."""
        return self.why_not(batch, plan) is None

    def replay(self, batch: RunnerBatch, plan: StepPlanView) -> Any:
        """Run ``batch`` through the graph of the plan's bucket; return outputs of the live rows.

        Raises ValueError naming the mismatch when the plan or the batch disagrees with what
        the bucket's graph baked in, RuntimeError before ``capture()``.
        """
        if not self._captured:
            raise RuntimeError("GraphRunner.replay: graphs are not captured; call capture() first")
        bucket = self.bucket_for(plan)
        captured = self._captured[bucket]
        reason = self._mismatch(batch, plan, captured)
        if reason:
            raise ValueError(f"GraphRunner.replay: {reason}")
        raw_bs, raw_n, n = batch.batch_size, batch.num_tokens, captured.record.num_tokens
        self.registry.fill(batch, raw_bs, bucket, raw_n, n)
        views = self.registry.views(bucket, n)
        seq_lens_cpu = views.get("seq_lens_cpu")
        # The host copy gives the sum without a device sync; without it the sum syncs.
        seq_lens_sum = int((seq_lens_cpu if seq_lens_cpu is not None else views["seq_lens"]).sum())
        self.backend.init_forward_metadata_replay(
            bs=bucket,
            raw_bs=raw_bs,
            req_pool_indices=views["req_pool_indices"],
            seq_lens=views["seq_lens"],
            seq_lens_sum=seq_lens_sum,
            forward_mode=self.forward_mode,
            seq_lens_cpu=seq_lens_cpu,
        )
        if captured.graph is not None:
            captured.graph.replay()
            output = captured.output
        else:
            # The stand-in runs what the capture recorded: the captured mode (an IDLE batch too)
            # and the capture plan (a gathering dispatcher lays its buffers out from it).
            view = dataclasses.replace(self.registry.view(batch, bucket, n),
                                       forward_mode=self.forward_mode, plan=captured.plan)
            with torch.inference_mode():
                output = self.forward(view)
        if raw_n == n and raw_bs == bucket:
            return output
        return slice_rows(output, n, raw_n, bucket, raw_bs)

    # -- teardown ------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release every graph, its outputs and the shared memory pool (idempotent).

        Call it before destroying process groups: a graph that captured a collective keeps
        pointers into the communicator's resources, and a communicator torn down under a live
        graph crashes or hangs at exit. Registry storage is not freed (the pool owns it).
        """
        for captured in self._captured.values():
            if captured.graph is not None:
                captured.graph.reset()
        self._captured.clear()
        self._pool = None
        self._shared_output = None
        if self.use_cuda_graph:
            torch.cuda.synchronize(self.registry.device)
            torch.cuda.empty_cache()
