"""The start-up memory decisions a patched vLLM worker asks kvcached for.

Stock (`KVCACHED_ENABLE=0`) must give vLLM's own comparisons for every input; elastic must
start beside neighbours whose memory moves and still refuse a device with no room for the
engine's first KV pages.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvcached_core.integration.vllm.startup_memory import (
    first_pages_bytes,
    memory_profile_consistent,
    neighbour_kv_bytes,
    startup_memory_short,
)
from kvcached_core.settings import KVCachedSettings
from tests.unit.neighbour_records import write_record

GIB = 1 << 30
STOCK = {"KVCACHED_ENABLE": "0"}
ELASTIC = {"KVCACHED_ENABLE": "1", "KVCACHED_PAGE_SIZE": "2MiB",
           "KVCACHED_MIN_RESERVED_PAGES": "5"}
FIRST_PAGES = 5 * 2 * (1 << 20)
memory = st.integers(min_value=0, max_value=200 * GIB)


@given(free=memory, requested=memory)
def test_stock_start_up_check_is_vllms_comparison(free: int, requested: int) -> None:
    assert startup_memory_short(free, requested, environ=STOCK) == (free < requested)


@given(initial=memory, current=memory, strict=st.booleans())
def test_stock_profile_check_is_vllms_comparison(initial: int, current: int,
                                                 strict: bool) -> None:
    expected = initial > current if strict else initial >= current
    assert memory_profile_consistent(initial, current, strict=strict,
                                     environ=STOCK) == expected


def test_stock_refuses_the_neighbour_rise_that_stopped_a_staggered_start() -> None:
    # The figures of the failed start: a neighbour gave 0.15 GiB back while this engine profiled.
    assert not memory_profile_consistent(136.70 * GIB, 136.85 * GIB, environ=STOCK)


def test_elastic_accepts_memory_given_back_while_profiling(records: Path) -> None:
    assert memory_profile_consistent(136.70 * GIB, 136.85 * GIB, environ=ELASTIC,
                                     records_directory=str(records))


def test_elastic_starts_below_its_utilization_share(records: Path) -> None:
    # Four neighbours at 0.9 of a 139 GiB device: 0.9 of it is no longer free, but the share
    # is a ceiling for an elastic engine, whose KV is mapped on demand.
    assert not startup_memory_short(100 * GIB, 0.9 * 139 * GIB, environ=ELASTIC,
                                    records_directory=str(records))
    # The same device is refused by the stock check.
    assert startup_memory_short(100 * GIB, 0.9 * 139 * GIB, environ=STOCK)


def test_elastic_refuses_a_device_without_room_for_its_first_kv_pages(records: Path) -> None:
    assert first_pages_bytes(KVCachedSettings.from_env(ELASTIC)) == FIRST_PAGES
    almost_full = FIRST_PAGES - 1
    assert startup_memory_short(almost_full, 120 * GIB, environ=ELASTIC,
                                records_directory=str(records))
    assert not memory_profile_consistent(10 * GIB, almost_full, environ=ELASTIC,
                                         records_directory=str(records))
    assert not startup_memory_short(FIRST_PAGES, 120 * GIB, environ=ELASTIC,
                                    records_directory=str(records))


def test_elastic_counts_the_kv_live_neighbours_give_back(records: Path, dead_pid: int) -> None:
    live_neighbour = os.getppid()
    write_record(records, "neighbour", used=8 << 20, reserved=4 << 20, pid=live_neighbour)
    write_record(records, "gone", used=GIB, reserved=0, pid=dead_pid)
    write_record(records, "mine", used=GIB, reserved=0, pid=os.getpid())
    assert neighbour_kv_bytes(own_pool="engine", directory=str(records)) == 12 << 20
    # 2 MiB free plus the neighbour's 12 MiB hold the 10 MiB of first pages; the stale
    # record and this process's own pool do not count.
    assert not startup_memory_short(2 << 20, 120 * GIB, environ=ELASTIC,
                                    records_directory=str(records))
    assert memory_profile_consistent(GIB, 2 << 20, environ=ELASTIC,
                                     records_directory=str(records))
    (records / "kvcached.neighbour").unlink()
    assert startup_memory_short(2 << 20, 120 * GIB, environ=ELASTIC,
                                records_directory=str(records))


def test_elastic_with_the_share_free_passes_like_stock(records: Path) -> None:
    assert not startup_memory_short(130 * GIB, 125 * GIB, environ=ELASTIC,
                                    records_directory=str(records))
    assert memory_profile_consistent(130 * GIB, 128 * GIB, environ=ELASTIC,
                                     records_directory=str(records))
