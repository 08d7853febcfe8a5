"""Two bf16 runs' greedy tokens compared the way a GPU allows: the logits of each token close
(within 8% of their range), and where the tokens differ, only at a near-tie of the reference."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def assert_same_greedy(want: Mapping[str, Sequence[int]], want_logits: Mapping[str, Sequence[torch.Tensor]],
                       got: Mapping[str, Sequence[int]], got_logits: Mapping[str, Sequence[torch.Tensor]]
                       ) -> list[tuple[str, int]]:
    """Assert that each request's tokens in ``got`` follow ``want`` (by request id; the logits of
    each token, in order): close logits, and a differing token only where the reference's top
    two are within twice the difference (the sequences part there). Returns the (rid, token
    index) where a near-tie parted them."""
    ties = []
    for rid, tokens in want.items():
        for j, (a, b) in enumerate(zip(tokens, got[rid], strict=True)):
            ref, new = want_logits[rid][j], got_logits[rid][j]
            diff = (new - ref).abs().max().item()
            span = (ref.max() - ref.min()).item()
            assert diff <= 0.08 * span, f"{rid} token {j}: logits differ by {diff / span:.2%} of their range"
            if a != b:  # only a near-tie may flip: the reference's top-2 margin within the difference
                top2 = ref.topk(2).values
                assert (top2[0] - top2[1]).item() <= 2 * diff, f"{rid} token {j}: {b} != {a}, no near-tie"
                ties.append((rid, j))
                break  # the sequences part here
    print(f"near-ties that parted a sequence: {ties}")
    return ties
