"""The PageMapper interface: a PageAllocator maps through a mapper written in Python exactly as
through a local FTensorAllocator (same errors, same threads), and adopts mapped pages on request.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable

import pytest

from kvcached_core import _C, native
from kvcached_core.errors import (
    KVCachedConfigError,
    MapQuarantinedError,
    PoolExhausted,
    StateConsistencyError,
)

PAGE = 64 * 1024
PAGES = 8


def _local_allocator() -> native.FTensorAllocator:
    allocator = native.FTensorAllocator(native.host_backend(), PAGE, True)
    allocator.create_kv_tensors(PAGE * PAGES, 2, 2)
    return allocator


class ForwardingMapper(_C.PageMapper):
    """Forwards to a local FTensorAllocator, failing a map on demand."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _local_allocator()
        self.fail_next_map: BaseException | None = None
        self.quarantined: list[int] = []
        self.calls: list[tuple[str, int]] = []  # (method, thread id)

    def _note(self, method: str) -> None:
        self.calls.append((method, threading.get_ident()))

    def map_pages(self, page_ids: list[int]) -> list[int]:
        self._note("map_pages")
        if self.fail_next_map is not None:
            error, self.fail_next_map = self.fail_next_map, None
            raise error
        return self.inner.map_pages(page_ids)

    def unmap_pages(self, page_ids: list[int]) -> None:
        self._note("unmap_pages")
        self.inner.unmap_pages(page_ids)

    def prepare_unmap(self, txn_id: int, page_ids: list[int]) -> None:
        self.inner.prepare_unmap(txn_id, page_ids)

    def commit_unmap(self, txn_id: int) -> None:
        self.inner.commit_unmap(txn_id)

    def abort_unmap(self, txn_id: int) -> None:
        self.inner.abort_unmap(txn_id)

    def pending_txn(self) -> int | None:
        return self.inner.pending_txn

    def mapped_page_ids(self) -> list[int]:
        return self.inner.mapped_page_ids()

    def quarantined_page_ids(self) -> list[int]:
        return self.quarantined

    def num_logical_pages(self) -> int:
        return self.inner.num_logical_pages

    def logical_page_bytes(self) -> int:
        return self.inner.logical_page_bytes

    def tensors_created(self) -> bool:
        return self.inner.tensors_created

    def physical_free_pages(self) -> int:
        return self.inner.physical_free_pages()


def _wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_an_ftensor_allocator_is_a_page_mapper() -> None:
    allocator = _local_allocator()
    assert isinstance(allocator, _C.PageMapper)
    pool = native.PageAllocator(allocator, 0, 0, False)
    assert pool.ftensor_allocator is allocator and pool.mapper is allocator
    assert pool.physical_free_pages() == allocator.physical_free_pages() > 0
    pool.stop()


def test_a_python_mapper_maps_and_unmaps_the_pages_of_the_pool() -> None:
    mapper = ForwardingMapper()
    pool = native.PageAllocator(mapper, 0, 1, False)
    assert pool.ftensor_allocator is None and pool.mapper is mapper
    assert pool.alloc_pages(3) == [0, 1, 2]
    assert mapper.inner.mapped_page_ids() == [0, 1, 2]
    pool.free_pages([0, 1, 2])
    assert mapper.inner.mapped_page_ids() == [0]  # one page stays in the reserve
    assert [name for name, _ in mapper.calls] == ["map_pages", "unmap_pages"]
    pool.stop()


@pytest.mark.parametrize(
    ("raised", "seen"),
    [
        (PoolExhausted("workers are full"), PoolExhausted),
        (RuntimeError("driver said no"), RuntimeError),
        (StateConsistencyError("lost a worker"), StateConsistencyError),
    ],
)
def test_errors_of_a_python_mapper_reach_the_caller_with_their_meaning(
    raised: BaseException, seen: type[BaseException]
) -> None:
    mapper = ForwardingMapper()
    pool = native.PageAllocator(mapper, 0, 0, False)
    mapper.fail_next_map = raised
    with pytest.raises(seen, match=str(raised)):
        pool.alloc_pages(2)
    assert pool.num_in_use == 0 and pool.num_free == PAGES
    assert pool.state == ("failed" if seen is StateConsistencyError else "healthy")
    pool.stop()


def test_a_quarantine_reported_by_a_python_mapper_sets_the_page_aside() -> None:
    mapper = ForwardingMapper()
    pool = native.PageAllocator(mapper, 0, 0, False)
    mapper.fail_next_map = MapQuarantinedError("rollback uncertain on page 0")
    mapper.quarantined = [0]
    with pytest.raises(MapQuarantinedError):
        pool.alloc_pages(2)
    assert (pool.state, pool.num_quarantined, pool.num_free) == ("degraded", 1, PAGES - 1)
    assert pool.alloc_pages(1) == [1]
    pool.stop()


def test_the_refill_thread_calls_a_python_mapper_and_fails_the_pool_on_unknown_state() -> None:
    mapper = ForwardingMapper()
    pool = native.PageAllocator(mapper, 2, 4, True)
    _wait_for(lambda: pool.num_reserved == 2)
    refill_threads = {tid for name, tid in mapper.calls if name == "map_pages"}
    assert threading.get_ident() not in refill_threads  # mapped from the pool's own thread

    mapper.fail_next_map = StateConsistencyError("a worker vanished")
    pool.alloc_pages(2)  # takes the reserve; the refill that follows fails
    _wait_for(lambda: pool.state == "failed")
    assert "a worker vanished" in pool.failure_reason
    pool.stop()


def test_the_pool_keeps_a_python_mapper_alive_and_lets_it_go_afterwards() -> None:
    mapper = ForwardingMapper()
    alive = weakref.ref(mapper)
    pool = native.PageAllocator(mapper, 1, 2, True)
    del mapper
    gc.collect()
    assert alive() is not None
    assert pool.alloc_pages(1) == [0]
    assert pool.mapper is alive()
    del pool  # joins the refill thread without holding the GIL
    gc.collect()
    assert alive() is None


def test_a_mapper_that_misses_a_method_is_refused_with_its_name() -> None:
    class Incomplete(_C.PageMapper):
        pass

    with pytest.raises(KVCachedConfigError, match="does not implement num_logical_pages"):
        native.PageAllocator(Incomplete(), 0, 0, False)


def test_mapped_pages_are_refused_unless_adopted_then_fill_the_reserve() -> None:
    allocator = _local_allocator()
    allocator.map_pages([1, 2, 3, 5])
    with pytest.raises(KVCachedConfigError, match="4 mapped; pass adopt_mapped=True"):
        native.PageAllocator(allocator, 0, 2, False)
    pool = native.PageAllocator(allocator, 0, 2, False, adopt_mapped=True)
    assert pool.reserved_page_ids() == [1, 2]  # the lowest ids, up to max_reserved
    assert allocator.mapped_page_ids() == [1, 2]  # the others were unmapped
    assert (pool.num_free, pool.num_in_use) == (PAGES - 2, 0)
    assert pool.alloc_pages(3) == [1, 2, 0]
    assert (pool.reserve_hits, pool.reserve_misses) == (2, 1)
    pool.stop()
