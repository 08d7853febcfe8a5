"""dp_gather / dp_scatter / dp_reduce_scatter without a process group (world size 1); the
multi-rank paths run under torchrun in test_dp_sync_dist.py."""

from __future__ import annotations

import pytest
import torch

from dp_runtime.sync.dp_buffer import dp_buffer_layout
from dp_runtime.sync.dp_gather import (
    dp_gather,
    dp_reduce_scatter,
    dp_scatter,
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


