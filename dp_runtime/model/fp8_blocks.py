"""FP8 block-quantized weights as data: values, scales and block shape in one small type that the
loader, the sizing functions and the kernels share.

The format is the one of DeepSeek's and Qwen's FP8 releases (``weight_block_size: [128, 128]``):
a quantized linear ``W`` of shape (N, K) is stored as ``float8_e4m3fn`` values ``Q`` (N, K) and a
float32 ``weight_scale_inv`` ``S`` of shape (ceil(N / 128), ceil(K / 128)), one scale per
128 x 128 block (the last row and column of blocks cover what is left), so that

    W[n, k] ~= Q[n, k] * S[n // 128, k // 128]

A stack of experts adds a leading axis to both (L, N, K) and (L, ceil(N/128), ceil(K/128)).
Quantization takes each block's absolute maximum to e4m3's largest value, 448 (a block of zeros
gets scale 1). ``dequantize`` is the float reference every FP8 kernel is tested against, and the
path the CPU runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "FP8_DTYPE", "FP8_MAX", "Fp8BlockWeight", "dequantize_blocks",
           "fake_quant_activations", "quantize_blocks", "scale_shape"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)  # the one block shape served: (rows of N, columns of K)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The scale tensor's shape for values of ``shape`` (…, N, K): (…, ceil(N/bn),
    ceil(K/bk))."""
    *lead, n, k = shape
    return (*lead, -(-n // block[0]), -(-k // block[1]))


def _blocked(t: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """``t`` (…, N, K) zero-padded to whole blocks and viewed as (…, nb, bn, kb, bk)."""
    *lead, n, k = t.shape
    bn, bk = block
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    if (pn, pk) != (n, k):
        t = torch.nn.functional.pad(t, (0, pk - k, 0, pn - n))
    return t.reshape(*lead, pn // bn, bn, pk // bk, bk), (n, k)


def quantize_blocks(w: torch.Tensor,
                    block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values fp8 (…, N, K), scales fp32 (…, ceil(N/bn), ceil(K/bk)))`` of ``w`` (…, N, K):
    each block scaled so its absolute maximum maps to ``FP8_MAX``; computed in float32."""
    blocks, (n, k) = _blocked(w.float(), block)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    *lead, nb, bn, kb, bk = q.shape
    values = q.reshape(*lead, nb * bn, kb * bk)[..., :n, :k].contiguous()
    return values, scale.reshape(*lead, nb, kb).contiguous()


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, block: tuple[int, int] = BLOCK,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values * scales`` broadcast over each block, in ``dtype`` (multiplied in float32)."""
    n, k = values.shape[-2:]
    if tuple(scales.shape) != scale_shape(tuple(values.shape), block):
        raise ValueError(f"dequantize_blocks: scales of shape {tuple(scales.shape)} do not fit "
                         f"values {tuple(values.shape)} in {block[0]}x{block[1]} blocks "
                         f"(need {scale_shape(tuple(values.shape), block)})")
    s = scales.float().repeat_interleave(block[0], dim=-2)[..., :n, :]
    s = s.repeat_interleave(block[1], dim=-1)[..., :k]
    return (values.float() * s).to(dtype)


def fake_quant_activations(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """``x`` (M, K) rounded as the W8A8 kernels round it, in float32: per row and group of
    ``group`` columns, scaled by ``max|x| / 448``, cast to e4m3 and scaled back (the reference
    that the kernels' in-register quantization is tested against)."""
    xf = x.float()
    m, k = xf.shape
    pad = -k % group
    blocks = torch.nn.functional.pad(xf, (0, pad)).view(m, -1, group)
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    q = (blocks / scale).to(FP8_DTYPE).float() * scale
    return q.view(m, -1)[:, :k]


@dataclass(frozen=True)
class Fp8BlockWeight:
    """A block-quantized weight (or a stack of them): ``values`` fp8 (…, N, K), ``scales`` fp32
    (…, ceil(N/bn), ceil(K/bk)), ``block`` (bn, bk). Views of model storage: ``select`` and
    ``rows`` give the weight of one expert or a block-aligned run of rows without a copy."""

    values: torch.Tensor
    scales: torch.Tensor
    block: tuple[int, int] = BLOCK

    def __post_init__(self) -> None:
        if self.values.dtype != FP8_DTYPE:
            raise ValueError(f"Fp8BlockWeight.values must be {FP8_DTYPE}, got {self.values.dtype}")
        if self.scales.dtype != torch.float32:
            raise ValueError(
                f"Fp8BlockWeight.scales must be torch.float32, got {self.scales.dtype}")
        want = scale_shape(tuple(self.values.shape), self.block)
        if tuple(self.scales.shape) != want:
            raise ValueError(f"Fp8BlockWeight: scales {tuple(self.scales.shape)} do not fit values "
                             f"{tuple(self.values.shape)} ({want} needed)")

    @classmethod
    def empty(cls, *shape: int, device: torch.device | str,
              block: tuple[int, int] = BLOCK) -> Fp8BlockWeight:
        """Uninitialised storage for values of ``shape``."""
        values = torch.empty(shape, dtype=FP8_DTYPE, device=device)
        return cls(values, torch.empty(scale_shape(shape, block), dtype=torch.float32,
                                       device=device), block)

    @classmethod
    def quantize(cls, w: torch.Tensor, block: tuple[int, int] = BLOCK) -> Fp8BlockWeight:
        return cls(*quantize_blocks(w, block), block)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + self.scales.numel() * 4

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_blocks(self.values, self.scales, self.block, dtype)

    def select(self, index: int) -> Fp8BlockWeight:
        """The weight at ``index`` of the leading (expert) axis."""
        return Fp8BlockWeight(self.values[index], self.scales[index], self.block)

    def rows(self, start: int, stop: int) -> Fp8BlockWeight:
        """Rows [start, stop) of the last-but-one axis; ``start`` must begin a block and ``stop``
        end one (or the weight), so the run owns whole scale rows."""
        bn, n = self.block[0], self.values.shape[-2]
        if start % bn or (stop % bn and stop != n):
            raise ValueError(
                f"Fp8BlockWeight.rows({start}, {stop}): not aligned to {bn}-row blocks")
        return Fp8BlockWeight(self.values[..., start:stop, :],
                              self.scales[..., start // bn: -(-stop // bn), :], self.block)

    def copy_(self, src: torch.Tensor | Fp8BlockWeight) -> None:
        """Fill from a checkpoint's quantized weight, or quantize a float one into place."""
        if not isinstance(src, Fp8BlockWeight):
            src = Fp8BlockWeight.quantize(src.to(self.device), self.block)
        self.values.copy_(src.values)
        self.scales.copy_(src.scales)
