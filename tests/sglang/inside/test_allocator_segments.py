"""The paged free path SGLang has from 0.5.17 (0.5.17 - 0.5.19 have no free_page_ids): freeing
by segment, alone and inside a free group."""

from __future__ import annotations


def test_paged_free_segment_alone_and_in_a_group(paged_setup) -> None:
    _, allocator = paged_setup
    ps = 4
    run = allocator.alloc(4 * ps)
    allocator.free_segment(run[: 2 * ps], start_pos=0)
    assert allocator.available_size() == 1020 - 2 * ps
    allocator.free_group_begin()
    allocator.free_segment(run[2 * ps: 3 * ps], start_pos=2 * ps)
    allocator.free(run[3 * ps + 1: 3 * ps + 2])  # any slot of a page frees the whole page
    assert allocator.available_size() == 1020 - 2 * ps  # held until the group ends
    allocator.free_group_end()
    assert allocator.available_size() == 1020
    assert allocator.alloc(1020) is not None and allocator.alloc(ps) is None

