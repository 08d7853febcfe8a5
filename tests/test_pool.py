"""BufferPool and share_input_buffers_in (issue: buffers/, pool behaviours 1-6)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from buffers import BufferPool, share_input_buffers_in

DECLS = [
    ("input_ids", (16,), "decode"),
    ("input_ids", (64,), "prefill"),
    ("input_ids", (2, 8), "spec"),
    ("positions", (32,), "decode"),
]


@pytest.mark.parametrize("order", [DECLS, DECLS[::-1]], ids=["forward", "reverse"])
def test_one_storage_per_name_at_largest_size_any_order(order):
    pool = BufferPool()
    for name, shape, user in order:
        pool.declare(name, shape, torch.int64, "cpu", user)
    pool.materialize()
    views = {(name, user): pool.view(name, shape) for name, shape, user in order}
    ids = [v for (n, _), v in views.items() if n == "input_ids"]
    assert len({v.untyped_storage().data_ptr() for v in ids}) == 1
    assert {tuple(v.shape) for v in ids} == {(16,), (64,), (2, 8)}
    report = {e.name: e for e in pool.report()}
    assert report["input_ids"].numel == 64 and report["positions"].numel == 32
    # writes through one user's view are seen by the others: it is one storage
    views[("input_ids", "prefill")][:16] = torch.arange(16)
    assert torch.equal(views[("input_ids", "decode")], torch.arange(16))
    assert torch.equal(views[("input_ids", "spec")].flatten(), torch.arange(16))


@pytest.mark.parametrize("other", [dict(dtype=torch.int32, device="cpu"), dict(dtype=torch.int64, device="meta")])
def test_same_name_other_dtype_or_device_names_both(other):
    pool = BufferPool()
    pool.declare("seq_lens", (8,), torch.int64, "cpu", "decode")
    with pytest.raises(ValueError) as e:
        pool.declare("seq_lens", (8,), other["dtype"], other["device"], "prefill")
    assert "'decode'" in str(e.value) and "'prefill'" in str(e.value)


def test_request_larger_than_materialized_is_refused_not_reallocated():
    pool = BufferPool()
    small = pool.request("positions", (8,), torch.int64, "cpu", "decode")
    ptr = small.data_ptr()
    with pytest.raises(ValueError, match=r"8 elements.*needs 64"):
        pool.request("positions", (64,), torch.int64, "cpu", "prefill")
    with pytest.raises(ValueError, match="holds 8 elements"):
        pool.view("positions", (9,))
    assert pool.view("positions", (8,)).data_ptr() == ptr
    # a smaller later request shares the storage
    assert pool.request("positions", (4,), torch.int64, "cpu", "other").data_ptr() == ptr


def test_view_of_unknown_or_unmaterialized_name():
    pool = BufferPool()
    with pytest.raises(KeyError, match="never declared"):
        pool.view("x", (1,))
    pool.declare("x", (1,), torch.float32, "cpu", "u")
    with pytest.raises(KeyError, match="not materialized"):
        pool.view("x", (1,))


def test_storage_is_writable_across_inference_mode():
    pool = BufferPool()
    with torch.inference_mode():
        pool.declare("a", (4,), torch.float32, "cpu", "u")
        pool.materialize()
        inside = pool.view("a", (4,))
    assert not inside.is_inference()
    inside.add_(1)  # outside inference mode, in place
    pool.declare("b", (4,), torch.float32, "cpu", "u")
    pool.materialize()
    outside = pool.view("b", (4,))
    with torch.inference_mode():
        outside.copy_(torch.full((4,), 3.0))
        pool.view("a", (4,)).mul_(2)
    assert torch.equal(pool.view("a", (4,)), torch.full((4,), 2.0))
    assert torch.equal(outside, torch.full((4,), 3.0))


@dataclasses.dataclass
class Inner:
    mrope: torch.Tensor
    unused: torch.Tensor | None = None


@dataclasses.dataclass
class Inputs:
    input_ids: torch.Tensor
    seq_lens: torch.Tensor
    extra: dict
    inner: Inner
    maybe: torch.Tensor | None = None


def test_share_input_buffers_in_pools_nested_fields_with_dotted_names():
    pool = BufferPool()
    a = Inputs(
        input_ids=torch.arange(8),
        seq_lens=torch.ones(4, dtype=torch.int32),
        extra={"custom_mask": torch.ones(6, dtype=torch.bool)},
        inner=Inner(mrope=torch.arange(12).view(3, 4)),
    )
    names = share_input_buffers_in(a, pool, "runner-a")
    assert sorted(names) == ["extra.custom_mask", "inner.mrope", "input_ids", "seq_lens"]
    assert a.maybe is None and a.inner.unused is None
    assert torch.equal(a.input_ids, torch.arange(8)) and torch.equal(a.inner.mrope, torch.arange(12).view(3, 4))
    b = SimpleNamespace(input_ids=torch.full((4,), 7), extra={"custom_mask": torch.zeros(2, dtype=torch.bool)})
    share_input_buffers_in(b, pool, "runner-b")
    assert b.input_ids.data_ptr() == a.input_ids.data_ptr()
    assert torch.equal(a.input_ids[:4], torch.full((4,), 7))  # one storage: b's data landed in a's view


def test_share_grows_nothing_when_later_user_is_larger_and_loses_nothing():
    pool = BufferPool()
    share_input_buffers_in(SimpleNamespace(x=torch.zeros(4)), pool, "small")
    late = SimpleNamespace(y=torch.ones(2), x=torch.zeros(8))
    with pytest.raises(ValueError, match="never reallocated"):
        share_input_buffers_in(late, pool, "large")
    assert [e.name for e in pool.report()] == ["x"]  # 'y' was not left half-declared
    assert torch.equal(late.y, torch.ones(2)) and late.x.shape == (8,)


def test_share_rejects_other_leaves_naming_the_field_and_changes_nothing():
    pool = BufferPool()
    ns = SimpleNamespace(input_ids=torch.arange(3), nested={"bad": [1, 2]})
    before = ns.input_ids
    with pytest.raises(TypeError, match=r"'nested\.bad' is a list"):
        share_input_buffers_in(ns, pool, "u")
    assert ns.input_ids is before and pool.report() == []


def test_report_lists_users_bytes_and_dtypes():
    pool = BufferPool()
    pool.declare("input_ids", (16,), torch.int64, "cpu", "decode")
    pool.declare("input_ids", (64,), torch.int64, "cpu", "prefill")
    pool.declare("embeds", (4, 8), torch.bfloat16, "cpu", "prefill")
    (embeds, ids) = pool.report()
    assert ids.users == ("decode", "prefill") and ids.nbytes == 64 * 8 and not ids.materialized
    assert embeds.dtype == torch.bfloat16 and embeds.nbytes == 32 * 2
    pool.materialize()
    assert all(e.materialized for e in pool.report())
    assert pool.total_bytes() == 64 * 8 + 64
    text = pool.format_report()
    assert "decode, prefill" in text and str(pool.total_bytes()) in text


@pytest.mark.parametrize(("shape", "message"), [
    ((2.7, 4), r"'u' declared 'x' with shape \(2.7, 4\): dimension 2.7 is not an int"),
    ((True,), r"dimension True is not an int"),
    ((3, -1), r"'u' declared 'x' with shape \(3, -1\): a dimension is negative"),
])
def test_non_integer_shapes_are_refused_not_truncated(shape, message):
    pool = BufferPool()
    with pytest.raises(ValueError, match=message):
        pool.request("x", shape, torch.float32, "cpu", user="u")
    with pytest.raises(ValueError, match=message):
        pool.declare_all([("y", (2,), torch.float32, "cpu"), ("x", shape, torch.float32, "cpu")], user="u")
    assert pool.report() == [] and pool.total_bytes() == 0  # nothing declared, nothing allocated


def test_refused_request_leaves_nothing_declared():
    pool = BufferPool()
    pool.request("a", (8,), torch.float32, "cpu", user="first")
    before = ([(e.name, e.numel) for e in pool.report()], pool.total_bytes(), {k: list(v) for k, v in pool._needs.items()})
    with pytest.raises(ValueError, match="is materialized with 8 elements"):
        pool.request("a", (16,), torch.float32, "cpu", user="second")  # storage never grows
    with pytest.raises(ValueError, match=r"dimension 1\.5 is not an int"):
        pool.request("c", (2, 1.5), torch.float32, "cpu", user="third")
    assert ([(e.name, e.numel) for e in pool.report()], pool.total_bytes(),
            {k: list(v) for k, v in pool._needs.items()}) == before
    # An allocation that fails after the declaration went through: the declaration is undone,
    # and so is the storage the same materialize() gave a pending name on the way.
    pending = pool.declare("b", (4,), torch.float32, "cpu", user="pending")
    with pytest.raises(RuntimeError):
        pool.request("huge", (2**62,), torch.float32, "cpu", user="fourth")
    assert "huge" not in pool._needs and not pool.is_materialized("huge")
    assert pool._needs["b"] == [pending] and not pool.is_materialized("b")
