"""Property test (issue: buffers/, 17): random slot sets, sizes and None fields.

fill then view equals a plain-Python reference built from lists, and no element outside
[0:padded) of any slot is written.
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from buffers import KEEP, ZERO, Axis, BufferPool, BufferRegistry, Slot, fill, fill_once

POISON = -99
DTYPES = [torch.int64, torch.int32, torch.float32, torch.bfloat16]
POLICIES = ["keep", "zero", "fill", "fill_once"]


@st.composite
def cases(draw):
    max_bs = draw(st.integers(1, 8))
    max_t = draw(st.integers(1, 12))
    n = draw(st.integers(1, 6))
    specs = []
    for i in range(n):
        axis = draw(st.sampled_from([Axis.BS, Axis.TOKENS, Axis.NONE]))
        specs.append(
            dict(
                name=f"s{i}",
                axis=axis,
                dtype=draw(st.sampled_from(DTYPES)),
                policy=draw(st.sampled_from(POLICIES)),
                value=draw(st.integers(-3, 3)),
                lead=draw(st.sampled_from([None, 2])),  # a (2, N) slot on dim 1, like mrope
                present=draw(st.booleans()),
            )
        )
    raw_bs = draw(st.integers(0, max_bs))
    padded_bs = draw(st.integers(raw_bs, max_bs))
    raw_t = draw(st.integers(0, max_t))
    padded_t = draw(st.integers(raw_t, max_t))
    return max_bs, max_t, specs, (raw_bs, padded_bs, raw_t, padded_t), draw(st.integers(0, 2**16))


def padding(spec):
    return {"keep": KEEP, "zero": ZERO, "fill": fill(spec["value"]), "fill_once": fill_once(spec["value"])}[spec["policy"]]


def shape_fn(spec):
    def shape(b, t):
        n = {Axis.BS: b, Axis.TOKENS: t, Axis.NONE: 3}[spec["axis"]]
        return (spec["lead"], n) if spec["lead"] else (n,)

    return shape


@settings(max_examples=150, deadline=None)
@given(cases())
def test_fill_then_view_matches_reference(case):
    max_bs, max_t, specs, (raw_bs, padded_bs, raw_t, padded_t), seed = case
    slots = [
        Slot(s["name"], shape_fn(s), s["dtype"], s["axis"], padding(s), dim=1 if s["lead"] else 0) for s in specs
    ]
    reg = BufferRegistry(slots, max_bs, max_t, "cpu", BufferPool())
    g = torch.Generator().manual_seed(seed)
    for s in specs:
        reg.buffer(s["name"]).fill_(POISON)

    Batch = dataclasses.make_dataclass("Batch", [("batch_size", int)] + [(s["name"], object, None) for s in specs])
    values = {}
    for s in specs:
        if not s["present"]:
            continue
        raw = {Axis.BS: raw_bs, Axis.TOKENS: raw_t, Axis.NONE: 3}[s["axis"]]
        shape = (s["lead"], raw) if s["lead"] else (raw,)
        values[s["name"]] = torch.randint(-50, 50, shape, generator=g).to(s["dtype"])
    batch = Batch(batch_size=raw_bs, **values)
    reg.fill(batch, raw_bs, padded_bs, raw_t, padded_t)
    view = reg.view(batch, padded_bs, padded_t)

    def along_axis(t, lead):
        """Elements along the slot's axis, each a tuple over the leading dim (if any)."""
        return [tuple(c) for c in zip(*t.tolist(), strict=True)] if lead else [(e,) for e in t.tolist()]

    for s in specs:
        name, buf, lead = s["name"], reg.buffer(s["name"]), s["lead"]
        width = lead or 1
        if s["axis"] is Axis.NONE:
            raw = padded = 3
        else:
            raw, padded = (raw_bs, padded_bs) if s["axis"] is Axis.BS else (raw_t, padded_t)
        n = buf.shape[1 if lead else 0]
        live = values.get(name)
        if live is None:
            expect = [(POISON,) * width] * n
            assert getattr(view, name) is None
        else:
            tail = {"keep": POISON, "zero": 0, "fill": s["value"], "fill_once": s["value"]}[s["policy"]]
            beyond = POISON
            if s["policy"] == "fill_once":
                # written once over the whole buffer, and only when a tail had to be padded
                tail = beyond = s["value"] if padded > raw else POISON
            expect = along_axis(live, lead) + [(tail,) * width] * (padded - raw) + [(beyond,) * width] * (n - padded)
            got_view = getattr(view, name)
            assert got_view.shape[1 if lead else 0] == padded
            if padded:
                assert got_view.data_ptr() == buf.data_ptr()
        assert along_axis(buf, lead) == expect, name
