"""KVPool: the engine-neutral facade an engine seam calls.

One pool owns the backend, the virtual KV tensors, the page allocator, the block ledger, the
shared limit record (and its watcher) and the pool's metrics. An engine seam needs only:
`alloc`, `free`, `available_size`, `kv_views`, the release-epoch pair and `close`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvcached_core.budget import require_budget
from kvcached_core.errors import KVCachedConfigError
from kvcached_core.layout import KVCacheSpec, check_page_geometry, kv_views
from kvcached_core.limits import LimitSegment, LimitWatcher
from kvcached_core.manager import KVCacheManager, ManagerSnapshot
from kvcached_core.metrics import PoolMetrics, register_pool
from kvcached_core.settings import MIB, KVCachedSettings

if TYPE_CHECKING:
    import torch
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
    """A KV cache whose physical memory follows the blocks in use."""

    def __init__(
        self,
        name: str,
        geometry: PoolGeometry,
        backend: Any,
        ftensor_allocator: Any,
        tensors: list[Any],
        page_allocator: Any,
        manager: KVCacheManager,
        segment: LimitSegment | None,
        metrics: PoolMetrics | None,
    ) -> None:
        self.name = name
        self.geometry = geometry
        self.backend = backend
        self.ftensor_allocator = ftensor_allocator
        self.tensors = tensors
        self.page_allocator = page_allocator
        self.manager = manager
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
        *,
        backend: BackendKind = "host",
        device: int = 0,
        num_layers: int,
        num_kv_buffers: int,
        block_bytes: int,
        virtual_bytes_per_layer: int,
        page_size: int = 2 * MIB,
        contiguous: bool = False,
        min_reserved: int = 5,
        max_reserved: int = 10,
        physical_limit_bytes: int | None = None,
        defer_physical_release: bool = False,
        reserve_null_block: bool = True,
        prealloc: bool = True,
        shm_dir: str | os.PathLike[str] | None = None,
        share_limits: bool = True,
        metrics_registry: CollectorRegistry | None = None,
        export_metrics: bool = True,
        host_memory_limit_bytes: int = 0,
        budget: str | None = None,
        zero_page_writable: bool = False,
    ) -> KVPool:
        """Build a pool. `virtual_bytes_per_layer` is the address space of one layer (all its
        buffers); it is rounded down to whole pages. `budget` names a host-wide memory budget
        (`kvcached_core.budget`) that the pool's physical pages are charged to.
        `zero_page_writable`: unbacked pages take stray writes instead of faulting (see
        `Backend.set_zero_page_writable`)."""
        if num_layers <= 0 or num_kv_buffers <= 0:
            raise KVCachedConfigError(
                f"num_layers and num_kv_buffers must be > 0, got {num_layers}, "
                f"{num_kv_buffers}"
            )
        page_geometry = check_page_geometry(block_bytes, page_size)
        unit = page_geometry.ledger_page_bytes
        per_buffer = (virtual_bytes_per_layer // num_kv_buffers) // unit * unit
        if per_buffer == 0:
            raise KVCachedConfigError(
                f"virtual_bytes_per_layer={virtual_bytes_per_layer} holds no whole page of "
                f"{unit} bytes per buffer ({num_kv_buffers} buffer(s))"
            )
        geometry = PoolGeometry(
            num_layers, num_kv_buffers, block_bytes, unit, per_buffer, contiguous
        )
        from kvcached_core import _C

        native_backend = make_backend(
            backend,
            device,
            host_memory_limit_bytes=host_memory_limit_bytes,
            budget=budget,
            shm_dir=shm_dir,
        )
        if zero_page_writable:
            native_backend.set_zero_page_writable(True)
        ftensor_allocator = _C.FTensorAllocator(native_backend, unit, contiguous)
        tensors = ftensor_allocator.create_kv_tensors(per_buffer, num_layers, num_kv_buffers)
        page_allocator = _C.PageAllocator(ftensor_allocator, min_reserved, max_reserved, prealloc)
        return cls._assemble(
            name, geometry, native_backend, ftensor_allocator, tensors, page_allocator,
            block_bytes=block_bytes, page_size=page_size,
            cost_per_page=geometry.page_bytes_all_layers, share_limits=share_limits,
            physical_limit_bytes=physical_limit_bytes, shm_dir=shm_dir,
            reserve_null_block=reserve_null_block,
            defer_physical_release=defer_physical_release, export_metrics=export_metrics,
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
        *,
        block_bytes: int,
        page_size: int,
        cost_per_page: int,
        share_limits: bool,
        physical_limit_bytes: int | None,
        shm_dir: str | os.PathLike[str] | None,
        reserve_null_block: bool,
        defer_physical_release: bool,
        export_metrics: bool,
        metrics_registry: CollectorRegistry | None,
    ) -> KVPool:
        """The ledger, limit record, metrics and limit watcher over a page allocator; on any
        failure everything made so far is released."""
        segment: LimitSegment | None = None
        pool: KVPool | None = None
        try:
            if share_limits:
                segment = LimitSegment.create(
                    name,
                    capacity_bytes=int(page_allocator.num_total) * cost_per_page,
                    limit_bytes=physical_limit_bytes,
                    directory=shm_dir,
                )
            manager = KVCacheManager(
                page_allocator,
                block_bytes,
                page_size,
                reserve_null_block=reserve_null_block,
                defer_physical_release=defer_physical_release,
            )
            pool = cls(name, geometry, native_backend, ftensor_allocator, tensors,
                       page_allocator, manager, segment, None)
            manager.set_pages_changed_callback(pool._publish_usage)
            if physical_limit_bytes is not None:
                manager.resize(pool._blocks_for_limit(physical_limit_bytes))
            if export_metrics:
                pool._metrics = register_pool(name, manager.snapshot, metrics_registry)
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
    def from_settings(
        cls,
        name: str,
        settings: KVCachedSettings,
        *,
        num_layers: int,
        num_kv_buffers: int,
        block_bytes: int,
        virtual_bytes_per_layer: int,
        **options: Any,
    ) -> KVPool:
        return cls.create(
            name,
            num_layers=num_layers,
            num_kv_buffers=num_kv_buffers,
            block_bytes=block_bytes,
            virtual_bytes_per_layer=virtual_bytes_per_layer,
            page_size=settings.page_size,
            contiguous=settings.contiguous_layout,
            min_reserved=settings.min_reserved_pages,
            max_reserved=settings.max_reserved_pages,
            prealloc=settings.prealloc,
            physical_limit_bytes=settings.physical_limit_bytes,
            defer_physical_release=settings.defer_physical_release,
            budget=settings.budget,
            zero_page_writable=bool(settings.zero_page_writable),
            **options,
        )

    @classmethod
    def over_mapper(
        cls,
        name: str,
        mapper: Any,
        *,
        page_bytes: int,
        min_reserved: int = 5,
        max_reserved: int = 10,
        physical_limit_bytes: int | None = None,
        defer_physical_release: bool = False,
        reserve_null_block: bool = True,
        prealloc: bool = True,
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
        """
        from kvcached_core import _C

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
        page_allocator = _C.PageAllocator(mapper, min_reserved, max_reserved, prealloc)
        return cls._assemble(
            name, geometry, None, None, [], page_allocator,
            block_bytes=page_bytes, page_size=page_bytes, cost_per_page=logical_page_bytes,
            share_limits=share_limits, physical_limit_bytes=physical_limit_bytes,
            shm_dir=shm_dir, reserve_null_block=reserve_null_block,
            defer_physical_release=defer_physical_release, export_metrics=export_metrics,
            metrics_registry=metrics_registry,
        )

    # ------------------------------------------------------------------ engine API

    def alloc(self, n: int) -> list[int]:
        return self.manager.alloc(n)

    def free(self, block_ids: list[int]) -> None:
        self.manager.free(block_ids)

    def available_size(self) -> int:
        return self.manager.available_size()

    @property
    def null_block_id(self) -> int | None:
        return self.manager.null_block_id

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    def capture_release_marker(self) -> int:
        return self.manager.capture_release_marker()

    def release_retired_through(self, marker: int) -> int:
        return self.manager.release_retired_through(marker)

    def kv_views(self, spec: KVCacheSpec, dtype: torch.dtype) -> list[torch.Tensor]:
        """One view per layer in the backend's shape (see `layout.kv_views`)."""
        geometry = self.geometry
        if (
            spec.block_bytes != geometry.block_bytes
            or spec.num_kv_buffers != geometry.num_kv_buffers
        ):
            raise KVCachedConfigError(
                f"spec has {spec.block_bytes}-byte blocks in {spec.num_kv_buffers} buffer(s); "
                f"pool {self.name!r} has {geometry.block_bytes}-byte blocks in "
                f"{geometry.num_kv_buffers}"
            )
        return kv_views(
            self.tensors,
            spec,
            num_layers=geometry.num_layers,
            bytes_per_layer_per_buffer=geometry.bytes_per_layer_per_buffer,
            contiguous=geometry.contiguous,
            dtype=dtype,
        )

    def set_limit(self, limit_bytes: int) -> bool:
        """Limit physical KV memory (all layers). True if applied now, False if shrinking."""
        if self._segment is not None:
            self._segment.set_limit(limit_bytes)
        return self.manager.resize(self._blocks_for_limit(limit_bytes))

    def trim(self) -> None:
        self.manager.trim()

    def snapshot(self) -> ManagerSnapshot:
        return self.manager.snapshot()

    def mapped_bytes(self) -> int:
        """Physical bytes the pool holds (all layers and buffers)."""
        return self.manager.mapped_pages * self.geometry.page_bytes_all_layers

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
        self.manager.shutdown()
        if self._segment is not None:
            self._segment.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _blocks_for_limit(self, limit_bytes: int) -> int:
        pages = max(0, limit_bytes) // self.geometry.page_bytes_all_layers
        return pages * self.manager.blocks_per_page

    def _on_shared_limit(self, limit_bytes: int) -> None:
        # Watcher thread: only publish; the scheduler thread applies it on its next alloc.
        self.manager.request_resize(self._blocks_for_limit(limit_bytes))

    def _publish_usage(self) -> None:
        if self._segment is None:
            return
        allocator = self.page_allocator
        pages = (int(allocator.num_in_use), int(allocator.num_reserved))
        self._published_pages = pages
        page_bytes = self.geometry.page_bytes_all_layers
        with contextlib.suppress(OSError):
            self._segment.update_usage(pages[0] * page_bytes, pages[1] * page_bytes)

    def _publish_usage_if_changed(self) -> None:
        """From the limit watcher: the reserve refill maps pages no allocation reports."""
        allocator = self.page_allocator
        if (int(allocator.num_in_use), int(allocator.num_reserved)) != self._published_pages:
            self._publish_usage()
