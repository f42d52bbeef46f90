"""The coordinator-worker protocol carried by an engine's own worker RPC (`RpcCarrier`).

Each rank is a `RankServer` over a real host-memory FTensorAllocator; the "engine RPC" is a
function that hands every broadcast to each worker's `answer_addressed`, as vLLM's
`collective_rpc` runs `answer_broadcast` in each worker process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from kvcached_core import native
from kvcached_core.errors import PoolExhausted, StateConsistencyError
from kvcached_core.ipc.coordinator import BroadcastMapper, RpcCarrier, WorkerCallError
from kvcached_core.ipc.paths import RankId, job_ranks
from kvcached_core.ipc.protocol import Command, Request, encode_request
from kvcached_core.ipc.worker import (
    RankServer,
    answer_broadcast,
    serve_in_process,
    withdraw_in_process,
)
from kvcached_core.ledger import BlockLedger

PAGE = 64 * 1024
PAGES = 16
LAYERS, BUFFERS = 2, 2
BLOCK_BYTES = PAGE // 4


class Rank:
    """One worker: its tensors in host memory, answered by a RankServer."""

    def __init__(self, rank: int, pp_rank: int = 0) -> None:
        self.backend = native.host_backend()
        self.allocator = native.FTensorAllocator(self.backend, PAGE, False)
        self.allocator.create_kv_tensors(PAGE * PAGES, LAYERS, BUFFERS)
        self.server = RankServer(self.allocator, rank, pp_rank,
                                 resident_bytes=self.backend.committed_bytes)

    def mapped(self) -> list[int]:
        return sorted(int(i) for i in self.allocator.mapped_page_ids())


Broadcast = Callable[[dict[str, bytes], float], Sequence[Any]]


def engine_rpc(ranks: Sequence[Rank], calls: list[dict[str, bytes]]) -> Broadcast:
    def broadcast(frames: dict[str, bytes], timeout: float) -> list[Any]:
        assert timeout > 0
        calls.append(frames)
        return [rank.server.answer_addressed(frames) for rank in ranks]

    return broadcast


@contextmanager
def ledger_over(mapper: BroadcastMapper) -> Iterator[tuple[native.PageAllocator, BlockLedger]]:
    pages = native.PageAllocator(mapper, 0, 0, False)
    ledger = BlockLedger(pages, BLOCK_BYTES, PAGE, set_aside_null_block=False)
    try:
        yield pages, ledger
    finally:
        ledger.shutdown()
        mapper.close()


def test_pages_map_and_unmap_on_every_rank_with_one_call_per_exchange() -> None:
    ranks = [Rank(r, pp) for pp in range(2) for r in range(2)]
    calls: list[dict[str, bytes]] = []
    mapper = BroadcastMapper(RpcCarrier(job_ranks(2, 2), engine_rpc(ranks, calls)))
    assert mapper.num_logical_pages() == PAGES
    assert mapper.logical_page_bytes() == 4 * PAGE * LAYERS * BUFFERS
    with ledger_over(mapper) as (pages, ledger):
        calls.clear()
        blocks = ledger.alloc(10)  # 4 blocks a page: pages 0, 1, 2
        assert [rank.mapped() for rank in ranks] == [[0, 1, 2]] * 4
        assert len(calls) == 1 and sorted(calls[0]) == ["0/0", "0/1", "1/0", "1/1"]
        ledger.free(blocks)
        # The two-phase unmap: a prepare and a commit, each one broadcast to all four ranks.
        assert [rank.mapped() for rank in ranks] == [[]] * 4
        assert len(calls) == 3
        assert pages.state == "healthy" and pages.unmap_calls == 1
        assert [state.mapped for state in mapper.worker_states()] == [[]] * 4


def test_a_failed_map_on_one_rank_is_rolled_back_on_the_others_and_is_recoverable() -> None:
    ranks = [Rank(0), Rank(1)]
    ranks[1].backend.inject_failure("map", nth=6)  # in rank 1's second map call
    mapper = BroadcastMapper(RpcCarrier(job_ranks(2), engine_rpc(ranks, [])))
    with ledger_over(mapper) as (pages, ledger):
        first = ledger.alloc(4)
        with pytest.raises(PoolExhausted, match=r"rank 1 \(pp 0\) map.*rolled back"):
            ledger.alloc(8)
        assert [rank.mapped() for rank in ranks] == [[0], [0]]
        assert pages.state == "healthy"
        assert ledger.alloc(8)
        ledger.free(first)


def test_an_rpc_that_fails_leaves_every_rank_unknown_and_the_pool_stops() -> None:
    ranks = [Rank(0), Rank(1)]
    healthy = engine_rpc(ranks, [])
    broken = {"now": False}

    def broadcast(frames: dict[str, bytes], timeout: float) -> Sequence[Any]:
        if broken["now"]:
            raise RuntimeError("The actor died unexpectedly before finishing this task.")
        return healthy(frames, timeout)

    mapper = BroadcastMapper(RpcCarrier(job_ranks(2), broadcast))
    with ledger_over(mapper) as (pages, ledger):
        broken["now"] = True
        with pytest.raises(StateConsistencyError,
                           match=r"rank 0 \(pp 0\) map: connection failed: The actor died"):
            ledger.alloc(4)
        assert pages.state == "failed"


def test_a_rank_no_worker_serves_is_refused_at_the_handshake_by_name() -> None:
    ranks = [Rank(0)]
    with pytest.raises(WorkerCallError,
                       match=r"rank 1 \(pp 0\) hello: unreachable.*no worker process"):
        BroadcastMapper(RpcCarrier(job_ranks(2), engine_rpc(ranks, [])))


def test_a_worker_process_answers_only_its_own_jobs_broadcasts() -> None:
    rank = Rank(1)
    frame = encode_request(Request(7, Command.HELLO.value, {}))
    serve_in_process("job-a", rank.server)
    try:
        with pytest.raises(Exception, match="already serves a rank of job 'job-a'"):
            serve_in_process("job-a", Rank(0).server)
        assert answer_broadcast("job-b", {RankId(1, 0).key: frame}) is None
        assert answer_broadcast("job-a", {RankId(0, 0).key: frame}) is None  # not its rank
        answer = answer_broadcast("job-a", {RankId(1, 0).key: frame})
        assert answer is not None and (answer["rank"], answer["pp_rank"]) == (1, 0)
        assert b'"protocol":1' in answer["reply"] and b'"id":7' in answer["reply"]
        bad = answer_broadcast("job-a", {RankId(1, 0).key: frame[:-1]})
        assert bad is not None and b'"kind":"protocol"' in bad["reply"]
    finally:
        withdraw_in_process("job-a")
    assert answer_broadcast("job-a", {RankId(1, 0).key: frame}) is None
