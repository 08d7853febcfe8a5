"""BufferRegistry: slots, fill, view, bind, capacity (issue: buffers/, registry behaviours 7-15)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from buffers import KEEP, ZERO, Axis, BufferPool, BufferRegistry, Slot, fill, fill_once

POISON = -77


@dataclasses.dataclass
class Batch:
    batch_size: int
    input_ids: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    total: torch.Tensor | None = None
    spec: dict | None = None


def _sum_hook(buf, batch, sizes):
    # computed slot: the sum of the live seq_lens, which fill copied just before
    buf.fill_(int(batch.seq_lens[: sizes.raw_bs].sum()))


def make_registry(max_bs=8, max_tokens=16, pool=None, extra=()):
    slots = [
        Slot("input_ids", lambda b, t: (t,), torch.int64, "tokens", KEEP),
        Slot("seq_lens", lambda b, t: (b,), torch.int64, Axis.BS, fill(1)),
        Slot("seq_lens_cpu", lambda b, t: (b,), torch.int32, Axis.BS, fill(1), device="cpu"),
        Slot("positions", lambda b, t: (t,), torch.int64, Axis.TOKENS, ZERO),
        Slot("mrope_positions", lambda b, t: (3, t), torch.int64, Axis.TOKENS, ZERO, dim=1),
        Slot("scale", lambda b, t: (b, 2), torch.float32, Axis.BS, fill(0.5)),
        Slot("total", lambda b, t: (1,), torch.int64, Axis.NONE, compute=_sum_hook),
        *extra,
    ]
    return BufferRegistry(slots, max_bs, max_tokens, "cpu", pool or BufferPool(), user="test")


def make_batch(bs, ntok, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Batch(
        batch_size=bs,
        input_ids=torch.randint(0, 1000, (ntok,), generator=g),
        seq_lens=torch.randint(1, 100, (bs,), generator=g),
        seq_lens_cpu=torch.randint(1, 100, (bs,), generator=g, dtype=torch.int32),
        positions=torch.randint(0, 100, (ntok,), generator=g),
        mrope_positions=torch.randint(0, 100, (3, ntok), generator=g),
        scale=torch.rand(bs, 2, generator=g),
    )


def poison(reg):
    for name in reg.names():
        reg.buffer(name).fill_(POISON)


# -- 7: slots are data ---------------------------------------------------------------------------
def test_slot_axis_must_be_known():
    with pytest.raises(ValueError, match="axis 'batch' is not one of"):
        Slot("x", lambda b, t: (b,), torch.int64, "batch")


def test_duplicate_slot_names_raise():
    s = Slot("x", lambda b, t: (b,), torch.int64)
    with pytest.raises(ValueError, match="duplicate slot name 'x'"):
        BufferRegistry([s, s], 4, 4, "cpu", BufferPool())


def test_slot_with_source_and_compute_raises():
    with pytest.raises(ValueError, match="not both"):
        Slot("x", lambda b, t: (b,), torch.int64, source="y", compute=lambda *a: None)


# -- 8, 11, 12: fill ------------------------------------------------------------------------------
def test_fill_pads_tail_copies_live_runs_hooks_and_leaves_beyond_padded():
    reg = make_registry()
    poison(reg)
    b = make_batch(3, 5)
    reg.fill(b, raw_bs=3, padded_bs=4, raw_num_tokens=5, padded_num_tokens=8)
    ids, sl, slc = reg.buffer("input_ids"), reg.buffer("seq_lens"), reg.buffer("seq_lens_cpu")
    assert torch.equal(ids[:5], b.input_ids) and (ids[5:] == POISON).all()  # keep: tail untouched
    assert torch.equal(sl[:3], b.seq_lens) and sl[3] == 1 and (sl[4:] == POISON).all()
    assert slc.dtype == torch.int32 and torch.equal(slc[:3], b.seq_lens_cpu) and slc[3] == 1
    pos = reg.buffer("positions")
    assert torch.equal(pos[:5], b.positions) and (pos[5:8] == 0).all() and (pos[8:] == POISON).all()
    mr = reg.buffer("mrope_positions")
    assert torch.equal(mr[:, :5], b.mrope_positions) and (mr[:, 5:8] == 0).all() and (mr[:, 8:] == POISON).all()
    sc = reg.buffer("scale")
    assert torch.equal(sc[:3], b.scale) and (sc[3] == 0.5).all() and (sc[4:] == POISON).all()
    assert reg.buffer("total").item() == int(b.seq_lens.sum())  # the hook saw the copied rows


def test_fill_without_tail_touches_only_live_rows():
    reg = make_registry()
    poison(reg)
    b = make_batch(4, 4)
    reg.fill(b, 4, 4)
    assert torch.equal(reg.buffer("seq_lens")[:4], b.seq_lens) and (reg.buffer("seq_lens")[4:] == POISON).all()
    assert torch.equal(reg.buffer("positions")[:4], b.positions) and (reg.buffer("positions")[4:] == POISON).all()


def test_fill_once_writes_whole_buffer_once_then_keeps():
    extra = [Slot("req_pool_indices", lambda b, t: (b,), torch.int64, Axis.BS, fill_once(9))]
    reg = make_registry(extra=extra)
    poison(reg)
    b = make_batch(2, 2)
    b.req_pool_indices = torch.tensor([3, 4])
    reg.fill(b, 2, 2)  # no tail: nothing to pad yet
    assert (reg.buffer("req_pool_indices")[2:] == POISON).all()
    reg.fill(b, 2, 4)
    assert reg.buffer("req_pool_indices").tolist() == [3, 4, 9, 9, 9, 9, 9, 9]
    b6 = make_batch(6, 6)
    b6.req_pool_indices = torch.arange(10, 16)
    reg.fill(b6, 6, 6)
    reg.fill(b, 2, 8)  # tail now holds stale live values: fill_once keeps them
    assert reg.buffer("req_pool_indices").tolist() == [3, 4, 12, 13, 14, 15, 9, 9]


def test_fill_policy_without_value_raises_only_with_a_tail():
    reg = BufferRegistry([Slot("x", lambda b, t: (b,), torch.int64, Axis.BS, fill(None))], 4, 4, "cpu", BufferPool())
    b = dataclasses.make_dataclass("B", [("x", torch.Tensor)])(torch.arange(2))
    reg.fill(b, 2, 2)
    with pytest.raises(ValueError, match=r"'x' has padding fill without a value.*raw 2, padded 4"):
        reg.fill(b, 2, 4)


# -- 9, 10: None fields, computed slots, view ------------------------------------------------------
def test_none_field_is_skipped_and_stays_none_in_view():
    reg = make_registry()
    poison(reg)
    b = make_batch(2, 2)
    b.positions = None
    b.mrope_positions = None
    reg.fill(b, 2, 4)
    assert (reg.buffer("positions") == POISON).all()  # neither copied nor padded
    v = reg.view(b, 4)
    assert v.positions is None and v.mrope_positions is None and v.input_ids is not None


def test_computed_slot_always_exposed_and_ignores_stale_batch_value():
    reg = make_registry()
    b = make_batch(2, 2)
    stale = torch.tensor([12345])
    b.total = stale
    reg.fill(b, 2, 4)
    v = reg.view(b, 4)
    assert v.total is not stale and v.total.item() == int(b.seq_lens.sum())
    b.total = None
    reg.fill(b, 2, 4)
    assert reg.view(b, 4).total is not None


def test_view_replaces_on_a_copy_sharing_storage():
    reg = make_registry()
    b = make_batch(3, 3)
    before = dataclasses.replace(b)
    reg.fill(b, 3, 4)
    v = reg.view(b, 4)
    assert v is not b and v.batch_size == 4 and b.batch_size == 3
    assert all(getattr(b, f.name) is getattr(before, f.name) for f in dataclasses.fields(b))
    assert v.input_ids.shape == (4,) and v.input_ids.data_ptr() == reg.buffer("input_ids").data_ptr()
    assert v.mrope_positions.shape == (3, 4) and v.scale.shape == (4, 2)


def test_dotted_slots_are_filled_but_not_passed_to_replace():
    extra = [Slot("spec.mask", lambda b, t: (t,), torch.bool, Axis.TOKENS, ZERO)]
    reg = make_registry(extra=extra)
    b = make_batch(2, 2)
    b.spec = {"mask": torch.tensor([True, True])}
    reg.fill(b, 2, 4)
    v = reg.view(b, 4)  # would raise TypeError if 'spec.mask' reached dataclasses.replace
    assert v.spec is b.spec
    assert reg.views(4)["spec.mask"].tolist() == [True, True, False, False]


def test_source_function_reads_nested_values():
    extra = [Slot("lens2", lambda b, t: (b,), torch.int64, Axis.BS, ZERO, source=lambda batch: batch.seq_lens * 2)]
    reg = make_registry(extra=extra)
    b = make_batch(3, 3)
    reg.fill(b, 3, 4)
    assert reg.buffer("lens2")[:4].tolist() == [*(b.seq_lens * 2).tolist(), 0]


# -- 13: capacity and mismatches -------------------------------------------------------------------
@pytest.mark.parametrize(
    "sizes, match",
    [
        (dict(raw_bs=3, padded_bs=9), r"slot 'seq_lens' holds 8 rows on axis bs \(limit\); padded size 9"),
        (dict(raw_bs=9, padded_bs=9), r"holds 8 rows on axis bs"),
        (dict(raw_bs=3, padded_bs=4, raw_num_tokens=3, padded_num_tokens=17), r"slot 'input_ids' holds 16 rows on axis tokens .* padded size 17"),
        (dict(raw_bs=5, padded_bs=4), r"raw <= padded on axis bs, got raw=5, padded=4"),
    ],
)
def test_over_capacity_names_slot_limit_and_value(sizes, match):
    reg = make_registry()
    with pytest.raises(ValueError, match=match):
        reg.fill(make_batch(3, 3), **sizes)


def test_batch_tensor_of_wrong_dtype_or_length_is_refused():
    reg = make_registry()
    b = make_batch(3, 3)
    b.seq_lens = b.seq_lens.to(torch.int32)
    with pytest.raises(ValueError, match=r"slot 'seq_lens' expects \(3,\) torch.int64 .* gives \(3,\) torch.int32"):
        reg.fill(b, 3, 4)
    b = make_batch(3, 3)
    with pytest.raises(ValueError, match=r"slot 'input_ids' expects \(2,\)"):
        reg.fill(b, 2, 4)


# -- 14: bind -------------------------------------------------------------------------------------
def test_bind_keeps_the_tensor_and_checks_shape_and_dtype():
    reg = make_registry()
    mine = torch.zeros(8, dtype=torch.int64)
    reg.bind("seq_lens", mine)
    b = make_batch(3, 3)
    reg.fill(b, 3, 4)
    assert reg.buffer("seq_lens").data_ptr() == mine.data_ptr() and torch.equal(mine[:3], b.seq_lens)
    assert reg.view(b, 4).seq_lens.data_ptr() == mine.data_ptr()
    with pytest.raises(ValueError, match=r"needs \(8,\) torch.int64 on cpu, got \(7,\) torch.int64"):
        reg.bind("seq_lens", torch.zeros(7, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"got \(8,\) torch.float32"):
        reg.bind("seq_lens", torch.zeros(8))
    with pytest.raises(KeyError, match="no slot 'nope'"):
        reg.bind("nope", mine)


def test_registries_share_pool_storage():
    pool = BufferPool()
    small = make_registry(max_bs=4, max_tokens=4, pool=pool)
    # Declared after the small one materialized: larger storage cannot be granted.
    with pytest.raises(ValueError, match="never reallocated"):
        make_registry(max_bs=8, max_tokens=16, pool=pool)
    pool2 = BufferPool()
    big = make_registry(max_bs=8, max_tokens=16, pool=pool2)
    little = make_registry(max_bs=4, max_tokens=4, pool=pool2)
    assert big.buffer("input_ids").data_ptr() == little.buffer("input_ids").data_ptr()
    assert small.buffer("input_ids").shape == (4,)


# -- 15: grouped launches equal a slot-by-slot reference -------------------------------------------
class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def reference_fill(reg, batch, raw_bs, padded_bs, raw_t, padded_t):
    """Slot by slot: the plain-Python meaning of fill (copy live, pad tail by policy)."""
    for slot in reg.slots.values():
        buf = reg.buffer(slot.name)
        if slot.computed:
            continue
        src = slot.read(batch)
        if src is None:
            continue
        if slot.axis is Axis.NONE:
            buf.copy_(src)
            continue
        raw, padded = (raw_bs, padded_bs) if slot.axis is Axis.BS else (raw_t, padded_t)
        idx = lambda a, z, s=slot: (slice(None),) * s.dim + (slice(a, z),)  # noqa: E731
        buf[idx(0, raw)].copy_(src)
        if padded > raw and slot.padding.kind in ("zero", "fill"):
            buf[idx(raw, padded)].fill_(slot.padding.value or 0)
    for slot in reg.slots.values():
        if slot.computed:
            slot.compute(reg.buffer(slot.name), batch, reg._sizes(raw_bs, padded_bs, raw_t, padded_t))


def test_fill_is_grouped_and_equals_slot_by_slot_reference():
    ours, ref = make_registry(), make_registry()
    poison(ours)
    poison(ref)
    b = make_batch(5, 9, seed=3)
    with CountOps() as counter:
        ours.fill(b, 5, 8, 9, 12)
    reference_fill(ref, b, 5, 8, 9, 12)
    for name in ours.names():
        assert torch.equal(ours.buffer(name), ref.buffer(name)), name
    copies = [op for op in counter.ops if op.startswith("aten._foreach_copy")]
    # one grouped copy per (device, dtype): int64 (the (3, T) mrope slot joins it row by row,
    # its rows being dense), int32 (seq_lens_cpu), float32 (scale)
    assert len(copies) == 3
    assert "aten.copy_" not in counter.ops  # no per-slot copies


def test_per_size_caches_stay_bounded_over_every_prefill_size():
    """An eager prefill of every size from 1 to 1024 tokens keeps at most PER_SIZE_CACHE fill
    plans and padded views: memory does not grow with the number of distinct sizes."""
    from buffers import BufferPool, build_prefill_registry
    from buffers.fill_plan import PER_SIZE_CACHE

    reg = build_prefill_registry(4, 1024, "cpu", BufferPool(), register_input_embeds=False)
    for n in range(1, 1025):
        batch = _PrefillBatch(n)
        reg.fill(batch, 1, 1, n, n)
        view = reg.view(batch, 1, n)
        assert view.input_ids.shape[0] == n and int(view.input_ids[-1]) == n - 1
    assert len(reg._plans) == PER_SIZE_CACHE and len(reg._padded) <= PER_SIZE_CACHE
    # the most recent sizes are the ones kept
    assert (1, 1, 1024, 1024) in reg._plans and (1, 1, 1, 1) not in reg._plans


@dataclasses.dataclass
class _PrefillBatch:
    """An extend batch of one request with ``n`` tokens, fields named like the prefill slots."""

    n: int
    batch_size: int = 1

    def __post_init__(self) -> None:
        self.input_ids = torch.arange(self.n)
        self.positions = torch.arange(self.n)
        self.out_cache_loc = torch.arange(self.n) + 1
        self.req_pool_indices = torch.tensor([1])
        self.seq_lens = torch.tensor([self.n])
        self.seq_lens_cpu = torch.tensor([self.n])
        self.extend_seq_lens = torch.tensor([self.n])
        self.extend_prefix_lens = torch.tensor([0])


def _state(reg, pool):
    """Everything a fill or a declaration could change: every buffer's contents, the pool's
    declarations and storage names, the registry's one-time-fill bookkeeping."""
    return ({n: reg.buffer(n).clone() for n in reg.names()}, {n: list(v) for n, v in pool._needs.items()},
            set(pool._storage), set(reg._once_done))


def _same(a, b):
    return (a[0].keys() == b[0].keys() and all(torch.equal(a[0][n], b[0][n]) for n in a[0])
            and a[1:] == b[1:])


@pytest.mark.parametrize(("args", "message"), [
    ((2.7, 8), r"registry 'test': fill raw_bs must be an int >= 0, got 2.7"),
    ((2, 8.0), r"registry 'test': fill padded_bs must be an int >= 0, got 8.0"),
    ((2, 8, 3.5, 8), r"registry 'test': fill raw_num_tokens must be an int >= 0, got 3.5"),
    ((2, 8, 3, True), r"registry 'test': fill padded_num_tokens must be an int >= 0, got True"),
])
def test_non_integer_fill_sizes_are_refused(args, message):
    pool = BufferPool()
    reg = make_registry(pool=pool)
    before = _state(reg, pool)
    with pytest.raises(ValueError, match=message):
        reg.fill(make_batch(2, 3), *args)
    assert _same(before, _state(reg, pool))


def test_refused_fill_changes_nothing_not_even_a_pending_fill_once_slot():
    extra = [Slot("req_pool_indices", lambda b, t: (b,), torch.int64, Axis.BS, fill_once(9))]
    pool = BufferPool()
    reg = make_registry(pool=pool, extra=extra)
    for n in reg.names():
        reg.buffer(n).fill_(POISON if reg.buffer(n).dtype != torch.float32 else 0.25)
    batch = make_batch(2, 2)
    batch.req_pool_indices = torch.arange(2)
    batch.positions = torch.zeros(5, dtype=torch.int64)  # wrong length: the fill is refused
    before = _state(reg, pool)
    with pytest.raises(ValueError, match="slot 'positions' expects"):
        reg.fill(batch, 2, 8)
    # Before: req_pool_indices had already been filled with 9 and marked done.
    assert _same(before, _state(reg, pool))
    batch.positions = torch.zeros(2, dtype=torch.int64)
    reg.fill(batch, 2, 8)
    assert reg.buffer("req_pool_indices")[2:].eq(9).all()


def test_refused_registry_declares_nothing_in_the_pool():
    pool = BufferPool()
    pool.request("seq_lens", (4,), torch.int32, "cpu", user="other")  # a clash for the 2nd slot
    before = ({n: list(v) for n, v in pool._needs.items()}, set(pool._storage), pool.total_bytes())
    with pytest.raises(ValueError, match="'seq_lens' declared twice with different dtype"):
        make_registry(pool=pool)
    # Before: input_ids (the first slot) stayed declared and was later materialized.
    assert ({n: list(v) for n, v in pool._needs.items()}, set(pool._storage), pool.total_bytes()) == before
    for bad, message in [((2.5, 16), "max_bs must be an int >= 0, got 2.5"),
                         ((8, -1), "max_num_tokens must be an int >= 0, got -1")]:
        with pytest.raises(ValueError, match=message):
            make_registry(*bad, pool=BufferPool())
