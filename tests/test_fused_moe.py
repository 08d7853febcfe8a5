"""The Triton fused expert path (dp_runtime/model/fused_moe_triton.py) against an fp64 expert
sum and the torch reference ``local_expert_sum``.

    python -m pytest -q tests/test_fused_moe.py           # no GPU: Triton's CPU interpreter
    python -m pytest -q -m gpu tests/test_fused_moe.py    # one GPU: real shapes, CUDA graphs

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET);
with one, the same small-shape tests run compiled on it. Skipped when triton is not installed.

Error bound (bf16 activations and weights, fp32 routing weights). Products of bf16 values are
exact in fp32 and every GEMM accumulates in fp32; the fused path then rounds three times to
bf16: the activation silu(g) * u, each weighted term w_k * y_k, and the output. A rounding with
unit roundoff u changes a value by at most u times its magnitude, and each of those errors
reaches the output scaled by at most S[n, h] = sum_k |w_k| (|W2_e| @ |act_k|)[h], so

    |fused - exact| <= (3 u + (H + I + K) 2^-24) S

elementwise, the second term bounding the fp32 accumulations. u = 2^-8 on a GPU (round to
nearest); 2^-7 in Triton's interpreter, whose fp32 -> bf16 cast truncates. Against the torch
reference, which rounds at more places (gate and up, silu, the product, each expert output), the
check is norm-wise: ||fused - ref|| <= 4 u ||ref||, where a wrong expert, weight or a dropped or
extra pick is an O(1) error.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from dp_runtime.model.experts import grouped_mm_supported, local_expert_sum
from dp_runtime.model.fused_moe import fused_moe_supported
from dp_runtime.model.fused_moe_triton import (
    MoeTileConfig,
    align_picks,
    fused_local_expert_sum,
    gemm2_tile_config,
    max_blocks,
    tile_config,
)
from dp_runtime.model.routing import softmax_topk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _unit_roundoff(device: torch.device) -> float:
    return 2.0**-8 if device.type == "cuda" else 2.0**-7


def _experts(num_local, hidden, inter, device, *, seed=0):
    """Random bf16 ``w13`` (L, 2I, H) and ``w2`` (L, H, I), drawn on ``device``."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(num_local, 2 * inter, hidden, generator=g, device=device) / hidden**0.5
    w2 = torch.randn(num_local, hidden, inter, generator=g, device=device) / inter**0.5
    return w13.bfloat16(), w2.bfloat16()


def _tokens(num_experts, top_k, hidden, num_tokens, num_local, device, *, seed=0):
    """Random bf16 rows, their routing over ``num_experts`` experts, and the local ids of a
    rank holding experts [0, num_local) (-1 for the others)."""
    g = torch.Generator(device=device).manual_seed(seed + 1000)
    x = torch.randn(num_tokens, hidden, generator=g, device=device).bfloat16()
    logits = torch.randn(num_tokens, num_experts, generator=g, device=device)
    weights, ids = softmax_topk(logits, top_k, renormalize=True)
    return x, torch.where(ids < num_local, ids, -1), weights


def _layer(num_experts, top_k, hidden, inter, num_tokens, num_local, device, *, seed=0):
    return (*_tokens(num_experts, top_k, hidden, num_tokens, num_local, device, seed=seed),
            *_experts(num_local, hidden, inter, device, seed=seed))


def _exact(x, ids, weights, w13, w2):
    """fp64 ``sum_k w * expert(x)`` over picks with 0 <= id < L, and S (module docstring)."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64, device=x.device)
    scale = torch.zeros_like(out)
    for e in range(w13.shape[0]):
        rows, ks = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        h = x[rows].double() @ w13[e].double().T
        act = F.silu(h[:, :inter]) * h[:, inter:]
        w = weights[rows, ks].double()[:, None]
        out.index_add_(0, rows, w * (act @ w2[e].double().T))
        scale.index_add_(0, rows, w.abs() * (act.abs() @ w2[e].double().abs().T))
    return out, scale


def _assert_within_bound(out, x, ids, weights, w13, w2):
    exact, scale = _exact(x, ids, weights, w13, w2)
    hidden, inter, top_k = x.shape[1], w2.shape[2], ids.shape[1]
    bound = (3 * _unit_roundoff(out.device) + (hidden + inter + top_k) * 2.0**-24) * scale
    err = (out.double() - exact).abs()
    worst = (err / bound.clamp_min(1e-300)).max().item()
    assert bool((err <= bound).all()), f"error exceeds the bf16 bound: max err/bound = {worst:.3f}"


def _assert_close_to_reference(out, ref):
    u = _unit_roundoff(out.device)
    rel = ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()
    assert rel <= 4 * u, f"||fused - ref|| / ||ref|| = {rel:.3g} > 4u = {4 * u:.3g}"


# (top_k, num_local, num_tokens) with E = 8, H 64, I 32; num_local 4 = EP 2: about half the
# picks belong to the other rank; 6 = an uneven partition (padded expert lanes in the kernels).
SMALL = [(2, 8, 1), (2, 4, 7), (4, 4, 7), (8, 4, 1), (8, 8, 64), (8, 4, 64), (4, 6, 7)]


@pytest.mark.parametrize(("top_k", "num_local", "num_tokens"), SMALL)
def test_matches_exact_and_reference(top_k, num_local, num_tokens):
    x, ids, weights, w13, w2 = _layer(8, top_k, 64, 32, num_tokens, num_local, DEVICE)
    out = fused_local_expert_sum(x, ids, weights, w13, w2)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    _assert_within_bound(out, x, ids, weights, w13, w2)
    _assert_close_to_reference(out, local_expert_sum(x, ids, weights, w13, w2, use_grouped_mm=False))


def test_uneven_shapes_and_small_tiles():
    # H 80 and I 48 are not multiples of block_k 32 (masked contraction) nor of the column tiles
    # (wrapped weight columns, masked stores); group_m 2 takes the grouped program order.
    x, ids, weights, w13, w2 = _layer(8, 4, 80, 48, 33, 4, DEVICE, seed=1)
    cfg = MoeTileConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)
    out = fused_local_expert_sum(x, ids, weights, w13, w2, config=cfg)
    _assert_within_bound(out, x, ids, weights, w13, w2)
    _assert_close_to_reference(out, local_expert_sum(x, ids, weights, w13, w2, use_grouped_mm=False))


def test_second_gemm_on_its_own_tiles():
    # config2 gives the second GEMM other column and contraction tiles over the same blocks; a
    # block_m that differs from the first GEMM's would read blocks laid out for another size.
    x, ids, weights, w13, w2 = _layer(8, 4, 80, 48, 33, 4, DEVICE, seed=2)
    cfg = MoeTileConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)
    cfg2 = MoeTileConfig(block_m=16, block_n=64, block_k=16, group_m=1, num_warps=4, num_stages=2)
    out = fused_local_expert_sum(x, ids, weights, w13, w2, config=cfg, config2=cfg2)
    _assert_within_bound(out, x, ids, weights, w13, w2)
    with pytest.raises(ValueError, match=r"config2.block_m=32 must equal the first GEMM's block_m=16"):
        fused_local_expert_sum(x, ids, weights, w13, w2, config=cfg, config2=MoeTileConfig(32, 64, 16, 1, 4, 2))


@pytest.mark.parametrize(("hidden", "num_tokens", "num_local"), [(64, 7, 8), (80, 33, 4)])
def test_add_norm_folds_the_next_residual_add_and_rms_norm(hidden, num_tokens, num_local):
    # The sum's launch also adds the (rounded) sum into the residual stream in place and writes
    # rms_norm(residual) * w, as the separate add+RMSNorm would: the residual bit for bit on a
    # GPU, the normed rows within a rounding or two (its fp32 sum runs in another order).
    x, ids, weights, w13, w2 = _layer(8, 4, hidden, 32, num_tokens, num_local, DEVICE, seed=6)
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    residual = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(x.dtype)
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen, device=DEVICE)).to(x.dtype)
    plain = fused_local_expert_sum(x, ids, weights, w13, w2)
    s = plain.float() + residual.float()
    want_x = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_w.float()).to(x.dtype)
    res = residual.clone()
    out = fused_local_expert_sum(x, ids, weights, w13, w2, add_norm=(res, norm_w, 1e-6))
    if DEVICE.type == "cuda":
        assert torch.equal(res, s.to(x.dtype))
    else:  # Triton's interpreter rounds to bf16 toward zero, not to nearest
        torch.testing.assert_close(res, s.to(x.dtype), rtol=2**-7, atol=0)
    torch.testing.assert_close(out, want_x, rtol=2**-6, atol=2**-6)
    assert not torch.equal(out, plain)
    with pytest.raises(ValueError, match="add_norm residual"):
        fused_local_expert_sum(x, ids, weights, w13, w2, add_norm=(res[:, :16], norm_w, 1e-6))
    with pytest.raises(ValueError, match="add_norm weight"):
        fused_local_expert_sum(x, ids, weights, w13, w2, add_norm=(res, norm_w[:16], 1e-6))


@pytest.mark.parametrize("num_tokens", [3, 33])  # 12 picks: one block per pick; 132: aligned blocks
@pytest.mark.parametrize("programs_per_sm", [1, 2, 7])
def test_a_persistent_grid_writes_what_a_program_per_tile_writes(num_tokens, programs_per_sm):
    # programs_per_sm > 0 runs each GEMM on a fixed grid whose programs walk the tiles in use
    # (the interpreter counts as one SM: 1 and 2 programs take several tiles each, 7 leaves
    # some programs without a tile). Every tile must come out as one program per tile writes
    # it, bit for bit; the unaligned layout (12 picks), which may hold other ranks' blocks,
    # keeps a program per tile.
    x, ids, weights, w13, w2 = _layer(8, 4, 80, 48, num_tokens, 6, DEVICE, seed=4)
    ids[0, 0] = -1  # another rank's pick: no slot when aligned, a skipped block when not
    per_tile = (MoeTileConfig(16, 32, 32, 2, 4, 2), MoeTileConfig(16, 64, 16, 1, 4, 2))
    persistent = [MoeTileConfig(16, 32, 32, 2, 4, 2, programs_per_sm), MoeTileConfig(16, 64, 16, 1, 4, 2, programs_per_sm)]
    want = fused_local_expert_sum(x, ids, weights, w13, w2, config=per_tile[0], config2=per_tile[1])
    got = fused_local_expert_sum(x, ids, weights, w13, w2, config=persistent[0], config2=persistent[1])
    assert torch.equal(got, want)
    _assert_within_bound(got, x, ids, weights, w13, w2)
    with pytest.raises(ValueError, match="programs_per_sm >= 0"):
        MoeTileConfig(16, 32, 32, 1, 4, 2, programs_per_sm=-1)


def test_no_rows_launches_nothing_and_returns_out():
    x, ids, weights, w13, w2 = _layer(8, 2, 64, 32, 0, 4, DEVICE)
    out = torch.empty(0, 64, dtype=torch.bfloat16, device=DEVICE)
    assert fused_local_expert_sum(x, ids, weights, w13, w2, out_ND=out) is out
    assert fused_local_expert_sum(x, ids, weights, w13, w2).shape == (0, 64)


def test_invalid_picks_are_never_computed_nor_multiplied():
    # Row 0 picks only other ranks' experts and holds NaN (like an uninitialised padding row of
    # a communication workspace); other rows carry NaN weights and out-of-range ids on their
    # invalid picks. Valid rows must match the reference; row 0 must be exactly zero.
    x, ids, weights, w13, w2 = _layer(8, 4, 64, 32, 7, 6, DEVICE, seed=2)
    ids[0] = -1
    ids[1, 0] = 6  # >= L: not a local expert either (and a padded lane of the kernels)
    ids[2, 0] = 100
    x[0] = float("nan")
    weights = torch.where((ids >= 0) & (ids < 6), weights, float("nan"))
    out = fused_local_expert_sum(x, ids, weights, w13, w2)
    assert bool((out[0] == 0).all())
    clean = torch.where((ids >= 0) & (ids < 6), ids, -1)
    _assert_within_bound(out, x, clean, torch.nan_to_num(weights), w13, w2)


def test_writes_the_given_strided_output_in_place():
    x, ids, weights, w13, w2 = _layer(8, 2, 64, 32, 7, 8, DEVICE, seed=3)
    wide = torch.full((7, 96), 7.0, dtype=torch.bfloat16, device=DEVICE)
    out = wide[:, 16:80]  # row stride 96
    assert fused_local_expert_sum(x, ids, weights, w13, w2, out_ND=out) is out
    assert bool((wide[:, :16] == 7).all()) and bool((wide[:, 80:] == 7).all())
    assert torch.equal(out, fused_local_expert_sum(x, ids, weights, w13, w2))


def test_bad_shapes_name_the_argument():
    x, ids, weights, w13, w2 = _layer(8, 2, 64, 32, 3, 4, DEVICE)
    with pytest.raises(ValueError, match="weights_NK"):
        fused_local_expert_sum(x, ids, weights[:, :1], w13, w2)
    with pytest.raises(ValueError, match="w2_LHI"):
        fused_local_expert_sum(x, ids, weights, w13, w2[:, :, :16])
    with pytest.raises(ValueError, match="out_ND"):
        fused_local_expert_sum(x, ids, weights, w13, w2, out_ND=x.new_empty(3, 32))
    with pytest.raises(ValueError, match="block_n"):
        MoeTileConfig(block_m=16, block_n=48, block_k=32, group_m=1, num_warps=4, num_stages=2)


@pytest.mark.parametrize("programs", [0, 128, 3], ids=["by-expert", "parallel", "parallel-3-programs"])
@pytest.mark.parametrize(("num_picks", "num_local", "block_m"),
                         [(1, 8, 16), (56, 4, 16), (300, 12, 16), (512, 128, 16), (700, 64, 64), (4500, 128, 32)])
def test_align_picks_blocks_by_expert(num_picks, num_local, block_m, programs, monkeypatch):
    # 4500 picks take five 1024-pick chunks (one partial) in each program of the by-expert
    # form, and 71 chunks of the parallel form, more than one 64-chunk tile of its count
    # table; 512 picks over 128 experts leave unused blocks past the used ones to clear.
    # ids include other ranks' (-1) and out-of-range ones. Both layouts are forced by moving the
    # threshold between them; with 3 programs each program of the parallel form counts and
    # places several chunks, and writes several tiles of blocks.
    from dp_runtime.model import moe_align

    monkeypatch.setattr(moe_align, "PARALLEL_PICKS", 1 << 30 if programs == 0 else 0)
    monkeypatch.setattr(moe_align, "MAX_PROGRAMS", programs or 128)
    g = torch.Generator().manual_seed(num_picks)
    ids = torch.randint(-1, num_local + 2, (num_picks,), generator=g, dtype=torch.int32)
    sorted_r, block_expert, num_rows = (t.cpu() for t in align_picks(ids.to(DEVICE), num_local, block_m))
    blocks = max_blocks(num_picks, num_local, block_m)
    assert sorted_r.shape == (blocks * block_m,) and block_expert.shape == (blocks,)
    counts = torch.bincount(ids[(ids >= 0) & (ids < num_local)].long(), minlength=num_local)
    used = int(((counts + block_m - 1) // block_m).sum())
    assert int(num_rows) == used * block_m
    assert bool((block_expert[used:] == -1).all())
    assert bool((sorted_r[used * block_m :] == num_picks).all()), "unused blocks hold only the sentinel"
    expected_experts = torch.repeat_interleave(torch.arange(num_local), (counts + block_m - 1) // block_m)
    assert torch.equal(block_expert[:used].long(), expected_experts)
    for b in range(used):
        slot = sorted_r[b * block_m : (b + 1) * block_m]
        real = slot[slot < num_picks].long()
        assert bool((ids[real] == block_expert[b]).all())
        assert bool((slot[len(real):] == num_picks).all()), "padding is the sentinel, after the picks"
        assert bool((real[1:] > real[:-1]).all()), "pick order within an expert"
    valid = torch.nonzero((ids >= 0) & (ids < num_local)).flatten()
    placed = sorted_r[: used * block_m]
    assert torch.equal(torch.sort(placed[placed < num_picks].long()).values, valid)


def test_tile_rule_grows_with_tokens():
    sizes = [tile_config(n).block_m for n in (1, 32, 33, 256, 1024, 2048, 8192)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 128


def test_extend_steps_of_65_to_1024_tokens_take_64_row_blocks_and_the_same_sums():
    # Prompt tokens share experts: extends of 65+ tokens take 64-row blocks (one block for an
    # expert's ~34 rows instead of three of 16); decode sizes and large extends keep the rule.
    assert [tile_config(n, extend=True).block_m for n in (64, 65, 128, 1024)] == [tile_config(64).block_m, 64, 64, 64]
    assert tile_config(2048, extend=True) == tile_config(2048) and tile_config(128).block_m == 16
    # Their second GEMM takes narrower column tiles on the same blocks; every other call one config.
    assert gemm2_tile_config(128, extend=True).block_m == 64 and gemm2_tile_config(128, extend=True).block_n == 64
    # ... and from 129 tokens walks them on a persistent grid.
    assert [gemm2_tile_config(n, extend=True).programs_per_sm for n in (128, 129, 1024)] == [0, 4, 4]
    assert gemm2_tile_config(129, extend=True).block_n == 64
    for n, ext in [(1, False), (128, False), (64, True), (2048, True)]:
        assert gemm2_tile_config(n, ext) == tile_config(n, ext)
    x, ids, weights, w13, w2 = _layer(8, 8, 64, 32, 80, 8, DEVICE, seed=4)
    out = fused_local_expert_sum(x, ids, weights, w13, w2, extend=True)
    _assert_within_bound(out, x, ids, weights, w13, w2)
    _assert_close_to_reference(out, local_expert_sum(x, ids, weights, w13, w2, use_grouped_mm=False))


def test_supported_names_the_reason():
    ok, reason = fused_moe_supported(torch.device("cpu"), torch.bfloat16)
    assert not ok and "cpu" in reason
    if torch.cuda.is_available():
        ok, reason = fused_moe_supported(torch.device("cuda"), torch.float32)
        assert not ok and "float32" in reason


# -- GPU: Qwen3-30B-A3B shapes (E 128, top-8, H 2048, I 768) --------------------------------------

def _skip_without_fused_moe() -> None:
    """Skip a GPU test where the fused path cannot run, with the reason."""
    ok, reason = fused_moe_supported(torch.device("cuda"), torch.bfloat16)
    if not ok:
        pytest.skip(reason)


REAL = {"num_experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}


def _real_layer(num_tokens, num_local, seed=0):
    x, ids, weights, w13, w2 = _layer(REAL["num_experts"], REAL["top_k"], REAL["hidden"], REAL["inter"],
                                      num_tokens, num_local, torch.device("cuda"), seed=seed)
    return x, ids, weights, w13, w2


@pytest.mark.gpu
@pytest.mark.parametrize("num_local", [128, 64])
@pytest.mark.parametrize("num_tokens", [0, 1, 8, 64, 256, 2048])
def test_gpu_real_shapes_match_grouped_mm(num_tokens, num_local):
    _skip_without_fused_moe()
    x, ids, weights, w13, w2 = _real_layer(num_tokens, num_local)
    if num_tokens and num_local < REAL["num_experts"]:
        ids[: max(1, num_tokens // 8)] = -1  # tokens routed to no local expert
    out = fused_local_expert_sum(x, ids, weights, w13, w2)
    grouped = grouped_mm_supported(x.device, x.dtype)
    ref = local_expert_sum(x, ids, weights, w13, w2, use_grouped_mm=grouped)
    assert out.shape == ref.shape
    if num_tokens == 0:
        return
    if num_local < REAL["num_experts"]:
        assert bool((out[: max(1, num_tokens // 8)] == 0).all())
    _assert_close_to_reference(out, ref)
    if num_tokens <= 256:  # the fp64 sum loops over experts: keep it to decode sizes
        _assert_within_bound(out, x, ids, weights, w13, w2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_local", [128, 64])
def test_gpu_graph_replay_equals_eager_bitwise(num_local):
    _skip_without_fused_moe()
    x, ids, weights, w13, w2 = _real_layer(64, num_local, seed=4)
    out = torch.empty_like(x)
    fused_local_expert_sum(x, ids, weights, w13, w2, out_ND=out)  # compile outside the capture
    new = [_tokens(REAL["num_experts"], REAL["top_k"], REAL["hidden"], 64, num_local, x.device, seed=seed)
           for seed in (5, 6)]
    _assert_replays_follow_new_inputs(lambda: fused_local_expert_sum(x, ids, weights, w13, w2, out_ND=out), out,
                                      (x, ids, weights), new, lambda: fused_local_expert_sum(x, ids, weights, w13, w2))


def _assert_replays_follow_new_inputs(run, out, bufs, new_inputs, want) -> None:
    """Capture ``run`` (it writes ``out``) in a CUDA graph; then for each tuple of
    ``new_inputs``, copy it into ``bufs``, replay and compare ``out`` with ``want()`` bit for bit.
    The counts, blocks and padding live on the device, so a replay must follow the new routing,
    not the one seen at capture."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for values in new_inputs:
        for buf, value in zip(bufs, values, strict=True):
            buf.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want())


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [128, 256])
def test_gpu_persistent_extend_gemms_match_per_tile_and_replay(num_tokens):
    # The extend tiles on a persistent grid, for a prompt's routing concentrated on 30 experts
    # (some get more than one block): equal to a program per tile bit for bit, eager and
    # replayed with new routing in the same buffers (the tiles in use come from the device).
    _skip_without_fused_moe()
    x, ids, weights, w13, w2 = _real_layer(num_tokens, 128, seed=7)

    def concentrated(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        logits = torch.full((num_tokens, REAL["num_experts"]), float("-inf"), device="cuda")
        keep = torch.randperm(REAL["num_experts"], generator=g, device="cuda")[:30]
        logits[:, keep] = torch.randn(num_tokens, 30, generator=g, device="cuda")
        w, i = softmax_topk(logits, REAL["top_k"], renormalize=True)
        return i, w

    per_tile = [dataclasses.replace(c, programs_per_sm=0)
                for c in (tile_config(num_tokens, extend=True), gemm2_tile_config(num_tokens, extend=True))]
    configs = [dataclasses.replace(c, programs_per_sm=p) for c, p in zip(per_tile, (3, 4), strict=True)]
    for buf, value in zip((ids, weights), concentrated(1), strict=True):
        buf.copy_(value)
    out = torch.empty_like(x)

    def persistent():
        return fused_local_expert_sum(x, ids, weights, w13, w2, out_ND=out, config=configs[0], config2=configs[1])

    def one_per_tile():
        return fused_local_expert_sum(x, ids, weights, w13, w2, config=per_tile[0], config2=per_tile[1])

    assert torch.equal(persistent(), one_per_tile())
    _assert_replays_follow_new_inputs(persistent, out, (ids, weights), [concentrated(2), concentrated(3)],
                                      one_per_tile)


def test_decode_picks_skip_the_alignment_and_match_the_aligned_path():
    """Up to UNALIGNED_PICKS picks, each pick is a block of its own (no alignment launch); the
    result equals the aligned path's on the same inputs, non-local picks included."""
    from dp_runtime.model import fused_moe_triton as fmt
    from dp_runtime.model.moe_align import UNALIGNED_PICKS, unaligned_blocks

    ids = torch.tensor([3, -1, 7, 0], dtype=torch.int32, device=DEVICE)
    sorted_R, block_expert, num_rows = unaligned_blocks(ids, 16)
    assert block_expert is ids and int(num_rows) == 4 * 16
    assert sorted_R.view(4, 16)[:, 0].tolist() == [0, 1, 2, 3] and (sorted_R.view(4, 16)[:, 1:] == 4).all()
    for num_tokens in (1, 2):  # top-8: 8 and 16 picks, both at or under the threshold
        x, ids_NK, weights, w13, w2 = _layer(16, 8, 64, 32, num_tokens, 12, DEVICE, seed=num_tokens)
        assert ids_NK.numel() <= UNALIGNED_PICKS
        fast = fused_local_expert_sum(x, ids_NK, weights, w13, w2)
        limit, fmt.UNALIGNED_PICKS = fmt.UNALIGNED_PICKS, 0  # force the aligned path
        try:
            aligned = fused_local_expert_sum(x, ids_NK, weights, w13, w2)
        finally:
            fmt.UNALIGNED_PICKS = limit
        assert torch.equal(fast, aligned)
        _assert_within_bound(fast, x, ids_NK, weights, w13, w2)


@pytest.mark.gpu
@pytest.mark.parametrize(("counts", "extend"), [((40, 41, 47, 48), False), ((300, 301, 307, 320), False),
                                               ((700, 701, 709, 720), False), ((200, 201, 213, 240), True)],
                         ids=["decode-tiles", "one-launch-alignment", "parallel-alignment", "extend-persistent"])
def test_gpu_one_build_serves_every_token_count_of_a_tile_config(counts, extend):
    # Within one tile config a new step size builds nothing: Triton specializes integer
    # arguments on divisibility by 16 and pointers on 16-byte alignment, and would otherwise
    # build again inside the step of a new size (a second of its prompt's time to first token).
    _skip_without_fused_moe()
    from dp_runtime.model import fused_moe_triton, moe_align
    from tests.support.triton_builds import compiled_variants

    kernels = (moe_align._align_by_expert_kernel, moe_align._chunk_counts_kernel, moe_align._chunk_scatter_kernel,
               fused_moe_triton._expert_gemm_kernel, fused_moe_triton._expert_gemm_persistent_kernel,
               fused_moe_triton._sum_picks_kernel)
    assert len({(tile_config(n, extend), gemm2_tile_config(n, extend)) for n in counts}) == 1
    assert len({n * REAL["top_k"] > moe_align.PARALLEL_PICKS for n in counts}) == 1
    fused_local_expert_sum(*_real_layer(counts[0], 128), extend=extend)
    built = [compiled_variants(k) for k in kernels]
    if extend:  # GEMM1 a program per tile, GEMM2 on the persistent grid
        assert built[3] >= 1 and built[4] >= 1
    for n in counts[1:]:
        fused_local_expert_sum(*_real_layer(n, 128), extend=extend)
    assert [compiled_variants(k) for k in kernels] == built
