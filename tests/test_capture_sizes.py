"""graph.capture_sizes: the capture-size policy and bucket choice (pure)."""

from __future__ import annotations

from itertools import pairwise

import pytest

from graph import bucket_for, capture_sizes, default_capture_sizes


def test_default_list_shape():
    sizes = capture_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24)
    assert all(b - a == 8 for a, b in pairwise(sizes[3:]))
    assert sizes[-1] == 256 and len(sizes) == 4 + 31


def test_default_steps_of_16_above_256_and_cap_included():
    sizes = capture_sizes(300)
    assert sizes[sizes.index(256):] == (256, 272, 288, 300)


def test_default_helper_is_raw_candidates():
    assert default_capture_sizes(10) == [1, 2, 4, 8]
    assert default_capture_sizes(1) == [1]


@pytest.mark.parametrize("max_bs", [1, 3, 7, 8, 9, 100, 256, 257, 512, 1000])
@pytest.mark.parametrize("alignment", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("configured", [None, [1, 2, 8, 24, 48, 96, 480, 2048]])
def test_sorted_unique_aligned_capped_cap_included(max_bs, alignment, configured):
    if configured is not None:
        configured = [s * alignment for s in configured]
    if max_bs < alignment:
        with pytest.raises(ValueError, match="below the alignment"):
            capture_sizes(max_bs, configured=configured, alignment=alignment)
        return
    sizes = capture_sizes(max_bs, configured=configured, alignment=alignment)
    cap = max_bs - max_bs % alignment
    assert list(sizes) == sorted(set(sizes))
    assert all(s % alignment == 0 and 1 <= s <= cap for s in sizes)
    assert sizes[-1] == cap
    # every batch up to the cap has a bucket
    assert all(bucket_for(sizes, n) >= n for n in range(cap + 1))


def test_alignment_filters_default_list():
    assert capture_sizes(32, alignment=4) == (4, 8, 16, 24, 32)
    assert capture_sizes(30, alignment=4) == (4, 8, 16, 24, 28)


def test_configured_list_is_deduplicated_sorted_and_capped():
    assert capture_sizes(256, configured=[8, 1, 4, 4, 512]) == (1, 4, 8, 256)


def test_empty_configured_list_is_a_clear_error():
    with pytest.raises(ValueError, match="configured list is empty"):
        capture_sizes(64, configured=[])


def test_misaligned_configured_value_names_it():
    with pytest.raises(ValueError, match=r"\[6\] are not multiples of the alignment 4"):
        capture_sizes(64, configured=[4, 6, 8], alignment=4)


@pytest.mark.parametrize("kw", [{"max_bs": 0}, {"max_bs": -3}, {"max_bs": 8, "alignment": 0}, {"max_bs": 8, "configured": [0, 4]}])
def test_bad_inputs_raise(kw):
    with pytest.raises(ValueError):
        capture_sizes(**kw)


def test_bucket_for_picks_smallest_at_or_above():
    sizes = (1, 2, 4, 8, 16)
    assert [bucket_for(sizes, n) for n in (0, 1, 2, 3, 5, 8, 9, 16)] == [1, 1, 2, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="size 17 exceeds the largest captured bucket 16"):
        bucket_for(sizes, 17)
    with pytest.raises(ValueError, match=">= 0"):
        bucket_for(sizes, -1)
