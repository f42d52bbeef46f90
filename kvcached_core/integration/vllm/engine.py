"""Engine-side seams: the KV budget, engine steps (release epochs), allocation races, shutdown.

Each function is called from a place a build-time transform wrote into vLLM; what differs
between vLLM versions is passed in by that call site.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from kvcached_core.errors import KVCachedConfigError, PoolExhausted
from kvcached_core.integration.vllm import pools
from kvcached_core.integration.vllm.block_pool import ElasticBlockPoolMixin
from kvcached_core.integration.vllm.config import engine_settings, pool_name, virtual_kv_bytes

F = TypeVar("F", bound=Callable[..., Any])


def check_single_process(executor_backend: object, world_size: int) -> None:
    """Refuse configurations whose workers live outside the scheduler's process."""
    if executor_backend in (None, "uni") and world_size == 1:
        return
    raise KVCachedConfigError(
        "elastic KV cache (kvcached) needs the scheduler and the worker in one process: "
        f"this engine uses the {executor_backend!r} executor with world size {world_size}. "
        "Use one device with distributed_executor_backend='uni', or set KVCACHED_ENABLE=0 "
        "for the stock KV cache."
    )


def kv_cache_budget(
    available: list[int],
    *,
    block_bytes_per_layer: Iterable[int],
    user_kv_bytes: int | None,
    user_num_blocks: int | None,
    executor_backend: object,
    world_size: int,
) -> list[int]:
    """The KV bytes vLLM sizes its block table from: the virtual KV size.

    vLLM's own `kv_cache_memory_bytes` / `num_gpu_blocks_override` win when a user set them;
    otherwise `KVCACHED_VIRTUAL_SIZE` if set, else vLLM's profiled budget. The result is rounded
    down so that every layer region is whole kvcached pages (what the KV buffers need).
    """
    settings = engine_settings()
    if not settings.enabled:
        return available
    check_single_process(executor_backend, world_size)
    sizes = list(block_bytes_per_layer)
    if not sizes:
        return available
    virtual = virtual_kv_bytes()
    if virtual is not None and not user_kv_bytes and user_num_blocks is None:
        available = [virtual for _ in available]
    # A vLLM block is `size` (one plane) or `size // 2` (K/V planes) bytes of a layer region.
    smallest_unit = min(sizes) // 2 or 1
    blocks_per_page = max(1, settings.page_size // smallest_unit)
    block_all_layers = sum(sizes)
    quantum = block_all_layers * blocks_per_page
    rounded = [(budget // quantum) * quantum for budget in available]
    if any(r <= 0 for r in rounded):
        raise KVCachedConfigError(
            f"KV budget {available} holds less than one kvcached page of blocks "
            f"({quantum} bytes); raise it or lower KVCACHED_PAGE_SIZE"
        )
    return rounded


def _scheduler_block_pool(core: Any) -> ElasticBlockPoolMixin | None:
    # EngineCore.scheduler.kv_cache_manager.block_pool exists in every supported vLLM; the pool
    # is stock (and left alone) when elastic mode is off.
    block_pool = core.scheduler.kv_cache_manager.block_pool
    return block_pool if isinstance(block_pool, ElasticBlockPoolMixin) else None


class _ReleaseEpochs:
    """Release markers of one engine: pages go back once no queued batch may read them."""

    def __init__(self) -> None:
        self.markers: deque[int] = deque()


def released_after_step(*, pipelined: bool) -> Callable[[F], F]:
    """Decorate EngineCore.step / step_with_batch_queue: after each step give idle pages back.

    A page freed in step N is retired at epoch N; it is unmapped once every batch submitted by
    then has finished: at once after a synchronous step, after `batch_queue_size` more steps
    when batches are queued.
    """

    def decorate(step: F) -> F:
        @functools.wraps(step)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = step(self, *args, **kwargs)
            block_pool = _scheduler_block_pool(self)
            if block_pool is not None:
                lag = int(self.batch_queue_size) if pipelined else 0
                on_step_end(self, block_pool, lag)
            return result

        return wrapper  # type: ignore[return-value]

    return decorate


def on_step_end(core: Any, block_pool: ElasticBlockPoolMixin, lag: int) -> None:
    epochs: _ReleaseEpochs | None = getattr(core, "_kvcached_epochs", None)
    if epochs is None:
        epochs = _ReleaseEpochs()
        core._kvcached_epochs = epochs
    block_pool.release_idle_pages(int(core.scheduler.block_size))
    pool = block_pool._kv.pool
    epochs.markers.append(pool.capture_release_marker())
    while len(epochs.markers) > lag:
        pool.release_retired_through(epochs.markers.popleft())


def none_on_pool_exhausted(allocate_slots: F) -> F:
    """Decorate KVCacheManager.allocate_slots: a lost page race ends as "no blocks" (None).

    Another engine may take the last physical page between the capacity check and the
    allocation. Every block this call added to the request (new blocks, touched cached ones)
    is given back, so the scheduler preempts or waits as if the check had failed. Only
    PoolExhausted is handled; every other error stays fatal.
    """

    @functools.wraps(allocate_slots)
    def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        managers = self.coordinator.single_type_managers
        request_id = request.request_id
        before = [len(m.req_to_blocks.get(request_id, ())) for m in managers]
        try:
            return allocate_slots(self, request, *args, **kwargs)
        except PoolExhausted:
            for manager, count in zip(managers, before, strict=True):
                blocks = manager.req_to_blocks.get(request_id)
                if blocks is None or len(blocks) <= count:
                    continue
                added = blocks[count:]
                del blocks[count:]
                manager.block_pool.free_blocks(reversed(added))
            return None

    return wrapper  # type: ignore[return-value]


def close_on_shutdown(shutdown: F) -> F:
    """Decorate EngineCore.shutdown: release every page and remove the shared-memory record."""

    @functools.wraps(shutdown)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return shutdown(self, *args, **kwargs)
        finally:
            if engine_settings().enabled:
                pools.close(pool_name())

    return wrapper  # type: ignore[return-value]
