"""Engine-side seams: the KV budget, engine steps (release epochs), allocation races, shutdown.

Each function is called from a place a build-time transform wrote into vLLM; what differs
between vLLM versions is passed in by that call site.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import queue
import weakref
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from enum import StrEnum
from typing import Any, Literal, TypeVar

from kvcached_core.errors import KVCachedConfigError, PoolExhausted
from kvcached_core.integration.vllm import pools, workers
from kvcached_core.integration.vllm.block_pool import ElasticBlockPoolMixin
from kvcached_core.integration.vllm.config import engine_settings, pool_name, virtual_kv_bytes
from kvcached_core.integration.vllm.families import build_cell
from kvcached_core.layout import choose_block_tiling

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger(__name__)


class WorkerRoute(StrEnum):
    """Where the KV tensors live relative to the scheduler, and how it maps their pages."""

    IN_PROCESS = "in-process"  # the uni executor: one process
    SOCKETS = "sockets"  # the mp executor: worker processes on this host
    ENGINE_RPC = "engine-rpc"  # the Ray executor: workers on any node, through its own RPC


#: The executor of the engine whose `_initialize_kv_caches` is running in this context (set
#: by `kv_caches_sized_with_executor`; builds without that seam leave it unset).
_sizing_executor: ContextVar[Any] = ContextVar("kvcached_sizing_executor", default=None)


def kv_caches_sized_with_executor(initialize: F) -> F:
    """Decorate EngineCore._initialize_kv_caches: while it runs, `kv_cache_budget` may reach
    the engine's workers through the executor's own RPC (the Ray executor's workers may run
    on other nodes, out of reach of the sockets the mp executor's workers use).

    When it returns, the engine's `cache_config.num_gpu_blocks` is the scheduler's block count
    (the returned config's), as in stock vLLM: a worker in the engine's own process (the uni
    executor) shares that config and sets it to its own plan's count, which
    `kv_cache_configs_in_whole_pages` may have widened, and the engine reports the figure to
    its front end and metrics.
    """

    @functools.wraps(initialize)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        token = _sizing_executor.set(getattr(self, "model_executor", None))
        try:
            scheduler_config = initialize(self, *args, **kwargs)
        finally:
            _sizing_executor.reset(token)
        vllm_config = args[0] if args else kwargs.get("vllm_config")
        blocks = getattr(scheduler_config, "num_blocks", None)
        if engine_settings().enabled and vllm_config is not None and blocks is not None:
            vllm_config.cache_config.num_gpu_blocks = blocks
        return scheduler_config

    return wrapper  # type: ignore[return-value]


def worker_route(executor_backend: object, world_size: int, *,
                 executor_known: bool) -> WorkerRoute:
    """How the scheduler reaches the KV tensors under this executor; an executor it cannot
    reach is refused with one line naming what is supported.

    `executor_known`: this build hands kvcached the engine's executor (the
    `vllm-engine-executor` seam), which the Ray executor needs.
    """
    if executor_backend in (None, "uni") and world_size == 1:
        return WorkerRoute.IN_PROCESS
    if executor_backend == "mp" or (executor_backend is None and world_size > 1):
        return WorkerRoute.SOCKETS
    if executor_backend == "ray" and executor_known:
        return WorkerRoute.ENGINE_RPC
    supported = "'uni' (one device), 'mp' (workers in their own processes on this host)"
    if executor_backend == "ray":
        raise KVCachedConfigError(
            f"elastic KV cache (kvcached) does not support the 'ray' executor in {build_cell()} "
            f"(no vllm-engine-executor seam): use {supported}, a cell with the seam "
            "(docs/seams.md), or set KVCACHED_ENABLE=0 for the stock KV cache."
        )
    raise KVCachedConfigError(
        f"elastic KV cache (kvcached) does not support the {executor_backend!r} executor "
        f"(world size {world_size}): use {supported} or 'ray' (workers on any node), or set "
        "KVCACHED_ENABLE=0 for the stock KV cache."
    )


def kv_cache_budget(
    available: list[int],
    *,
    block_bytes_per_layer: Iterable[int],
    user_kv_bytes: int | None,
    user_num_blocks: int | None,
    executor_backend: object,
    world_size: int,
    pipeline_size: int = 1,
    planned_in_whole_pages: bool = True,
) -> list[int]:
    """The KV bytes vLLM sizes its block table from: the virtual KV size.

    vLLM's own `kv_cache_memory_bytes` / `num_gpu_blocks_override` win when a user set them;
    otherwise `KVCACHED_VIRTUAL_SIZE` if set, else vLLM's profiled budget.

    The bytes are vLLM's to size from as they are, so the scheduler has exactly stock vLLM's
    blocks, its capacity check and its fitted model length; the workers' buffers are given
    whole pages later (`kv_cache_configs_in_whole_pages`, which every cell's build calls and
    says so with `planned_in_whole_pages`; a build that does not is refused).

    When the executor runs the workers in other processes, the job is announced here, before
    the workers allocate their KV buffers, so that they serve them to this scheduler: in files
    they find on this host (mp), or through the executor's own RPC (Ray).
    """
    if not engine_settings().enabled:
        return available
    if not planned_in_whole_pages:
        # Every cell's build plans its workers in whole pages (`kv_cache_configs_in_whole_pages`);
        # vLLM's own plan would put layer regions off page boundaries. Refused before any job
        # is announced to the workers.
        raise KVCachedConfigError(
            "elastic KV cache (kvcached): this build sizes the KV budget without planning the "
            "workers' KV tensors in whole pages; rebuild the cell or set KVCACHED_ENABLE=0")
    executor = _sizing_executor.get()
    route = worker_route(executor_backend, world_size, executor_known=executor is not None)
    if route is not WorkerRoute.IN_PROCESS:
        if world_size % pipeline_size:
            raise KVCachedConfigError(
                f"world size {world_size} is not a multiple of the pipeline size {pipeline_size}"
            )
        tp_size = world_size // pipeline_size
        if route is WorkerRoute.ENGINE_RPC:
            workers.announce_rpc_job(pool_name(), tp_size=tp_size, pp_size=pipeline_size,
                                     executor=executor)
        else:
            workers.announce_job(pool_name(), tp_size=tp_size, pp_size=pipeline_size)
    if not list(block_bytes_per_layer):  # no KV cache layers: nothing to size
        return available
    virtual = virtual_kv_bytes()
    if virtual is not None and not user_kv_bytes and user_num_blocks is None:
        available = [virtual for _ in available]
    return available


#: `plan` for vLLM 0.9 - 0.10, whose ranks keep the tensor bytes they sized when brought to one
#: block count: each tensor is scaled by the model's page size rather than by its own bytes
#: per block (`_tensor_block_bytes`).
RANKS_KEEP_THEIR_BYTES = "ranks-keep-their-bytes"


def kv_cache_configs_in_whole_pages(
        configs: list[Any], *, vllm_config: Any,
        plan: Callable[[Any, int], Any] | Literal["ranks-keep-their-bytes"] | None,
) -> list[Any]:
    """The workers' KV cache configs, each re-planned to a block count whose KV buffers are
    whole kvcached pages (the call vLLM's `initialize_from_config` is given).

    vLLM sized `configs` from the user's bytes exactly as stock vLLM does (the scheduler's
    copy, taken before this call, keeps that block count: the same capacity, the same
    refusal when the model's longest sequence does not fit, the same fitted
    `max_model_len`). A layer-outermost buffer puts layer `l` at `l * num_blocks * block`
    bytes (and a per-layer buffer puts its V plane at `num_blocks * block / 2`), so unless
    `num_blocks` is a multiple of the blocks of a page the regions do not start on pages,
    and one pool cannot back them page by page. Each worker's config is therefore planned
    again for the next multiple the way the release re-plans a rank for another block count
    itself: by its planner (`plan(groups, num_blocks)`, vLLM 0.29 and later) or, where the
    release scales each KVCacheTensor's size with the block count instead (`plan=None`, vLLM
    0.11 - 0.28, whose workers lay a buffer out from its size; `RANKS_KEEP_THEIR_BYTES`, 0.9 -
    0.10), by that scaling. The extra blocks are address space the scheduler never hands out,
    mapped never.
    `num_gpu_blocks_override` is the scheduler's figure, so it is set aside while planning.
    """
    settings = engine_settings()
    if not settings.enabled:
        return configs
    by_page = plan == RANKS_KEEP_THEIR_BYTES
    planned = []
    for config in configs:
        quantum = _whole_page_blocks(config, settings.page_size, by_page=by_page)
        blocks = int(config.num_blocks)
        wanted = -(-blocks // quantum) * quantum
        # Already whole pages (a vLLM 0.9 - 0.10 rank that kept more bytes than the common block
        # count is scaled to it all the same: its worker would lay out all of them).
        if wanted == blocks and not (by_page and any(
                _tensor_block_bytes(config, t, by_page=True) * blocks != int(t.size)
                for t in config.kv_cache_tensors)):
            planned.append(config)
            continue
        cache_config = vllm_config.cache_config
        override = cache_config.num_gpu_blocks_override
        cache_config.num_gpu_blocks_override = None
        try:
            widened = (plan(config.kv_cache_groups, wanted) if callable(plan)
                       else _scaled_config(config, wanted, by_page=by_page))
        finally:
            cache_config.num_gpu_blocks_override = override
        if int(widened.num_blocks) != wanted:
            raise KVCachedConfigError(
                f"vLLM planned {widened.num_blocks} KV blocks for a worker where kvcached asked "
                f"for {wanted} (whole pages of its {blocks}); set KVCACHED_ENABLE=0")
        for field in dataclasses.fields(config):
            if field.name not in ("num_blocks", "kv_cache_tensors"):
                setattr(widened, field.name, getattr(config, field.name))
        logger.info("kvcached: the scheduler keeps vLLM's %d KV blocks; the workers' buffers "
                    "are planned for %d (whole %d-byte pages)", blocks, wanted,
                    settings.page_size)
        planned.append(widened)
    return planned


def _scaled_config(config: Any, num_blocks: int, *, by_page: bool) -> Any:
    """`config` for `num_blocks` blocks, every KVCacheTensor's size scaled with the block
    count: how vLLM 0.11 - 0.28 bring a rank to another block count (`get_kv_cache_configs`),
    which holds because every tensor of theirs is `num_blocks` times a block's bytes."""
    tensors = [dataclasses.replace(
        tensor, size=_tensor_block_bytes(config, tensor, by_page=by_page) * num_blocks)
        for tensor in config.kv_cache_tensors]
    return dataclasses.replace(config, num_blocks=num_blocks, kv_cache_tensors=tensors)


def _tensor_block_bytes(config: Any, tensor: Any, *, by_page: bool) -> int:
    """The bytes of one of `config`'s blocks in KVCacheTensor `tensor`.

    From 0.11 a rank's tensors are resized with its block count: a tensor is `num_blocks`
    whole blocks. vLLM 0.9 - 0.10 bring their ranks to one block count without resizing them
    (`unify_kv_cache_configs`: a rank that sized more blocks keeps their bytes, and its
    worker lays out `size // page_size_bytes` blocks), so there (`by_page`) a block is the
    page size every layer of the model shares (they plan no other model). Anything else is
    refused, not guessed.
    """
    size, blocks = int(tensor.size), int(config.num_blocks)
    if by_page:
        pages = {getattr(getattr(group, "kv_cache_spec", None), "page_size_bytes", None)
                 for group in config.kv_cache_groups}
        if len(pages) == 1 and isinstance(page := pages.pop(), int) and page > 0 \
                and size % page == 0:
            return page
    elif size % blocks == 0:
        return size // blocks
    raise KVCachedConfigError(
        f"a KV cache tensor of {size} bytes is not whole blocks of "
        f"{'the model' if by_page else blocks}: kvcached cannot plan it for whole pages; set "
        "KVCACHED_ENABLE=0")


def _whole_page_blocks(config: Any, page_size: int, *, by_page: bool) -> int:
    """The fewest blocks that make every region of `config`'s KV buffers whole pages.

    vLLM >= 0.29: a KVCacheTensor whose layer stride exceeds its block stride gives each
    layer its own region of `num_blocks * block_stride` bytes (`kv_buffers.shared_geometry`);
    a block-outermost one is one region, which `shared_kv_buffer` pads to whole pages itself.
    Before: a tensor is one layer's buffer of `num_blocks` blocks, in one region or a K and a
    V plane (`aligned_blocks_quantum`), or with a packed block stride (vLLM 0.24 - 0.28) the
    one backing of every layer, one region `kv_tensor_buffer` pads itself.
    """
    quanta = []
    for tensor in config.kv_cache_tensors:
        if getattr(tensor, "host_resident", False):
            continue
        layer_stride = getattr(tensor, "layer_stride", None)
        block_stride = int(getattr(tensor, "block_stride", 0))
        if layer_stride is not None:
            if int(layer_stride) > block_stride:
                quanta.append(choose_block_tiling(block_stride, page_size).quantum_blocks)
        elif not block_stride:
            quanta.append(aligned_blocks_quantum(
                [_tensor_block_bytes(config, tensor, by_page=by_page)], page_size))
    return math.lcm(*quanta) if quanta else 1


def aligned_blocks_quantum(block_bytes_per_layer: Iterable[int], page_size: int) -> int:
    """The fewest vLLM blocks whose bytes are whole kvcached pages in every layer region.

    A vLLM block is `size` bytes of a layer region (one plane: blocks-first layouts, MLA's
    latent, 0.29's layer-outermost buffer) or `size // 2` (K and V planes apart), whichever
    the attention backend chose; a block count that is a multiple of this quantum makes every
    region whole pages under either. For a block that does not tile a page (MLA: 36,864
    bytes at 32 tokens) that is the blocks of a common multiple of block and page (512 blocks,
    18 MiB, on 2 MiB pages), not one page's worth.
    """
    units = set()
    for size in block_bytes_per_layer:
        units.add(int(size))
        if size % 2 == 0:
            units.add(int(size) // 2)
    return math.lcm(*(choose_block_tiling(unit, page_size).quantum_blocks for unit in units))


def _scheduler_block_pool(core: Any) -> ElasticBlockPoolMixin | None:
    # EngineCore.scheduler.kv_cache_manager.block_pool exists in every supported vLLM; the pool
    # is stock (and left alone) when elastic mode is off.
    block_pool = core.scheduler.kv_cache_manager.block_pool
    return block_pool if isinstance(block_pool, ElasticBlockPoolMixin) else None


def released_after_step(*, pipelined: bool) -> Callable[[F], F]:
    """Decorate EngineCore.step / step_with_batch_queue: after each step give idle pages back.

    A page freed in step N is retired at epoch N; it is unmapped once every batch submitted by
    then has finished: at once after a synchronous step, after `batch_queue_size` more steps
    when batches are queued.

    Why that is enough with worker processes (the mp executor; docs/runtime.md#worker-processes):
    - `step` returns only after the executor handed back the batch's output. Only one rank
      sends it, but every layer's attention on every rank is followed by a tensor-parallel
      all-reduce that rank waits for (and pipeline stages hand activations on in order), so
      when the output arrives every rank has finished reading and writing that batch's KV.
      Blocks freed while processing it belong to no later batch, so their pages may be
      unmapped before the next step is submitted.
    - `step_with_batch_queue` keeps at most `batch_queue_size` (Q) batches in flight and
      completes them in submission order; a step either submits (only while fewer than Q are
      in flight) or completes the oldest. Of the m <= Q batches in flight when a page is freed,
      at most Q - m submissions and m completions can happen before the last of them
      completes: after Q more steps none of them can still read the page.
    - The unmap itself is a two-phase broadcast (`ipc.BroadcastMapper`), so no rank drops a
      page that another keeps.
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
    block_pool.end_step(block_tokens=int(core.scheduler.block_size), lag=lag,
                        is_drained=lambda: _drained(core, pipelined=lag > 0))


def _drained(core: Any, *, pipelined: bool) -> bool:
    """No request is left and, for `step_with_batch_queue`, no batch is in flight.

    With a batch queue, a batch scheduled ahead may still run on the device after its
    requests finished; it is over once its futures are (`_queued_batches_finished`).
    """
    if core.scheduler.has_unfinished_requests():
        return False
    return not pipelined or _queued_batches_finished(core.batch_queue)


def _queued_batches_finished(batches: Any) -> bool:
    """Whether every batch still queued has finished, waiting for them if need be.

    With no unfinished request left, a queued batch holds only finished requests: it was
    scheduled ahead before their last tokens came back. A caller that steps the engine only
    while it has unfinished requests (the in-process LLM does) never takes the step that would
    collect it, so without this wait the pages that batch may still read, the whole working
    set of the last burst, would stay mapped while the engine idles. A batch's futures
    complete once every rank has finished it (see `released_after_step`), so waiting for them
    here costs at most the rest of one step's device time, once, when the engine goes idle;
    the step that later pops the batch finds them done. A queued item without a future, or a
    future that failed, leaves the pages mapped (the engine's next step reports the failure).
    """
    # EngineCore keeps its in-flight batches in a queue.Queue (FIFO; no len()) or in a deque
    # filled with appendleft (the oldest on the right), depending on the engine.
    fifo = isinstance(batches, queue.Queue)
    items = list(batches.queue) if fifo else list(reversed(batches))
    for item in items:
        parts = item if isinstance(item, tuple) else (item,)
        futures = [part for part in parts
                   if callable(getattr(part, "result", None))
                   and callable(getattr(part, "done", None))]
        if not futures:
            return False
        for future in futures:  # oldest batch first, as the engine would collect them
            try:
                future.result()
            except Exception:
                return False
    return True


# Per single-type manager (vLLM's object, so nothing is written onto it): the size of its
# __dict__ when its request-keyed dicts were last found, and their names.
_request_dicts: weakref.WeakKeyDictionary[Any, tuple[int, tuple[str, ...]]] = (
    weakref.WeakKeyDictionary())


def _request_keyed_dicts(manager: Any) -> tuple[str, ...]:
    """Names of the dict attributes of a single-type manager (besides `req_to_blocks`): the
    per-request bookkeeping `allocate_slots` may touch (`num_cached_block`, partial-hit
    records, ...), so no version needs to know their names. Found per manager and found again
    when the manager gained attributes (some are created lazily)."""
    attributes = manager.__dict__
    cached = _request_dicts.get(manager)
    if cached is None or cached[0] != len(attributes):
        names = tuple(sorted(name for name, value in attributes.items()
                             if isinstance(value, dict) and name != "req_to_blocks"))
        cached = (len(attributes), names)
        _request_dicts[manager] = cached
    return cached[1]


_ABSENT = object()


def none_on_pool_exhausted(allocate_slots: F) -> F:
    """Decorate KVCacheManager.allocate_slots: a lost page race ends as "no blocks" (None).

    Another engine may take the last physical page between the capacity check and the
    allocation. The request is put back exactly as it was before the call: every block the
    call added (new blocks, touched cached ones) is given back and the managers' per-request
    bookkeeping restored, so the scheduler preempts or waits as if the check had failed. Only
    PoolExhausted is handled; every other error stays fatal.
    """

    @functools.wraps(allocate_slots)
    def wrapper(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        coordinator = self.coordinator
        block_pool = coordinator.block_pool
        if not isinstance(block_pool, ElasticBlockPoolMixin):
            # vLLM's own pool (KVCACHED_ENABLE=0) never raises PoolExhausted.
            return allocate_slots(self, request, *args, **kwargs)
        managers = coordinator.single_type_managers
        # An upper bound on the tokens the call adds to its request. Every token count
        # allocate_slots takes (new, new computed, external, lookahead, encoder tokens, in
        # every supported vLLM) is an int argument and never negative, and flags (bool) add
        # at most 1 each, so the sum of the arguments bounds it. A call that passes anything
        # else (prefix-cache hits to touch, None) stops the sum (TypeError) and is not
        # bounded. Inline, not a helper: this runs once per request and engine step.
        try:
            tokens = sum(args) + sum(kwargs.values())
        except TypeError:
            tokens = None
        if (type(tokens) is int and tokens >= 0
                and block_pool.make_room_in_held_pages(tokens, len(managers))):
            # Nothing to map, so no page race to lose: skip the snapshot, which costs
            # more than the allocation itself, on nearly every decode step of every request.
            return allocate_slots(self, request, *args, **kwargs)
        request_id = request.request_id
        before = [len(m.req_to_blocks[request_id]) if request_id in m.req_to_blocks else None
                  for m in managers]
        saved = [{name: m.__dict__[name].get(request_id, _ABSENT)
                  for name in _request_keyed_dicts(m)} for m in managers]
        try:
            return allocate_slots(self, request, *args, **kwargs)
        except PoolExhausted:
            for manager, count, state in zip(managers, before, saved, strict=True):
                blocks = manager.req_to_blocks.get(request_id)
                if blocks is not None and len(blocks) > (count or 0):
                    added = blocks[count or 0:]
                    del blocks[count or 0:]
                    manager.block_pool.free_blocks(reversed(added))
                if count is None:
                    manager.req_to_blocks.pop(request_id, None)
                for name, value in state.items():
                    table = manager.__dict__.get(name)
                    if not isinstance(table, dict):
                        continue
                    if value is _ABSENT:
                        table.pop(request_id, None)
                    else:
                        table[request_id] = value
            return None

    return wrapper  # type: ignore[return-value]


def close_on_shutdown(shutdown: F) -> F:
    """Decorate EngineCore.shutdown: release every page and remove the shared-memory record.

    With worker processes, vLLM's shutdown stops the workers first (each stops its listener
    and removes its socket); then the pool, the coordinator and the job's announcement go.
    Closing never maps or unmaps, so it does not need the workers any more.
    """

    @functools.wraps(shutdown)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return shutdown(self, *args, **kwargs)
        finally:
            if engine_settings().enabled:
                name = pool_name()
                try:
                    pools.close(name)
                finally:
                    workers.withdraw_job(name)

    return wrapper  # type: ignore[return-value]
