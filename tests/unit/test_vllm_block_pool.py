"""The elastic block pool's start-up rule and step-end release, over a minimal BlockPool.

The stand-in BlockPool has the interface the mixin relies on (its module docstring lists it);
the contract tests run the same mixin over vLLM's own classes.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvcached_core.errors import KVCachedConfigError, PoolExhausted
from kvcached_core.integration.vllm import engine, make_block_pool, pools
from kvcached_core.integration.vllm.config import pool_name
from kvcached_core.layout import BlockTiling
from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec

PAGE = 4096
BLOCKS_PER_PAGE = 4
NUM_PAGES = 8
NUM_BLOCKS = BLOCKS_PER_PAGE * NUM_PAGES


class _Block:
    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash = None


class _FreeQueue:
    def __init__(self, blocks: Iterable[_Block]) -> None:
        self._blocks = deque(blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._blocks)

    def popleft(self) -> _Block:
        return self._blocks.popleft()

    def append(self, block: _Block) -> None:
        self._blocks.append(block)

    def remove(self, block: _Block) -> None:
        self._blocks.remove(block)


class StandInBlockPool:
    """vLLM's BlockPool as far as the elastic mixin uses it (no prefix caching)."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = False) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [_Block(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = _FreeQueue(self.blocks[1:])  # block 0: the null block

    def get_new_blocks(self, num_blocks: int) -> list[_Block]:
        chosen = [self.free_block_queue.popleft() for _ in range(num_blocks)]
        for block in chosen:
            block.ref_cnt += 1
        return chosen

    def free_blocks(self, ordered_blocks: Iterable[_Block]) -> None:
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)


@pytest.fixture
def engine_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in [k for k in os.environ if k.startswith("KVCACHED_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_POOL_NAME", "block-pool-test")
    yield
    pools.close_all()


def _register_pool() -> KVPool:
    pool = KVPool.create(
        pool_name(), PoolSpec(1, 1, PAGE, NUM_PAGES * PAGE, PAGE),
        PoolPolicy(min_reserve_pages=0, max_reserve_pages=0, prealloc=False,
                   defer_physical_release=True),
        share_limits=False, export_metrics=False,
    )
    pools.register(pools.EnginePool(pool_name(), pool, BlockTiling(PAGE // BLOCKS_PER_PAGE, PAGE),
                                    NUM_BLOCKS))
    return pool


def test_an_elastic_scheduler_without_vmm_backed_kv_buffers_refuses_to_start(
    engine_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(KVCachedConfigError, match="no VMM-backed KV pool 'block-pool-test'"):
        make_block_pool(StandInBlockPool, NUM_BLOCKS)
    # Elastic off: the stock class, untouched.
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    assert type(make_block_pool(StandInBlockPool, NUM_BLOCKS)) is StandInBlockPool
    # A process declared to run a scheduler only gets its host-memory ledger.
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    monkeypatch.setenv("KVCACHED_SCHEDULER_ONLY", "1")
    block_pool: Any = make_block_pool(StandInBlockPool, NUM_BLOCKS)
    assert block_pool._kv.private
    assert len(block_pool.get_new_blocks(3)) == 3
    # KV buffers allocated on their own in such a process (vLLM's tests do) register a pool;
    # the next schedulers still get ledgers of their own, never that pool.
    _register_pool()
    try:
        for _ in range(2):
            other: Any = make_block_pool(StandInBlockPool, NUM_BLOCKS)
            assert other._kv.private
        assert not pools.lookup(pool_name()).attached
    finally:
        pools.close(pool_name())


# MLA-like blocks that do not tile a page: 5 KiB blocks on 12 KiB pages. Page p holds the
# blocks wholly inside [12p, 12p + 12) KiB: page 0 blocks 0 and 1, block 2 (10-15 KiB)
# straddles two pages, and so do blocks 4, 7 and 9; block 12 (60-65) starts page 5.
STRADDLE_PAGE = 12 << 10
STRADDLE_BLOCK = 5 << 10


def test_blocks_that_straddle_two_pages_are_never_handed_out(engine_env: None) -> None:
    """A block size stock vLLM accepts is never refused: where blocks do not tile pages, the
    pool hands out only blocks lying wholly in a backed page, and reports as free exactly
    what it could hand out."""
    tiling = BlockTiling(STRADDLE_BLOCK, STRADDLE_PAGE)
    pages = 6
    num_blocks = pages * STRADDLE_PAGE // STRADDLE_BLOCK  # 14 blocks over 6 pages
    pool = KVPool.create(
        pool_name(), PoolSpec(1, 1, STRADDLE_PAGE, pages * STRADDLE_PAGE, 4096),
        PoolPolicy(min_reserve_pages=0, max_reserve_pages=0, prealloc=False,
                   defer_physical_release=True),
        share_limits=False, export_metrics=False,
    )
    pools.register(pools.EnginePool(pool_name(), pool, tiling, num_blocks))
    straddling = {b for b in range(num_blocks) if tiling.page_of(b) is None}
    assert straddling == {2, 4, 7, 9}
    block_pool: Any = make_block_pool(StandInBlockPool, num_blocks)
    usable = num_blocks - len(straddling)
    assert block_pool.get_num_free_blocks() <= usable - 1  # less the null block
    handed = block_pool.get_new_blocks(usable - 1)
    ids = sorted(b.block_id for b in handed)
    assert not set(ids) & straddling and 0 not in ids
    assert ids == sorted(set(range(1, num_blocks)) - straddling)
    assert block_pool.get_num_free_blocks() == 0
    with pytest.raises((PoolExhausted, ValueError)):
        block_pool.get_new_blocks(1)
    # Every page is mapped while its blocks live, and all but the null block's page go back.
    assert pool.snapshot().in_use_pages == pages
    block_pool.free_blocks(handed)
    block_pool.end_step(block_tokens=16, lag=0, is_drained=lambda: True)
    assert pool.snapshot().in_use_pages == 1


class StandInLIFOBlockPool(StandInBlockPool):
    """vLLM 0.23's free_blocks: `prepend` puts the freed blocks at the front for reuse."""

    def free_blocks(self, ordered_blocks: Iterable[_Block], prepend: bool = False) -> None:
        blocks = list(ordered_blocks)
        super().free_blocks(blocks)
        if prepend:
            freed = [b for b in blocks if b.ref_cnt == 0]
            queued = self.free_block_queue._blocks
            for block in freed:
                queued.remove(block)
            queued.extendleft(reversed(freed))


def test_the_release_s_own_free_options_reach_its_block_pool(engine_env: None) -> None:
    _register_pool()
    block_pool: Any = make_block_pool(StandInLIFOBlockPool, NUM_BLOCKS)
    blocks = block_pool.get_new_blocks(5)
    block_pool.free_blocks(blocks[2:4], prepend=True)
    # The freed blocks are handed out first again.
    assert [b.block_id for b in block_pool.get_new_blocks(2)] == [3, 4]


def test_a_pool_backs_one_block_pool_only(engine_env: None) -> None:
    _register_pool()
    make_block_pool(StandInBlockPool, NUM_BLOCKS)
    with pytest.raises(KVCachedConfigError, match="already backs another block pool"):
        make_block_pool(StandInBlockPool, NUM_BLOCKS)


def test_step_end_releases_pages_after_the_lag_and_writes_nothing_onto_the_engine(
    engine_env: None,
) -> None:
    pool = _register_pool()
    block_pool: Any = make_block_pool(StandInBlockPool, NUM_BLOCKS)
    blocks = block_pool.get_new_blocks(8)  # the rest of the null block's page, two more
    assert pool.snapshot().in_use_pages == 3
    scheduler = SimpleNamespace(block_size=16, has_unfinished_requests=lambda: False)
    # A batch queue of size 1 (lag 1) with a batch still in flight: the pages freed in this
    # step outlive one more step.
    core = SimpleNamespace(scheduler=scheduler, batch_queue=deque([object()]))
    before = dict(vars(core))
    block_pool.free_blocks(blocks)
    engine.on_step_end(core, block_pool, 1)
    assert pool.snapshot().in_use_pages == 3
    engine.on_step_end(core, block_pool, 1)
    assert pool.snapshot().in_use_pages == 1
    assert vars(core) == before


@pytest.mark.parametrize("in_flight", [deque(), queue.Queue()], ids=["deque", "Queue"])
def test_a_drained_pipelined_engine_releases_its_pages_in_its_last_step(
    engine_env: None, in_flight: Any,
) -> None:
    """The step that completes the last batch leaves an idle engine: nothing would release
    the pages it retired later, since an idle engine takes no further step."""
    pool = _register_pool()
    block_pool: Any = make_block_pool(StandInBlockPool, NUM_BLOCKS)
    blocks = block_pool.get_new_blocks(8)
    unfinished = [True]
    scheduler = SimpleNamespace(block_size=16, has_unfinished_requests=lambda: unfinished[0])
    core = SimpleNamespace(scheduler=scheduler, batch_queue=in_flight)
    block_pool.free_blocks(blocks)
    engine.on_step_end(core, block_pool, 2)  # another request still runs: pages kept
    assert pool.snapshot().in_use_pages == 3
    unfinished[0] = False
    engine.on_step_end(core, block_pool, 2)  # the last step: drained, released at once
    assert pool.snapshot().in_use_pages == 1


def test_an_in_process_engine_idle_after_its_burst_releases_the_pages_of_its_queued_batch(
    engine_env: None,
) -> None:
    """The in-process LLM stops stepping once every request finished, leaving the batch that
    was scheduled ahead in the queue: the last step waits for that batch to finish on the
    device and then releases its pages, instead of keeping the working set while idle."""
    pool = _register_pool()
    block_pool: Any = make_block_pool(StandInBlockPool, NUM_BLOCKS)
    blocks = block_pool.get_new_blocks(8)
    ahead: Future[str] = Future()
    exec_done: Future[None] = Future()
    exec_done.set_result(None)
    scheduler = SimpleNamespace(block_size=16, has_unfinished_requests=lambda: False)
    core = SimpleNamespace(scheduler=scheduler,
                           batch_queue=deque([(ahead, "scheduler output", exec_done)]))
    finisher = threading.Timer(0.2, ahead.set_result, args=("model output",))
    finisher.start()
    block_pool.free_blocks(blocks)
    engine.on_step_end(core, block_pool, 2)
    assert ahead.done()  # waited for, not abandoned
    assert pool.snapshot().in_use_pages == 1
    assert len(core.batch_queue) == 1  # the engine's next step still collects it


def test_a_queued_batch_that_failed_keeps_its_pages_for_the_next_step_to_report(
    engine_env: None,
) -> None:
    pool = _register_pool()
    block_pool: Any = make_block_pool(StandInBlockPool, NUM_BLOCKS)
    blocks = block_pool.get_new_blocks(8)
    failed: Future[str] = Future()
    failed.set_exception(RuntimeError("device error"))
    scheduler = SimpleNamespace(block_size=16, has_unfinished_requests=lambda: False)
    core = SimpleNamespace(scheduler=scheduler, batch_queue=deque([(failed, "output")]))
    block_pool.free_blocks(blocks)
    engine.on_step_end(core, block_pool, 2)
    assert pool.snapshot().in_use_pages == 3


class _StandInManager:
    """A single-type manager as far as `none_on_pool_exhausted` restores it."""

    def __init__(self, block_pool: Any) -> None:
        self.block_pool = block_pool
        self.req_to_blocks: dict[str, list[Any]] = {}
        self.num_cached_block: dict[str, int] = {}


class _StandInKVCacheManager:
    def __init__(self, block_pool: Any) -> None:
        self.coordinator = SimpleNamespace(block_pool=block_pool,
                                           single_type_managers=(_StandInManager(block_pool),))
        self.calls = 0

    @engine.none_on_pool_exhausted
    def allocate_slots(self, request: Any, num_new_tokens: int,
                       num_lookahead_tokens: int = 0) -> list[Any]:
        """Like vLLM's: the per-request record changes, then blocks for the new tokens."""
        self.calls += 1
        manager = self.coordinator.single_type_managers[0]
        held = manager.req_to_blocks.setdefault(request.request_id, [])
        manager.num_cached_block[request.request_id] = len(held) + 100  # changed, then...
        tokens = len(held) * 16 + num_new_tokens + num_lookahead_tokens
        new = self.coordinator.block_pool.get_new_blocks(-(-tokens // 16) - len(held))
        held.extend(new)
        manager.num_cached_block[request.request_id] = len(held)
        return new


def test_a_decode_allocation_within_held_pages_and_one_that_loses_a_page_race(
    engine_env: None,
) -> None:
    pool = _register_pool()
    block_pool: Any = make_block_pool(StandInBlockPool, NUM_BLOCKS)
    manager = _StandInKVCacheManager(block_pool)
    core = SimpleNamespace(scheduler=SimpleNamespace(block_size=16,
                                                     has_unfinished_requests=lambda: True),
                           batch_queue=None)
    engine.on_step_end(core, block_pool, 0)  # the pool learns the block size
    request = SimpleNamespace(request_id="A")
    assert len(manager.allocate_slots(request, 16)) == 1  # the null block's page has room
    assert block_pool.make_room_in_held_pages(1, 1)
    assert pool.snapshot().in_use_pages == 1
    # A competitor takes every other page: an allocation that needs a new page loses the race
    # inside the call and leaves the request as it was, per-request record included.
    pool.set_limit(pool.snapshot().in_use_pages * PAGE)
    assert not block_pool.make_room_in_held_pages(64, 1)
    assert manager.allocate_slots(request, 64) is None
    stand_in = manager.coordinator.single_type_managers[0]
    assert [b.block_id for b in stand_in.req_to_blocks["A"]] == [1]
    assert stand_in.num_cached_block["A"] == 1
    # Within the held page, the same request grows with no snapshot and no new page.
    assert len(manager.allocate_slots(request, 16)) == 1
    assert stand_in.num_cached_block["A"] == 2 and pool.snapshot().in_use_pages == 1


def test_with_vllms_own_block_pool_allocate_slots_is_vllms_own() -> None:
    """KVCACHED_ENABLE=0: the stock pool never loses a page race, so the wrapper neither reads
    nor saves any per-request record (it costs nothing per request and step) and an error
    from the allocation is vLLM's, not turned into "no blocks"."""

    class StockKVCacheManager:
        # No single_type_managers: reading them (the snapshot) would raise AttributeError.
        coordinator = SimpleNamespace(block_pool=object())

        @engine.none_on_pool_exhausted
        def allocate_slots(self, request: Any, num_new_tokens: int) -> Any:
            if num_new_tokens < 0:
                raise PoolExhausted("only an elastic pool raises this")
            return [request.request_id] * num_new_tokens

    manager = StockKVCacheManager()
    assert manager.allocate_slots(SimpleNamespace(request_id="A"), 2) == ["A", "A"]
    with pytest.raises(PoolExhausted):
        manager.allocate_slots(SimpleNamespace(request_id="A"), -1)


def test_chosen_blocks_hand_out_exactly_the_chosen_blocks_in_order() -> None:
    """vLLM's get_new_blocks takes blocks with popleft_n (>= 0.10) or popleft (0.9): the
    stand-in queue gives exactly the elastic pool's choice, in order, and never more."""
    from kvcached_core.integration.vllm.block_pool import _ChosenBlocks

    chosen = _ChosenBlocks(["b3", "b7", "b9"])
    assert chosen.popleft() == "b3"
    assert chosen.popleft_n(2) == ["b7", "b9"]
    assert chosen.num_free_blocks == 0
    with pytest.raises(ValueError):
        chosen.popleft_n(1)


def test_a_burst_after_an_idle_spell_passes_over_no_block_of_a_page_given_back(
    engine_env: None,
) -> None:
    """Bursts with idle gaps get the same low pages back each time: their first allocations
    take blocks of those pages straight from the queue instead of passing over the blocks of
    pages given back (which would sit at the queue's tail) or of pages never used (ahead of
    them, from start); the walk that parks those happens once, at the first idle step end."""
    pool = _register_pool()
    block_pool: Any = make_block_pool(StandInBlockPool, NUM_BLOCKS)
    idle = SimpleNamespace(scheduler=SimpleNamespace(block_size=16,
                                                     has_unfinished_requests=lambda: False),
                           batch_queue=None)
    popped: list[int] = []
    queue = block_pool.free_block_queue
    popleft = queue.popleft

    def counting_popleft() -> _Block:
        block = popleft()
        popped.append(block.block_id)
        return block

    queue.popleft = counting_popleft
    for burst in range(3):
        popped.clear()
        taken = [block_pool.get_new_blocks(1)[0] for _ in range(9)]  # 3 pages' worth
        assert all(block.block_id // BLOCKS_PER_PAGE in block_pool._kv_held for block in taken)
        if burst > 0:
            assert popped == [block.block_id for block in taken]  # none passed over
        block_pool.free_blocks(taken)
        engine.on_step_end(idle, block_pool, 0)  # idle: the pages go back
        assert pool.snapshot().in_use_pages == 1
        assert {b.block_id // BLOCKS_PER_PAGE for b in queue._blocks} == {0}
    assert block_pool.get_num_free_blocks() == NUM_BLOCKS - 1
