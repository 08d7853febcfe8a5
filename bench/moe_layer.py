"""One MoE layer's expert path on one GPU: our grouped-GEMM path, the Triton fused MoE and
(optionally) FlashInfer's CUTLASS fused MoE against the bytes floor, side by side in one run.

    python bench/moe_layer.py                  # N 1 8 64 256 2048 at EP 1 and EP 2; < 1 min after compiles
    python bench/moe_layer.py --flashinfer     # + flashinfer.fused_moe.cutlass_fused_moe (its sm90
                                               #   module JIT-builds for > 19 min when not cached)
    python bench/moe_layer.py --tune           # + sweep the Triton tile configs per row (minutes)
    python bench/moe_layer.py --split          # + the Triton path's microseconds per kernel per row

Layer: Qwen3-30B-A3B's experts (E 128, top-8, H 2048, I 768, bf16, random weights), routed from
random router logits (softmax, top-8, renormalised). EP 2 is rank 0 of two: L 64 local experts;
picks of experts 64..127 belong to the other rank (about half of them).

Paths, on the same rows, routing and weights:
- grouped: ``experts.local_expert_sum(use_grouped_mm=True)``, today's path (argsort, two
  ``torch._grouped_mm``, SiLU-and-mul, weighted sum);
- triton: ``fused_moe_triton.fused_local_expert_sum`` (align, two GEMMs with fused epilogues,
  top-k sum; tile config by ``tile_config(N)``);
- triton_3l: the same with the pick alignment forced into the parallel form (two launches) at
  every size (beside the one-launch, one-program-per-expert form below
  ``moe_align.PARALLEL_PICKS``);
- flashinfer: ``cutlass_fused_moe`` on global expert ids with ``ep_size``/``ep_rank``, fc1 laid
  out as [up; gate] (its SwiGLU convention);
- floor: the bytes a layer must move (weights of the distinct local experts at least one pick
  uses, x read, output written, ids and weights read) over the GPU's HBM bandwidth from
  ``launch/gpu_specs.py`` (a measured copy bandwidth for a GPU not listed there).

Timing: a path runs ``--layers`` layers, each with its own weights and routing, captured once as
a CUDA graph; the graph is replayed ``--inner`` times between two CUDA events, ``--repeats``
times; a cell is the median time per layer in microseconds. Distinct layers (4 x 1.2 GB of
experts at EP 1) mean a layer's experts have left L2 by the time they are read again, as in a
model's step. ``kernels``: GPU operations (kernels, copies, memsets) of one call, counted by the
torch profiler over eager calls. ``check``: each path's output against the grouped path's (the
dense loop where grouped GEMM is missing): ``||out - ref|| / ||ref||``, flagged BAD above
4 * 2^-8 (tests/test_fused_moe.py derives that bound).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import dataclasses
import datetime
import itertools
import os
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.gpu_kernels import graph_us
from dp_runtime.model.experts import grouped_mm_supported, local_expert_sum
from dp_runtime.model.fused_moe import fused_moe_supported
from dp_runtime.model.routing import softmax_topk
from launch.gpu_specs import gpu_spec_for_device, measure_copy_bandwidth

REL_BOUND = 4 * 2.0**-8


@dataclass(frozen=True)
class Layer:
    """One layer's inputs: rows, routing (global ids for FlashInfer, local ids for ours) and
    this rank's experts; ``w31`` is fc1 in FlashInfer's [up; gate] order (None without it)."""

    x: torch.Tensor
    ids: torch.Tensor
    local_ids: torch.Tensor
    weights: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    w31: torch.Tensor | None


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 2048])
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2], help="EP sizes (rank 0 of each)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--flashinfer", action="store_true", help="also time flashinfer's cutlass_fused_moe")
    p.add_argument("--tune", action="store_true", help="sweep Triton tile configs per row, print the best")
    p.add_argument("--split", action="store_true", help="print the Triton path's time per kernel per row")
    p.add_argument("--persistent", nargs="*", default=[], metavar="G1,G2",
                   help="also time the rule's tiles with GEMM1 and GEMM2 on persistent grids of G1 and G2 "
                        "programs per SM (MoeTileConfig.programs_per_sm; 0: a program per tile), e.g. 3,4 0,4")
    p.add_argument("--configs", nargs="*", default=[], metavar="G1/G2",
                   help="also time these tile configs of GEMM1 and GEMM2, each 'block_m,block_n,block_k,"
                        "group_m,warps,stages[,programs_per_sm]' (MoeTileConfig's fields), GEMM1's then '/' "
                        "then GEMM2's, e.g. 128,128,64,8,8,3/128,64,64,8,4,3")
    p.add_argument("--touched", type=int, default=None,
                   help="route each layer's tokens among this many random experts only (a prompt's tokens "
                        "share experts: a 128-token extend of the random preset touches ~30 of 128)")
    p.add_argument("--routing", default=None, metavar="PATH",
                   help="replay a model step's routing (prefill.py --profile --save-routing): layer j routes "
                        "as the step's layer j; --tokens is taken from the file")
    p.add_argument("--extend", action="store_true",
                   help="the rows are prompt tokens: the Triton path takes its extend tiles (tile_config extend=True)")
    args = p.parse_args()
    try:  # "G1,G2" -> (G1, G2)
        args.persistent = [tuple(int(v) for v in pair.split(",")) for pair in args.persistent]
    except ValueError:
        args.persistent = None
    if args.persistent is None or any(len(pair) != 2 or min(pair) < 0 for pair in args.persistent):
        p.error("--persistent takes G1,G2 pairs of programs per SM >= 0 (0: a program per tile), e.g. 3,4 0,4")
    try:
        args.configs = [tuple(_tile(part) for part in spec.split("/")) for spec in args.configs]
    except (TypeError, ValueError) as exc:
        p.error(f"--configs: {exc}")
    if any(len(pair) != 2 for pair in args.configs):
        p.error("--configs takes GEMM1/GEMM2 pairs of tile configs")
    args.routed = None
    if args.routing:
        if not os.path.isfile(args.routing):
            p.error(f"--routing {args.routing}: no such file (prefill.py --profile --save-routing writes one)")
        args.routed = torch.load(args.routing)
        args.tokens = [args.routed[0][0].shape[0]]
        if args.touched is not None:
            p.error("--routing and --touched: give one")
    if args.touched is not None and not args.top_k <= args.touched <= args.experts:
        p.error(f"--touched {args.touched}: must be in [--top-k {args.top_k}, --experts {args.experts}]")
    for ep in args.ep:
        if ep < 1 or args.experts % ep:
            p.error(f"--ep {ep}: must divide --experts {args.experts}")
    return args


def _tile(text: str):
    """A MoeTileConfig from 'block_m,block_n,block_k,group_m,warps,stages[,programs_per_sm]'."""
    from dp_runtime.model.fused_moe_triton import MoeTileConfig

    values = [int(v) for v in text.split(",")]
    if not 6 <= len(values) <= 7:
        raise ValueError(f"{text!r}: 6 or 7 comma-separated ints")
    return MoeTileConfig(*values)


def _timed_pairs(args, layers: list[Layer], pairs, baseline_us: float, split: bool) -> str:
    """Each ``(label, GEMM1 config, GEMM2 config)`` of ``pairs`` on these layers, one line: us
    per layer, the ratio to the rule as it stands (and the kernel split with ``split``)."""
    outs = [torch.empty_like(layer.x) for layer in layers]
    parts = []
    for label, cfg, cfg2 in pairs:
        run = _fused_with(layers, outs, cfg, cfg2)
        us = graph_us(run, len(layers), args.repeats, args.inner)
        parts.append(f"{label} {us:.1f} us ({us / baseline_us:.3f})"
                     + (f" [{_kernel_split(run, len(layers))}]" if split else ""))
    return "; ".join(parts)


def _experts(args, layer: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(layer)
    e, h, i = args.experts, args.hidden, args.inter
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g, device=device) / i**0.5).bfloat16()
    return w13, w2


def _layer(args, experts, w31, layer: int, num_tokens: int, ep: int) -> Layer:
    device = experts[0].device
    g = torch.Generator(device=device).manual_seed(1000 * layer + num_tokens)
    x = torch.randn(num_tokens, args.hidden, generator=g, device=device).bfloat16()
    if args.routed is not None:  # a model step's routing, layer by layer
        routed_ids, routed_weights = args.routed[layer % len(args.routed)]
        ids, weights = routed_ids.to(device, torch.int32), routed_weights.to(device, torch.float32)  # as softmax_topk
    else:
        logits = torch.randn(num_tokens, args.experts, generator=g, device=device)
        if args.touched is not None:  # the same random subset for every token of the layer
            keep = torch.randperm(args.experts, generator=g, device=device)[: args.touched]
            logits = torch.full_like(logits, float("-inf")).index_copy_(1, keep, logits[:, keep])
        weights, ids = softmax_topk(logits, args.top_k, renormalize=True)
    num_local = args.experts // ep
    local_ids = torch.where(ids < num_local, ids, -1)
    w13, w2 = (w[:num_local] for w in experts)
    return Layer(x, ids, local_ids, weights, w13, w2, None if w31 is None else w31[:num_local])


def _floor_bytes(args, layer: Layer) -> int:
    n = layer.x.shape[0]
    touched = torch.unique(layer.local_ids[layer.local_ids >= 0]).numel()
    weight_bytes = touched * 3 * args.hidden * args.inter * 2
    return weight_bytes + 2 * n * args.hidden * 2 + n * args.top_k * (4 + 4)


def _bandwidth(device) -> tuple[float, str]:
    spec = gpu_spec_for_device(torch.cuda.get_device_name(device))
    if spec is not None:
        return spec.hbm_bytes_per_s, f"{spec.name} spec"
    return measure_copy_bandwidth(device), "measured copy"


def _gpu_ops(run: Callable[[], None]) -> list:
    """The GPU activities (kernels, copies, memsets) of one eager call, by the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _ops_per_call(run: Callable[[], None], calls: int) -> float:
    return len(_gpu_ops(run)) / calls


def _kernel_split(run: Callable[[], None], calls: int) -> str:
    """Microseconds per call by kernel (eager, profiled): where a path's time goes. A kernel
    launched more than once per call is split by launch (``#0`` GEMM1, ``#1`` GEMM2)."""
    ops = sorted(_gpu_ops(run), key=lambda e: e.time_range.start)
    names = [e.name.split("(")[0].removeprefix("void ")[:32] for e in ops]
    per_call = {name: names.count(name) // calls for name in set(names)}
    seen: dict[str, int] = {}
    by: dict[str, float] = {}
    for e, name in zip(ops, names, strict=True):
        if per_call[name] > 1:
            i = seen.get(name, 0)
            seen[name] = i + 1
            name = f"{name}#{i % per_call[name]}"
        by[name] = by.get(name, 0.0) + (e.time_range.end - e.time_range.start) / calls
    return " ".join(f"{k} {v:.1f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))


def _occupancy() -> str:
    """Registers, spills and shared memory of each built expert-GEMM variant, and the programs
    of it an SM can hold at once (65,536 registers, 227 KB of shared memory on sm90): a
    streaming kernel wants several in flight per SM."""
    from dp_runtime.model.fused_moe_triton import _expert_gemm_kernel

    out = []
    for i, kernel in enumerate(_expert_gemm_kernel.device_caches.get(torch.cuda.current_device(), ({},))[0].values()):
        md = kernel.metadata
        threads = 32 * md.num_warps
        by_regs = 65536 // max(1, kernel.n_regs * threads)
        by_smem = (227 * 1024) // max(1, md.shared)
        out.append(f"variant {i} (built in call order: GEMM1 first) warps {md.num_warps} stages {md.num_stages}: "
                   f"{kernel.n_regs} regs, {kernel.n_spills} spills, {md.shared} B shared -> "
                   f"{min(by_regs, by_smem)} per SM")
    return "; ".join(out)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def _paths(layers: list[Layer], ep: int, outs, extend: bool = False) -> dict[str, Callable[[], None]]:
    """Path name -> a call running every layer into that path's output buffers."""
    grouped = grouped_mm_supported(layers[0].x.device, layers[0].x.dtype)

    def ours(use_grouped: bool):
        def run():
            for layer, out in zip(layers, outs["grouped"], strict=True):
                local_expert_sum(layer.x, layer.local_ids, layer.weights, layer.w13, layer.w2,
                                 use_grouped_mm=use_grouped, out_ND=out)
        return run

    paths = {"grouped": ours(grouped)}
    if "triton" in outs:
        from dp_runtime.model.fused_moe_triton import fused_local_expert_sum

        def fused(name: str, parallel_picks: int | None = None):
            from dp_runtime.model import moe_align

            def run():
                # parallel_picks: side by side, the alignment in the parallel form at every
                # size; the threshold is read at each call.
                saved = moe_align.PARALLEL_PICKS
                moe_align.PARALLEL_PICKS = saved if parallel_picks is None else parallel_picks
                try:
                    for layer, out in zip(layers, outs[name], strict=True):
                        fused_local_expert_sum(layer.x, layer.local_ids, layer.weights, layer.w13, layer.w2,
                                               out_ND=out, extend=extend)
                finally:
                    moe_align.PARALLEL_PICKS = saved
            return run
        paths["triton"] = fused("triton")
        if "triton_3l" in outs:
            paths["triton_3l"] = fused("triton_3l", parallel_picks=0)
    if "flashinfer" in outs:
        from flashinfer.fused_moe import cutlass_fused_moe

        def flashinfer_run():
            for layer, out in zip(layers, outs["flashinfer"], strict=True):
                cutlass_fused_moe(
                    input=layer.x, token_selected_experts=layer.ids, token_final_scales=layer.weights,
                    fc1_expert_weights=layer.w31, fc2_expert_weights=layer.w2, output_dtype=layer.x.dtype,
                    quant_scales=None, ep_size=ep, ep_rank=0, output=out,
                )
        paths["flashinfer"] = flashinfer_run
    return paths


def _row(ep: int, n: int, floor_us: float, names: list[str], us: dict, ops: dict, checks: list[str]) -> list[str]:
    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    row = [str(ep), str(n), f"{floor_us:.1f}"] + [f"{us[name]:.1f}" if name in us else "-" for name in names]
    row += [ratio(us.get("triton"), floor_us), ratio(us.get("grouped"), us.get("triton")),
            ratio(us.get("triton_3l"), us.get("triton"))]
    row += [ratio(us.get("flashinfer"), us.get("triton"))] if "flashinfer" in names else []
    row += ["/".join(f"{ops[name]:.0f}" if name in ops else "-" for name in names), ", ".join(checks) or "-"]
    return row


def _fused_with(layers: list[Layer], outs: list[torch.Tensor], cfg, cfg2) -> Callable[[], None]:
    """A call running the Triton path on every layer into ``outs`` with tile configs ``cfg``
    (both GEMMs) and ``cfg2`` (the second GEMM's, or None)."""
    from dp_runtime.model.fused_moe_triton import fused_local_expert_sum

    def run():
        for layer, out in zip(layers, outs, strict=True):
            fused_local_expert_sum(layer.x, layer.local_ids, layer.weights, layer.w13, layer.w2,
                                   out_ND=out, config=cfg, config2=cfg2)
    return run


def _persistent(args, layers: list[Layer], baseline_us: float, split: bool) -> str:
    """The rule's tiles with each ``--persistent`` pair of programs per SM (``_timed_pairs``)."""
    from dp_runtime.model.fused_moe_triton import gemm2_tile_config, tile_config

    n = layers[0].x.shape[0]
    rule, rule2 = tile_config(n, args.extend), gemm2_tile_config(n, args.extend)
    pairs = [(f"{g1},{g2}/SM", dataclasses.replace(rule, programs_per_sm=g1),
              dataclasses.replace(rule2, programs_per_sm=g2)) for g1, g2 in args.persistent]
    return _timed_pairs(args, layers, pairs, baseline_us, split)


def _tune(args, layers: list[Layer], baseline_us: float) -> str:
    """The fastest tile config for these layers among a sweep around the expected rows per
    expert block (both GEMMs on one config), then the second GEMM's own tiles on top of the
    best, as one line."""
    from dp_runtime.model.fused_moe_triton import MoeTileConfig
    from dp_runtime.model.fused_moe_triton import tile_config as tile_config_for

    n = layers[0].x.shape[0]
    touched = args.touched or statistics.mean(int(torch.unique(layer.local_ids[layer.local_ids >= 0]).numel())
                                              for layer in layers)
    rows = max(1.0, n * args.top_k / touched)  # mean rows a touched expert gets
    block_ms = [m for m in (16, 32, 64, 128) if m == 16 or rows / 2 <= m <= 2 * rows]
    outs = [torch.empty_like(layer.x) for layer in layers]
    failed = 0

    def timed(cfg: MoeTileConfig, cfg2: MoeTileConfig | None = None) -> float | None:
        nonlocal failed
        try:
            return graph_us(_fused_with(layers, outs, cfg, cfg2), len(layers), repeats=10, inner=5)
        except Exception:  # a config past the shared memory or registers of this GPU
            failed += 1
            return None

    def name(cfg: MoeTileConfig) -> str:
        return (f"block_m {cfg.block_m} block_n {cfg.block_n} block_k {cfg.block_k} group_m {cfg.group_m} "
                f"warps {cfg.num_warps} stages {cfg.num_stages}")

    # Blocks of 16-64 rows in groups of 8 (a weight tile read once, then from L2); a
    # stage holds a BLOCK_M x block_k slice of the rows and a block_n x block_k one of the
    # weights, and up to 200 KB of shared memory in all is tried (1-4 programs per SM).
    best: tuple[float, MoeTileConfig] | None = None
    rule = tile_config_for(n, args.extend)
    candidates = [rule]
    for m in block_ms:
        for bn, bk, stages, warps in itertools.product((64, 128, 256), (64, 128, 256), (2, 3, 4, 5), (4, 8)):
            if stages * (m + bn) * bk * 2 > 200 * 1024 or (warps == 8 and bn < 128) or (bk == 256 and bn == 256):
                continue  # shared memory; too little of a tile per warp; registers
            cfg = MoeTileConfig(m, bn, bk, 8, warps, stages)
            if cfg != rule:
                candidates.append(cfg)
    for cfg in candidates:
        # the second GEMM on the extend rule's 64-column tiles of the same blocks
        us = timed(cfg, dataclasses.replace(cfg, block_n=64, block_k=64, num_warps=4, num_stages=3))
        if us is not None and (best is None or us < best[0]):
            best = (us, cfg)
        # as it goes, so that a sweep cut short by a time limit still reports what it measured
        print(f"# tried {name(cfg)}: {'failed' if us is None else f'{us:.1f} us'}", file=sys.stderr, flush=True)
    if best is None:
        return f"no config ran ({failed} failed)"
    us, cfg = best
    line = f"best {us:.1f} us ({baseline_us / us:.2f}x the rule's) {name(cfg)}"
    best2: tuple[float, MoeTileConfig] | None = None
    for bn, bk, stages, warps in itertools.product((32, 64, 128, 256), (64, 128, 256), (3, 4), (4, 8)):
        if (bk == 256 and (cfg.block_m > 32 or stages > 3)) or (warps == 8 and bn < 256):
            continue
        cfg2 = MoeTileConfig(cfg.block_m, bn, bk, cfg.group_m, warps, stages)
        us2 = timed(cfg, cfg2)
        if us2 is not None and (best2 is None or us2 < best2[0]):
            best2 = (us2, cfg2)
    if best2 is not None and best2[0] < us:
        line += f"; with GEMM2 on its own tiles {best2[0]:.1f} us: {name(best2[1])}"
    return line + (f"; {failed} configs did not run" if failed else "")


def main() -> None:
    args = _parse()
    if not torch.cuda.is_available():
        print("moe_layer: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda")
    bw, bw_source = _bandwidth(device)
    ok, triton_note = fused_moe_supported(device, torch.bfloat16)
    names = ["grouped"] + (["triton", "triton_3l"] if ok else [])
    fi_note = ""
    if args.flashinfer:
        try:
            import flashinfer.fused_moe  # noqa: F401

            names.append("flashinfer")
        except ImportError as exc:
            fi_note = f"flashinfer not importable ({exc})"

    commit = os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False).stdout.strip() or "unknown"
    print(f"# moe_layer  date {datetime.date.today()}  GPU {torch.cuda.get_device_name(device)}  "
          f"HBM {bw / 1e12:.2f} TB/s ({bw_source})  torch {torch.__version__}  commit {commit}")
    print(f"# E {args.experts} top-{args.top_k} H {args.hidden} I {args.inter} bf16, {args.layers} layers per graph; "
          f"triton: {triton_note}" + (f"; {fi_note}" if fi_note else ""))

    experts = [_experts(args, layer, device) for layer in range(args.layers)]
    w31 = None
    if "flashinfer" in names:
        i = args.inter
        w31 = [torch.cat([w13[:, i:], w13[:, :i]], dim=1) for w13, _ in experts]

    head = ["ep", "tokens", "floor_us"] + [f"{name}_us" for name in names] + ["triton/floor", "grouped/triton", "3l/triton"]
    head += ["fi/triton"] if "flashinfer" in names else []
    head += ["kernels " + "/".join(names), "check (rel err)"]
    rows, tune_lines, split_lines = [], [], []
    for ep in args.ep:
        for n in args.tokens:
            layers = [_layer(args, experts[j], None if w31 is None else w31[j], j, n, ep) for j in range(args.layers)]
            floor_us = statistics.mean(_floor_bytes(args, layer) for layer in layers) / bw * 1e6
            outs = {name: [torch.empty_like(layer.x) for layer in layers] for name in names}
            paths = _paths(layers, ep, outs, args.extend)
            us, ops, checks = {}, {}, []
            for name, run in paths.items():
                try:
                    run()
                    torch.cuda.synchronize()
                    if name != "grouped" and "grouped" in us:
                        err = _rel_err(outs[name][0], outs["grouped"][0])
                        checks.append(f"{name} {err:.1e}" + ("" if err <= REL_BOUND else " BAD"))
                    us[name] = graph_us(run, args.layers, args.repeats, args.inner)
                    ops[name] = _ops_per_call(run, args.layers)
                except Exception as exc:  # a peer that fails here must not hide the others' numbers
                    print(f"# {name} failed at ep {ep} tokens {n}: {type(exc).__name__}: {exc}", file=sys.stderr)

            row = _row(ep, n, floor_us, names, us, ops, checks)
            rows.append(row)
            print("# " + "  ".join(f"{h}={c}" for h, c in zip(head, row, strict=True)), flush=True)
            if args.split and "triton" in paths:
                split_lines.append(f"ep {ep} tokens {n}: " + _kernel_split(paths["triton"], args.layers))
                split_lines.append(f"ep {ep} tokens {n} occupancy: " + _occupancy())
            if args.persistent and "triton" in us:
                tune_lines.append(f"ep {ep} tokens {n} persistent grids, rule's tiles ({us['triton']:.1f} us as "
                                  f"the rule stands): " + _persistent(args, layers, us["triton"], args.split))
            if args.configs and "triton" in us:
                tune_lines.append(f"ep {ep} tokens {n} configs ({us['triton']:.1f} us as the rule stands): "
                                  + _timed_pairs(args, layers, [(f"{c} / {c2}:", c, c2) for c, c2 in args.configs],
                                                 us["triton"], args.split))
            if args.tune and "triton" in us:
                tune_lines.append(f"ep {ep} tokens {n}: " + _tune(args, layers, us["triton"]))
            del layers, outs, paths
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print()
    print("  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    for line in split_lines:
        print("# us per layer by kernel, triton, " + line)
    for line in tune_lines:
        print("# tune " + line)


if __name__ == "__main__":
    main()
