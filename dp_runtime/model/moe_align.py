"""Expert-aligned blocks of a MoE layer's picks, for the fused expert GEMMs (``fused_moe_triton``):
each local expert's picks gathered into blocks of ``block_m`` row slots, in one Triton launch (two
for many picks); or, for a handful of picks (decode), one block per pick with no launch.

Shapes: P picks (tokens x top-k), L local experts, R row slots.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dp_runtime.model.pdl import pdl_entry, pdl_meta

__all__ = ["PARALLEL_PICKS", "UNALIGNED_PICKS", "align_picks", "max_blocks", "unaligned_blocks"]


def max_blocks(num_picks: int, num_local: int, block_m: int) -> int:
    """Blocks the aligned layout may need: each non-empty expert pads its picks up to a multiple
    of ``block_m``, and at most min(L, P) experts are non-empty, so
    sum_e ceil(c_e / BM) <= (P + min(L, P) * (BM - 1)) // BM."""
    return (num_picks + min(num_local, num_picks) * (block_m - 1)) // block_m


@triton.jit
def _write_blocks(block_expert_ptr, sorted_ptr, counts, block_start, block_end, used_blocks,
                  num_blocks, num_picks, experts, first, stride, BLOCK_M: tl.constexpr,
                  CHUNK_B: tl.constexpr):
    """Per block, its expert (the number of experts that end at or before it; empty experts own
    no block and padded lanes end at used_blocks), and the sentinel in every slot past that
    expert's last pick, for the CHUNK_B-block tiles from ``first`` on, ``stride`` blocks apart.
    The pick scatter writes the other slots: the two need no barrier."""
    rows = tl.arange(0, BLOCK_M)
    for b0 in range(first, num_blocks, stride):
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


@triton.jit
def _one_hot(ids_ptr, start, num_picks, num_local, experts, CHUNK: tl.constexpr):
    """Picks [start, start + CHUNK) against the experts: a (CHUNK, BLOCK_E) int32 one-hot in
    which invalid ids (another rank's pick, a padding row) match no column."""
    picks = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + picks, mask=picks < num_picks, other=-1)
    return ((ids[:, None] == experts[None, :]) & (experts[None, :] < num_local)).to(tl.int32), picks


@triton.jit
def _scatter_chunk(ids_ptr, sorted_ptr, start, next_slot, num_picks, num_local, experts,
                   CHUNK: tl.constexpr):
    """Each valid pick of one chunk to its expert's next slot, in pick order (a stable sort)."""
    hit, picks = _one_hot(ids_ptr, start, num_picks, num_local, experts, CHUNK)
    rank = tl.cumsum(hit, axis=0)  # 1-based rank of the pick among this chunk's picks of e
    slot = tl.sum(hit * (next_slot[None, :] + rank - 1), axis=1)
    tl.store(sorted_ptr + slot, picks, mask=tl.sum(hit, axis=1) > 0)
    return tl.sum(hit, axis=0)


@triton.jit
def _expert_counts(ids_ptr, num_picks, num_local, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Valid picks per local expert, (BLOCK_E,) int32: a histogram of each chunk over 2 *
    BLOCK_E bins, invalid ids (another rank's pick, a padding row, a lane past the picks) in
    bin BLOCK_E, of which the first half is kept. ``tl.histogram`` costs a few warp ballots per
    pick where a one-hot costs BLOCK_E compares."""
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    half = tl.arange(0, 2)[:, None]
    for start in range(0, num_picks, CHUNK):
        picks = start + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + picks, mask=picks < num_picks, other=-1)
        bins = tl.where((ids >= 0) & (ids < num_local), ids, BLOCK_E)
        hist = tl.reshape(tl.histogram(bins, 2 * BLOCK_E), (2, BLOCK_E))
        counts += tl.sum(tl.where(half == 0, hist, 0), axis=0)
    return counts


@triton.jit(do_not_specialize=["num_picks", "num_blocks"])
def _align_by_expert_kernel(
    ids_ptr,  # (P,) local expert id of each pick; outside [0, num_local) = not computed here
    sorted_ptr,  # (num_blocks * BLOCK_M,) int32 out: pick of each row slot, num_picks = padding
    block_expert_ptr,  # (num_blocks,) int32 out: expert of each block, -1 = unused
    num_rows_ptr,  # (1,) int32 out: row slots in use
    num_picks,
    num_local,
    num_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next power of two >= num_local
    CHUNK: tl.constexpr,  # picks per step
    CHUNK_B: tl.constexpr,  # blocks per step
    PDL: tl.constexpr,  # launched with programmatic dependent launch
):
    """The whole layout in one launch, one program per local expert: every program counts all
    picks (cheap for a few thousand, read from L2), so each knows where its expert's blocks
    start without waiting for another program; it then places its own picks in pick order,
    pads its last block with the sentinel, and writes its share of the unused blocks."""
    pdl_entry(PDL)
    e = tl.program_id(0)
    counts = _expert_counts(ids_ptr, num_picks, num_local, BLOCK_E, CHUNK)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    # inclusive: expert e owns [block_end - blocks, block_end)
    block_end = tl.cumsum(blocks, axis=0)
    used_blocks = tl.sum(blocks, axis=0)
    mine = tl.arange(0, BLOCK_E) == e
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    end = tl.sum(tl.where(mine, block_end, 0), axis=0)
    start = end - (count + BLOCK_M - 1) // BLOCK_M
    next_slot = start * BLOCK_M
    for s in range(0, num_picks, CHUNK):
        picks = s + tl.arange(0, CHUNK)
        hit = (tl.load(ids_ptr + picks, mask=picks < num_picks, other=-1) == e).to(tl.int32)
        tl.store(sorted_ptr + next_slot + tl.cumsum(hit, axis=0) - 1, picks, mask=hit > 0)
        next_slot += tl.sum(hit, axis=0)
    rows = tl.arange(0, BLOCK_M)
    sentinel = tl.full([BLOCK_M], 0, tl.int32) + num_picks
    tl.store(sorted_ptr + next_slot + rows, sentinel, mask=next_slot + rows < end * BLOCK_M)
    for b0 in range(start, end, CHUNK_B):
        b = b0 + tl.arange(0, CHUNK_B)
        tl.store(block_expert_ptr + b, tl.full([CHUNK_B], 0, tl.int32) + e, mask=b < end)
    for b0 in range(used_blocks + e * CHUNK_B, num_blocks, tl.num_programs(0) * CHUNK_B):
        b = b0 + tl.arange(0, CHUNK_B)
        in_range = b < num_blocks
        tl.store(block_expert_ptr + b, tl.full([CHUNK_B], -1, tl.int32), mask=in_range)
        tl.store(sorted_ptr + b[:, None] * BLOCK_M + rows[None, :],
                 tl.full([CHUNK_B, BLOCK_M], 0, tl.int32) + num_picks, mask=in_range[:, None])
    if e == 0:
        tl.store(num_rows_ptr, used_blocks * BLOCK_M)


@triton.jit(do_not_specialize=["num_picks", "per_prog"])
def _chunk_counts_kernel(ids_ptr, table_ptr, num_picks, num_local, per_prog, BLOCK_E: tl.constexpr,
                         CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Parallel layout, launch 1 of 2: program c counts its picks [c * per_prog, (c + 1) *
    per_prog) per expert into row c of the table."""
    pdl_entry(PDL)
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(c * per_prog, tl.minimum((c + 1) * per_prog, num_picks), CHUNK):
        hit, _ = _one_hot(ids_ptr, start, num_picks, num_local, experts, CHUNK)
        counts += tl.sum(hit, axis=0)
    tl.store(table_ptr + c * BLOCK_E + experts, counts)


@triton.jit(do_not_specialize=["num_picks", "num_blocks", "per_prog", "num_progs"])
def _chunk_scatter_kernel(ids_ptr, table_ptr, sorted_ptr, block_expert_ptr, num_rows_ptr, num_picks,
                          num_local, num_blocks, per_prog, num_progs, BLOCK_M: tl.constexpr,
                          BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, CHUNK_B: tl.constexpr,
                          ROWS: tl.constexpr, PDL: tl.constexpr):
    """Parallel layout, launch 2 of 2: program c reads the whole count table (at most
    MAX_PROGRAMS rows, from L2) for each expert's picks and blocks and, from the rows before its
    own, its first slot per expert; it places its picks in their slots, in pick order, and
    writes its share of the blocks (every num_programs-th tile of CHUNK_B blocks). Every program
    derives the same layout, so no launch in between has to publish it."""
    pdl_entry(PDL)
    c = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)  # picks of programs < c, per expert
    for r0 in range(0, num_progs, ROWS):
        rs = r0 + tl.arange(0, ROWS)
        tile = tl.load(table_ptr + rs[:, None] * BLOCK_E + experts[None, :],
                       mask=rs[:, None] < num_progs, other=0)
        counts += tl.sum(tile, axis=0)
        before += tl.sum(tl.where(rs[:, None] < c, tile, 0), axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    block_start = block_end - blocks
    used_blocks = tl.sum(blocks, axis=0)
    if c == 0:
        tl.store(num_rows_ptr, used_blocks * BLOCK_M)
    _write_blocks(block_expert_ptr, sorted_ptr, counts, block_start, block_end, used_blocks,
                  num_blocks, num_picks, experts, c * CHUNK_B, tl.num_programs(0) * CHUNK_B,
                  BLOCK_M, CHUNK_B)
    next_slot = block_start * BLOCK_M + before
    for start in range(c * per_prog, tl.minimum((c + 1) * per_prog, num_picks), CHUNK):
        next_slot += _scatter_chunk(ids_ptr, sorted_ptr, start, next_slot, num_picks, num_local,
                                    experts, CHUNK)


# Up to this many picks (two tokens at top-8) each pick is a block of its own and the alignment
# kernel is skipped: decode picks are mostly distinct experts, so one-row blocks read the same
# weights aligned blocks would, and the alignment launch (about 8 us of a ~90 us layer at bs 1
# on an H200) leaves the critical path.
UNALIGNED_PICKS = 16

# Up to this many picks (bs 512 at top-8) the layout is one launch of one program per expert,
# each counting every pick; beyond, counting all picks in every program costs more than the
# two launches of the parallel form, whose programs each count a share (see ``align_picks``).
PARALLEL_PICKS = 4096
MAX_PROGRAMS = 128  # programs of the parallel form's counting and scatter launches


@functools.lru_cache(maxsize=64)
def _slot_table(num_picks: int, block_m: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    sorted_R = torch.full((num_picks, block_m), num_picks, dtype=torch.int32)
    sorted_R[:, 0] = torch.arange(num_picks, dtype=torch.int32)
    return sorted_R.view(-1).to(device), torch.tensor([num_picks * block_m], dtype=torch.int32,
                                                      device=device)


def unaligned_blocks(ids_P: torch.Tensor,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align_picks``'s layout with one block per pick: block b's first slot is pick b, the rest
    the sentinel P, its expert the pick's own id (the GEMMs skip ids outside [0, L)). No launch:
    the slot table and row count depend only on (P, block_m); made once, before any capture
    (a graph's warm-up runs first)."""
    sorted_R, num_rows = _slot_table(ids_P.shape[0], block_m, ids_P.device)
    return sorted_R, ids_P, num_rows


def align_picks(ids_P: torch.Tensor, num_local: int, block_m: int,
                pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert-aligned blocks of the picks ``ids_P`` (P,) (local expert ids; outside
    [0, ``num_local``) = not computed here). Returns int32 device tensors
    ``(sorted_R, block_expert, num_rows)``: R = ``max_blocks(P, num_local, block_m) * block_m``
    row slots, expert by expert and in pick order within an expert, each expert's share padded
    to a multiple of ``block_m`` with the sentinel P; the expert of each block (-1 past the used
    ones); the number of slots in use, shape (1,). P must be > 0.

    Up to ``PARALLEL_PICKS`` picks one launch does it all, one program per local expert;
    beyond, up to ``MAX_PROGRAMS`` programs each count a share of the picks, and the programs
    again each read every program's counts (at most MAX_PROGRAMS rows, whatever P), turn them
    into blocks and their own first slots, place their picks and write a share of the blocks
    (two launches)."""
    num_picks = ids_P.shape[0]
    blocks = max_blocks(num_picks, num_local, block_m)
    slots = blocks * block_m
    block_e = triton.next_power_of_2(num_local)
    # Tiles of 8K int32 (64 per thread over 4 warps): no spills.
    chunk, chunk_b = max(16, 8192 // block_e), max(16, 8192 // max(block_e, block_m))
    parallel = num_picks > PARALLEL_PICKS
    # Parallel form: at most MAX_PROGRAMS programs, each a whole number of chunks.
    chunks = triton.cdiv(num_picks, chunk)
    per_prog = triton.cdiv(chunks, MAX_PROGRAMS) * chunk
    progs = triton.cdiv(num_picks, per_prog)
    # One int32 workspace for the outputs (and the parallel form's count table): one allocation.
    # Every part starts 16 bytes in (4 int32): Triton specializes pointers on 16-byte
    # alignment, and a part whose alignment moved with P would build the kernels again.
    extra = progs * block_e if parallel else 0
    rows_at = slots + triton.cdiv(blocks, 4) * 4
    align_ws = torch.empty(rows_at + 4 + extra, dtype=torch.int32, device=ids_P.device)
    sorted_R, block_expert = align_ws[:slots], align_ws[slots : slots + blocks]
    num_rows, tables = align_ws[rows_at : rows_at + 1], align_ws[rows_at + 4 :]
    if not parallel:
        # One chunk size for every P: no recompile per step size (masked lanes cost little).
        _align_by_expert_kernel[(num_local,)](
            ids_P, sorted_R, block_expert, num_rows, num_picks, num_local, blocks,
            BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=1024, CHUNK_B=chunk_b, num_warps=4,
            **pdl_meta(pdl),
        )
        return sorted_R, block_expert, num_rows
    _chunk_counts_kernel[(progs,)](ids_P, tables, num_picks, num_local, per_prog, BLOCK_E=block_e,
                                   CHUNK=chunk, num_warps=4, **pdl_meta(pdl))
    _chunk_scatter_kernel[(progs,)](ids_P, tables, sorted_R, block_expert, num_rows, num_picks,
                                    num_local, blocks, per_prog, progs, BLOCK_M=block_m,
                                    BLOCK_E=block_e, CHUNK=chunk, CHUNK_B=chunk_b,
                                    ROWS=max(1, 8192 // block_e), num_warps=4, **pdl_meta(pdl))
    return sorted_R, block_expert, num_rows
