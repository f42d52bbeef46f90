"""BlockLedger on the real native page allocator (host backend, small pages)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvcached_core import _C
from kvcached_core.errors import KVCachedConfigError, PoolExhausted, StateConsistencyError
from kvcached_core.ledger import BlockLedger

KIB = 1024
PAGE = 64 * KIB


@dataclass
class Native:
    backend: Any
    ftensors: Any
    pages: Any


def make_native(
    num_pages: int = 8,
    *,
    page_size: int = PAGE,
    min_reserved: int = 0,
    max_reserved: int = 2,
    prealloc: bool = False,
    memory_limit: int = 0,
) -> Native:
    backend = _C.HostBackend(memory_limit)
    ftensors = _C.FTensorAllocator(backend, page_size, False)
    ftensors.create_kv_tensors(num_pages * page_size, 2, 2)
    pages = _C.PageAllocator(ftensors, min_reserved, max_reserved, prealloc)
    return Native(backend, ftensors, pages)


@pytest.fixture
def native() -> Iterator[Native]:
    made = make_native()
    yield made
    made.pages.stop()


def manager_for(native: Native, block_bytes: int = 16 * KIB, **options: Any) -> BlockLedger:
    return BlockLedger(native.pages, block_bytes, PAGE, **options)


def test_null_block_is_block_zero_and_never_handed_out(native: Native) -> None:
    manager = manager_for(native)
    assert manager.null_block_id == 0
    assert manager.blocks_per_page == 4
    assert manager.available_size() == 8 * 4 - 1
    blocks = manager.alloc(31)
    assert 0 not in blocks
    assert sorted(blocks) == list(range(1, 32))
    with pytest.raises(PoolExhausted):
        manager.alloc(1)


def test_alloc_takes_lowest_ids_and_fills_partial_pages_first(native: Native) -> None:
    manager = manager_for(native, set_aside_null_block=False)
    assert manager.alloc(3) == [0, 1, 2]
    assert manager.alloc(2) == [3, 4]  # the last block of page 0, then a new page
    assert manager.page_occupancy() == {0: 4, 1: 1}


def test_best_fit_picks_the_smallest_partial_page_that_holds_the_run(native: Native) -> None:
    manager = manager_for(native, set_aside_null_block=False)
    blocks = manager.alloc(12)  # pages 0, 1, 2 full
    manager.free([0, 1, 2])  # page 0: 3 free
    manager.free([4])  # page 1: 1 free
    manager.free([8, 9])  # page 2: 2 free
    assert manager.alloc(2) == [8, 9]  # page 2 fits exactly
    assert manager.alloc(1) == [4]  # page 1 is the smallest page that fits 1
    # Nothing fits 4: take the emptiest page (0) first, then a new page.
    assert manager.alloc(4) == [0, 1, 2, 12]
    assert len(set(blocks)) == 12


def test_free_of_an_empty_page_returns_it_to_the_allocator(native: Native) -> None:
    manager = manager_for(native, set_aside_null_block=False)
    blocks = manager.alloc(8)
    assert native.pages.num_in_use == 2
    manager.free(blocks[4:])
    assert native.pages.num_in_use == 1
    manager.free(blocks[:4])
    assert native.pages.num_in_use == 0
    manager.trim()
    assert native.ftensors.mapped_page_ids() == []


def test_double_free_and_foreign_ids_name_the_id_and_leave_the_ledger_unchanged(
    native: Native,
) -> None:
    manager = manager_for(native)
    blocks = manager.alloc(6)
    manager.free(blocks[:2])
    before = (manager.page_occupancy(), manager.available_size(), manager.num_used_blocks)
    with pytest.raises(StateConsistencyError, match=f"block {blocks[0]}"):
        manager.free([blocks[3], blocks[0]])
    assert (manager.page_occupancy(), manager.available_size(), manager.num_used_blocks) == before
    # Unknown state is fatal: the pool refuses further work and says why.
    with pytest.raises(StateConsistencyError, match="refuses work"):
        manager.alloc(1)
    assert manager.snapshot().state == "failed"


@pytest.mark.parametrize("bad", [[10_000], [-1], [0], [5, 5]])
def test_each_kind_of_bad_free_is_refused(native: Native, bad: list[int]) -> None:
    manager = manager_for(native)
    manager.alloc(8)
    used = manager.num_used_blocks
    with pytest.raises(StateConsistencyError, match=f"block {bad[-1]}"):
        manager.free(bad)
    assert manager.num_used_blocks == used


def test_pool_exhausted_leaves_the_ledger_unchanged(native: Native) -> None:
    manager = manager_for(native)
    manager.alloc(5)
    manager.try_to_set_aside(2)
    before = (manager.page_occupancy(), manager.available_size(), native.pages.num_in_use)
    with pytest.raises(PoolExhausted, match="requested 100 blocks"):
        manager.alloc(100)
    assert (manager.page_occupancy(), manager.available_size(), native.pages.num_in_use) == before


def test_physical_exhaustion_rolls_back_everything() -> None:
    # The backend may commit only 3 pages (2 layers x 2 buffers each): the 4th map fails.
    made = make_native(memory_limit=3 * 4 * PAGE)
    try:
        manager = BlockLedger(made.pages, 16 * KIB, PAGE)
        first = manager.alloc(8)
        manager.try_to_set_aside(2)
        before = (manager.page_occupancy(), manager.num_used_blocks, manager.num_set_aside_blocks)
        with pytest.raises(PoolExhausted):
            manager.alloc(8)  # 2 reserved + 1 partial + needs 2 new pages, 1 is physical
        after = (manager.page_occupancy(), manager.num_used_blocks, manager.num_set_aside_blocks)
        assert after == before
        assert made.pages.num_in_use == 3
        manager.free(first)
        assert manager.alloc(3) == [9, 10, 8]  # set-aside blocks first, then best fit
    finally:
        made.pages.stop()


def test_injected_map_failure_is_pool_exhausted_with_nothing_changed(native: Native) -> None:
    manager = manager_for(native)
    manager.alloc(3)
    native.backend.inject_failure("map", 1, False)
    with pytest.raises(PoolExhausted, match="rolled back"):
        manager.alloc(4)
    assert manager.page_occupancy() == {0: 4}
    assert native.ftensors.mapped_page_ids() == [0]
    assert manager.alloc(4) == [4, 5, 6, 7]


def test_injected_unmap_failure_makes_the_pool_refuse(native: Native) -> None:
    manager = manager_for(native, set_aside_null_block=False)
    native.pages.trim()
    blocks = manager.alloc(4 * 4)
    native.backend.inject_failure("unmap", 1, False)
    with pytest.raises(StateConsistencyError):
        manager.free(blocks)  # 4 pages empty: 2 go to the reserve, 2 are unmapped
    with pytest.raises(StateConsistencyError, match="refuses work"):
        manager.alloc(1)


def test_try_to_reserve_and_free_reserved(native: Native) -> None:
    manager = manager_for(native)
    total = manager.available_size()
    assert manager.try_to_set_aside(5)
    assert manager.available_size() == total  # set-aside blocks still count as available
    assert manager.num_set_aside_blocks == 6  # five plus the null block
    assert not manager.try_to_set_aside(total)  # only total - 5 more fit
    assert manager.alloc(2) == [1, 2]  # set-aside blocks go first
    manager.free_set_aside()
    assert manager.num_set_aside_blocks == 1
    assert manager.available_size() == total - 2


def test_available_size_matches_what_alloc_accepts(native: Native) -> None:
    manager = manager_for(native)
    manager.alloc(5)
    manager.try_to_set_aside(3)
    available = manager.available_size()
    with pytest.raises(PoolExhausted):
        manager.alloc(available + 1)
    assert len(manager.alloc(available)) == available
    assert manager.available_size() == 0


def test_deferred_release_waits_for_the_marker(native: Native) -> None:
    manager = manager_for(native, set_aside_null_block=False, defer_physical_release=True)
    native_pages = native.pages
    a = manager.alloc(4)
    b = manager.alloc(4)
    manager.free(a)  # page 0 retires in epoch 0
    marker = manager.capture_release_marker()
    manager.free(b)  # page 1 retires in epoch 1
    assert manager.num_retired_pages == 2
    assert native_pages.num_in_use == 2  # still mapped: a batch may be reading them
    assert manager.release_retired_through(marker) == 1
    assert native_pages.num_in_use == 1
    # Reusing a retired page cancels its retirement.
    assert manager.alloc(4) == [4, 5, 6, 7]
    assert manager.num_retired_pages == 0
    assert manager.release_retired_through(manager.capture_release_marker()) == 0
    assert native_pages.num_in_use == 1


def test_shrink_is_lazy_and_never_revokes_live_blocks(native: Native) -> None:
    manager = manager_for(native, set_aside_null_block=False)
    blocks = manager.alloc(16)  # 4 pages
    assert not manager.resize(8)  # 2 pages: shrink pending
    assert manager.num_blocks == 8
    assert manager.snapshot().in_shrink
    assert manager.available_size() == 0
    with pytest.raises(PoolExhausted):
        manager.alloc(1)
    manager.free(blocks[:8])  # two pages drain: the shrink completes
    assert not manager.snapshot().in_shrink
    assert native.pages.capacity == 2
    assert manager.available_size() == 0
    manager.free(blocks[8:12])
    assert manager.available_size() == 4
    assert manager.resize(32)  # grow
    assert manager.available_size() == 32 - 4


def test_resize_target_from_another_thread_applies_on_next_alloc(native: Native) -> None:
    manager = manager_for(native, set_aside_null_block=False)
    manager.request_resize(4)
    assert manager.num_blocks == 32
    manager.alloc(1)
    assert manager.num_blocks == 4
    with pytest.raises(PoolExhausted):
        manager.alloc(4)


def test_clear_frees_everything_and_rereserves_the_null_block(native: Native) -> None:
    manager = manager_for(native)
    manager.alloc(10)
    manager.try_to_set_aside(3)
    manager.clear()
    assert manager.num_used_blocks == 0
    assert manager.null_block_id == 0
    assert native.pages.num_in_use == 1
    assert native.ftensors.mapped_page_ids() == [0]
    assert manager.available_size() == 31


def test_clear_under_a_limit_of_zero_keeps_the_null_blocks_page(native: Native) -> None:
    # An engine put to sleep (limit 0) whose cache is then flushed: the clear must not have to
    # map the null block's page again, which the limit would refuse.
    manager = manager_for(native)
    manager.alloc(10)
    manager.request_resize(0)  # kvctl limit POOL 0, seen by the pool's watcher
    manager.clear()
    assert manager.null_block_id == 0 and manager.num_used_blocks == 0
    assert native.ftensors.mapped_page_ids() == [0]
    assert sorted(manager.alloc(3)) == [1, 2, 3]  # the page the pool keeps still serves
    with pytest.raises(PoolExhausted):
        manager.alloc(1)  # but no new page is mapped under the limit
    assert native.ftensors.mapped_page_ids() == [0]


def test_blocks_spanning_pages_use_one_ledger_page_per_block() -> None:
    # block = 2 pages: the allocator counts in 2-page units (what KVPool builds).
    made = make_native(4, page_size=2 * PAGE)
    try:
        manager = BlockLedger(made.pages, 2 * PAGE, PAGE, set_aside_null_block=False)
        assert (manager.blocks_per_page, manager.geometry.pages_per_block) == (1, 2)
        assert manager.alloc(3) == [0, 1, 2]
        assert made.pages.num_in_use == 3
    finally:
        made.pages.stop()


def test_geometry_that_does_not_tile_is_a_config_error(native: Native) -> None:
    with pytest.raises(KVCachedConfigError, match=r"24576.*65536.*nearest working block size"):
        manager_for(native, block_bytes=24 * KIB)


def test_snapshot_reports_counters(native: Native) -> None:
    manager = manager_for(native)
    manager.alloc(6)
    snap = manager.snapshot()
    assert snap.num_used_blocks == 6
    assert snap.in_use_pages == 2
    assert snap.mapped_pages == manager.mapped_pages >= 2
    assert snap.reserve_misses == 2
    assert snap.map_calls >= 1 and snap.map_ns_total > 0
    assert snap.state == "healthy"
    with pytest.raises(AttributeError):
        snap.num_used_blocks = 0  # type: ignore[misc]
