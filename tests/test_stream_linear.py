"""The split-K projection kernel (dp_runtime/model/stream_linear.py) against float64 math on the
same bf16/fp16 inputs; its split-K counters (zero after every launch, the same bits every call,
in a CUDA graph too); its argument checks; and the ops seam that picks it (decode_linear: 3-16
rows of weights up to SEAM_MAX_N rows).

Tolerance. Products of two bf16 (or fp16) values are exact in fp32; the fp32 additions and the
final rounding err. A program adds K / BLOCK_K tile products of 16-wide MMA sums into its
accumulator, the last program adds the SPLIT_K partials: under 300 dependent additions for every
shape here, each off by at most 2^-23 relative (tensor cores may truncate), so the sum is within
2^-15 * sum_k |w_k x_k| of the exact one. Rounding to the output dtype adds one unit roundoff u
(2^-8 bf16, 2^-11 fp16), two in Triton's CPU interpreter, whose fp32 -> bf16 casts truncate.
A lost split, tile or row moves outputs by a sizeable fraction of |ref|, far above this bound.

GPU tests carry ``@pytest.mark.gpu``; the interpreter tests run on CPU machines only.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from dp_runtime.model import elementwise_ops
from dp_runtime.model.elementwise_ops import decode_linear
from dp_runtime.model.stream_linear import (
    SEAM_MAX_ROWS,
    STREAM_MIN_ROWS,
    StreamLinear,
    StreamTiles,
    stream_tiles,
)
from tests.support.linear_cases import check_against_fp64, linear_case

HAS_TRITON = importlib.util.find_spec("triton") is not None
SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (100, 200)]  # qkv, o_proj, router, odd
interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not HAS_TRITON,
    reason="Triton's CPU interpreter: CPU machines with triton (gpu tests cover GPUs)")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")


_case = linear_case


def _check(y, x, w, *, truncating=False):
    check_against_fp64(y, x, w, sum_term=2.0**-15, truncating=truncating)


def _run_twice(stream, x, w, tiles=None):
    """Two launches: the second must give the first's bits (counters back at zero between)."""
    y = stream(x, w, tiles=tiles)
    assert not stream._counters.any(), "a split-K counter was left non-zero"
    assert torch.equal(stream(x, w, tiles=tiles), y)
    return y


# -- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [3, 16, 64, 100, 256])
def test_matches_fp64_reference_gpu(m, n, k, dtype):
    x, w = _case(m, n, k, dtype, "cuda")
    _check(_run_twice(StreamLinear("cuda"), x, w), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [StreamTiles(64, 64, 1, 4, 3), StreamTiles(64, 128, 8, 4, 4),
                                   StreamTiles(64, 256, 3, 4, 3), StreamTiles(128, 64, 2, 8, 3)])
@pytest.mark.parametrize("m", [5, 16, 64])
def test_other_tilings_and_strided_rows_gpu(m, tiles):
    # x and w as slices of wider tensors (unit stride along K only), as a fused output's view
    xb, wb = _case(m, 2100, 4160, torch.bfloat16, "cuda")
    x, w = xb[:, 64:], wb[5:, :4096]
    _check(_run_twice(StreamLinear("cuda"), x, w, tiles), x, w)


@pytest.mark.gpu
def test_cuda_graph_replays_every_shape_in_order():
    # A layer's three projections in a row, captured, share one StreamLinear's counters.
    stream = StreamLinear("cuda")
    cases = [_case(64, n, k, torch.bfloat16, "cuda") for n, k in SHAPES[:3]]
    for x, w in cases:  # compile outside the capture, as the graph runners warm up
        stream(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [stream(x, w) for x, w in cases]
    for i, (x, w) in enumerate(cases):
        x.copy_(_case(64, w.shape[0], w.shape[1], torch.bfloat16, "cuda", seed=i + 1)[0])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert not stream._counters.any()
    for y, (x, w) in zip(ys, cases, strict=True):
        assert torch.equal(y, stream(x, w))  # the replay read the new x, with the eager bits
        _check(y, x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [0, 2, 3, 16, 17, 64])
def test_ops_seam_picks_the_kernel_for_narrow_weights_from_3_to_16_rows(m):
    calls = []

    class Spy(StreamLinear):
        def __call__(self, x, w, **kw):
            calls.append(x.shape[0])
            return super().__call__(x, w, **kw)

    stream = Spy("cuda")
    x, w = _case(m, 2048, 4096, torch.bfloat16, "cuda")
    picked = STREAM_MIN_ROWS <= m <= SEAM_MAX_ROWS
    assert stream.takes(x, w, None) == picked
    x_qkv, w_qkv = _case(m, 5120, 2048, torch.bfloat16, "cuda")
    assert not stream.takes(x_qkv, w_qkv, None)  # wider than SEAM_MAX_N: cuBLAS was faster
    y = decode_linear(x, w, None, stream)
    assert calls == ([m] if picked else [])
    assert y.shape == (m, 2048)
    if picked:
        _check(y, x, w)
        ops = elementwise_ops.elementwise_ops(torch.device("cuda"), torch.bfloat16)
        if isinstance(ops, elementwise_ops.FlashInferOps):  # the model's seam: the same bits
            assert torch.equal(ops.linear(x, w), y)
    elif m != 2:  # 2 rows: skinny_linear (tests/test_skinny_linear.py)
        assert torch.equal(y, F.linear(x, w))
    b = torch.randn(2048, device="cuda").bfloat16()
    assert not stream.takes(x, w, b)  # a bias: F.linear
    assert torch.equal(decode_linear(x, w, b, stream), F.linear(x, w, b))
    assert not stream.takes(x.float(), w.float(), None)
    assert len(calls) == (1 if picked else 0)


# -- CPU: Triton's interpreter -------------------------------------------------------------------

@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), [(3, 128, 256), (64, 256, 512), (17, 100, 96),
                                           (256, 64, 1024)])
def test_matches_fp64_reference_interpreter(m, n, k, dtype):
    x, w = _case(m, n, k, dtype, "cpu")
    _check(_run_twice(StreamLinear("cpu"), x, w), x, w, truncating=True)


@interpreter
@pytest.mark.parametrize("tiles", [StreamTiles(64, 32, 4, 4, 2), StreamTiles(64, 64, 1, 4, 2),
                                   StreamTiles(64, 32, 3, 4, 2), StreamTiles(64, 16, 16, 4, 2)])
def test_splits_strided_rows_and_ragged_k_interpreter(tiles):
    # K 240 is not a multiple of every split's range: the last split is short (masked loads)
    xb, wb = _case(5, 140, 300, torch.bfloat16, "cpu")
    x, w = xb[:, 60:], wb[3:, :240]  # row strides 300, unit stride along K
    _check(_run_twice(StreamLinear("cpu"), x, w, tiles), x, w, truncating=True)


@interpreter
def test_zero_rows_launch_nothing():
    x, w = _case(0, 33, 100, torch.bfloat16, "cpu")
    assert StreamLinear("cpu")(x, w).shape == (0, 33)


# -- CPU: argument checks, tilings, the seam's fallback ------------------------------------------

def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@needs_triton
@pytest.mark.parametrize(("x", "w", "message"), [
    (_bf16(1, 2, 64), _bf16(32, 64), r"must be 2-D, got x \(1, 2, 64\) and w \(32, 64\)"),
    (_bf16(257, 64), _bf16(32, 64), r"x has 257 rows, more than STREAM_MAX_ROWS=256"),
    (_bf16(4, 64), _bf16(32, 48), r"x has K=64 columns but w has K=48"),
    (torch.zeros(4, 64), torch.zeros(32, 64), r"bfloat16/float16, got x torch.float32"),
    (_bf16(4, 64), _bf16(32, 64).half(), r"got x torch.bfloat16 and w torch.float16"),
    (_bf16(64, 4).t(), _bf16(32, 64), r"contiguous along K \(stride 1\), got strides x \(1, 4\)"),
])
def test_argument_errors_name_the_value_and_limit(x, w, message, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match=message):
        StreamLinear("cpu")(x, w)


@needs_triton
def test_cpu_tensors_need_cuda_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"needs CUDA tensors, got cpu"):
        StreamLinear("cpu")(_bf16(4, 64), _bf16(32, 64))


def test_tilings_fill_the_gpu_and_fit_shared_memory():
    assert stream_tiles(64, 5120, 2048) == StreamTiles(64, 128, 2, 4, 4)  # qkv: 160 programs
    assert stream_tiles(64, 2048, 4096) == StreamTiles(64, 128, 4, 4, 4)  # o_proj: 128
    assert stream_tiles(256, 2048, 4096).block_k == 64  # x's wider tile: a smaller K step
    for m in (3, 16, 64, 65, 128, 256):
        for n, k in [*SHAPES, (151936, 2048), (4096, 16384), (64, 64)]:
            t = stream_tiles(m, n, k)
            tiles_n = -(-n // t.block_n)
            # a split keeps at least two loads; more splits only while the grid is under a wave
            assert k // t.split_k >= 2 * t.block_k or t.split_k == 1
            assert t.split_k == 1 or tiles_n * t.split_k // 2 < 120
            block_m = max(16, 1 << (m - 1).bit_length())
            assert t.num_stages * (t.block_n + block_m) * t.block_k * 2 <= 200 * 1024


@pytest.mark.parametrize("m", [0, 3, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_ops_seam_falls_back_to_f_linear_on_cpu(m, bias):
    x, w = _case(m, 48, 64, torch.bfloat16, "cpu")
    b = torch.randn(48).bfloat16() if bias else None
    stream = StreamLinear("cpu") if HAS_TRITON else None
    if stream is not None:
        assert not stream.takes(x, w, b)  # CPU tensors never take it outside the interpreter tests
    assert torch.equal(decode_linear(x, w, b, stream), F.linear(x, w, b))
