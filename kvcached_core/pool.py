"""KVPool: the engine-neutral facade an engine seam calls.

One pool owns the backend, the virtual KV tensors, the page allocator, the block ledger, the
shared limit record (and its watcher) and the pool's metrics. An engine seam needs only:
`alloc`, `free`, `available_size`, the release-epoch pair, the reserve (`reserve_pages`,
`trim`), `clear` and `close`. A pool is made from a `PoolSpec` (its shape) and a `PoolPolicy`
(how it spends memory).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from kvcached_core.budget import require_budget
from kvcached_core.errors import KVCachedConfigError
from kvcached_core.layout import check_page_geometry
from kvcached_core.ledger import BlockLedger, LedgerSnapshot
from kvcached_core.limits import LimitSegment, LimitWatcher
from kvcached_core.metrics import PoolMetrics, register_pool
from kvcached_core.settings import MIB, KVCachedSettings

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

BackendKind = Literal["host", "cuda"]


def make_backend(
    kind: BackendKind,
    device: int = 0,
    *,
    host_memory_limit_bytes: int = 0,
    budget: str | None = None,
    shm_dir: str | os.PathLike[str] | None = None,
) -> Any:
    """The native memory backend: host memory (any machine) or one CUDA device.

    With `budget`, every physical page it creates is charged to that host-wide budget (which
    must exist: `kvctl budget set NAME SIZE`); a spent budget reads as out of memory.
    """
    from kvcached_core import _C

    backend: _C.Backend
    if kind == "host":
        backend = _C.HostBackend(host_memory_limit_bytes)
    elif kind == "cuda":
        backend = _C.cuda_backend(device)
    else:
        raise KVCachedConfigError(f"backend must be 'host' or 'cuda', got {kind!r}")
    if budget is None:
        return backend
    path = require_budget(budget, shm_dir)
    return _C.BudgetedBackend(backend, budget, str(path))


@dataclass(frozen=True)
class PoolSpec:
    """The shape a pool is asked for: what its KV tensors look like.

    `virtual_bytes_per_layer` is the address space of one layer (all its buffers), rounded down
    to whole pages at creation; `page_size` is the mapping unit per layer and buffer;
    `contiguous` puts every layer of a page side by side (one mapping per page; see the
    memory model in `layout`).
    """

    num_layers: int
    num_kv_buffers: int
    block_bytes: int
    virtual_bytes_per_layer: int
    page_size: int = 2 * MIB
    contiguous: bool = False

    @classmethod
    def from_settings(
        cls,
        settings: KVCachedSettings,
        *,
        num_layers: int,
        num_kv_buffers: int,
        block_bytes: int,
        virtual_bytes_per_layer: int,
    ) -> PoolSpec:
        # `auto` (None) is per-layer here: a caller that can use the contiguous layout decides
        # so from its KV layout and asks for it explicitly (vLLM's KV buffers do).
        return cls(num_layers, num_kv_buffers, block_bytes, virtual_bytes_per_layer,
                   settings.page_size, settings.contiguous_layout is True)


@dataclass(frozen=True)
class PoolPolicy:
    """How a pool spends physical memory.

    `min_reserve_pages` / `max_reserve_pages`: the page allocator's reserve (warm mapped pages
    no block is in yet); `prealloc` fills it at start. `physical_limit_bytes`: the limit at
    start (None: the capacity). `defer_physical_release`: freed pages are only retired; the
    engine releases them by epoch (`capture_release_marker` / `release_retired_through`).
    `set_aside_null_block`: block 0 is set aside as the engine's null/padding block. `budget`:
    a host-wide budget the pages are charged to (`kvctl budget set`). `zero_page_writable`:
    unbacked pages take stray writes instead of faulting (`Backend.set_zero_page_writable`).
    `host_memory_limit_bytes`: cap of the host backend (0: none).
    """

    min_reserve_pages: int = 5
    max_reserve_pages: int = 10
    prealloc: bool = True
    physical_limit_bytes: int | None = None
    defer_physical_release: bool = False
    set_aside_null_block: bool = True
    budget: str | None = None
    zero_page_writable: bool = False
    host_memory_limit_bytes: int = 0

    @classmethod
    def from_settings(cls, settings: KVCachedSettings, **overrides: Any) -> PoolPolicy:
        """The policy the `KVCACHED_*` settings give (`overrides` win, by field name)."""
        policy = cls(
            min_reserve_pages=settings.min_reserved_pages,
            max_reserve_pages=settings.max_reserved_pages,
            prealloc=settings.prealloc,
            physical_limit_bytes=settings.physical_limit_bytes,
            defer_physical_release=settings.defer_physical_release,
            budget=settings.budget,
            zero_page_writable=bool(settings.zero_page_writable),
        )
        return replace(policy, **overrides) if overrides else policy


@dataclass(frozen=True)
class PoolGeometry:
    """Sizes fixed at creation (bytes per layer per buffer unless named otherwise)."""

    num_layers: int
    num_kv_buffers: int
    block_bytes: int
    allocator_page_bytes: int  # the page the allocator maps at once (>= block when blocks span)
    bytes_per_layer_per_buffer: int
    contiguous: bool

    @property
    def page_bytes_all_layers(self) -> int:
        """Physical bytes one allocator page costs across every layer and buffer."""
        return self.allocator_page_bytes * self.num_layers * self.num_kv_buffers

    @property
    def block_bytes_all_layers(self) -> int:
        return self.block_bytes * self.num_layers * self.num_kv_buffers


class KVPool:
    """A KV cache whose physical memory follows the blocks in use.

    The ledger (`BlockLedger`) behind it is an implementation detail: engine seams use the
    methods of this class only.
    """

    def __init__(
        self,
        name: str,
        geometry: PoolGeometry,
        backend: Any,
        ftensor_allocator: Any,
        tensors: list[Any],
        page_allocator: Any,
        ledger: BlockLedger,
        segment: LimitSegment | None,
        metrics: PoolMetrics | None,
    ) -> None:
        self.name = name
        self.geometry = geometry
        self.backend = backend
        self.ftensor_allocator = ftensor_allocator
        self.tensors = tensors
        self.page_allocator = page_allocator
        self.ledger = ledger
        self._segment = segment
        self._metrics = metrics
        self._watcher: LimitWatcher | None = None
        self._close_lock = threading.Lock()
        self._closed = False
        self._published_pages: tuple[int, int] | None = None

    @classmethod
    def create(
        cls,
        name: str,
        spec: PoolSpec,
        policy: PoolPolicy | None = None,
        *,
        backend: BackendKind = "host",
        device: int = 0,
        shm_dir: str | os.PathLike[str] | None = None,
        share_limits: bool = True,
        metrics_registry: CollectorRegistry | None = None,
        export_metrics: bool = True,
    ) -> KVPool:
        """Build a pool of shape `spec` spending memory by `policy` (default `PoolPolicy()`) on
        the `backend` ("host" or one CUDA `device`). `share_limits`: publish a limit record
        (`kvctl`) in `shm_dir`; `export_metrics`: register Prometheus metrics."""
        policy = PoolPolicy() if policy is None else policy
        if spec.num_layers <= 0 or spec.num_kv_buffers <= 0:
            raise KVCachedConfigError(
                f"num_layers and num_kv_buffers must be > 0, got {spec.num_layers}, "
                f"{spec.num_kv_buffers}"
            )
        page_geometry = check_page_geometry(spec.block_bytes, spec.page_size)
        unit = page_geometry.ledger_page_bytes
        per_buffer = (spec.virtual_bytes_per_layer // spec.num_kv_buffers) // unit * unit
        if per_buffer == 0:
            raise KVCachedConfigError(
                f"virtual_bytes_per_layer={spec.virtual_bytes_per_layer} holds no whole page "
                f"of {unit} bytes per buffer ({spec.num_kv_buffers} buffer(s))"
            )
        geometry = PoolGeometry(
            spec.num_layers, spec.num_kv_buffers, spec.block_bytes, unit, per_buffer,
            spec.contiguous,
        )
        from kvcached_core import _C

        native_backend = make_backend(
            backend,
            device,
            host_memory_limit_bytes=policy.host_memory_limit_bytes,
            budget=policy.budget,
            shm_dir=shm_dir,
        )
        if policy.zero_page_writable:
            native_backend.set_zero_page_writable(True)
        ftensor_allocator = _C.FTensorAllocator(native_backend, unit, spec.contiguous)
        tensors = ftensor_allocator.create_kv_tensors(
            per_buffer, spec.num_layers, spec.num_kv_buffers)
        page_allocator = _C.PageAllocator(
            ftensor_allocator, policy.min_reserve_pages, policy.max_reserve_pages,
            policy.prealloc)
        return cls._assemble(
            name, geometry, native_backend, ftensor_allocator, tensors, page_allocator,
            policy, page_size=spec.page_size, cost_per_page=geometry.page_bytes_all_layers,
            share_limits=share_limits, shm_dir=shm_dir, export_metrics=export_metrics,
            metrics_registry=metrics_registry,
        )

    @classmethod
    def _assemble(
        cls,
        name: str,
        geometry: PoolGeometry,
        native_backend: Any,
        ftensor_allocator: Any,
        tensors: list[Any],
        page_allocator: Any,
        policy: PoolPolicy,
        *,
        page_size: int,
        cost_per_page: int,
        share_limits: bool,
        shm_dir: str | os.PathLike[str] | None,
        export_metrics: bool,
        metrics_registry: CollectorRegistry | None,
    ) -> KVPool:
        """The ledger, limit record, metrics and limit watcher over a page allocator; on any
        failure everything made so far is released."""
        segment: LimitSegment | None = None
        pool: KVPool | None = None
        limit = policy.physical_limit_bytes
        try:
            if share_limits:
                segment = LimitSegment.create(
                    name,
                    capacity_bytes=int(page_allocator.num_total) * cost_per_page,
                    limit_bytes=limit,
                    directory=shm_dir,
                )
            ledger = BlockLedger(
                page_allocator,
                geometry.block_bytes,
                page_size,
                set_aside_null_block=policy.set_aside_null_block,
                defer_physical_release=policy.defer_physical_release,
            )
            pool = cls(name, geometry, native_backend, ftensor_allocator, tensors,
                       page_allocator, ledger, segment, None)
            ledger.set_pages_changed_callback(pool._publish_usage)
            if limit is not None:
                ledger.resize(pool._blocks_for_limit(limit))
            if export_metrics:
                pool._metrics = register_pool(name, ledger.snapshot, metrics_registry)
            if segment is not None:
                pool._publish_usage()
                pool._watcher = LimitWatcher(segment, pool._on_shared_limit,
                                             on_tick=pool._publish_usage_if_changed)
            return pool
        except BaseException:
            if pool is not None:
                pool.close()
            else:
                page_allocator.stop()
                if segment is not None:
                    segment.close()
            raise

    @classmethod
    def over_mapper(
        cls,
        name: str,
        mapper: Any,
        *,
        page_bytes: int,
        policy: PoolPolicy | None = None,
        shm_dir: str | os.PathLike[str] | None = None,
        share_limits: bool = True,
        metrics_registry: CollectorRegistry | None = None,
        export_metrics: bool = True,
    ) -> KVPool:
        """A pool with no tensors of its own whose pages are mapped through `mapper` (a
        `_C.PageMapper`, e.g. `ipc.BroadcastMapper` over the worker processes of a job).

        One ledger block is one mapper page of `page_bytes` (per layer and buffer, the page
        the workers' tensors map at once). The limit record, metrics, shared limit and release
        epochs are those of a local pool; costs are the mapper's `logical_page_bytes`, i.e.
        every rank's memory together. The geometry counts each (rank, layer, buffer) plane of
        a page as one layer, so `page_bytes_all_layers` is what one page costs the job.
        `policy`'s budget, zero page and host limit belong to the workers' backends and are
        not used here.
        """
        from kvcached_core import _C

        policy = PoolPolicy() if policy is None else policy
        logical_page_bytes = int(mapper.logical_page_bytes())
        num_pages = int(mapper.num_logical_pages())
        if page_bytes <= 0 or logical_page_bytes % page_bytes or num_pages <= 0:
            raise KVCachedConfigError(
                f"mapper pages of {logical_page_bytes} bytes ({num_pages} pages) are not whole "
                f"planes of {page_bytes} bytes"
            )
        geometry = PoolGeometry(
            logical_page_bytes // page_bytes, 1, page_bytes, page_bytes,
            num_pages * page_bytes, False,
        )
        page_allocator = _C.PageAllocator(
            mapper, policy.min_reserve_pages, policy.max_reserve_pages, policy.prealloc)
        return cls._assemble(
            name, geometry, None, None, [], page_allocator, policy,
            page_size=page_bytes, cost_per_page=logical_page_bytes,
            share_limits=share_limits, shm_dir=shm_dir, export_metrics=export_metrics,
            metrics_registry=metrics_registry,
        )

    # ------------------------------------------------------------------ engine API

    def alloc(self, n: int) -> list[int]:
        return self.ledger.alloc(n)

    def free(self, block_ids: list[int]) -> None:
        self.ledger.free(block_ids)

    def available_size(self) -> int:
        """Blocks the next `alloc` accepts, under the current limit (scheduler thread: a
        limit `kvctl` published is applied first)."""
        return self.ledger.available_size()

    def available_under_budget(self) -> int:
        """`available_size()`, and no more than the pool's budget lets it map now: the blocks
        of pages already mapped plus the pages the budget's free bytes still pay for. Neighbours
        charge the same budget, so this moves between calls; a scheduler that admits work by it
        rarely meets a refused page (`available_size()` where the pool has no budget)."""
        available = self.available_size()
        free_bytes = getattr(self.backend, "budget_free_bytes", None)
        if free_bytes is None:
            return available
        pages = int(free_bytes()) // self.geometry.page_bytes_all_layers
        return min(available,
                   self.ledger.mapped_free_blocks() + pages * self.ledger.blocks_per_page)

    @property
    def null_block_id(self) -> int | None:
        return self.ledger.null_block_id

    @property
    def num_blocks(self) -> int:
        return self.ledger.num_blocks

    @property
    def capacity_blocks(self) -> int:
        """Blocks of the pool's whole address range, whatever its limit."""
        return self.ledger.capacity_blocks

    @property
    def blocks_per_page(self) -> int:
        return self.ledger.blocks_per_page

    @property
    def mapped_pages(self) -> int:
        """Pages with physical memory behind them: held by blocks or warm in the reserve."""
        return self.ledger.mapped_pages

    def holds_page(self, page: int) -> bool:
        """Whether the ledger holds page `page` (some of its blocks may be handed out)."""
        return self.ledger.holds_page(page)

    @property
    def reserve_pages(self) -> int:
        """Warm pages the page allocator keeps mapped ahead of demand (no block is in them)."""
        return int(self.page_allocator.num_reserved)

    def clear(self) -> None:
        """Free every block (set-aside ones too), drop the reserve, set the null block aside."""
        self.ledger.clear()

    def capture_release_marker(self) -> int:
        return self.ledger.capture_release_marker()

    def release_retired_through(self, marker: int) -> int:
        return self.ledger.release_retired_through(marker)

    def set_limit(self, limit_bytes: int) -> bool:
        """Limit physical KV memory (all layers). True if applied now, False if shrinking."""
        if self._segment is not None:
            self._segment.set_limit(limit_bytes)
        return self.ledger.resize(self._blocks_for_limit(limit_bytes))

    def trim(self) -> None:
        """Unmap the reserve (warm pages no block is in)."""
        self.ledger.trim()

    def snapshot(self) -> LedgerSnapshot:
        return self.ledger.snapshot()

    def mapped_bytes(self) -> int:
        """Physical bytes the pool holds (all layers and buffers)."""
        return self.ledger.mapped_pages * self.geometry.page_bytes_all_layers

    def close(self) -> None:
        """Stop threads, stop exporting, release the limit record. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self._watcher is not None:
            self._watcher.stop()
        if self._metrics is not None:
            self._metrics.close()
        self.ledger.shutdown()
        if self._segment is not None:
            self._segment.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _blocks_for_limit(self, limit_bytes: int) -> int:
        pages = max(0, limit_bytes) // self.geometry.page_bytes_all_layers
        return pages * self.ledger.blocks_per_page

    def _on_shared_limit(self, limit_bytes: int) -> None:
        # Watcher thread: only publish; the scheduler thread applies it on its next alloc.
        self.ledger.request_resize(self._blocks_for_limit(limit_bytes))

    def _publish_usage(self) -> None:
        if self._segment is None:
            return
        allocator = self.page_allocator
        pages = (int(allocator.num_in_use), int(allocator.num_reserved))  # in use, reserve
        self._published_pages = pages
        page_bytes = self.geometry.page_bytes_all_layers
        with contextlib.suppress(OSError):
            self._segment.update_usage(pages[0] * page_bytes, pages[1] * page_bytes,
                                       int(allocator.reserve_hits),
                                       int(allocator.reserve_misses))

    def _publish_usage_if_changed(self) -> None:
        """From the limit watcher: the reserve refill maps pages no allocation reports."""
        allocator = self.page_allocator
        if (int(allocator.num_in_use), int(allocator.num_reserved)) != self._published_pages:
            self._publish_usage()
