"""FlashInfer decode attention alone, as the decode graphs run it (page size 1, NHD, bf16), for
the qwen3-30b-a3b layer (32 query heads, 4 KV heads of 128): the wrapper variants side by side,
inside CUDA graphs, against the bytes floor of the KV the step reads.

    python bench/decode_attention.py                       # bs 1 64 256, context 100 and 1000
    python bench/decode_attention.py --bs 256 --ctx 128
    python bench/decode_attention.py --kv-dtypes --bs 64 128 --ctx 300 600   # bf16 against FP8 caches

Variants: FlashInfer's decode wrapper on ``tc`` (tensor-core kernels, its prefill kernel: what
the backend picks for GQA >= 4) and ``cc`` (CUDA-core decode kernel), each with its KV split
(``split``) and without (``nosplit``, what ``NO_SPLIT_KV_BS`` asks for at bs >= 64); its paged
prefill wrapper on FA3 with one query row per request (``fa3``); our Triton kernel
(``triton N``, dp_runtime/attention/triton_decode.py, KV blocks of N tokens; the ratio is its
best over FlashInfer's best). Each call reads its own
copy of the cache rows: nothing is served from L2 between calls. Random page order, like a
cache that has served many requests.

``--kv-dtypes``: instead, our Triton kernel (blocks of 128) and FlashInfer's ``tc nosplit`` over a
bf16 cache and an FP8 e4m3 one (``RuntimeConfig.kv_cache_dtype``), each with its slots in random
order and in runs of consecutive slots per request (a fresh cache), against each dtype's floor.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from bench.gpu_kernels import graph_us


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bs", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--ctx", type=int, nargs="+", default=[100, 1000])
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--copies", type=int, default=8, help="layers of cache cycled through inside one graph")
    p.add_argument("--kv-dtypes", action="store_true", help="bf16 against FP8 caches, random and consecutive slots")
    p.add_argument("--spread", type=int, default=1,
                   help="--kv-dtypes: a pool this many times the live tokens, random slots drawn from all of it")
    return p.parse_args()


def kv_dtype_us(flashinfer, args, bs: int, ctx: int, dev: torch.device) -> list[float]:
    """us per call of the Triton kernel and FlashInfer's tc nosplit, for a bf16 and an FP8 cache,
    slots in random order and consecutive per request (``--kv-dtypes``)."""
    from dp_runtime.attention.triton_decode import triton_decode_attention

    hq, hk, d = args.q_heads, args.kv_heads, args.head_dim
    tokens, pool = bs * ctx, bs * ctx * args.spread
    q = torch.randn(bs, hq, d, device=dev, dtype=torch.bfloat16)
    indptr = torch.arange(bs + 1, dtype=torch.int32) * ctx
    indptr_d, last = indptr.to(dev), torch.ones(bs, dtype=torch.int32)
    cells = []
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        caches = [tuple(torch.randn(pool, 1, hk, d, device=dev).to(dtype) for _ in range(2))
                  for _ in range(args.copies)]
        for indices in (torch.randperm(pool, dtype=torch.int32)[:tokens].to(dev),
                        torch.arange(tokens, dtype=torch.int32, device=dev)):
            cells.append(graph_us(lambda ix=indices, cs=caches: [
                triton_decode_attention(q, k, v, indptr_d, ix, d**-0.5) for k, v in cs], args.copies, 5, 20))
            ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=True, paged_kv_indptr_buffer=indptr_d,
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last.to(dev))
            w.plan(indptr, indices, last, hq, hk, d, 1, q_data_type=torch.bfloat16, kv_data_type=dtype,
                   disable_split_kv=True)
            cells.append(graph_us(lambda w=w, cs=caches: [w.run(q, c) for c in cs], args.copies, 5, 20))
    return cells


def print_kv_dtypes(flashinfer, args, dev: torch.device, bw: float) -> None:
    hk, d = args.kv_heads, args.head_dim
    names = [f"{dt} {order} {k}" for dt in ("bf16", "fp8") for order in ("random", "consecutive")
             for k in ("triton", "fi tc")]
    print("| bs | ctx | floor bf16 / fp8 us | " + " | ".join(names) + " | fp8/bf16 triton random |")
    print("|---:|---:|---:|" + "---:|" * (len(names) + 1))
    for bs in args.bs:
        for ctx in args.ctx:
            floor = 2 * bs * ctx * hk * d * 2 / bw * 1e6
            c = kv_dtype_us(flashinfer, args, bs, ctx, dev)
            print(f"| {bs} | {ctx} | {floor:.1f} / {floor / 2:.1f} | " + " | ".join(f"{x:.1f}" for x in c)
                  + f" | {c[4] / c[0]:.2f} |", flush=True)


def case_us(flashinfer, args, bs: int, ctx: int, dev: torch.device) -> list[float]:
    """us per call of every variant (module docstring) for ``bs`` requests of ``ctx`` tokens."""
    from dp_runtime.attention.triton_decode import triton_decode_attention

    hq, hk, d = args.q_heads, args.kv_heads, args.head_dim
    tokens = bs * ctx
    caches = [(torch.randn(tokens, 1, hk, d, device=dev, dtype=torch.bfloat16),
               torch.randn(tokens, 1, hk, d, device=dev, dtype=torch.bfloat16)) for _ in range(args.copies)]
    q = torch.randn(bs, hq, d, device=dev, dtype=torch.bfloat16)
    indptr = torch.arange(bs + 1, dtype=torch.int32) * ctx
    indices = torch.randperm(tokens, dtype=torch.int32).to(dev)
    last = torch.ones(bs, dtype=torch.int32)
    kw = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

    def timed(w) -> float:
        return graph_us(lambda: [w.run(q, c) for c in caches], args.copies, 5, 20)

    cells = []
    for tc in (True, False):
        for split in (True, False):
            ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, use_tensor_cores=tc, paged_kv_indptr_buffer=indptr.to(dev),
                paged_kv_indices_buffer=indices, paged_kv_last_page_len_buffer=last.to(dev))
            w.plan(indptr, indices, last, hq, hk, d, 1, **kw, **({} if split else {"disable_split_kv": True}))
            cells.append(timed(w))
    try:
        ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
        qo = torch.arange(bs + 1, dtype=torch.int32)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            ws, "NHD", use_cuda_graph=True, qo_indptr_buf=qo.to(dev), paged_kv_indptr_buf=indptr.to(dev),
            paged_kv_indices_buf=indices, paged_kv_last_page_len_buf=last.to(dev), backend="fa3")
        w.plan(qo, indptr, indices, last, hq, hk, d, 1, causal=False, **kw)
        cells.append(timed(w))
    except Exception as e:  # a variant this FlashInfer lacks is an empty cell, not a failed run
        print(f"fa3 at bs {bs} ctx {ctx}: {type(e).__name__}: {str(e)[:120]}")
        cells.append(float("nan"))
    indptr_d, scale = indptr.to(dev), d**-0.5
    for bn in (32, 64, 128):
        cells.append(graph_us(lambda bn=bn: [triton_decode_attention(q, k, v, indptr_d, indices, scale, block_n=bn)
                                             for k, v in caches], args.copies, 5, 20))
    return cells


def main() -> None:
    args = parse_args()
    import flashinfer

    from launch.gpu_specs import measure_copy_bandwidth

    dev = torch.device("cuda")
    bw = measure_copy_bandwidth(dev)
    hk, d = args.kv_heads, args.head_dim
    print(f"{torch.cuda.get_device_name()}, copy bandwidth {bw / 1e12:.2f} TB/s, heads {args.q_heads}/{hk}x{d}")
    if args.kv_dtypes:
        print_kv_dtypes(flashinfer, args, dev, bw)
        return
    names = ("tc split", "tc nosplit", "cc split", "cc nosplit", "fa3", "triton 32", "triton 64", "triton 128")
    print("| bs | ctx | floor us | " + " | ".join(f"{v} us" for v in names) + " | triton/best FlashInfer |")
    print("|---:|---:|---:|" + "---:|" * (len(names) + 1))
    for bs in args.bs:
        for ctx in args.ctx:
            floor = 2 * bs * ctx * hk * d * 2 / bw * 1e6
            cells = case_us(flashinfer, args, bs, ctx, dev)
            best_fi = min(c for c in cells[:5] if c == c)
            print(f"| {bs} | {ctx} | {floor:.1f} | " + " | ".join(f"{c:.1f}" for c in cells)
                  + f" | {min(cells[5:]) / best_fi:.2f} |", flush=True)


if __name__ == "__main__":
    main()
