"""Programmatic dependent launch (``dp_runtime.model.pdl``) changes no value: a chain of the
runtime's Triton kernels, each reading what the one before wrote, gives bit for bit the same
tensors launched with PDL as without, eagerly and replayed from a CUDA graph.

The chain is a MoE layer's and an attention block's kernels at three sizes that take every
path: routing, pick alignment (none at 2 rows, one launch at 64, three at 640), the two expert
GEMMs (the persistent second GEMM for the 640-token extend), the top-k sum with the next add +
RMSNorm, a projection (``skinny_linear`` at 2 rows), the q/k prologue that stores K/V into the
cache and the decode attention that reads the new rows back. A PDL kernel that touched memory
before its predecessor completed would read stale routing, blocks or K/V rows here.

A CPU test checks the rule every PDL kernel keeps (``pdl_entry`` is its first statement) and
how ``resolve_pdl`` resolves.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import textwrap

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
E, K, H, INTER, HQ, HKV, D = 128, 8, 512, 256, 8, 2, 128


def _pdl_kernels():
    from dp_runtime.attention import triton_decode
    from dp_runtime.model import (
        fused_moe_triton,
        moe_align,
        qk_norm_rope,
        routing_triton,
        skinny_linear,
        stream_linear,
    )

    for module in (
        fused_moe_triton,
        moe_align,
        routing_triton,
        qk_norm_rope,
        skinny_linear,
        stream_linear,
        triton_decode,
    ):
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # a @triton.jit function's Python source
            defined_here = (
                fn is not None and fn.__module__ == module.__name__
            )  # not pdl_entry itself
            if defined_here and "PDL" in inspect.signature(fn).parameters:
                yield f"{module.__name__}.{name}", fn


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_every_pdl_kernel_waits_before_it_touches_memory():
    names = []
    for name, fn in _pdl_kernels():
        body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = ast.unparse(body[0])
        assert first == "pdl_entry(PDL)", (
            f"{name}: first statement is {first!r}, not pdl_entry(PDL)"
        )
        names.append(name.rsplit(".", 1)[1])
    # every kernel of a decode layer's Triton chain (a new kernel must opt in, or be named here)
    assert {
        "_softmax_topk_kernel",
        "_align_by_expert_kernel",
        "_chunk_counts_kernel",
        "_chunk_scatter_kernel",
        "_expert_gemm_kernel",
        "_expert_gemm_persistent_kernel",
        "_sum_picks_kernel",
        "_qk_norm_rope_store_kernel",
        "_skinny_linear_kernel",
        "_stream_linear_kernel",
        "_decode_kernel",
    } <= set(names)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_resolve_pdl_on_a_cpu_tensor():
    from dp_runtime.model.pdl import pdl_meta, resolve_pdl

    x = torch.zeros(1)
    assert resolve_pdl(None, x, 1) is False and resolve_pdl(False, x, 1) is False
    with pytest.raises(
        ValueError,
        match=r"pdl=True needs a CUDA device of compute capability >= 9.0 and Triton >= 3.4, "
        r"got cpu",
    ):
        resolve_pdl(True, x, 1)
    assert pdl_meta(False) == {"PDL": False}
    assert pdl_meta(True) == {"PDL": True, "launch_pdl": True}


def _inputs(t: int, seed: int, dev: torch.device) -> dict[str, torch.Tensor]:
    from dp_runtime.model.layers import RotaryEmbedding

    g = torch.Generator(device=dev).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).bfloat16()

    lens = torch.randint(1, 200, (t,), generator=g, device=dev)
    indptr = torch.zeros(t + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(lens, 0)
    slots = int(indptr[-1]) + 64  # every context row a slot of its own, slot 0 unused
    indices = torch.randperm(slots - 1, generator=g, device=dev)[: slots - 64].to(torch.int32) + 1
    new_slots = indices[indptr[1:].long() - 1]  # each row's last context slot: written, then read
    return dict(
        x=rand(t, H),
        residual=rand(t, H),
        w_router=rand(E, H, scale=0.05),
        w13=rand(E, 2 * INTER, H, scale=0.05),
        w2=rand(E, H, INTER, scale=0.05),
        norm_w=rand(H).abs(),
        w_qkv=rand((HQ + 2 * HKV) * D, H, scale=0.05),
        q_norm=rand(D).abs(),
        k_norm=rand(D).abs(),
        k_cache=rand(slots, HKV, D),
        v_cache=rand(slots, HKV, D),
        cos_sin=RotaryEmbedding(D, 4096, 1e6, dev).cos_sin_PD,
        positions=(lens - 1).to(torch.int64),
        slots=new_slots.to(torch.int64),
        indptr=indptr,
        indices=indices,
    )


def _chain(v: dict[str, torch.Tensor], pdl: bool, extend: bool) -> list[torch.Tensor]:
    """The kernels in a row, each consuming the previous one's output; returns every output
    (the residual and caches are updated in place)."""
    from dp_runtime.attention.triton_decode import triton_decode_attention
    from dp_runtime.model.fused_moe_triton import fused_local_expert_sum
    from dp_runtime.model.qk_norm_rope import qk_norm_rope_store
    from dp_runtime.model.routing_triton import softmax_topk_triton
    from dp_runtime.model.skinny_linear import SKINNY_MAX_ROWS, skinny_linear

    x = v["x"]
    weights, ids = softmax_topk_triton(
        x @ v["w_router"].T, K, renormalize=True, round_bf16=True, pdl=pdl
    )
    normed = fused_local_expert_sum(
        x,
        ids,
        weights,
        v["w13"],
        v["w2"],
        extend=extend,
        pdl=pdl,
        add_norm=(v["residual"], v["norm_w"], 1e-6),
    )
    if x.shape[0] <= SKINNY_MAX_ROWS:
        qkv = skinny_linear(normed, v["w_qkv"], pdl=pdl)
    else:
        qkv = normed @ v["w_qkv"].T
    q, k = qk_norm_rope_store(
        qkv,
        v["q_norm"],
        v["k_norm"],
        v["cos_sin"],
        v["positions"],
        v["slots"],
        v["k_cache"],
        v["v_cache"],
        num_heads=HQ,
        num_kv_heads=HKV,
        head_dim=D,
        eps=1e-6,
        pdl=pdl,
    )
    o = triton_decode_attention(
        q, v["k_cache"], v["v_cache"], v["indptr"], v["indices"], D**-0.5, pdl=pdl
    )
    return [weights, ids, normed, v["residual"], qkv, q, k, o, v["k_cache"], v["v_cache"]]


def _run(t: int, pdl: bool, graph: bool, extend: bool) -> list[torch.Tensor]:
    dev = torch.device("cuda")
    v = _inputs(t, seed=t, dev=dev)
    if not graph:
        return [o.clone() for o in _chain(v, pdl, extend)]
    start = {name: v[name].clone() for name in ("residual", "k_cache", "v_cache")}
    _chain(v, pdl, extend)  # warm-up: builds every kernel before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = _chain(v, pdl, extend)
    for _ in range(3):  # each replay starts from the same residual and caches
        for name, t0 in start.items():
            v[name].copy_(t0)
        g.replay()
    torch.cuda.synchronize()
    return [o.clone() for o in outs]


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize(
    "t,extend", [(2, False), (64, False), (640, True)], ids=["t2", "t64", "t640x"]
)
def test_pdl_launches_give_the_same_bits(t, extend, graph):
    from dp_runtime.model.pdl import pdl_supported

    if not pdl_supported(torch.device("cuda")):
        pytest.skip("PDL needs compute capability >= 9.0 and Triton >= 3.4")
    plain = _run(t, pdl=False, graph=graph, extend=extend)
    with_pdl = _run(t, pdl=True, graph=graph, extend=extend)
    names = [
        "weights",
        "ids",
        "normed",
        "residual",
        "qkv",
        "q",
        "k",
        "attention",
        "k_cache",
        "v_cache",
    ]
    for name, a, b in zip(names, plain, with_pdl, strict=True):
        assert torch.equal(a, b), f"{name} differs with PDL (t={t}, graph={graph})"
    assert plain[7].abs().sum() > 0 and torch.isfinite(plain[7].float()).all()
