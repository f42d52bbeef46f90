"""A restarted coordinator: it finishes what the previous one left in doubt and adopts the
workers' pages, or refuses with the reason."""

from __future__ import annotations

import json

import pytest
from test_ipc_harness import BLOCK_BYTES, LOGICAL_PAGE_BYTES, PAGE, spawn, workers

from kvcached_core import native
from kvcached_core.errors import KVCachedConfigError, StateConsistencyError
from kvcached_core.ipc.coordinator import BroadcastMapper, RecoveryRefused
from kvcached_core.ledger import BlockLedger


def _raw_prepare(ranks: list, txn: int, page_ids: list[int]) -> None:  # type: ignore[type-arg]
    for rank in ranks:
        assert rank.call("prepare_unmap", txn=txn, page_ids=page_ids).ok


def test_a_coordinator_killed_mid_unmap_is_replaced_by_one_that_aborts_and_adopts() -> None:
    gate = {"command": "prepare_unmap", "when": "before"}
    with workers(2, gate={1: gate}) as (root, ranks):
        crashed = spawn("coordinator", {"root": str(root), "tp_size": 2, "blocks": 8})
        try:
            assert crashed.stdout is not None
            line = crashed.stdout.readline()
            assert line.startswith("allocated "), crashed.stderr.read() if crashed.stderr else ""
            assert json.loads(line.removeprefix("allocated ")) == list(range(8))
            ranks[1].wait_reached("prepare_unmap")  # rank 0 prepared, rank 1 about to
            crashed.kill()
            crashed.wait(10)
        finally:
            crashed.kill()
            crashed.wait(10)
            for stream in (crashed.stdout, crashed.stderr):
                if stream is not None:
                    stream.close()
        ranks[1].release("prepare_unmap")  # the request was delivered: rank 1 prepares late
        states = [rank.state() for rank in ranks]
        (txn,) = {state["pending_txn"] for state in states}
        assert txn is not None and all(state["mapped"] == [] for state in states)

        mapper = BroadcastMapper.for_job(root, tp_size=2)
        report = mapper.recover()
        assert report.resolved == {txn: "aborted"}
        assert report.adopted == [0, 1] and report.released == []
        for rank in ranks:
            state = rank.state()
            assert state["mapped"] == [0, 1] and state["pending_txn"] is None

        # The new pool keeps one adopted page warm and gives the other back on every rank.
        pages = native.PageAllocator(mapper, 0, 1, False, adopt_mapped=True)
        manager = BlockLedger(pages, BLOCK_BYTES, PAGE, set_aside_null_block=False)
        try:
            assert pages.reserved_page_ids() == [0]
            for rank in ranks:
                state = rank.state()
                assert state["mapped"] == [0]
                assert state["resident_bytes"] == LOGICAL_PAGE_BYTES
            assert manager.alloc(4) == [0, 1, 2, 3]
            assert (pages.reserve_hits, pages.reserve_misses) == (1, 0)
            # Transaction ids continue after the ones the workers remember.
            assert max(int(t) for t, _ in ranks[0].state()["txn_history"]) > txn
        finally:
            manager.shutdown()
            mapper.close()


def test_a_transaction_committed_on_some_rank_is_committed_everywhere() -> None:
    with workers(2) as (root, ranks):
        for rank in ranks:
            assert rank.call("map", page_ids=[2, 3]).ok
        _raw_prepare(ranks, 7, [2, 3])
        assert ranks[0].call("commit_unmap", txn=7).ok  # the old coordinator died here
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        report = mapper.recover()
        assert report.resolved == {7: "committed"} and report.adopted == []
        for rank in ranks:
            state = rank.state()
            assert state["mapped"] == [] and state["resident_bytes"] == 0
            assert dict(state["txn_history"]) == {7: "committed"}
        mapper.close()


def test_recovery_refuses_ranks_that_map_different_pages() -> None:
    with workers(2) as (root, ranks):
        for rank in ranks:
            assert rank.call("map", page_ids=[1]).ok
        assert ranks[0].call("map", page_ids=[4, 5]).ok
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        with pytest.raises(
            RecoveryRefused, match=r"rank 1 \(pp 0\) lacks pages \[4, 5\] that rank 0 \(pp 0\)"
        ):
            mapper.recover()
        with pytest.raises(StateConsistencyError, match="disagree on the mapped pages"):
            native.PageAllocator(mapper, 0, 4, False, adopt_mapped=True)
        assert [rank.state()["mapped"] for rank in ranks] == [[1, 4, 5], [1]]  # untouched
        mapper.close()


def test_recovery_can_release_the_pages_instead_of_adopting_them() -> None:
    with workers(2) as (root, ranks):
        for rank in ranks:
            assert rank.call("map", page_ids=[1, 2]).ok
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        with pytest.raises(KVCachedConfigError, match="adopt_mapped"):
            native.PageAllocator(mapper, 0, 4, False)  # pages are mapped: not silently taken
        report = mapper.recover(adopt=False)
        assert report.released == [1, 2] and report.adopted == []
        for rank in ranks:
            state = rank.state()
            assert state["mapped"] == [] and state["resident_bytes"] == 0
        pages = native.PageAllocator(mapper, 0, 4, False)
        assert pages.num_free == pages.num_total
        pages.stop()
        mapper.close()


def test_a_pending_transaction_blocks_a_new_pool_until_recovered() -> None:
    with workers(2) as (root, ranks):
        for rank in ranks:
            assert rank.call("map", page_ids=[6]).ok
        _raw_prepare(ranks[:1], 3, [6])  # only rank 0 heard the prepare
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        assert mapper.pending_txn() == 3
        with pytest.raises(KVCachedConfigError, match="transaction 3 is"):
            native.PageAllocator(mapper, 0, 4, False, adopt_mapped=True)
        report = mapper.recover()
        assert report.resolved == {3: "aborted"} and report.adopted == [6]
        # Rank 1 never saw the prepare; it recorded the abort, so a late prepare is refused.
        late = ranks[1].call("prepare_unmap", txn=3, page_ids=[6])
        assert not late.ok and "already aborted" in late.message
        mapper.close()


def test_recovery_refuses_quarantined_pages() -> None:
    uncertain_rollback = [("map", 1), ("map_zero", 1)]
    with workers(2, inject={1: uncertain_rollback}) as (root, ranks):
        failed = ranks[1].call("map", page_ids=[0])
        assert not failed.ok and failed.error_kind == "map_quarantined"
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        with pytest.raises(RecoveryRefused, match=r"rank 1 \(pp 0\) holds quarantined pages \[0\]"):
            mapper.recover()
        mapper.close()
