"""The narrow GEMM (dp_runtime/model/narrow_gemm.py) against float64 math on the same bf16/fp16
inputs, its argument checks and tile rule.

Tolerance: products of two bf16 (fp16) values are exact in fp32; the fp32 sums err by about
depth * 2^-24 relative to sum_k |w_k x_k|, and tensor cores may align the products of one
instruction to the largest before adding (a few more bits). 2^-14 * (|x| @ |w|.T) covers both
with room, plus one unit roundoff of the output (two under Triton's CPU interpreter, which
truncates the final cast; tests/test_skinny_linear.py says more). A missed K chunk, row block or
column tile, or a wrong stride, moves outputs by a sizeable fraction of |ref|.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from dp_runtime.model.narrow_gemm import NARROW_MAX_ROWS, narrow_gemm, narrow_tiles

HAS_TRITON = importlib.util.find_spec("triton") is not None
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not HAS_TRITON,
    reason="Triton's CPU interpreter: CPU machines with triton (gpu tests cover GPUs)")


def _case(m, n, k, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed * 7919 + m * n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    return x.to(device), w.to(device)


def _check(y, x, w, *, truncating=False):
    assert y.shape == (x.shape[0], w.shape[0]) and y.dtype == x.dtype and y.device == x.device
    ref = F.linear(x.double(), w.double())
    sum_abs = F.linear(x.double().abs(), w.double().abs())
    u = UNIT_ROUNDOFF[x.dtype] * (2 if truncating else 1)
    excess = (y.double() - ref).abs() - (u * ref.abs() + 2.0**-14 * sum_abs)
    assert excess.max().item() <= 0, f"worst element exceeds its bound by {excess.max().item():.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(2048, 4096), (5120, 2048), (128, 2048), (33, 100)])
@pytest.mark.parametrize("m", [5, 16, 63, 128, 200, 256])
def test_matches_fp64_reference_gpu(m, n, k, dtype):
    x, w = _case(m, n, k, dtype, "cuda")
    _check(narrow_gemm(x, w), x, w)


@pytest.mark.gpu
def test_cuda_graph_capture_replay_and_one_build_for_every_row_count():
    x, w = _case(128, 2048, 4096, torch.bfloat16, "cuda")
    narrow_gemm(x, w)  # compile outside the capture, as the graph runners warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = narrow_gemm(x, w)
    x.copy_(_case(128, 2048, 4096, torch.bfloat16, "cuda", seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, narrow_gemm(x, w))  # the replay read the new x
    # Row counts of one tile config share a build: the row count is not specialized.
    from dp_runtime.model.narrow_gemm import _narrow_gemm_kernel

    cache = _narrow_gemm_kernel.device_caches[torch.cuda.current_device()][0]
    before = len(cache)
    for m in (65, 80, 97, 113, 127):  # all (64, 32, 128, 4, 4) tiles
        assert narrow_tiles(m, 2048, 4096) == narrow_tiles(128, 2048, 4096)
        narrow_gemm(x[:m], w)
    assert len(cache) == before


@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(5, 40, 64), (33, 72, 96), (130, 48, 160), (16, 128, 2048)])
def test_matches_fp64_reference_interpreter(m, n, k, dtype):
    x, w = _case(m, n, k, dtype, "cpu")
    _check(narrow_gemm(x, w), x, w, truncating=True)


@interpreter
@pytest.mark.parametrize("tiles", [(16, 16, 32, 4, 2), (32, 64, 64, 4, 3), (64, 16, 128, 8, 4)])
def test_strided_rows_and_other_tiles_interpreter(tiles):
    xb, wb = _case(70, 70, 320, torch.bfloat16, "cpu")
    x, w = xb[:, 10:266], wb[3:, :256]  # row strides 320, unit stride along K; 3 row blocks of 32
    _check(narrow_gemm(x, w, tiles=tiles), x, w, truncating=True)


@interpreter
def test_zero_rows_launch_nothing():
    x, w = _case(0, 33, 100, torch.bfloat16, "cpu")
    assert narrow_gemm(x, w).shape == (0, 33)


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(("x", "w", "message"), [
    (_bf16(1, 2, 64), _bf16(32, 64), r"must be 2-D, got x \(1, 2, 64\) and w \(32, 64\)"),
    (_bf16(257, 64), _bf16(32, 64), r"x has 257 rows, more than NARROW_MAX_ROWS=256"),
    (_bf16(8, 64), _bf16(32, 48), r"x has K=64 columns but w has K=48"),
    (torch.zeros(8, 64), torch.zeros(32, 64), r"bfloat16/float16, got x torch.float32 and w torch.float32"),
    (_bf16(64, 8).t(), _bf16(32, 64), r"contiguous along K \(stride 1\), got strides x \(1, 8\)"),
])
def test_argument_errors_name_the_value_and_limit(x, w, message):
    with pytest.raises(ValueError, match=message):
        narrow_gemm(x, w)


def test_tiles_fill_the_gpu_where_the_shape_allows():
    for m in (5, 8, 16, 64, 128, 256):
        for n, k in [(2048, 4096), (5120, 2048), (128, 2048)]:
            bm, bn, bk, _, _ = narrow_tiles(m, n, k)
            assert 16 <= bm <= 64 and bm >= min(m, 64) and bk == 128
            programs = -(-m // bm) * -(-n // bn)
            assert programs >= 2 * 132 or bn == 16, (m, n, programs)
    assert narrow_tiles(NARROW_MAX_ROWS, 5120, 2048)[:2] == (64, 64)  # 4 x 80 programs
