"""Prefill attention alone on one GPU: FlashInfer's ragged prefill with its FA2 and FA3
backends, against torch's SDPA, side by side in one run (causal, Qwen3-30B-A3B's heads:
32 query heads, 4 KV heads, head dim 128, bf16).

    python bench/prefill_attention.py                     # 1x8192, 8x1024, 64x128
    python bench/prefill_attention.py --shapes 2x4096

A shape ``BxN`` is B sequences of N new tokens with no cached prefix. TFLOP/s counts the causal
work once per (query, key) pair at or before it: 4 * H * D * sum(N*(N+1)/2). A backend that
cannot run here (FA3 needs sm90) prints its reason instead of a column.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F


def _time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1x8192,8x1024,64x128")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("prefill_attention: needs a CUDA GPU", file=sys.stderr)
        sys.exit(2)
    import flashinfer

    h, kv, d = args.heads, args.kv_heads, args.head_dim
    print(f"# prefill_attention  GPU {torch.cuda.get_device_name()}  flashinfer {flashinfer.__version__}  "
          f"torch {torch.__version__}; heads {h}/{kv} dim {d} bf16 causal")
    print(f"{'shape':>8} {'backend':>8} {'ms':>8} {'TFLOP/s':>8} {'vs fa2':>7}")
    for part in args.shapes.split(","):
        b, n = (int(x) for x in part.split("x"))
        q = torch.randn(b * n, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b * n, kv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        flops = 4 * h * d * b * n * (n + 1) / 2
        indptr = torch.arange(b + 1, dtype=torch.int32, device="cuda") * n
        times = {}
        for backend in ("fa2", "fa3"):
            try:
                ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
                w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend=backend)
                w.plan(indptr, indptr, h, kv, d, causal=True, q_data_type=torch.bfloat16)
                times[backend] = _time_ms(lambda w=w, q=q, k=k, v=v: w.run(q, k, v), args.iters)
            except Exception as exc:  # a backend that cannot run here is reported, not fatal
                print(f"# {part} {backend}: {type(exc).__name__}: {str(exc)[:200]}")
        qs = q.view(b, n, h, d).transpose(1, 2)
        ks = k.view(b, n, kv, d).transpose(1, 2).repeat_interleave(h // kv, dim=1)
        vs = v.view(b, n, kv, d).transpose(1, 2).repeat_interleave(h // kv, dim=1)
        times["sdpa"] = _time_ms(lambda qs=qs, ks=ks, vs=vs: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True),
                                 args.iters)
        for name, ms in times.items():
            ratio = f"{times['fa2'] / ms:.2f}x" if "fa2" in times else "-"
            print(f"{part:>8} {name:>8} {ms:>8.3f} {flops / ms / 1e9:>8.0f} {ratio:>7}")


if __name__ == "__main__":
    main()
