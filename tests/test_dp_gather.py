"""dp_gather / dp_scatter without a process group (world size 1), and the device-offset SUM_LEN
path simulated for several ranks in one process (each rank's contribution, summed by hand, is
what the all-reduce would produce)."""

from __future__ import annotations

import pytest
import torch

from dp_runtime.sync.dp_buffer import dp_buffer_layout
from dp_runtime.sync.dp_gather import (
    dp_gather,
    dp_gather_by_counts,
    dp_reduce_scatter,
    dp_scatter,
    dp_scatter_by_counts,
)

D = 4


def one_rank(g, loc, is_max, n):
    return dp_buffer_layout(g, loc, is_max, (n,), rank=0, dp_size=1, max_tokens_per_rank=64)


@pytest.mark.parametrize(
    ("g", "is_max", "n", "t"),
    [
        (6, True, 6, 6),
        (8, True, 6, 6),
        (8, True, 6, 2),
        (6, False, 6, 6),
        (6, False, 6, 4),
        (0, True, 0, 0),
    ],
)
def test_world_one_gather_is_a_copy_with_zero_padding(g, is_max, n, t):
    lay = one_rank(g, g, is_max, n) if is_max else one_rank(g, n, False, n)
    x = torch.randn(t, D)
    out = torch.full((g, D), float("nan"))
    dp_gather(out, x, lay)
    assert torch.equal(out[:t], x)
    assert torch.count_nonzero(out[t:]) == 0  # the slot's tail is zero, not stale
    back = dp_scatter(out, lay)
    assert back.shape == (n, D) and torch.equal(back[:t], x)
    dest = torch.empty(64, D)
    assert torch.equal(dp_scatter(out, lay, out_TD=dest)[:t], x)
    assert torch.equal(dp_reduce_scatter(out, lay)[:t], x)


def test_gather_in_place_from_the_slot():
    lay = one_rank(8, 8, True, 5)
    out = torch.zeros(8, D)
    out[:5] = torch.arange(20.0).view(5, D)
    expected = out[:5].clone()
    dp_gather(out, out[:5], lay)
    assert torch.equal(out[:5], expected)


def test_gather_refuses_rows_over_the_slot_and_wrong_buffer_length():
    lay = one_rank(4, 4, True, 4)
    with pytest.raises(ValueError, match="brings 5 rows, its slot holds 4"):
        dp_gather(torch.empty(4, D), torch.empty(5, D), lay)
    with pytest.raises(ValueError, match="global buffer has 3 rows, global_dp_buffer_len is 4"):
        dp_gather(torch.empty(3, D), torch.empty(4, D), lay)


@pytest.mark.parametrize(
    ("counts", "capacity"),
    [((3, 0, 5), 12), ((0, 0, 1), 3), ((4, 4, 4), 12), ((0, 0, 0), 6), ((2, 7), 20), ((5,), 5)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_by_counts_sums_to_the_concatenation(counts, capacity, dtype):
    gen = torch.Generator().manual_seed(0)
    ranks = len(counts)
    pad = 3  # each rank's local buffer is longer than its count; the tail holds garbage
    locals_ = []
    for n in counts:
        x = torch.randn(n + pad, D, generator=gen).to(dtype)
        x[n:] = float("nan")
        locals_.append(x)
    counts_R = torch.tensor(counts, dtype=torch.int32)
    total = torch.zeros(capacity, D, dtype=dtype)
    for r in range(ranks):
        buf = torch.full((capacity, D), 7.0, dtype=dtype)  # stale content must be overwritten
        total += dp_gather_by_counts(buf, locals_[r], counts_R, r)
    expected = torch.cat([x[:n] for x, n in zip(locals_, counts, strict=True)])
    assert torch.equal(total[: sum(counts)], expected)
    assert torch.count_nonzero(total[sum(counts) :]) == 0
    for r in range(ranks):
        out = torch.full((counts[r] + pad, D), 5.0, dtype=dtype)
        dp_scatter_by_counts(total, counts_R, r, out)
        assert torch.equal(out[: counts[r]], locals_[r][: counts[r]])
        assert torch.count_nonzero(out[counts[r] :]) == 0


def test_by_counts_with_empty_buffers():
    counts_R = torch.tensor([0, 2])
    assert dp_gather_by_counts(torch.empty(0, D), torch.empty(0, D), counts_R, 0).shape == (0, D)
    buf = torch.ones(4, D)
    assert torch.count_nonzero(dp_gather_by_counts(buf, torch.empty(0, D), counts_R, 0)) == 0
    assert dp_scatter_by_counts(torch.ones(4, D), counts_R, 0, torch.empty(0, D)).shape == (0, D)
    assert (
        torch.count_nonzero(dp_scatter_by_counts(torch.empty(0, D), counts_R, 1, torch.ones(2, D)))
        == 0
    )
