"""A grouped free whose tensor the caller reuses before the group ends: from 0.5.18 the release
defers a copy (_copy_for_free_group), and the elastic allocator must give back the slots the
tensor held when it was freed."""

from __future__ import annotations


def test_token_grouped_free_survives_the_callers_reuse(token_setup) -> None:
    _, allocator = token_setup
    slots = allocator.alloc(8)
    row = slots.clone()
    allocator.free_group_begin()
    allocator.free(row[:4])
    row[:4] = row[4:]  # the caller reuses its row before the group ends
    allocator.free(row[4:])
    allocator.free_group_end()
    assert allocator.available_size() == 1023
    assert sorted(allocator.alloc(1023).tolist()) == list(range(1, 1024))
