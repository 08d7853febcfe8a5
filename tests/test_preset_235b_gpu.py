"""Qwen3-235B-A22B's shapes on 2 or 4 GPUs (NCCL), at 2 layers and a small vocabulary: hidden
4096, 128 experts, top 8, MoE intermediate 1536, 64 query / 4 KV heads of 128, FP8 weights
quantized at load (``--quantization fp8``), DP = EP = world size, through every dispatcher. Each
rank's greedy run equals a world-size-1 worker's run of the same prompts and the same random
weights on its GPU (drawn per tensor name: every rank draws its experts as the single rank
does; tests/test_preset_235b_dist.py is the gloo twin).

"Equals", in bf16: the two runs reduce the experts' outputs in different orders (combine on the
home rank against the local sum), so their logits differ in the last bits and a router near-tie
can swap one expert of eight. Every step's logits must lie within TOL of the logits' range of
each other up to the first step whose greedy tokens differ; past it the runs decode different
sequences and nothing more is compared. Tokens that differ need a near-tie: with logits this
close, the reference's own gap between the two tokens is at most 2 x TOL of its range. A wrong
expert, a row sent to the wrong rank or a lost combine moves the logits by a large share of
their range (another seed's weights: 70-90% at the first step).

    torchrun --standalone --nproc-per-node 2 -m pytest -m gpu2 -p no:cacheprovider \\
        tests/test_preset_235b_gpu.py
    torchrun --standalone --nproc-per-node 4 -m pytest -m gpu4 -p no:cacheprovider \\
        tests/test_preset_235b_gpu.py

Imports only torch and the runtime at collection: FlashInfer (carried in a bundle on GPU
machines) is looked up with ``find_spec`` and imported by the runtime when a case uses it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.distributed as dist

from dp_runtime.model.fp8_blocks import Fp8BlockWeight
from dp_runtime.rank_spec import RankSpec
from dp_runtime.rank_worker import RankWorker
from dp_runtime.serving.request import Request, SamplingParams
from tests.model_gpu_checks import prompts_for

# The preset's shapes but the layer count and the vocabulary (prompts_for draws ids below 256).
SHAPES = dict(num_layers=2, vocab_size=512)
NEW = 6
TOL = 0.08  # of the logits' range, as tests/model_gpu_checks.py allows bf16 against float32

# (dispatcher, CUDA graphs): all_to_all reads its split sizes on the host, so it runs eagerly.
# FlashInfer's case comes last: bench/run_gpu.sh dep JIT-builds its MoeAlltoAll in the
# background while the others run.
CASES = [("all_gather", True), ("all_to_all", False)] + (
    [("flashinfer", True)] if importlib.util.find_spec("flashinfer") else [])
WORLDS = [pytest.param(2, marks=pytest.mark.gpu2, id="2gpu"),
          pytest.param(4, marks=pytest.mark.gpu4, id="4gpu")]


def _spec(world: int, dispatcher: str, graphs: bool, *, shapes=SHAPES, device="cuda",
          dtype="bfloat16") -> RankSpec:
    return RankSpec.create(
        "qwen3-235b-a22b", model_overrides=shapes, dp_size=world, quantization="fp8", dtype=dtype,
        device=device, max_running_requests=4, chunked_prefill_size=16, cuda_graph_bs=(1, 2, 4),
        max_context_len=96, kv_cache_tokens=2048, dispatcher=dispatcher, use_cuda_graph=graphs,
    )


def _run(spec: RankSpec, rank: int, world: int, prompts):
    """(tokens by rid, logits rows by rid, metrics, facts of the rank's weights) of ``prompts``
    (index, token ids) on rank ``rank`` of ``world``."""
    with RankWorker(spec, rank=rank, world_size=world, keep_logits=True) as w:
        layer, mc = w.model.layers[0], w.model_config
        fp8 = isinstance(layer.w13, Fp8BlockWeight) and isinstance(layer.w_qkv, Fp8BlockWeight)
        facts = dict(fp8=fp8, local_experts=layer.w13.shape[0], experts=mc.num_experts,
                     top_k=mc.top_k)
        reqs = [Request(f"p{i}", p, SamplingParams(max_new_tokens=NEW)) for i, p in prompts]
        results = w.generate(reqs)
        metrics = w.metrics()
        logits = {rid: torch.stack(rows).float() for rid, rows in w.sampled_logits.items()}
    return {r.rid: r.output_ids for r in results}, logits, metrics, facts


def _disagreement(tokens, logits, ref_tokens, ref_logits) -> str | None:
    """Why one request's run is not the reference's (module docstring), or None. Never raises:
    every rank must reach the verdicts' all-gather."""
    if not len(tokens) == len(logits) == len(ref_tokens) == len(ref_logits) == NEW:
        return f"{len(tokens)} tokens and {len(logits)} logits rows, {NEW} wanted"
    for k, (ours, ref) in enumerate(zip(tokens, ref_tokens, strict=True)):
        row, ref_row = logits[k], ref_logits[k]
        err = (row - ref_row).abs().max().item() / (ref_row.max() - ref_row.min()).item()
        if err > TOL:
            return (f"step {k}: logits differ by {err:.2%} of their range (tokens "
                    f"{tokens[:k + 1]} vs {ref_tokens[:k + 1]})")
        if ours != ref:
            return None  # a near-tie (<= 2 x TOL apart); the sequences part here
    return None


@pytest.fixture(scope="module")
def reference(dist_group):
    """This rank's prompts through a world-size-1 worker (no process group) on its own GPU: the
    same FP8 weights, all 128 experts, the local dispatcher, graphs on."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens, logits, _, facts = _run(_spec(1, "local", True), 0, 1, prompts_for(rank, world))
    assert facts == dict(fp8=True, local_experts=128, experts=128, top_k=8), facts
    return world, tokens, logits


@pytest.mark.parametrize("world_size", WORLDS)
@pytest.mark.parametrize(("dispatcher", "graphs"), CASES)
def test_the_235b_shapes_in_fp8_on_every_gpu_equal_one_gpu(reference, world_size, dispatcher,
                                                           graphs):
    world, ref_tokens, ref_logits = reference
    if world != world_size:  # the same on every rank: the job's size picks the variant
        pytest.skip(f"the {world_size}-GPU variant; this job has {world} ranks")
    rank = dist.get_rank()
    spec = _spec(world, dispatcher, graphs)
    tokens, logits, metrics, facts = _run(spec, rank, world, prompts_for(rank, world))
    problems = [f"{rid}: {why}" for rid in ref_tokens if (why := _disagreement(
        tokens.get(rid, ()), logits.get(rid, ()), ref_tokens[rid], ref_logits[rid]))]
    if facts != dict(fp8=True, local_experts=128 // world, experts=128, top_k=8):
        problems.append(f"weights {facts}")
    if metrics["dispatcher"] != dispatcher or (metrics["graph_steps"] > 0) != graphs:
        problems.append(f"dispatcher {metrics['dispatcher']}, graph steps {metrics['graph_steps']}")
    same = sum(tokens.get(rid) == ref_tokens[rid] for rid in ref_tokens)
    report = [None] * world
    dist.all_gather_object(report, (rank, problems, f"{same} of {len(ref_tokens)} token-equal"))
    assert all(not p for _, p, _ in report), report  # every rank asserts on every rank's verdict
