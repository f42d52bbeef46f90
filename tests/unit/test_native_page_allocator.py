"""The page pool: reserve hits and misses, capacity, refill, exhaustion, degraded and failed."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvcached_core import native
from kvcached_core.errors import (
    KVCachedConfigError,
    MapQuarantinedError,
    PoolExhausted,
    StateConsistencyError,
)

PAGE = 64 * 1024
PAGES = 8


def _pool(
    min_reserved: int = 0,
    max_reserved: int = 0,
    prealloc: bool = False,
    backend: native.HostBackend | None = None,
    contiguous: bool = True,
) -> tuple[native.HostBackend, native.PageAllocator]:
    backend = backend or native.host_backend()
    allocator = native.FTensorAllocator(backend, PAGE, contiguous)
    allocator.create_kv_tensors(PAGE * PAGES, 2, 2)
    pool = native.PageAllocator(allocator, min_reserved, max_reserved, prealloc)
    return backend, pool


def _counts(pool: native.PageAllocator) -> tuple[int, int, int, int, int]:
    return (pool.num_free, pool.num_reserved, pool.num_in_use, pool.num_quarantined, pool.capacity)


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_alloc_maps_lowest_ids_and_free_unmaps_beyond_the_reserve() -> None:
    backend, pool = _pool(max_reserved=2)
    page_bytes = pool.ftensor_allocator.logical_page_bytes
    assert pool.alloc_pages(3) == [0, 1, 2]
    assert (pool.reserve_hits, pool.reserve_misses) == (0, 3)
    assert pool.map_calls == 1
    assert pool.ftensor_allocator.mapped_page_ids() == [0, 1, 2]
    assert backend.committed_bytes() == 3 * page_bytes

    pool.free_pages([2, 0, 1])
    assert pool.reserved_page_ids() == [0, 1]  # up to max_reserved stay mapped
    assert pool.ftensor_allocator.mapped_page_ids() == [0, 1]
    assert backend.committed_bytes() == 2 * page_bytes
    assert pool.unmap_calls == 1
    assert _counts(pool) == (6, 2, 0, 0, PAGES)

    assert pool.alloc_pages(3) == [0, 1, 2]  # two reserve hits, one fresh map
    assert (pool.reserve_hits, pool.reserve_misses) == (2, 4)
    assert pool.map_ns_total > 0 and pool.unmap_ns_total > 0


def test_freeing_a_page_not_in_use_names_it_and_changes_nothing() -> None:
    _, pool = _pool()
    pool.alloc_pages(2)
    with pytest.raises(StateConsistencyError, match="page id 5"):
        pool.free_pages([0, 5])
    with pytest.raises(StateConsistencyError, match="page id 1"):
        pool.free_pages([1, 1])
    assert pool.num_in_use == 2
    assert pool.state == "healthy"


def test_exhaustion_by_capacity_leaves_counts_unchanged() -> None:
    _, pool = _pool(max_reserved=1)
    pool.alloc_pages(PAGES - 1)
    before = _counts(pool)
    with pytest.raises(PoolExhausted):
        pool.alloc_pages(2)
    assert _counts(pool) == before
    assert pool.alloc_pages(1) == [PAGES - 1]


def test_exhaustion_by_physical_memory_rolls_back_and_leaves_counts_unchanged() -> None:
    backend = native.host_backend(memory_limit_bytes=3 * PAGE * 4)
    _, pool = _pool(backend=backend, contiguous=False)
    assert pool.physical_free_pages() == 3
    pool.alloc_pages(1)
    before = _counts(pool)
    with pytest.raises(PoolExhausted, match="out of physical memory"):
        pool.alloc_pages(3)
    assert _counts(pool) == before
    assert pool.ftensor_allocator.mapped_page_ids() == [0]
    assert backend.committed_bytes() == PAGE * 4
    assert pool.alloc_pages(2) == [1, 2]


def test_capacity_shrink_trims_the_reserve_and_never_revokes_pages() -> None:
    _, pool = _pool(max_reserved=4)
    pages = pool.alloc_pages(4)
    pool.free_pages(pages[2:])
    assert (pool.num_in_use, pool.num_reserved) == (2, 2)

    assert pool.set_capacity(3) is True
    assert (pool.capacity, pool.num_reserved) == (3, 1)

    assert pool.set_capacity(1) is False  # two pages are still in use
    assert pool.num_reserved == 0
    assert pool.ftensor_allocator.mapped_page_ids() == [0, 1]
    with pytest.raises(PoolExhausted):
        pool.alloc_pages(1)

    pool.free_pages([1])
    assert pool.num_reserved == 0  # no room under the capacity for a reserve
    assert pool.set_capacity(PAGES) is True
    assert pool.alloc_pages(2) == [1, 2]


def test_trim_unmaps_the_whole_reserve() -> None:
    backend, pool = _pool(max_reserved=8)
    pool.free_pages(pool.alloc_pages(5))
    assert pool.num_reserved == 5
    pool.trim()
    assert pool.num_reserved == 0
    assert backend.committed_bytes() == 0
    assert pool.num_free == PAGES


def test_a_trim_right_after_an_allocation_stays_trimmed() -> None:
    # The allocation asks the refill thread for a new reserve; a trim that follows at once
    # (an engine that just drained) must win, however the two interleave.
    backend, pool = _pool(min_reserved=2, max_reserved=2)
    for _ in range(30):
        pages = pool.alloc_pages(1)
        pool.trim()
        time.sleep(0.01)  # time for a refill that was already deciding its batch
        assert pool.num_reserved == 0
        pool.free_pages(pages)
        pool.trim()
    assert backend.committed_bytes() == 0


def test_background_refill_keeps_the_minimum_reserve() -> None:
    backend, pool = _pool(min_reserved=2, max_reserved=4, prealloc=True)
    _wait_for(lambda: pool.num_reserved == 2)
    assert pool.reserved_page_ids() == [0, 1]
    assert backend.committed_bytes() == 2 * pool.ftensor_allocator.logical_page_bytes

    assert pool.alloc_pages(2) == [0, 1]
    assert (pool.reserve_hits, pool.reserve_misses) == (2, 0)
    _wait_for(lambda: pool.num_reserved == 2)
    assert pool.reserved_page_ids() == [2, 3]
    pool.stop()
    pool.alloc_pages(2)
    time.sleep(0.05)
    assert pool.num_reserved == 0  # stopped: no more refills


def test_refill_waits_for_an_allocation_without_prealloc_and_respects_physical_memory() -> None:
    backend = native.host_backend(memory_limit_bytes=2 * PAGE * 4)
    _, pool = _pool(min_reserved=3, max_reserved=3, backend=backend)
    time.sleep(0.05)
    assert pool.num_reserved == 0
    pool.alloc_pages(1)
    _wait_for(lambda: pool.num_reserved == 1)  # only one more page fits in memory
    time.sleep(0.05)
    assert pool.num_reserved == 1
    assert pool.state == "healthy"


def test_uncertain_map_rollback_quarantines_and_degrades() -> None:
    backend, pool = _pool()
    backend.inject_failure("map", nth=1)
    backend.inject_failure("map_zero", nth=1)
    with pytest.raises(MapQuarantinedError):
        pool.alloc_pages(1)
    assert pool.state == "degraded"
    assert pool.failure_reason == ""
    assert (pool.num_quarantined, pool.num_in_use, pool.num_free) == (1, 0, PAGES - 1)
    assert pool.alloc_pages(1) == [1]  # page 0 is never handed out again


def test_failed_unmap_fails_the_pool_for_good() -> None:
    backend, pool = _pool()
    pages = pool.alloc_pages(2)
    backend.inject_failure("unmap", nth=1)
    with pytest.raises(StateConsistencyError):
        pool.free_pages(pages)
    assert pool.state == "failed"
    assert "injected failure of unmap" in pool.failure_reason
    for call in (lambda: pool.alloc_pages(1), lambda: pool.free_pages([0]), pool.trim):
        with pytest.raises(StateConsistencyError, match="page pool failed"):
            call()


def test_clean_driver_failure_changes_nothing() -> None:
    backend, pool = _pool()
    before = _counts(pool)
    backend.inject_failure("map", nth=1)
    with pytest.raises(RuntimeError, match="rolled back"):
        pool.alloc_pages(1)
    assert _counts(pool) == before
    assert pool.state == "healthy"


def test_settings_are_checked() -> None:
    with pytest.raises(KVCachedConfigError, match="min_reserved"):
        _pool(min_reserved=3, max_reserved=1)
    allocator = native.FTensorAllocator(native.host_backend(), PAGE, True)
    with pytest.raises(KVCachedConfigError, match="create_kv_tensors"):
        native.PageAllocator(allocator, 0, 0, False)
