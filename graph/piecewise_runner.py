"""PiecewiseRunner: extend (prefill) steps of up to a few hundred tokens through CUDA graphs
captured in pieces, with attention run eagerly between them.

An extend step's attention depends on how its tokens split into requests and how long each
request's cached prefix is; the rest of the step (projections, norms, the MoE layer and its
collectives, the LM head) depends only on the token count. So a bucket of ``T`` tokens is
captured as ``L + 1`` graphs for a model of ``L`` attention layers: everything before the
first attention call, everything between two of them, everything after the last. At replay
each graph runs in capture order and the real attention runs in between on the live rows,
planned for the live batch as an eager step would be (``backend.init_forward_metadata``).

The seam is ``AttentionSplit``: the model's attention object, transparent by default (every
call and attribute goes to the backend). While a bucket is captured it ends the current graph
at each ``forward(q, k, v, ...)``, keeps the addresses of q/k/v (graph memory, rewritten by
every replay) without keeping that memory allocated, and returns a fixed output buffer that the
next graph reads (one for every layer and bucket: a layer's attention output is read only by the
next graph, its o_proj, before the next attention writes the buffer again); while one replays
without CUDA it runs the backend on the live rows and pads the result to ``T`` rows. The model
stores each layer's K/V before it calls attention, so the store lies inside a piece (every row
of the bucket, padding rows into the reserved slot 0) and attention between pieces only reads.

Geometry: bucket ``T`` holds ``T`` tokens and ``min(T, max_requests)`` request slots (a
request has at least one token; a rank runs at most ``max_requests`` at once).
``registry.fill`` copies the live rows and pads the tail: padding tokens carry position 0 and
KV slot 0 (the reserved padding slot), padding requests ``extend_seq_lens`` 0, so their logit
rows repeat the last live token's and are sliced off. The bucket comes from the step
plan (``plan.graph_bucket``, the same on every rank): an IDLE rank replays it with no live row
and runs no attention, but joins every collective the graphs hold.

Why the pieces do not own their q/k/v: a layer's q/k/v are read only by the attention that runs
right after the graph that writes them, and nothing else runs on the stream in between. So once
a piece is captured, its q/k/v memory may go back to the shared pool, where the next piece's
capture, and every other bucket's, reuse it: the graphs' memory is one bucket's working set, not
every layer's q/k/v of every bucket (1.8 GiB for the 48-layer model's default buckets; vLLM's
piecewise graphs hold their pieces' outputs by weak reference for the same reason). A bucket's
logits likewise: the step's sampling is enqueued right after the replay, before any other graph
runs, so every bucket's logits may share the pool's memory instead of each keeping its own
(``replay``'s result is valid until the next replay of any graph in the pool).

Without CUDA the pieces are not captured: replay runs the forward eagerly on the padded
registry views with the same split, so fill, padding, live-row attention and slicing are
exercised by CPU tests.

Lifecycle: ``capture()`` once (after the decode graphs, sharing their memory pool if given),
``replay(batch, plan)`` per step, ``destroy()`` before the process groups go.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from buffers import BufferRegistry
from graph.capture_common import capture_largest_first, checked_sizes, resolve_cuda_graph
from graph.capture_sizes import bucket_for
from graph.forward_mode import ForwardMode
from graph.step_plan_view import StepPlanView

__all__ = ["AttentionSplit", "PiecewiseRunner"]

# (q, k, v, layer_id, batch) -> the attention output, (T, heads * head_dim)
AttentionHook = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, Any], torch.Tensor]


class AttentionSplit:
    """The model's attention object: the backend itself unless a PiecewiseRunner has hooked it
    (module docstring). Attributes other than ``forward`` are the backend's."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self._hook: AttentionHook | None = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not set on the split itself: the backend's (kv_cache, ...).
        return getattr(self.__dict__["backend"], name)

    def forward(self, q, k, v, layer_id: int, batch: Any) -> torch.Tensor:
        if self._hook is None:
            return self.backend.forward(q, k, v, layer_id, batch)
        return self._hook(q, k, v, layer_id, batch)

    @contextmanager
    def hooked(self, hook: AttentionHook) -> Iterator[None]:
        if self._hook is not None:
            raise RuntimeError("AttentionSplit: already hooked (one runner at a time)")
        self._hook = hook
        try:
            yield
        finally:
            self._hook = None


def _unowned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory (same address, shape and strides) in a tensor that does not keep it
    allocated: through ``__cuda_array_interface__``, of a same-width integer view (the interface
    knows no bfloat16), held by an object that owns no storage."""
    as_int = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                     8: torch.int64}[t.element_size()])

    class _Address:
        __cuda_array_interface__ = as_int.__cuda_array_interface__

    return torch.as_tensor(_Address(), device=t.device).view(t.dtype)


@dataclass
class _Piece:
    """One attention call between two graphs: its inputs (graph memory the piece does not own:
    module docstring) and output buffer."""

    layer_id: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


@dataclass
class _Bucket:
    tokens: int
    plan: Any  # the capture plan: the bucket on every rank
    graphs: list[torch.cuda.CUDAGraph]  # empty without CUDA
    pieces: list[_Piece]
    output: Any


class PiecewiseRunner:
    """Captures extend steps per token bucket in pieces and replays them (module docstring).

    Args:
        forward: ``forward(batch) -> logits`` of the sampling rows (one per request); it must
            not synchronize with the host between attention calls.
        split: the model's ``AttentionSplit`` over ``backend``.
        backend: the attention backend; ``init_forward_metadata(batch)`` plans the live batch.
        registry: extend inputs (``buffers.build_prefill_registry``) for the largest bucket:
            its tokens, and ``min(tokens, max_requests)`` requests.
        sizes: the token buckets (``RuntimeConfig.cuda_graph_extend_tokens``).
        max_requests: the most requests one extend step holds (``max_running_requests``).
        capture_batch: ``(bs, num_tokens, plan) -> batch``, an EXTEND batch of one token per
            request pointing at the reserved padding targets.
        capture_plan: ``bucket -> plan``, the step plan every rank has when all run that bucket;
            the capture batch carries it into the forward (and the stand-in replays with it).
        pool: a CUDA graph memory pool to share (the decode graphs'), or None for a new one.
        use_cuda_graph: None for "when CUDA is available and the registry is on CUDA".
        warmup_runs: eager runs of the whole forward before each capture.
    """

    def __init__(
        self,
        forward: Callable[[Any], Any],
        split: AttentionSplit,
        backend: Any,
        registry: BufferRegistry,
        sizes: Sequence[int],
        *,
        max_requests: int,
        capture_batch: Callable[[int, int, StepPlanView], Any],
        capture_plan: Callable[[int], StepPlanView],
        pool: Any = None,
        use_cuda_graph: bool | None = None,
        warmup_runs: int = 2,
        show_progress: bool = True,
    ) -> None:
        self.sizes = checked_sizes("PiecewiseRunner", sizes)
        if max_requests < 1:
            raise ValueError(f"PiecewiseRunner: max_requests must be >= 1, got {max_requests}")
        self.max_requests = int(max_requests)
        largest = self.sizes[-1]
        if self.slots(largest) > registry.max_bs or largest > registry.max_num_tokens:
            raise ValueError(
                f"PiecewiseRunner: largest bucket {largest} exceeds registry {registry.user!r} "
                f"capacity max_bs={registry.max_bs}, max_num_tokens={registry.max_num_tokens}"
            )
        if split.backend is not backend:
            raise ValueError("PiecewiseRunner: the split must wrap the backend the runner plans")
        self.use_cuda_graph = resolve_cuda_graph("PiecewiseRunner", use_cuda_graph, registry)
        self.forward, self.split, self.backend, self.registry = forward, split, backend, registry
        self.warmup_runs = int(warmup_runs)
        self.show_progress = show_progress
        self._capture_batch, self._capture_plan = capture_batch, capture_plan
        self._pool = pool
        self._buckets: dict[int, _Bucket] = {}
        # by width: every layer's
        self._out_buffers: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self.capture_memory_bytes = 0

    @property
    def captured(self) -> bool:
        return bool(self._buckets)

    def slots(self, tokens: int) -> int:
        """Request slots of the bucket of ``tokens`` tokens."""
        return min(tokens, self.max_requests)

    # -- capture -------------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every bucket, largest first (module docstring). On a failure the pieces
        captured so far are released before the error propagates."""
        if self._buckets:
            raise RuntimeError("PiecewiseRunner.capture: already captured; call destroy() first")
        if self.use_cuda_graph and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self.capture_memory_bytes = capture_largest_first(
            self.sizes, self._buckets, self._capture_one, device=self.registry.device,
            use_cuda_graph=self.use_cuda_graph, label="extend graphs",
            show_progress=self.show_progress, on_error=self.destroy)

    def _out_buffer(self, q: torch.Tensor) -> torch.Tensor:
        width = q.shape[1] * q.shape[2] if q.dim() == 3 else q.shape[1]
        buf = self._out_buffers.get((width, q.dtype))
        if buf is None:  # allocated between two captures: ordinary memory, kept for every bucket
            buf = torch.zeros(self.sizes[-1], width, dtype=q.dtype, device=q.device)
            self._out_buffers[(width, q.dtype)] = buf
        return buf

    def _capture_one(self, tokens: int, stream: torch.cuda.Stream | None) -> _Bucket:
        plan = self._capture_plan(tokens)
        bs = self.slots(tokens)
        batch = self._capture_batch(bs, tokens, plan)
        if (batch.forward_mode is not ForwardMode.EXTEND or batch.num_tokens != tokens
                or batch.batch_size != bs):
            raise ValueError(f"PiecewiseRunner: capture_batch({bs}, {tokens}) must be an EXTEND "
                             f"batch of {bs} requests, {tokens} tokens")
        self.registry.fill(batch, bs, bs, tokens, tokens)
        if stream is None:
            return _Bucket(tokens, plan, [], [], None)
        view = self.registry.view(batch, bs, tokens)
        self.backend.init_forward_metadata(view)  # the warm-up runs attend for real
        stream.wait_stream(torch.cuda.current_stream(self.registry.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(self.warmup_runs):
                self.forward(view)
        torch.cuda.synchronize(self.registry.device)
        graphs: list[torch.cuda.CUDAGraph] = []
        pieces: list[_Piece] = []

        def begin() -> None:
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=self._pool)

        def cut(q, k, v, layer_id, _batch) -> torch.Tensor:
            graphs[-1].capture_end()
            out = self._out_buffer(q)[:tokens]
            pieces.append(_Piece(layer_id, _unowned(q), _unowned(k), _unowned(v), out))
            begin()
            return out

        with torch.cuda.stream(stream), torch.inference_mode(), self.split.hooked(cut):
            begin()
            try:
                output = self.forward(view)
            finally:
                graphs[-1].capture_end()
        torch.cuda.synchronize(self.registry.device)
        return _Bucket(tokens, plan, graphs, pieces, _unowned(output))

    # -- replay --------------------------------------------------------------------------------
    def why_not(self, batch: Any, plan: StepPlanView) -> str | None:
        """Why ``batch`` under ``plan`` cannot replay, or None when it can."""
        if not self._buckets:
            return "extend graphs are not captured"
        if plan.graph_bucket is None:
            return "the plan has no graph bucket (this step runs eager)"
        try:
            tokens = bucket_for(self.sizes, int(plan.graph_bucket))
        except ValueError as e:
            return str(e)
        if batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.IDLE):
            return (f"batch mode {batch.forward_mode.name}; extend graphs replay EXTEND (and IDLE) "
                    "batches")
        if batch.num_tokens > tokens or batch.batch_size > self.slots(tokens):
            return (f"batch has {batch.num_tokens} tokens in {batch.batch_size} requests; "
                    f"bucket {tokens} holds {tokens} tokens in {self.slots(tokens)} requests")
        return None

    def replay(self, batch: Any, plan: StepPlanView) -> Any:
        """Run ``batch`` through the plan's bucket; return the logits of its live requests
        (graph memory the runner does not own: valid until the next replay of any graph in the
        pool, so read it, or enqueue what reads it, first). Raises ValueError naming a
        mismatch."""
        reason = self.why_not(batch, plan)
        if reason:
            raise ValueError(f"PiecewiseRunner.replay: {reason}")
        b = self._buckets[bucket_for(self.sizes, int(plan.graph_bucket))]
        t, raw_bs, raw_n = b.tokens, batch.batch_size, batch.num_tokens
        bs = self.slots(t)
        if getattr(batch, "extend_seq_lens", None) is None:
            # An IDLE rank: zero-length extends, so the fill pads every request slot (a slot the
            # batch lacks would keep the last step's lengths, which index the logit rows).
            empty = torch.empty(0, dtype=torch.int64, device=self.registry.device)
            batch = dataclasses.replace(batch, extend_seq_lens=empty, extend_prefix_lens=empty)
        self.registry.fill(batch, raw_bs, bs, raw_n, t)
        live = self.registry.view(batch, raw_bs, raw_n)
        self.backend.init_forward_metadata(live)

        def attend(q, k, v, layer_id, out) -> None:  # the live rows' attention, into out
            self.backend.forward(q[:raw_n], k[:raw_n], v[:raw_n], layer_id, live, out=out)

        if b.graphs:
            # The pieces' tensors were made in inference mode (the capture): writes to them too.
            with torch.inference_mode():
                b.graphs[0].replay()
                for piece, graph in zip(b.pieces, b.graphs[1:], strict=True):
                    if raw_n:  # straight into the buffer the next graph reads: no copy
                        attend(piece.q, piece.k, piece.v, piece.layer_id, out=piece.out[:raw_n])
                    graph.replay()
            output = b.output
        else:
            # The capture plan, as the pieces recorded it (a gathering dispatcher lays out from it).
            view = dataclasses.replace(self.registry.view(batch, bs, t),
                                       forward_mode=ForwardMode.EXTEND, plan=b.plan)

            def stand_in(q, k, v, layer_id, _batch) -> torch.Tensor:
                out = q.new_zeros(t, q.shape[1] * q.shape[2] if q.dim() == 3 else q.shape[1])
                if raw_n:
                    attend(q, k, v, layer_id, out=out[:raw_n])
                return out

            with self.split.hooked(stand_in), torch.inference_mode():
                output = self.forward(view)
        return output[:raw_bs]

    # -- teardown ------------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release every piece, the output buffers and (when it made it) the pool; idempotent.
        Call it before destroying process groups (the pieces hold collectives)."""
        for b in self._buckets.values():
            for graph in b.graphs:
                graph.reset()
        self._buckets.clear()
        self._out_buffers.clear()
        if self.use_cuda_graph:
            torch.cuda.synchronize(self.registry.device)
            torch.cuda.empty_cache()
