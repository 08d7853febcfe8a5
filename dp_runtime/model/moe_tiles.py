"""Tiles of the fused MoE's two expert GEMMs (``fused_moe_triton``): ``MoeTileConfig``, and the
rule that picks one by the tokens on the rank and the kind of step (``tile_config``,
``gemm2_tile_config``). Plain Python: the kernels read these as launch constants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["MoeTileConfig", "gemm2_tile_config", "tile_config"]


@dataclass(frozen=True)
class MoeTileConfig:
    """Tiles of the two expert GEMMs. ``block_m``: rows (picks of one expert) per block, the
    multiple each expert is padded to; ``block_n``: output columns per program (in GEMM1 half
    are gate columns, half the matching up columns, so both GEMMs keep a BLOCK_M x block_n fp32
    accumulator); ``block_k``: contraction step; ``group_m``: blocks that walk the column tiles
    together (L2 reuse of weight tiles); ``num_warps`` / ``num_stages``: Triton launch options;
    ``programs_per_sm``: 0 launches a program per tile of the worst case, n > 0 a persistent grid
    of n programs per SM that walk the tiles in use (``_expert_gemm_persistent_kernel``; aligned
    layouts only, one program per tile otherwise)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 0

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            # tl.dot needs every tile dimension >= 16; GEMM1 splits block_n into two halves.
            low = 32 if name == "block_n" else 16
            if value < low or value & (value - 1):
                raise ValueError(f"MoeTileConfig.{name}={value}: must be a power of two >= {low}")
        if (self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1
                or self.programs_per_sm < 0):
            raise ValueError(f"MoeTileConfig: group_m, num_warps, num_stages must be >= 1 and "
                             f"programs_per_sm >= 0, got {self}")


# Tile configs by tokens on the rank (N), for Qwen3-30B-A3B-like layers (top-8 of 128 experts,
# H 2048, I 768) on H100/H200. A token's K picks spread over the E experts, so an expert block
# holds about N*K/E rows: up to ~2 for N <= 32, which the smallest tensor-core M (16) pads the
# least. There the GEMMs stream each touched expert's weights once and are bound by HBM, so the
# column tiles are narrow enough to give every SM work (GEMM1 at N = 1: 8 experts x 12 column
# tiles) and the K loop long and deeply pipelined (block_k 128, 4 stages) to keep loads in
# flight. Blocks of 32-64 rows start to reuse each weight tile across tokens; from ~2048 tokens
# (~128 rows per expert) the GEMMs are compute-bound and take large tiles with grouped ordering
# so that neighbouring blocks share weight tiles in L2. Sizes follow the shape of published
# fused-MoE tunings for this layer; `bench/moe_layer.py --tune` re-measured them on an H100
# (2026-11-23): within 2% of the best of its sweep except at 256 tokens (block_k 128: 5% faster)
# and 2048 (block_n 256: 1%).
_TO_512 = MoeTileConfig(32, 128, 128, 1, 4, 3)
_TILE_RULE: tuple[tuple[int, MoeTileConfig], ...] = (
    (32, MoeTileConfig(16, 64, 128, 1, 4, 4)),
    (128, MoeTileConfig(16, 128, 128, 1, 4, 3)),
    (512, _TO_512),
    (1024, MoeTileConfig(64, 128, 64, 8, 4, 3)),
)
_LARGE = MoeTileConfig(128, 256, 64, 8, 8, 4)

# Extend steps: a prompt's tokens route to far fewer experts than the rule above assumes. On
# the random-weight preset a 128-token prompt touches ~30 of 128 experts per layer, ~34 rows
# each (`bench/prefill.py --profile`); 16-row blocks then read each expert's weights three
# times. From 65 tokens extends take 64-row blocks, walked in groups for L2 reuse.
_EXTEND_FROM = 65
_EXTEND_MID = MoeTileConfig(64, 128, 64, 8, 4, 3)
# Its second GEMM (K = I = 768, a short contraction) on 64-column tiles: twice the programs, so
# the last wave is shorter. H200, `moe_layer.py --tokens 128 --touched 30 --extend --tune`:
# 93.6 -> 91.1 us per layer.
_EXTEND_MID_GEMM2 = MoeTileConfig(64, 64, 64, 8, 4, 3)
# From 129 tokens (more blocks: a program per tile makes ~3-8 waves of short programs) the
# second GEMM runs on a persistent grid of 4 programs per SM, whose flattened loop loads a
# program's next tile while it finishes the current one. H200, `moe_layer.py --touched 30
# --extend --persistent 0,4`, us per layer: 112.8 -> 110.0 at 256 tokens, 275.9 -> 267.1 at
# 1024; at 128 tokens 86.0 -> 86.9 (a prompt's routing: 93.3 both), so not below 129. GEMM1
# on a persistent grid lost at every size (93.3 -> 103.6-107.4 us at 128 tokens).
_EXTEND_PERSISTENT_FROM = 129
_EXTEND_LONG_GEMM2 = dataclasses.replace(_EXTEND_MID_GEMM2, programs_per_sm=4)

# FP8 experts (W8A8: a byte per value of both operands) take a 128-deep contraction step where
# bf16 takes 64 (a step then loads what bf16's does, and spans one 128 x 128 weight block), and
# 64 x 128 tiles at 4 warps where bf16 takes 128 x 256 at 8. H200, bench/fp8_tune.py (docs/
# BENCHMARKS.md session 25), us per layer: 405 -> 312 at 1,024 tokens, 3,337 -> 860 at 4,096.
_FP8_LARGE = MoeTileConfig(64, 128, 128, 8, 4, 3)
# And 16-row blocks up to 512 tokens (~32 rows an expert): 196 against 207 us at 256.
_FP8_MID = MoeTileConfig(16, 128, 128, 1, 4, 3)


def _fp8(cfg: MoeTileConfig) -> MoeTileConfig:
    if cfg is _LARGE:
        return _FP8_LARGE
    if cfg is _TO_512:
        return _FP8_MID
    return dataclasses.replace(cfg, block_k=128) if cfg.block_k < 128 else cfg


def gemm2_tile_config(num_tokens: int, extend: bool = False, fp8: bool = False) -> MoeTileConfig:
    """The second GEMM's tiles for a call of ``num_tokens`` rows: ``tile_config``'s, except for
    mid-size extends (``_EXTEND_MID_GEMM2``, ``_EXTEND_LONG_GEMM2``). Same ``block_m``: both
    GEMMs walk one layout. ``fp8``: FP8 expert weights (``_FP8_LARGE``)."""
    cfg = tile_config(num_tokens, extend)
    if cfg is _EXTEND_MID:
        cfg = _EXTEND_LONG_GEMM2 if num_tokens >= _EXTEND_PERSISTENT_FROM else _EXTEND_MID_GEMM2
    return _fp8(cfg) if fp8 else cfg


def tile_config(num_tokens: int, extend: bool = False, fp8: bool = False) -> MoeTileConfig:
    """The tile config used for a call with ``num_tokens`` rows (see ``_TILE_RULE``); ``extend``:
    the rows are prompt tokens (see ``_EXTEND_MID``); ``fp8``: FP8 expert weights
    (``_FP8_LARGE``)."""
    if extend and _EXTEND_FROM <= num_tokens <= _TILE_RULE[-1][0]:
        cfg = _EXTEND_MID
    else:
        cfg = next((c for limit, c in _TILE_RULE if num_tokens <= limit), _LARGE)
    return _fp8(cfg) if fp8 else cfg
