"""Prometheus metrics for KV pools, read from the manager's snapshot when scraped.

Nothing here runs on the allocation path: a collector calls each registered pool's snapshot
function at scrape time and turns the counters into metric families labelled by `pool`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from kvcached_core.ledger import LedgerSnapshot

SnapshotSource = Callable[[], "LedgerSnapshot"]

# The registry used when the caller passes none (kept apart from prometheus_client's global one
# so that importing this module never changes what an engine already exports).
DEFAULT_REGISTRY = CollectorRegistry(auto_describe=True)

_NS_PER_S = 1e9


class PoolCollector(Collector):
    """One collector per registry; pools come and go by name."""

    def __init__(self) -> None:
        self._sources: dict[str, SnapshotSource] = {}
        self._lock = threading.Lock()

    def add(self, pool: str, source: SnapshotSource) -> None:
        with self._lock:
            if pool in self._sources:
                raise ValueError(f"pool {pool!r} already has metrics in this registry")
            self._sources[pool] = source

    def remove(self, pool: str) -> None:
        with self._lock:
            self._sources.pop(pool, None)

    def pools(self) -> list[str]:
        with self._lock:
            return sorted(self._sources)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            sources = sorted(self._sources.items())
        gauges = {
            "mapped_pages": GaugeMetricFamily(
                "kvcached_mapped_pages", "Pages backed by physical memory", labels=["pool"]
            ),
            "in_use_pages": GaugeMetricFamily(
                "kvcached_in_use_pages", "Pages holding at least one block", labels=["pool"]
            ),
            "reserve_pool_pages": GaugeMetricFamily(
                "kvcached_reserve_pool_pages", "Mapped idle pages kept warm", labels=["pool"]
            ),
            "num_used_blocks": GaugeMetricFamily(
                "kvcached_used_blocks", "Blocks handed out to the engine", labels=["pool"]
            ),
            "num_blocks": GaugeMetricFamily(
                "kvcached_blocks", "Blocks the pool may hold at its current limit", labels=["pool"]
            ),
        }
        counters = {
            "reserve_hits": CounterMetricFamily(
                "kvcached_reserve_hits",
                "New pages served from the mapped reserve pool",
                labels=["pool"],
            ),
            "reserve_misses": CounterMetricFamily(
                "kvcached_reserve_misses",
                "New pages that had to be mapped on the allocation path",
                labels=["pool"],
            ),
        }
        map_latency = SummaryMetricFamily(
            "kvcached_map_seconds", "Time spent mapping pages", labels=["pool"]
        )
        unmap_latency = SummaryMetricFamily(
            "kvcached_unmap_seconds", "Time spent unmapping pages", labels=["pool"]
        )
        for pool, source in sources:
            snapshot = source()
            for field, gauge in gauges.items():
                gauge.add_metric([pool], float(getattr(snapshot, field)))
            for field, counter in counters.items():
                counter.add_metric([pool], float(getattr(snapshot, field)))
            map_latency.add_metric(
                [pool], count_value=snapshot.map_calls, sum_value=snapshot.map_ns_total / _NS_PER_S
            )
            unmap_latency.add_metric(
                [pool],
                count_value=snapshot.unmap_calls,
                sum_value=snapshot.unmap_ns_total / _NS_PER_S,
            )
        yield from gauges.values()
        yield from counters.values()
        yield map_latency
        yield unmap_latency


_collectors: dict[int, tuple[CollectorRegistry, PoolCollector]] = {}
_collectors_lock = threading.Lock()


def _collector_for(registry: CollectorRegistry) -> PoolCollector:
    with _collectors_lock:
        entry = _collectors.get(id(registry))
        if entry is None or entry[0] is not registry:
            collector = PoolCollector()
            registry.register(collector)
            _collectors[id(registry)] = (registry, collector)
            return collector
        return entry[1]


class PoolMetrics:
    """Handle returned by `register_pool`; `close()` stops exporting the pool."""

    def __init__(self, pool: str, collector: PoolCollector) -> None:
        self.pool = pool
        self._collector = collector

    def close(self) -> None:
        self._collector.remove(self.pool)


def register_pool(
    pool: str, source: SnapshotSource, registry: CollectorRegistry | None = None
) -> PoolMetrics:
    """Export a pool's counters (read from `source()` on every scrape)."""
    collector = _collector_for(DEFAULT_REGISTRY if registry is None else registry)
    collector.add(pool, source)
    return PoolMetrics(pool, collector)
