"""Prometheus export of pool counters, read from the manager's snapshot on scrape."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvcached_core import _C
from kvcached_core.ledger import BlockLedger
from kvcached_core.metrics import DEFAULT_REGISTRY, register_pool

KIB = 1024
PAGE = 64 * KIB


@pytest.fixture
def manager() -> Iterator[BlockLedger]:
    backend = _C.HostBackend(0)
    ftensors = _C.FTensorAllocator(backend, PAGE, False)
    ftensors.create_kv_tensors(8 * PAGE, 1, 2)
    pages = _C.PageAllocator(ftensors, 0, 1, False)
    made = BlockLedger(pages, 16 * KIB, PAGE)
    yield made
    made.shutdown()


def test_scrape_reads_live_counters_with_a_pool_label(manager: BlockLedger) -> None:
    registry = CollectorRegistry()
    handle = register_pool("llama", manager.snapshot, registry)
    blocks = manager.alloc(9)  # 3 pages: 1 from the first alloc, 2 more
    sample = registry.get_sample_value
    assert sample("kvcached_used_blocks", {"pool": "llama"}) == 9
    assert sample("kvcached_mapped_pages", {"pool": "llama"}) == 3
    assert sample("kvcached_in_use_pages", {"pool": "llama"}) == 3
    assert sample("kvcached_reserve_misses_total", {"pool": "llama"}) == 3
    assert sample("kvcached_map_seconds_count", {"pool": "llama"}) == 2
    assert sample("kvcached_map_seconds_sum", {"pool": "llama"}) > 0
    manager.free(blocks)
    manager.alloc(4)  # the freed page waits in the reserve pool: a hit
    assert sample("kvcached_reserve_hits_total", {"pool": "llama"}) == 1
    assert sample("kvcached_used_blocks", {"pool": "llama"}) == 4
    assert sample("kvcached_unmap_seconds_count", {"pool": "llama"}) >= 1
    text = generate_latest(registry).decode()
    assert 'kvcached_used_blocks{pool="llama"} 4.0' in text
    handle.close()
    assert sample("kvcached_used_blocks", {"pool": "llama"}) is None


def test_two_pools_share_one_registry_and_names_are_unique(manager: BlockLedger) -> None:
    registry = CollectorRegistry()
    first = register_pool("a", manager.snapshot, registry)
    second = register_pool("b", manager.snapshot, registry)
    with pytest.raises(ValueError, match="already has metrics"):
        register_pool("a", manager.snapshot, registry)
    manager.alloc(2)
    assert registry.get_sample_value("kvcached_used_blocks", {"pool": "a"}) == 2
    assert registry.get_sample_value("kvcached_used_blocks", {"pool": "b"}) == 2
    first.close()
    second.close()


def test_default_registry_is_the_module_one(manager: BlockLedger) -> None:
    handle = register_pool("default-test", manager.snapshot)
    try:
        assert DEFAULT_REGISTRY.get_sample_value("kvcached_blocks", {"pool": "default-test"}) == 32
    finally:
        handle.close()


def test_scrape_costs_nothing_on_alloc(manager: BlockLedger) -> None:
    # The collector only runs on scrape: a failing source breaks the scrape, not the allocator.
    registry = CollectorRegistry()
    calls = []

    def source() -> object:
        calls.append(1)
        return manager.snapshot()

    register_pool("lazy", source, registry)
    calls.clear()
    for _ in range(100):
        manager.free(manager.alloc(3))
    assert calls == []
    registry.get_sample_value("kvcached_used_blocks", {"pool": "lazy"})
    assert len(calls) == 1
