"""The elastic block pool's start-up rule and step-end release, over a minimal BlockPool.

The stand-in BlockPool has the interface the mixin relies on (its module docstring lists it);
the contract tests run the same mixin over vLLM's own classes.
"""

from __future__ import annotations

import os
import queue
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.integration.vllm import engine, make_block_pool, pools
from kvcached_core.integration.vllm.config import pool_name
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
    pools.register(pools.EnginePool(pool_name(), pool, BLOCKS_PER_PAGE, NUM_BLOCKS))
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
