"""KVPool on the host backend: views, resident memory, shared limits, settings."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvcached_core.errors import KVCachedConfigError, PoolExhausted
from kvcached_core.kvctl import main as kvctl_main
from kvcached_core.limits import CorruptRecordError, read_about, read_record, record_path
from kvcached_core.native import as_tensor
from kvcached_core.pool import KVPool, PoolPolicy, PoolSpec
from kvcached_core.settings import KVCachedSettings
from tests.unit.backend_views import (
    KVCacheSpec,
    KVLayout,
    kernel_block_byte_offset,
    pool_kv_views,
)
from tests.unit.pool_factory import create_pool

KIB = 1024
MIB = 1 << 20
PAGE = 64 * KIB


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(tmp_path))
    return tmp_path


def make_pool(name: str = "test", **options: Any) -> KVPool:
    defaults: dict[str, Any] = {
        "num_layers": 2,
        "num_kv_buffers": 2,
        "block_bytes": 16 * KIB,
        "virtual_bytes_per_layer": 2 * 16 * PAGE,
        "page_size": PAGE,
        "min_reserve_pages": 0,
        "max_reserve_pages": 1,
        "metrics_registry": CollectorRegistry(),
    }
    defaults.update(options)
    return create_pool(name, **defaults)


@pytest.fixture
def pool(shm: Path) -> Iterator[KVPool]:
    made = make_pool()
    yield made
    made.close()


def flat_bytes(ftensor: Any) -> torch.Tensor:
    return as_tensor(ftensor, torch.uint8, (ftensor.size,))


SPECS = [
    KVCacheSpec(KVLayout.FLASH_ATTN, 16, 2, 32, 2, kernel_block_size=8),
    KVCacheSpec(KVLayout.FLASHINFER, 16, 4, 16, 2),
    KVCacheSpec(KVLayout.CPU, 16, 2, 32, 2, kernel_block_size=4),
    KVCacheSpec(KVLayout.PACKED, 16, 2, 32, 2),
    KVCacheSpec(KVLayout.MLA, 32, 1, 64, 2, kernel_block_size=16),
]


def _unit(spec: KVCacheSpec, view: torch.Tensor, buffer: int, unit: int) -> torch.Tensor:
    if spec.layout in (KVLayout.FLASH_ATTN, KVLayout.CPU):
        return view[buffer, unit]
    if spec.layout is KVLayout.FLASHINFER:
        return view[unit, buffer]
    return view[unit]


@pytest.mark.parametrize("contiguous", [False, True], ids=["per-layer", "contiguous"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.layout.value)
def test_views_write_where_the_layout_promises_and_never_overlap(
    shm: Path, spec: KVCacheSpec, contiguous: bool
) -> None:
    layers = 3
    with make_pool(
        "views",
        num_layers=layers,
        num_kv_buffers=spec.num_kv_buffers,
        block_bytes=spec.block_bytes,
        virtual_bytes_per_layer=4 * PAGE * spec.num_kv_buffers,
        contiguous=contiguous,
        set_aside_null_block=False,
    ) as kv:
        blocks = kv.alloc(kv.available_size())  # back every page so writes land in memory
        assert len(blocks) == kv.num_blocks
        views = pool_kv_views(kv, spec, torch.float16)
        region = kv.geometry.bytes_per_layer_per_buffer
        flats = [flat_bytes(t) for t in kv.tensors]
        owners = torch.full((sum(f.numel() for f in flats),), -1, dtype=torch.int64)
        for layer, view in enumerate(views):
            kernel_blocks = region // spec.kernel_block_bytes
            assert (
                view.shape[
                    0 if spec.num_kv_buffers == 1 or spec.layout is KVLayout.FLASHINFER else 1
                ]
                == kernel_blocks
            )
            for buffer, unit in itertools.product(
                range(spec.num_kv_buffers), [0, 1, kernel_blocks - 1]
            ):
                for flat in flats:
                    flat.zero_()
                _unit(spec, view, buffer, unit).view(torch.int16).fill_(0x0101)
                index = 0 if contiguous else layer
                touched = flats[index].nonzero().flatten()
                start = kernel_block_byte_offset(
                    spec,
                    kernel_block=unit,
                    layer=layer,
                    buffer=buffer,
                    num_layers=layers,
                    region_bytes=region,
                    contiguous=contiguous,
                )
                assert int(touched.min()) == start
                assert int(touched.max()) == start + spec.kernel_block_bytes - 1
                assert all(int(f.count_nonzero()) == 0 for i, f in enumerate(flats) if i != index)
            # Ownership map: every byte of every layer's view belongs to exactly one layer.
            for flat in flats:
                flat.zero_()
            view.view(torch.int16).fill_(0x0101)
            base = 0 if contiguous else sum(f.numel() for f in flats[:layer])
            written = flats[0 if contiguous else layer].nonzero().flatten() + base
            assert bool((owners[written] == -1).all()), "layer views overlap"
            owners[written] = layer
        kv.free(blocks)


def test_views_reject_a_spec_of_another_geometry(pool: KVPool) -> None:
    with pytest.raises(KVCachedConfigError, match="16384-byte blocks"):
        pool_kv_views(pool, KVCacheSpec(KVLayout.FLASH_ATTN, 16, 1, 32, 2), torch.float16)


def _rss_shmem_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("RssShmem missing from /proc/self/status")


def test_resident_memory_follows_demand(shm: Path) -> None:
    spec = KVCacheSpec(KVLayout.FLASH_ATTN, 16, 8, 64, 2)  # 16 KiB blocks
    with make_pool(
        "rss",
        block_bytes=spec.block_bytes,
        page_size=256 * KIB,
        virtual_bytes_per_layer=2 * 64 * 256 * KIB,  # 32 MiB per layer
        max_reserve_pages=2,
    ) as kv:
        views = pool_kv_views(kv, spec, torch.float16)
        store = kv.backend.store_allocated_bytes
        idle_store, idle_rss = store(), _rss_shmem_bytes()
        blocks = kv.alloc(40 * kv.ledger.blocks_per_page)  # a burst: 40 pages
        for view in views:  # the engine writes its KV
            for block in blocks:
                view[:, block].fill_(1.0)
        page_all_layers = kv.geometry.page_bytes_all_layers
        assert store() - idle_store >= 40 * page_all_layers
        assert _rss_shmem_bytes() - idle_rss >= 40 * page_all_layers * 9 // 10
        assert kv.mapped_bytes() >= 40 * page_all_layers
        kv.free(blocks)
        kv.trim()
        # Only the null block's page is left.
        assert store() - idle_store <= page_all_layers
        assert _rss_shmem_bytes() - idle_rss <= 2 * page_all_layers
        assert kv.snapshot().mapped_pages == 1
        # Unbacked pages read zeros.
        assert float(views[0][:, blocks[-1]].abs().sum()) == 0.0


def test_limit_record_tracks_usage_and_is_removed_on_close(shm: Path) -> None:
    kv = make_pool("rec")
    path = record_path("rec", shm)
    record = read_record("rec", shm)
    page_all = kv.geometry.page_bytes_all_layers
    assert record.capacity_bytes == 16 * page_all
    blocks = kv.alloc(9)  # the null block's page plus 2 more
    assert read_record("rec", shm).used_bytes == 3 * page_all
    kv.free(blocks)
    assert read_record("rec", shm).used_bytes == page_all
    kv.close()
    assert not path.exists()
    kv.close()  # idempotent


def test_the_record_shows_the_reserve_the_refill_thread_maps_on_its_own(shm: Path) -> None:
    # No allocation reports these pages: the limit watcher publishes them within a poll.
    with make_pool("refill", min_reserve_pages=3, max_reserve_pages=3, prealloc=True) as kv:
        page_all = kv.geometry.page_bytes_all_layers
        deadline = time.monotonic() + 5
        while read_record("refill", shm).reserved_bytes != 3 * page_all:
            assert time.monotonic() < deadline, read_record("refill", shm)
            time.sleep(0.02)
        assert kv.page_allocator.num_reserved == 3


def test_kvctl_limit_reaches_the_pool_through_the_watcher(shm: Path) -> None:
    with make_pool("shared") as kv:
        page_all = kv.geometry.page_bytes_all_layers
        blocks = kv.alloc(20)  # 6 pages with the null block
        assert kvctl_main(["limit", "shared", str(4 * page_all)]) == 0
        deadline = time.monotonic() + 5
        while kv.ledger._pending_resize is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(PoolExhausted):
            kv.alloc(4)  # applies the new limit (4 pages) first: shrink pending
        assert kv.num_blocks == 16
        assert kv.snapshot().in_shrink
        kv.free(blocks)
        assert not kv.snapshot().in_shrink
        assert kv.available_size() == 15
        assert len(kv.alloc(15)) == 15


def test_a_limit_set_with_kvctl_is_seen_by_the_next_capacity_check_before_any_alloc(
        shm: Path) -> None:
    # A scheduler checks capacity before it allocates: one that refuses everything under a low
    # limit must see the limit raised without allocating first.
    with make_pool("check", physical_limit_bytes=4 * PAGE) as kv:  # one page, all layers
        page_all = kv.geometry.page_bytes_all_layers
        assert page_all == 4 * PAGE
        held_back = kv.available_size()
        assert held_back == kv.blocks_per_page - 1  # the null block's page, nothing more
        assert kvctl_main(["limit", "check", str(4 * page_all)]) == 0
        deadline = time.monotonic() + 5
        while kv.available_size() == held_back:
            assert time.monotonic() < deadline, "the raised limit never reached the check"
            time.sleep(0.01)
        assert kv.available_size() == 4 * kv.blocks_per_page - 1  # less the null block
        assert kv.num_blocks == 4 * kv.blocks_per_page
        assert kvctl_main(["limit", "check", str(2 * page_all)]) == 0
        deadline = time.monotonic() + 5
        while kv.available_size() != 2 * kv.blocks_per_page - 1:
            assert time.monotonic() < deadline, kv.available_size()
            time.sleep(0.01)
        assert kv.num_blocks == 2 * kv.blocks_per_page


def test_a_truncated_limit_record_is_rewritten_by_its_owner_which_keeps_watching(
    shm: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvcached_core.limits")
    with make_pool("trunc") as kv:
        page_all = kv.geometry.page_bytes_all_layers
        blocks = kv.alloc(9)  # 3 pages with the null block
        assert kvctl_main(["limit", "trunc", str(12 * page_all)]) == 0
        deadline = time.monotonic() + 5
        while kv.ledger._pending_resize is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the owner has seen the limit: it is part of its own state now
        path = record_path("trunc", shm)
        os.truncate(path, 0)  # another process, or a full /dev/shm
        more = kv.alloc(2)  # publishing usage meets the corrupt record too
        deadline = time.monotonic() + 5
        while True:
            try:
                record = read_record("trunc", shm)
                break
            except CorruptRecordError:
                assert time.monotonic() < deadline, "the owner never rewrote its record"
                time.sleep(0.02)
        assert record.limit_bytes == 12 * page_all
        assert record.used_bytes == 3 * page_all
        assert record.capacity_bytes == 16 * page_all
        assert record.owner_pid == os.getpid() and record.revision >= 2
        about = read_about("trunc", shm)  # and its trailer, nothing of the old bytes after it
        assert about is not None and about.engine == ""
        assert path.stat().st_size == len(record.pack()) + len(about.pack())
        time.sleep(0.3)  # a few more polls: the recovery is reported once, not per poll
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "trunc" in warnings[0] and "corrupt" in warnings[0] and "rewrote" in warnings[0]
        # The watcher is alive: a limit set afterwards still reaches the pool.
        assert kvctl_main(["limit", "trunc", str(2 * page_all)]) == 0
        deadline = time.monotonic() + 5
        while (kv.ledger._pending_resize != 2 * kv.blocks_per_page
               and time.monotonic() < deadline):
            time.sleep(0.01)
        with pytest.raises(PoolExhausted):
            kv.alloc(4)
        assert kv.snapshot().in_shrink
        kv.free(blocks + more)


def test_set_limit_and_physical_limit(shm: Path) -> None:
    page_all = 4 * PAGE
    with make_pool("lim", physical_limit_bytes=3 * page_all) as kv:
        assert kv.num_blocks == 12
        assert kv.available_size() == 11
        assert read_record("lim", shm).limit_bytes == 3 * page_all
        assert kv.set_limit(5 * page_all)
        assert kv.available_size() == 19
        assert read_record("lim", shm).revision == 1


def test_blocks_larger_than_a_page_map_together(shm: Path) -> None:
    with make_pool("big", block_bytes=2 * PAGE, virtual_bytes_per_layer=2 * 8 * PAGE) as kv:
        assert kv.geometry.allocator_page_bytes == 2 * PAGE
        assert kv.ledger.blocks_per_page == 1
        assert kv.available_size() == 3  # 4 blocks minus the null block
        assert kv.alloc(2) == [1, 2]


def test_pool_metrics_are_read_on_scrape(shm: Path) -> None:
    registry = CollectorRegistry()
    with make_pool("m", metrics_registry=registry) as kv:
        kv.alloc(6)
        assert registry.get_sample_value("kvcached_used_blocks", {"pool": "m"}) == 6
        assert registry.get_sample_value("kvcached_mapped_pages", {"pool": "m"}) >= 2
    assert registry.get_sample_value("kvcached_used_blocks", {"pool": "m"}) is None


def test_second_pool_with_a_live_name_is_refused(pool: KVPool) -> None:
    with pytest.raises(KVCachedConfigError, match="in use by process"):
        make_pool()


def test_bad_geometry_is_refused_before_any_memory_is_reserved(shm: Path) -> None:
    with pytest.raises(KVCachedConfigError, match="nearest working block size"):
        make_pool("bad", block_bytes=24 * KIB)
    with pytest.raises(KVCachedConfigError, match="holds no whole page"):
        make_pool("bad", virtual_bytes_per_layer=PAGE)
    assert not record_path("bad", shm).exists()


# ---------------------------------------------------------------------- settings


def test_settings_from_env_reads_every_variable() -> None:
    settings = KVCachedSettings.from_env(
        {
            "KVCACHED_ENABLE": "1",
            "KVCACHED_PAGE_SIZE": "4M",
            "KVCACHED_LAYOUT": "contiguous",
            "KVCACHED_MIN_RESERVED_PAGES": "2",
            "KVCACHED_MAX_RESERVED_PAGES": "8",
            "KVCACHED_PREALLOC": "false",
            "KVCACHED_PHYSICAL_LIMIT": "1.5GiB",
            "KVCACHED_MAX_CACHED_TOKENS": "-1",
            "KVCACHED_DEFER_PHYSICAL_RELEASE": "yes",
        }
    )
    assert settings == KVCachedSettings(
        enabled=True,
        page_size=4 * MIB,
        contiguous_layout=True,
        min_reserved_pages=2,
        max_reserved_pages=8,
        prealloc=False,
        physical_limit_bytes=3 * (1 << 29),
        max_cached_tokens=-1,
        defer_physical_release=True,
    )
    assert KVCachedSettings.from_env({}) == KVCachedSettings()


def test_settings_hold_every_kvcached_variable_read_anywhere() -> None:
    settings = KVCachedSettings.from_env({
        "KVCACHED_VIRTUAL_SIZE": "64G",
        "KVCACHED_POOL_NAME": "llama",
        "KVCACHED_IPC_TIMEOUT": "2.5",
        "KVCACHED_SHM_DIR": "/run/kv",
        "KVCACHED_SCHEDULER_ONLY": "1",
        "KVCACHED_BUDGET": "gpu0",
        "KVCACHED_ZERO_PAGE": "read-only",
    })
    assert (settings.virtual_size_bytes, settings.pool_name) == (64 << 30, "llama")
    assert (settings.ipc_timeout_s, settings.shm_dir) == (2.5, "/run/kv")
    assert settings.scheduler_only and settings.budget == "gpu0"
    assert settings.zero_page_writable is False
    defaults = KVCachedSettings()
    assert (defaults.virtual_size_bytes, defaults.pool_name) == (None, None)
    assert (defaults.ipc_timeout_s, defaults.shm_dir, defaults.scheduler_only) == (
        60.0, "/dev/shm", False)


def test_current_settings_follow_the_environment_and_parse_once_per_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvcached_core import settings as settings_module

    parses: list[int] = []
    original = KVCachedSettings.from_env.__func__  # type: ignore[attr-defined]

    def counting_from_env(cls: type[KVCachedSettings], environ: Any = None) -> KVCachedSettings:
        parses.append(1)
        return original(cls, environ)  # type: ignore[no-any-return]

    monkeypatch.setattr(KVCachedSettings, "from_env", classmethod(counting_from_env))
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "4M")
    first = settings_module.current_settings()
    assert first.page_size == 4 * MIB
    assert settings_module.current_settings() is first  # unchanged environment: no parse
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    assert settings_module.current_settings() is first
    assert len(parses) == 1
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "8M")  # a test or launcher changes a setting
    assert settings_module.current_settings().page_size == 8 * MIB
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", "3000")
    with pytest.raises(KVCachedConfigError, match="KVCACHED_PAGE_SIZE"):
        settings_module.current_settings()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KVCACHED_ENABLE", "maybe"),
        ("KVCACHED_PAGE_SIZE", "3000"),
        ("KVCACHED_PAGE_SIZE", "lots"),
        ("KVCACHED_LAYOUT", "diagonal"),
        ("KVCACHED_MIN_RESERVED_PAGES", "x"),
        ("KVCACHED_MIN_RESERVED_PAGES", "-1"),
        ("KVCACHED_MAX_RESERVED_PAGES", "1"),
        ("KVCACHED_PHYSICAL_LIMIT", "2X"),
        ("KVCACHED_MAX_CACHED_TOKENS", "1e3"),
        ("KVCACHED_VIRTUAL_SIZE", "big"),
        ("KVCACHED_IPC_TIMEOUT", "0"),
        ("KVCACHED_SCHEDULER_ONLY", "perhaps"),
    ],
)
def test_settings_errors_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(KVCachedConfigError, match=name):
        KVCachedSettings.from_env(
            {name: value, "KVCACHED_MIN_RESERVED_PAGES": "2"}
            if name == "KVCACHED_MAX_RESERVED_PAGES"
            else {name: value}
        )


def test_pool_from_settings(shm: Path) -> None:
    settings = KVCachedSettings(page_size=PAGE, min_reserved_pages=0, max_reserved_pages=1)
    spec = PoolSpec.from_settings(settings, num_layers=1, num_kv_buffers=2,
                                  block_bytes=16 * KIB, virtual_bytes_per_layer=2 * 4 * PAGE)
    assert (spec.page_size, spec.contiguous) == (PAGE, False)
    policy = PoolPolicy.from_settings(settings)
    assert (policy.min_reserve_pages, policy.max_reserve_pages) == (0, 1)
    with KVPool.create("fs", spec, policy, metrics_registry=CollectorRegistry()) as kv:
        assert kv.available_size() == 15


def test_pool_from_settings_joins_the_budget_named_in_the_settings(shm: Path) -> None:
    from kvcached_core.budget import read_budget, set_budget

    set_budget("fs-budget", 2 * 2 * PAGE)  # two logical pages of one layer, two buffers
    settings = KVCachedSettings(page_size=PAGE, min_reserved_pages=0, max_reserved_pages=0,
                                prealloc=False, budget="fs-budget")
    spec = PoolSpec.from_settings(settings, num_layers=1, num_kv_buffers=2,
                                  block_bytes=16 * KIB, virtual_bytes_per_layer=2 * 4 * PAGE)
    with KVPool.create("fs-b", spec, PoolPolicy.from_settings(settings),
                       metrics_registry=CollectorRegistry()) as kv:
        # The null block's page is charged; one more page fits, the third is refused.
        assert read_budget("fs-budget").charged_bytes == 2 * PAGE
        taken: list[int] = []
        with pytest.raises(PoolExhausted):
            while True:
                taken += kv.alloc(1)
        assert taken
        assert read_budget("fs-budget").charged_bytes == 2 * 2 * PAGE
        kv.free(taken)


def test_a_pool_no_larger_than_its_reserve_starts_while_the_refill_runs(shm: Path) -> None:
    """The refill thread may hold every page at start; the null block must wait for it."""
    for attempt in range(40):
        made = make_pool(f"small-{attempt}", virtual_bytes_per_layer=2 * 4 * PAGE,
                         min_reserve_pages=5, max_reserve_pages=5, prealloc=True)
        try:
            assert made.null_block_id == 0
            blocks = made.alloc(made.available_size())
            assert len(set(blocks)) == len(blocks) > 0
            made.free(blocks)
        finally:
            made.close()


def test_the_record_trailer_carries_the_reserve_counters_kvtop_shows(shm: Path) -> None:
    with make_pool("about", min_reserve_pages=1, max_reserve_pages=2) as kv:
        blocks = kv.alloc(4)
        kv.free(blocks)
        blocks = kv.alloc(8)  # pages again: some from the warm reserve
        deadline = time.monotonic() + 5
        while True:
            snapshot = kv.snapshot()
            about = read_about("about", shm)
            assert about is not None
            if (about.reserve_hits, about.reserve_misses) == (snapshot.reserve_hits,
                                                              snapshot.reserve_misses):
                break
            assert time.monotonic() < deadline, (about, snapshot)
            time.sleep(0.02)
        assert about.reserve_hits + about.reserve_misses >= 2
        assert about.hit_rate is not None and 0 <= about.hit_rate <= 1
        kv.free(blocks)
