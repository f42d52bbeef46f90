"""The KV pools of this process, shared by vLLM's worker (which creates them) and scheduler.

When scheduler and worker run in one process (the uni executor), the worker creates the pool
while allocating its KV buffers and the scheduler's block pool attaches to it by name. When the
workers live in other processes (the mp executor), each worker registers the pool of its own
tensors and serves it on its rank's socket, and the scheduler registers a pool with no tensors
that maps through every rank (`workers.py`). A process declared to run a scheduler only
(`KVCACHED_SCHEDULER_ONLY=1`: vLLM's own scheduler tests, offline planning) gets a private host
pool with the same number of blocks, so it runs the same elastic code paths; otherwise a
scheduler with no pool refuses to start (its KV buffers would not be VMM-backed).
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.layout import BlockTiling
from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec
from kvcached_core.settings import KVCachedSettings

# A private pool's vLLM block is this many bytes of a 4 KiB host page: one page then holds
# every block of a unit-test-sized pool, so the ledger never constrains which id vLLM picks.
_PRIVATE_BLOCK_BYTES = 1
_PRIVATE_PAGE_BYTES = 4096


@dataclass
class EnginePool:
    """A kvcached pool seen as vLLM blocks: ledger page `p` holds vLLM blocks
    `tiling.blocks_of(p)` (`[p*k, (p+1)*k)` when blocks tile pages)."""

    name: str
    pool: KVPool
    tiling: BlockTiling
    num_blocks: int
    private: bool = False
    attached: bool = False
    #: Scheduler of a job with worker processes: the BroadcastMapper its pages go through.
    mapper: Any = None
    #: Worker of such a job: stops serving this rank's tensors (before they are torn down).
    stop_serving: Callable[[], None] | None = None
    #: Scheduler of such a job: closes the coordinator and withdraws the job (after the pool).
    detach: Callable[[], None] | None = None

    def close(self) -> None:
        if self.stop_serving is not None:
            self.stop_serving()
        try:
            self.pool.close()
        finally:
            if self.detach is not None:
                self.detach()


_lock = threading.Lock()
_pools: dict[str, EnginePool] = {}


def register(engine_pool: EnginePool) -> None:
    with _lock:
        if engine_pool.name in _pools:
            raise KVCachedConfigError(
                f"a KV pool named {engine_pool.name!r} already exists in this process; set "
                "KVCACHED_POOL_NAME to tell engines apart"
            )
        _pools[engine_pool.name] = engine_pool


def lookup(name: str) -> EnginePool | None:
    with _lock:
        return _pools.get(name)


def engine_pools() -> list[EnginePool]:
    """The worker-created pools of this process (for diagnostics and tests)."""
    with _lock:
        return [p for p in _pools.values() if not p.private]


def close(name: str) -> None:
    """Release every page of the pool and remove its shared-memory record."""
    with _lock:
        engine_pool = _pools.pop(name, None)
    if engine_pool is not None:
        engine_pool.close()


def close_all() -> None:
    with _lock:
        names = list(_pools)
    for name in names:
        close(name)


atexit.register(close_all)


def private_pool(num_blocks: int, settings: KVCachedSettings) -> EnginePool:
    """A host pool for a scheduler-only process (`KVCACHED_SCHEDULER_ONLY=1`; never registered)."""
    tiling = BlockTiling(_PRIVATE_BLOCK_BYTES, _PRIVATE_PAGE_BYTES)
    pages = tiling.pages_for(num_blocks)
    pool = KVPool.create(
        "vllm-scheduler",
        PoolSpec(1, 1, _PRIVATE_PAGE_BYTES, pages * _PRIVATE_PAGE_BYTES, _PRIVATE_PAGE_BYTES),
        PoolPolicy(min_reserve_pages=0, max_reserve_pages=0, prealloc=False,
                   physical_limit_bytes=settings.physical_limit_bytes),
        share_limits=False,
        export_metrics=False,
    )
    return EnginePool("vllm-scheduler", pool, tiling, num_blocks, private=True)
