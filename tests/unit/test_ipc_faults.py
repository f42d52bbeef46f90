"""Faults in the two-phase unmap and in shutdown, with real worker processes."""

from __future__ import annotations

import threading
import time

import pytest
from test_ipc_harness import (
    BLOCK_BYTES,
    LOGICAL_PAGE_BYTES,
    PAGE,
    WorkerProcess,
    socket_root,
    workers,
)

from kvcached_core import native
from kvcached_core.errors import StateConsistencyError
from kvcached_core.ipc.coordinator import TIMEOUT_ENV, BroadcastMapper
from kvcached_core.ledger import BlockLedger


def _history(state: dict[str, object]) -> dict[int, str]:
    return {int(txn): str(outcome) for txn, outcome in state["txn_history"]}  # type: ignore[attr-defined]


def test_a_worker_killed_mid_prepare_aborts_everywhere_without_losing_a_page() -> None:
    gate = {"command": "prepare_unmap", "when": "after"}  # rank 1 prepared, not yet answered
    with workers(2, gate={1: gate}) as (root, (rank0, rank1)):
        mapper = BroadcastMapper.for_job(root, tp_size=2, retry_delay_s=0.01)
        pages = native.PageAllocator(mapper, 0, 0, False)
        manager = BlockLedger(pages, BLOCK_BYTES, PAGE, set_aside_null_block=False)
        try:
            blocks = manager.alloc(8)  # pages 0 and 1 on both ranks
            assert rank0.state()["mapped"] == [0, 1]
            failure: list[BaseException] = []

            def free() -> None:
                try:
                    manager.free(blocks)
                except BaseException as exc:  # checked below
                    failure.append(exc)

            freeing = threading.Thread(target=free)
            freeing.start()
            rank1.wait_reached("prepare_unmap")
            rank1.kill()
            freeing.join(30)
            assert not freeing.is_alive()

            assert len(failure) == 1 and isinstance(failure[0], StateConsistencyError)
            message = str(failure[0])
            assert "rank 1 (pp 0) prepare_unmap: connection failed" in message
            assert "abort could not be confirmed" in message
            assert "rank 1 (pp 0) abort_unmap: cannot connect" in message

            # The survivor put its pages back: still mapped, backed once, nothing pending.
            state = rank0.state()
            assert state["mapped"] == [0, 1]
            assert state["resident_bytes"] == 2 * LOGICAL_PAGE_BYTES
            assert state["pending_txn"] is None
            (txn,) = _history(state)
            assert _history(state) == {txn: "aborted"}
            # A repeated abort is a no-op; a commit of the aborted transaction is refused and
            # releases nothing (no double release).
            assert rank0.call("abort_unmap", txn=txn).ok
            refused = rank0.call("commit_unmap", txn=txn)
            assert not refused.ok and "aborted" in refused.message
            assert rank0.state()["resident_bytes"] == 2 * LOGICAL_PAGE_BYTES

            assert pages.state == "failed"
            with pytest.raises(StateConsistencyError, match="refuses work"):
                manager.alloc(1)
        finally:
            manager.shutdown()
            mapper.close()


def test_a_failed_prepare_aborts_on_every_rank() -> None:
    with workers(2) as (root, (rank0, rank1)):
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        mapper.map_pages([3, 4])
        assert rank1.call("unmap", page_ids=[4]).ok  # rank 1 no longer maps page 4
        with pytest.raises(
            StateConsistencyError,
            match=r"prepare failed, aborted on every rank.*rank 1 \(pp 0\) prepare_unmap: "
            r"state_consistency: page id 4 is not mapped",
        ):
            mapper.unmap_pages([3, 4])
        state0, state1 = rank0.state(), rank1.state()
        assert state0["mapped"] == [3, 4] and state0["pending_txn"] is None
        assert state1["mapped"] == [3] and state1["pending_txn"] is None
        (txn,) = _history(state0)
        assert _history(state0) == _history(state1) == {txn: "aborted"}
        assert mapper.pending_txn() is None
        mapper.close()


def test_duplicate_commit_and_abort_are_no_ops() -> None:
    with workers(2) as (root, ranks):
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        mapper.map_pages([0, 1, 2])

        mapper.prepare_unmap(10, [0, 1])
        assert mapper.pending_txn() == 10
        assert [rank.state()["mapped"] for rank in ranks] == [[2], [2]]
        mapper.commit_unmap(10)
        mapper.commit_unmap(10)  # duplicate: nothing happens
        for rank in ranks:
            assert rank.call("commit_unmap", txn=10).ok
            state = rank.state()
            assert state["mapped"] == [2]
            assert state["resident_bytes"] == LOGICAL_PAGE_BYTES  # released exactly once
        with pytest.raises(StateConsistencyError, match="refused: it was committed"):
            mapper.abort_unmap(10)

        mapper.prepare_unmap(11, [2])
        mapper.abort_unmap(11)
        mapper.abort_unmap(11)  # duplicate: nothing happens
        for rank in ranks:
            state = rank.state()
            assert state["mapped"] == [2] and state["resident_bytes"] == LOGICAL_PAGE_BYTES
            assert _history(state) == {10: "committed", 11: "aborted"}
        with pytest.raises(StateConsistencyError, match="refused: it was aborted"):
            mapper.commit_unmap(11)
        mapper.close()


def test_a_late_prepare_after_an_abort_is_rejected() -> None:
    with workers(2) as (root, ranks):
        mapper = BroadcastMapper.for_job(root, tp_size=2)
        mapper.map_pages([5])
        mapper.abort_unmap(20)  # no rank saw a prepare: each records the abort
        with pytest.raises(StateConsistencyError, match="rejected: it was already aborted"):
            mapper.prepare_unmap(20, [5])
        for rank in ranks:
            state = rank.state()
            assert state["mapped"] == [5] and state["pending_txn"] is None
            late = rank.call("prepare_unmap", txn=20, page_ids=[5])
            assert not late.ok and late.error_kind == "state_consistency"
        mapper.close()


def test_an_unanswered_commit_is_retried_never_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = {"command": "commit_unmap", "when": "before"}
    with workers(2, gate={1: gate}) as (root, (rank0, rank1)):
        monkeypatch.setenv(TIMEOUT_ENV, "0.4")
        mapper = BroadcastMapper.for_job(root, tp_size=2, commit_attempts=8, retry_delay_s=0.02)
        mapper.map_pages([1, 2])

        def release_after_a_timeout() -> None:
            rank1.wait_reached("commit_unmap")
            time.sleep(0.6)  # the first commit attempt has timed out by now
            rank1.release("commit_unmap")

        releaser = threading.Thread(target=release_after_a_timeout)
        releaser.start()
        mapper.unmap_pages([1, 2])
        releaser.join(10)
        for rank in (rank0, rank1):
            state = rank.state()
            assert state["mapped"] == [] and state["resident_bytes"] == 0
            assert list(_history(state).values()) == ["committed"]
        mapper.close()


def test_shutdown_drains_the_call_in_flight_before_removing_the_socket() -> None:
    gate = {"command": "map_pages", "when": "before"}
    with socket_root() as root:
        worker = WorkerProcess(root, 0, gate=gate).start()
        try:
            mapper = BroadcastMapper.for_job(root, tp_size=1)
            result: list[list[int]] = []
            mapping = threading.Thread(target=lambda: result.append(mapper.map_pages([3])))
            mapping.start()
            worker.wait_reached("map_pages")
            worker.terminate()  # the worker calls listener.stop() while the map is running
            time.sleep(0.3)
            assert worker.path.exists()  # not removed while the call is in flight
            worker.release("map_pages")
            mapping.join(10)
            assert result == [[3]]  # the call in flight finished and was answered
            assert worker.process is not None and worker.process.stdout is not None
            assert worker.process.stdout.readline().strip() == "stopped True socket_exists False"
            assert worker.process.wait(10) == 0
            assert not root.exists()  # the emptied socket directory is gone too
            mapper.close()
        finally:
            worker.close()


def test_shutdown_that_cannot_drain_in_time_keeps_the_socket_and_can_be_retried() -> None:
    gate = {"command": "map_pages", "when": "before"}
    with socket_root() as root:
        worker = WorkerProcess(root, 0, gate=gate, stop_timeout_s=0.2).start()
        try:
            assert worker.process is not None and worker.process.stdout is not None
            caller = threading.Thread(target=lambda: worker.call("map", page_ids=[1]))
            caller.start()
            worker.wait_reached("map_pages")
            worker.terminate()
            assert worker.process.stdout.readline().strip() == "stopped False socket_exists True"
            assert worker.path.exists()
            worker.release("map_pages")
            caller.join(10)
            lines = [worker.process.stdout.readline().strip() for _ in range(8)]
            assert "stopped True socket_exists False" in lines
            assert worker.process.wait(10) == 0
            assert not worker.path.exists()
        finally:
            worker.close()
