"""A scheduler-side PageAllocator and block ledger driving worker processes over the sockets."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from test_ipc_harness import (
    BLOCK_BYTES,
    LOGICAL_PAGE_BYTES,
    PAGE,
    PAGES,
    WorkerProcess,
    socket_root,
    wait_for,
    workers,
)

from kvcached_core import native
from kvcached_core.errors import (
    KVCachedConfigError,
    MapQuarantinedError,
    PoolExhausted,
    StateConsistencyError,
)
from kvcached_core.ipc.coordinator import (
    TIMEOUT_ENV,
    BroadcastMapper,
    WorkerCallError,
    ipc_timeout_s,
)
from kvcached_core.ledger import BlockLedger


@contextmanager
def coordinator(
    mapper: BroadcastMapper,
    min_reserved: int = 0,
    max_reserved: int = 0,
    prealloc: bool = False,
    set_aside_null_block: bool = False,
) -> Iterator[tuple[native.PageAllocator, BlockLedger]]:
    pages = native.PageAllocator(mapper, min_reserved, max_reserved, prealloc)
    manager = BlockLedger(pages, BLOCK_BYTES, PAGE, set_aside_null_block=set_aside_null_block)
    try:
        yield pages, manager
    finally:
        manager.shutdown()
        mapper.close()


def _held_pages(pages: native.PageAllocator, manager: BlockLedger) -> list[int]:
    return sorted(set(manager.page_occupancy()) | set(pages.reserved_page_ids()))


def test_allocations_map_on_every_rank_and_frees_unmap_everywhere() -> None:
    with workers(2) as (root, ranks):
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        assert mapper.num_logical_pages() == PAGES
        assert mapper.logical_page_bytes() == 2 * LOGICAL_PAGE_BYTES  # summed over the ranks
        with coordinator(mapper, max_reserved=1, set_aside_null_block=True) as (pages, manager):
            assert pages.ftensor_allocator is None and pages.mapper is mapper
            blocks = manager.alloc(10)  # 4 blocks a page: pages 0 (null block), 1, 2
            held = _held_pages(pages, manager)
            assert held == [0, 1, 2]
            for rank in ranks:
                state = rank.state()
                assert state["mapped"] == held
                assert state["resident_bytes"] == len(held) * LOGICAL_PAGE_BYTES

            manager.free(blocks)
            # Page 1 stays warm in the reserve (max_reserved=1); page 2 is unmapped on every
            # rank by one committed two-phase transaction.
            assert pages.reserved_page_ids() == [1]
            for rank in ranks:
                state = rank.state()
                assert state["mapped"] == [0, 1]
                assert state["resident_bytes"] == 2 * LOGICAL_PAGE_BYTES
                assert state["pending_txn"] is None
                assert [outcome for _, outcome in state["txn_history"]] == ["committed"]
            assert pages.state == "healthy"
            assert pages.unmap_calls == 1


def test_the_reserve_refill_thread_maps_through_the_workers() -> None:
    with workers(2) as (root, ranks):
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        with coordinator(mapper, min_reserved=3, max_reserved=4, prealloc=True) as (pages, _):
            wait_for(lambda: pages.num_reserved == 3, 10, "fill the reserve")
            assert pages.physical_free_pages() > 0
            for rank in ranks:
                assert rank.state()["mapped"] == [0, 1, 2]


def test_pipeline_stages_each_get_their_own_sockets() -> None:
    with socket_root() as root:
        stages = [WorkerProcess(root, rank, pp) for pp in range(2) for rank in range(2)]
        try:
            for worker in stages:
                worker.start()
            assert (root / "pp1" / "w1.sock").exists() and (root / "w1.sock").exists()
            mapper = BroadcastMapper.for_job(root, tp_size=2, pp_size=2)
            with coordinator(mapper) as (_, manager):
                manager.alloc(5)
                assert [w.state()["mapped"] for w in stages] == [[0, 1]] * 4
        finally:
            for worker in stages:
                worker.close()


def test_a_failed_map_on_one_rank_is_rolled_back_on_the_others() -> None:
    # Each page is 4 unit maps on a rank (2 layers x K and V): rank 1's 6th unit map fails, in
    # the middle of the second call, after it mapped one unit of it (rolled back locally).
    with workers(2, inject={1: [("map", 6)]}) as (root, ranks):
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        with coordinator(mapper) as (pages, manager):
            first = manager.alloc(4)  # page 0 maps everywhere (rank 1's first map call)
            with pytest.raises(PoolExhausted, match=r"rank 1 \(pp 0\) map.*rolled back"):
                manager.alloc(8)  # rank 1 fails; rank 0 had mapped pages 1 and 2
            for rank in ranks:
                state = rank.state()
                assert state["mapped"] == [0]
                assert state["resident_bytes"] == LOGICAL_PAGE_BYTES
            assert pages.state == "healthy"
            assert (pages.num_in_use, pages.num_free) == (1, PAGES - 1)
            assert manager.alloc(8)  # the failure was recoverable
            assert ranks[0].state()["mapped"] == ranks[1].state()["mapped"] == [0, 1, 2]
            manager.free(first)


def test_a_silent_rank_times_out_with_its_name_and_the_pool_stops(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = {"command": "map_pages", "when": "before"}
    with workers(2, gate={1: gate}) as (root, ranks):
        monkeypatch.setenv(TIMEOUT_ENV, "0.3")
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        assert mapper.timeout_s == 0.3
        with coordinator(mapper) as (pages, manager):
            with pytest.raises(
                StateConsistencyError,
                match=r"rank 1 \(pp 0\) map: no answer within 0\.3 s \(KVCACHED_IPC_TIMEOUT\)",
            ):
                manager.alloc(4)
            assert ranks[0].state()["mapped"] == []  # rank 0's new page was rolled back
            assert pages.state == "failed"
            with pytest.raises(StateConsistencyError, match="refuses work"):
                manager.alloc(1)
            ranks[1].release("map_pages")


def test_calls_are_serialised_across_threads() -> None:
    with workers(2) as (root, ranks):
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        errors: list[BaseException] = []

        def churn(first_page: int) -> None:
            try:
                for _ in range(20):
                    ids = [first_page, first_page + 1]
                    mapper.map_pages(ids)
                    mapper.unmap_pages(ids)
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=churn, args=(page,)) for page in (0, 4, 8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors
        for rank in ranks:
            state = rank.state()
            assert state["mapped"] == [] and state["resident_bytes"] == 0
            assert len(state["txn_history"]) == 60 and state["highest_txn"] == 60
        mapper.close()


def test_the_timeout_setting_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert ipc_timeout_s() == 60.0
    monkeypatch.setenv(TIMEOUT_ENV, "2.5")
    assert ipc_timeout_s() == 2.5
    for bad in ("soon", "0", "-1", "inf", "nan"):
        monkeypatch.setenv(TIMEOUT_ENV, bad)
        with pytest.raises(KVCachedConfigError, match=TIMEOUT_ENV):
            ipc_timeout_s()


def test_a_coordinator_refuses_missing_ranks_and_ranks_with_another_geometry() -> None:
    with socket_root() as root:
        ranks = [WorkerProcess(root, 0), WorkerProcess(root, 1, pages=PAGES // 2)]
        try:
            ranks[0].start()
            with pytest.raises(WorkerCallError, match=r"rank 1 \(pp 0\) hello.*cannot connect"):
                BroadcastMapper.for_job(root, tp_size=2)  # rank 1 is not running
            ranks[1].start()
            with pytest.raises(KVCachedConfigError, match="disagree on the number of pages"):
                BroadcastMapper.for_job(root, tp_size=2)
        finally:
            for rank in ranks:
                rank.close()


def test_an_uncertain_rollback_on_one_rank_quarantines_the_page_for_the_whole_pool() -> None:
    uncertain_rollback = [("map", 1), ("map_zero", 1)]
    with workers(2, inject={1: uncertain_rollback}) as (root, ranks):
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        with coordinator(mapper) as (pages, manager):
            with pytest.raises(MapQuarantinedError, match=r"rank 1 \(pp 0\) map"):
                manager.alloc(4)
            assert pages.state == "degraded" and pages.num_quarantined == 1
            assert manager.alloc(4) == [4, 5, 6, 7]  # page 0 is never handed out again
            assert [rank.state()["mapped"] for rank in ranks] == [[1], [1]]
            assert ranks[1].state()["quarantined"] == [0]


def test_a_restarted_worker_is_reached_again_on_a_fresh_connection() -> None:
    with workers(2) as (root, ranks):
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        mapper.map_pages([1])
        ranks[1].kill()
        replacement = WorkerProcess(root, 1).start()
        try:
            states = mapper.worker_states()  # the old connection to rank 1 is dead
            assert [state.mapped for state in states] == [[1], []]
            with pytest.raises(StateConsistencyError, match=r"rank 1 \(pp 0\) lacks pages \[1\]"):
                mapper.mapped_page_ids()
        finally:
            replacement.close()
            mapper.close()
