"""The skinny linear kernel (dp_runtime/model/skinny_linear.py) against float64 math on the same
bf16/fp16 inputs, its argument checks, and the ops seam that picks it (elementwise_ops.linear).

Tolerance. Products of two bf16 (or fp16) values are exact in fp32; only the fp32 additions and
the final rounding to the output dtype err. The kernel's summation has depth at most K / BLOCK_K
sequential steps per lane plus the reduction across the tile (elements per thread, 5 shuffle
levels, the warps): under 64 for every shape here, so its sum is within 64 * 2^-24 * sum_k
|w_k x_k| of the exact one. Rounding to nearest then adds at most one unit roundoff of the
output: 2^-8 relative in bf16 (8 significant bits), 2^-11 in fp16. So each element must satisfy
|y - ref| <= u * |ref| + 2^-18 * (|x| @ |w|.T), with ref in float64. Triton's CPU interpreter
truncates fp32 -> bf16/fp16 casts instead of rounding (see tests/test_qk_norm_rope.py): there the
relative term is one full unit in the last place, 2u. Every real bug (a K chunk or a row missed, a
wrong mask, a wrong stride) moves outputs by a sizeable fraction of |ref|, far above these bounds.

GPU tests carry ``@pytest.mark.gpu`` (``pytest -m gpu``); the interpreter tests run on CPU
machines only (with a GPU, TRITON_INTERPRET is not set and the gpu versions cover them).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from dp_runtime.model import elementwise_ops
from dp_runtime.model.elementwise_ops import TorchOps, decode_linear
from dp_runtime.model.skinny_linear import (
    SKINNY_USE_ROWS,
    _tiles,
    skinny_linear,
    use_skinny,
)
from tests.support.linear_cases import check_against_fp64, linear_case

HAS_TRITON = importlib.util.find_spec("triton") is not None
SHAPES = [(2048, 4096), (5120, 2048), (128, 2048), (33, 100)]  # (N, K): o_proj, qkv, router, odd
interpreter = pytest.mark.skipif(
    torch.cuda.is_available() or not HAS_TRITON,
    reason="Triton's CPU interpreter: CPU machines with triton (gpu tests cover GPUs)")


_case = linear_case


def _check(y, x, w, *, truncating=False):
    check_against_fp64(y, x, w, sum_term=2.0**-18, truncating=truncating)


# -- GPU ---------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_matches_fp64_reference_gpu(m, n, k, dtype):
    x, w = _case(m, n, k, dtype, "cuda")
    _check(skinny_linear(x, w), x, w)


@pytest.mark.gpu
def test_strided_rows_gpu():
    # x and w as row slices of wider tensors (unit stride along K only), as a fused output's view
    xb, wb = _case(3, 80, 4160, torch.bfloat16, "cuda")
    x, w = xb[:, 64:], wb[5:, :4096]
    _check(skinny_linear(x, w), x, w)


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    x, w = _case(2, 2048, 4096, torch.bfloat16, "cuda")
    skinny_linear(x, w)  # compile outside the capture, as the graph runners warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = skinny_linear(x, w)
    x.copy_(_case(2, 2048, 4096, torch.bfloat16, "cuda", seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, skinny_linear(x, w))  # the replay read the new x
    _check(y, x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 8])
def test_ops_seam_picks_the_kernel_up_to_max_rows(m, monkeypatch):
    calls = []

    def spy(x, w):
        calls.append(x.shape[0])
        return skinny_linear(x, w)

    monkeypatch.setattr(elementwise_ops, "skinny_linear", spy)
    x, w = _case(m, 2048, 4096, torch.bfloat16, "cuda")
    picked = 1 <= m <= SKINNY_USE_ROWS
    assert use_skinny(x, w, None) == picked
    y = decode_linear(x, w, None, None)  # no StreamLinear: tests/test_stream_linear.py has it
    assert calls == ([m] if picked else [])
    assert y.shape == (m, 2048)
    if picked:
        _check(y, x, w)
    else:  # 0 rows (an IDLE rank) and more than SKINNY_USE_ROWS: F.linear itself
        assert torch.equal(y, F.linear(x, w))
    b = torch.randn(2048, device="cuda").bfloat16()
    assert torch.equal(decode_linear(x, w, b, None), F.linear(x, w, b))  # a bias: F.linear
    assert len(calls) == (1 if picked else 0)
    assert torch.equal(TorchOps.linear(x, w, None), F.linear(x, w))


# -- CPU: Triton's interpreter -------------------------------------------------------------------

@interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(128, 2048), (33, 100), (7, 16)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_matches_fp64_reference_interpreter(m, n, k, dtype):
    x, w = _case(m, n, k, dtype, "cpu")
    _check(skinny_linear(x, w), x, w, truncating=True)


@interpreter
@pytest.mark.parametrize("tiles", [None, (16, 64, 4, 2), (32, 128, 8, 4), (8, 16, 2, 3)])
def test_strided_rows_and_other_tiles_interpreter(tiles):
    xb, wb = _case(3, 70, 320, torch.bfloat16, "cpu")
    x, w = xb[:, 10:266], wb[3:, :256]  # row strides 320, unit stride along K
    _check(skinny_linear(x, w, tiles=tiles), x, w, truncating=True)


@interpreter
def test_zero_rows_launch_nothing():
    x, w = _case(0, 33, 100, torch.bfloat16, "cpu")
    assert skinny_linear(x, w).shape == (0, 33)


# -- CPU: argument checks, tile choice, the seam's fallback ---------------------------------------

def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(("x", "w", "message"), [
    (_bf16(1, 2, 64), _bf16(32, 64), r"must be 2-D, got x \(1, 2, 64\) and w \(32, 64\)"),
    (_bf16(5, 64), _bf16(32, 64), r"x has 5 rows, more than SKINNY_MAX_ROWS=4"),
    (_bf16(2, 64), _bf16(32, 48), r"x has K=64 columns but w has K=48"),
    (torch.zeros(2, 64), torch.zeros(32, 64), r"bfloat16/float16, got x torch.float32 and w torch.float32"),
    (_bf16(2, 64), _bf16(32, 64).half(), r"got x torch.bfloat16 and w torch.float16"),
    (_bf16(64, 2).t(), _bf16(32, 64), r"contiguous along K \(stride 1\), got strides x \(1, 2\)"),
    (_bf16(2, 64), _bf16(64, 32).t(), r"contiguous along K \(stride 1\), got .* w \(1, 32\)"),
])
def test_argument_errors_name_the_value_and_limit(x, w, message):
    with pytest.raises(ValueError, match=message):
        skinny_linear(x, w)


def test_cpu_tensors_need_cuda_outside_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"needs CUDA tensors, got cpu"):
        skinny_linear(_bf16(2, 64), _bf16(32, 64))


def test_tiles_give_two_waves_where_n_allows():
    assert _tiles(2048, 4096) == (8, 512, 4, 3)  # o_proj: 256 programs
    assert _tiles(5120, 2048) == (16, 256, 4, 3)  # qkv: 320 programs
    assert _tiles(128, 2048) == (8, 512, 4, 3)  # the router: 16 programs, all N allows at 8
    assert _tiles(33, 100)[:2] == (8, 128)  # small K: one chunk, the next power of two
    assert _tiles(7, 5)[:2] == (8, 16)
    for n, k in [*SHAPES, (151936, 2048), (4096, 16384)]:
        block_n, block_k, num_warps, _ = _tiles(n, k)
        # 32 fp32 accumulator registers per thread per row of x at most (the kernel's budget)
        assert block_n * block_k <= 32 * 32 * num_warps
        assert -(-n // block_n) >= 2 * 132 or block_n == 8


@pytest.mark.parametrize("m", [0, 1, 4, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_ops_seam_falls_back_to_f_linear_on_cpu(m, bias):
    x, w = _case(m, 48, 64, torch.bfloat16, "cpu")
    b = torch.randn(48).bfloat16() if bias else None
    assert not use_skinny(x, w, b)
    want = F.linear(x, w, b)
    for got in (TorchOps.linear(x, w, b), decode_linear(x, w, b, None)):  # FlashInferOps.linear's
        assert got.shape == (m, 48) and torch.equal(got, want)


def test_use_skinny_refuses_what_the_kernel_cannot_take():
    # Never raises: a float32 model, a bias, mismatched K or dtypes, strided K all go to F.linear
    # (which raises its own errors where the shapes do not fit). On CPU it is always False.
    x, w = _bf16(2, 64), _bf16(32, 64)
    for args in ((x, w, None), (x.float(), w.float(), None), (x, w, _bf16(32)), (x, _bf16(32, 48), None),
                 (x, w.half(), None), (_bf16(64, 2).t(), w, None), (_bf16(2, 2, 64), w, None)):
        assert use_skinny(*args) is False
