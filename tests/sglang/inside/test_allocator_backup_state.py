"""The allocator API SGLang has up to 0.5.16: the `is_not_in_free_group` flag, `free` as the
only free path (the paged one stages pages in `release_pages`) and `backup_state` /
`restore_state`. Every one of them must go through the kvcached ledger."""

from __future__ import annotations

import pytest
from conftest import (
    TOKENS_PER_PAGE,
    allocators_sort,
    make_mha_pool,
    make_paged_allocator,
    mapped_pages,
)

from kvcached_core.errors import StateConsistencyError


def test_token_restore_state_gives_back_what_was_allocated_since_the_backup(
        token_setup) -> None:
    _, allocator = token_setup
    kept = allocator.alloc(5)
    state = allocator.backup_state()
    taken = allocator.alloc(7)
    allocator.free(taken[:2])  # freed since the backup: not given back a second time
    assert allocator.available_size() == 1023 - 10
    allocator.restore_state(state)
    assert allocator.available_size() == 1023 - 5
    allocator.free(kept)  # held before the backup, so still held after the restore
    assert allocator.available_size() == 1023
    assert allocator.free_pages is None  # SGLang's own free list is never used


def test_a_backup_from_before_a_clear_is_refused(token_setup) -> None:
    _, allocator = token_setup
    stale = allocator.backup_state()
    allocator.clear()
    with pytest.raises(StateConsistencyError, match="last backup_state"):
        allocator.restore_state(stale)


# need_sort exists from 0.5.1; before, the one case is the unsorted one.
@pytest.mark.parametrize("need_sort", [False, True] if allocators_sort() else [False])
def test_paged_free_and_free_group_give_whole_pages_to_the_ledger(need_sort: bool) -> None:
    ps = 4
    pool = make_mha_pool(1020, page_size=ps)
    allocator = make_paged_allocator(1020, ps, pool, need_sort)
    pool.kvcached_pool.trim()
    idle = mapped_pages(pool)
    run = allocator.alloc(4 * TOKENS_PER_PAGE)
    assert run is not None and mapped_pages(pool) >= idle + 4
    allocator.free_group_begin()
    allocator.free(run[1:2])  # any slot of a page frees the whole page
    assert allocator.available_size() == 1020 - 4 * TOKENS_PER_PAGE  # held until the end
    allocator.free_group_end()
    assert allocator.available_size() == 1020 - 4 * TOKENS_PER_PAGE + ps
    allocator.free(run[ps:])
    assert allocator.available_size() == 1020
    pool.kvcached_pool.trim()
    assert mapped_pages(pool) == idle
    # Nothing is staged in SGLang's own lists, whatever need_sort says.
    assert allocator.release_pages is None and allocator.free_pages.numel() == 0


def test_paged_restore_state_gives_back_whole_pages(paged_setup) -> None:
    _, allocator = paged_setup
    state = allocator.backup_state()
    assert allocator.alloc(3 * 4) is not None
    allocator.restore_state(state)
    assert allocator.available_size() == 1020
    assert allocator.alloc(1020) is not None  # every page is back in the ledger
