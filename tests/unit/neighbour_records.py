"""Limit records of neighbouring pools, written as a live or dead engine would leave them: what
the start-up memory checks of both engines read (tests/unit/test_*_startup_memory_adapter.py;
the `records` and `dead_pid` fixtures are in tests/unit/conftest.py)."""

from __future__ import annotations

from pathlib import Path

from kvcached_core.limits import LimitRecord, record_path

GIB = 1 << 30


def write_record(directory: Path, pool: str, *, used: int, reserved: int, pid: int) -> None:
    record = LimitRecord(pool, limit_bytes=64 * GIB, used_bytes=used, reserved_bytes=reserved,
                         revision=0, owner_pid=pid, capacity_bytes=64 * GIB)
    record_path(pool, directory).write_bytes(record.pack())
