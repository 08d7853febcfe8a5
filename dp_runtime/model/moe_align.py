"""Expert-aligned blocks of a MoE layer's picks, for the fused expert GEMMs
(``fused_moe_triton``): each local expert's picks gathered into blocks of ``block_m`` row slots,
in one Triton launch; or, for a handful of picks (decode), one block per pick with no launch.

Shapes: P picks (tokens x top-k), L local experts, R row slots.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["UNALIGNED_PICKS", "align_picks", "max_blocks", "unaligned_blocks"]


def max_blocks(num_picks: int, num_local: int, block_m: int) -> int:
    """Blocks the aligned layout may need: each non-empty expert pads its picks up to a multiple
    of ``block_m``, and at most min(L, P) experts are non-empty, so
    sum_e ceil(c_e / BM) <= (P + min(L, P) * (BM - 1)) // BM."""
    return (num_picks + min(num_local, num_picks) * (block_m - 1)) // block_m


@triton.jit(do_not_specialize=["num_picks", "num_blocks"])
def _align_kernel(
    ids_ptr,  # (P,) local expert id of each pick; outside [0, num_local) = not computed here
    sorted_ptr,  # (num_blocks * BLOCK_M,) int32 out: pick of each row slot, num_picks = padding
    block_expert_ptr,  # (num_blocks,) int32 out: expert of each block, -1 = unused
    num_rows_ptr,  # (1,) int32 out: row slots in use
    num_picks,
    num_local,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next power of two >= num_local
    CHUNK: tl.constexpr,  # picks per step: a (CHUNK, BLOCK_E) one-hot stays in registers
    CHUNK_B: tl.constexpr,  # blocks per step of the block pass
):
    experts = tl.arange(0, BLOCK_E)

    # Pass 1: picks per expert. A one-hot compare instead of a histogram lets invalid ids
    # (another rank's pick, a padding row) simply match no column.
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_picks, CHUNK):
        picks = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + picks, mask=picks < num_picks, other=-1)
        hit = (ids[:, None] == experts[None, :]) & (experts[None, :] < num_local)
        counts += tl.sum(hit.to(tl.int32), axis=0)

    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)  # inclusive: expert e owns [block_end - blocks, block_end)
    block_start = block_end - blocks
    used_blocks = tl.sum(blocks, axis=0)
    tl.store(num_rows_ptr, used_blocks * BLOCK_M)

    # Pass 2: per block, its expert (the number of experts that end at or before it; empty
    # experts own no block and padded lanes end at used_blocks), and the sentinel in every slot
    # past that expert's last pick. Slots written here and in pass 3 are disjoint, so the
    # passes need no barrier between them.
    rows = tl.arange(0, BLOCK_M)
    for b0 in range(0, num_blocks, CHUNK_B):
        b = b0 + tl.arange(0, CHUNK_B)
        in_range = b < num_blocks
        expert_b = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        used = b < used_blocks
        tl.store(block_expert_ptr + b, tl.where(used, expert_b, -1), mask=in_range)
        own = (expert_b[:, None] == experts[None, :]) & used[:, None]
        count_b = tl.sum(tl.where(own, counts[None, :], 0), axis=1)
        start_b = tl.sum(tl.where(own, block_start[None, :], 0), axis=1)
        filled_b = count_b - (b - start_b) * BLOCK_M  # picks in this block; <= 0 past the used
        slots = b[:, None] * BLOCK_M + rows[None, :]
        pad = (rows[None, :] >= filled_b[:, None]) & in_range[:, None]
        tl.store(sorted_ptr + slots, tl.full([CHUNK_B, BLOCK_M], 0, tl.int32) + num_picks, mask=pad)

    # Pass 3: each valid pick to its expert's next slot, in pick order (a stable sort by expert).
    next_slot = block_start * BLOCK_M
    for start in range(0, num_picks, CHUNK):
        picks = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + picks, mask=picks < num_picks, other=-1)
        hit = ((ids[:, None] == experts[None, :]) & (experts[None, :] < num_local)).to(tl.int32)
        rank = tl.cumsum(hit, axis=0)  # 1-based rank of the pick among this chunk's picks of e
        slot = tl.sum(hit * (next_slot[None, :] + rank - 1), axis=1)
        tl.store(sorted_ptr + slot, picks, mask=tl.sum(hit, axis=1) > 0)
        next_slot += tl.sum(hit, axis=0)


# Up to this many picks (two tokens at top-8) each pick is a block of its own and the alignment
# kernel is skipped: decode picks are mostly distinct experts, so one-row blocks read the same
# weights aligned blocks would, and the one-program alignment launch (about 8 us of a ~90 us
# layer at bs 1 on an H200) leaves the critical path.
UNALIGNED_PICKS = 16


@functools.lru_cache(maxsize=64)
def _slot_table(num_picks: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    sorted_R = torch.full((num_picks, block_m), num_picks, dtype=torch.int32)
    sorted_R[:, 0] = torch.arange(num_picks, dtype=torch.int32)
    return sorted_R.view(-1).to(device), torch.tensor([num_picks * block_m], dtype=torch.int32, device=device)


def unaligned_blocks(ids_P: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align_picks``'s layout with one block per pick: block b's first slot is pick b, the rest
    the sentinel P, its expert the pick's own id (the GEMMs skip ids outside [0, L)). No launch:
    the slot table and row count depend only on (P, block_m); made once, before any capture
    (a graph's warm-up runs first)."""
    sorted_R, num_rows = _slot_table(ids_P.shape[0], block_m, ids_P.device)
    return sorted_R, ids_P, num_rows


def align_picks(ids_P: torch.Tensor, num_local: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-aligned blocks of the picks ``ids_P`` (P,) (local expert ids; outside
    [0, ``num_local``) = not computed here), in one launch. Returns int32 device tensors
    ``(sorted_R, block_expert, num_rows)``: R = ``max_blocks(P, num_local, block_m) * block_m``
    row slots, expert by expert and in pick order within an expert, each expert's share padded
    to a multiple of ``block_m`` with the sentinel P; the expert of each block (-1 past the used
    ones); the number of slots in use, shape (1,). P must be > 0."""
    num_picks = ids_P.shape[0]
    blocks = max_blocks(num_picks, num_local, block_m)
    slots = blocks * block_m
    # One int32 workspace for the three outputs: one allocation instead of three.
    align_ws = torch.empty(slots + blocks + 1, dtype=torch.int32, device=ids_P.device)
    sorted_R, block_expert, num_rows = align_ws[:slots], align_ws[slots : slots + blocks], align_ws[-1:]
    block_e = triton.next_power_of_2(num_local)
    _align_kernel[(1,)](
        ids_P, sorted_R, block_expert, num_rows, num_picks, num_local, blocks,
        BLOCK_M=block_m, BLOCK_E=block_e,
        # Chunks sized so a one-hot tile is 8K int32 (64 per thread over 4 warps): no spills.
        CHUNK=max(16, 8192 // block_e), CHUNK_B=max(16, 8192 // max(block_e, block_m)),
        num_warps=4,
    )
    return sorted_R, block_expert, num_rows


