"""Shared limit records: format, ownership, staleness, revisions and the watcher."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.limits import (
    MAGIC,
    RECORD_SIZE,
    CorruptRecordError,
    LimitSegment,
    LimitWatcher,
    PoolAbout,
    StaleRevisionError,
    UnknownPoolError,
    collect_stale,
    delete_record,
    list_records,
    read_about,
    read_record,
    record_path,
    set_limit,
    shm_dir,
)
from kvcached_core.processes import state_of

GIB = 1 << 30


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_create_writes_fixed_binary_record_with_owner_and_mode_0600(tmp_path: Path) -> None:
    segment = LimitSegment.create("llama", capacity_bytes=8 * GIB, directory=tmp_path)
    path = tmp_path / "kvcached.llama"
    assert path.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    raw = path.read_bytes()
    assert RECORD_SIZE == 64
    assert raw[:8] == MAGIC
    # The trailer after the record: the engine this process imported (none here), no pages yet.
    assert PoolAbout.unpack(raw[RECORD_SIZE:]) == PoolAbout("", 0, 0)
    record = read_record("llama", tmp_path)
    assert record.limit_bytes == record.capacity_bytes == 8 * GIB
    assert record.owner_pid == os.getpid()
    assert (record.used_bytes, record.reserved_bytes, record.revision) == (0, 0, 0)
    assert not record.stale
    segment.close()
    assert not path.exists()
    segment.close()  # idempotent


def test_second_live_owner_is_refused(tmp_path: Path) -> None:
    segment = LimitSegment.create("p", capacity_bytes=GIB, directory=tmp_path)
    with pytest.raises(KVCachedConfigError, match="in use by process"):
        LimitSegment.create("p", capacity_bytes=GIB, directory=tmp_path)
    segment.close()


def test_stale_record_is_replaced_on_create_and_collected(tmp_path: Path) -> None:
    segment = LimitSegment.create("old", capacity_bytes=GIB, directory=tmp_path)
    path = segment.path
    # Simulate a crashed owner: rewrite the pid to one that no longer exists.
    record = read_record("old", tmp_path)
    dead = _dead_pid()
    path.write_bytes(
        type(record)(
            "old", record.limit_bytes, 5, 0, record.revision, dead, record.capacity_bytes
        ).pack()
    )
    assert read_record("old", tmp_path).stale
    assert [r.pool for r in collect_stale(tmp_path)] == ["old"]
    assert not path.exists()
    # A new owner may take the name of a stale record.
    path.write_bytes(type(record)("old", GIB, 0, 0, 0, dead, GIB).pack())
    fresh = LimitSegment.create("old", capacity_bytes=2 * GIB, directory=tmp_path)
    assert read_record("old", tmp_path).owner_pid == os.getpid()
    fresh.close()


def test_a_record_whose_owner_is_a_zombie_is_stale_and_collected(tmp_path: Path) -> None:
    # A killed owner that nobody has reaped yet still answers signals: it holds no pages.
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while state_of(child.pid) != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    segment = LimitSegment.create("zombie", capacity_bytes=GIB, directory=tmp_path)
    record = read_record("zombie", tmp_path)
    segment.path.write_bytes(type(record)(
        "zombie", record.limit_bytes, 0, 0, record.revision, child.pid,
        record.capacity_bytes).pack())
    assert read_record("zombie", tmp_path).stale
    assert [r.pool for r in collect_stale(tmp_path)] == ["zombie"]
    child.wait()


def test_set_limit_bumps_revision_clamps_and_refuses_stale_revision(tmp_path: Path) -> None:
    segment = LimitSegment.create("p", capacity_bytes=4 * GIB, directory=tmp_path)
    first = set_limit("p", GIB, directory=tmp_path)
    assert (first.limit_bytes, first.revision) == (GIB, 1)
    clamped = set_limit("p", 64 * GIB, expected_revision=1, directory=tmp_path)
    assert (clamped.limit_bytes, clamped.revision) == (4 * GIB, 2)
    with pytest.raises(StaleRevisionError, match="revision 2, not 1"):
        set_limit("p", GIB, expected_revision=1, directory=tmp_path)
    assert read_record("p", tmp_path).limit_bytes == 4 * GIB
    with pytest.raises(UnknownPoolError):
        set_limit("nope", GIB, directory=tmp_path)
    segment.close()


def test_usage_updates_keep_the_limit_and_revision(tmp_path: Path) -> None:
    segment = LimitSegment.create("p", capacity_bytes=4 * GIB, directory=tmp_path)
    set_limit("p", 2 * GIB, directory=tmp_path)
    segment.update_usage(3 << 20, 1 << 20)
    record = read_record("p", tmp_path)
    assert (record.used_bytes, record.reserved_bytes) == (3 << 20, 1 << 20)
    assert (record.limit_bytes, record.revision) == (2 * GIB, 1)
    segment.close()


def test_delete_refuses_live_owner_without_force(tmp_path: Path) -> None:
    segment = LimitSegment.create("p", capacity_bytes=GIB, directory=tmp_path)
    with pytest.raises(KVCachedConfigError, match="live process"):
        delete_record("p", directory=tmp_path)
    delete_record("p", force=True, directory=tmp_path)
    assert list_records(tmp_path) == []
    segment.close()  # the path is gone: close must not fail


def test_owner_close_does_not_remove_a_replacement_file(tmp_path: Path) -> None:
    segment = LimitSegment.create("p", capacity_bytes=GIB, directory=tmp_path)
    delete_record("p", force=True, directory=tmp_path)
    other = LimitSegment.create("p", capacity_bytes=GIB, directory=tmp_path)
    segment.close()
    assert record_path("p", tmp_path).exists()
    other.close()


def test_corrupt_and_foreign_files_are_skipped_by_list(tmp_path: Path) -> None:
    (tmp_path / "kvcached.junk").write_bytes(b"x" * RECORD_SIZE)
    (tmp_path / "unrelated").write_bytes(b"y")
    segment = LimitSegment.create("good", capacity_bytes=GIB, directory=tmp_path)
    assert [r.pool for r in list_records(tmp_path)] == ["good"]
    with pytest.raises(CorruptRecordError, match="bad magic"):
        read_record("junk", tmp_path)
    segment.close()


def test_invalid_pool_names_are_rejected(tmp_path: Path) -> None:
    for name in ("", "../etc", "a/b", "x" * 200):
        with pytest.raises(KVCachedConfigError, match="invalid pool name"):
            record_path(name, tmp_path)


def test_directory_comes_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCACHED_SHM_DIR", str(tmp_path))
    assert shm_dir() == tmp_path
    monkeypatch.delenv("KVCACHED_SHM_DIR")
    assert shm_dir() == Path("/dev/shm")


def test_watcher_reports_each_new_revision_once(tmp_path: Path) -> None:
    segment = LimitSegment.create("p", capacity_bytes=4 * GIB, directory=tmp_path)
    seen: list[int] = []
    changed = threading.Event()

    def on_limit(limit: int) -> None:
        seen.append(limit)
        changed.set()

    watcher = LimitWatcher(segment, on_limit, interval_s=0.01)
    try:
        segment.update_usage(GIB, 0)  # not a limit change
        set_limit("p", GIB, directory=tmp_path)
        assert changed.wait(2.0)
        changed.clear()
        set_limit("p", 2 * GIB, directory=tmp_path)
        assert changed.wait(2.0)
    finally:
        watcher.stop()
    assert seen == [GIB, 2 * GIB]
    segment.close()


def test_a_failing_poll_is_reported_once_and_the_watcher_keeps_watching(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    segment = LimitSegment.create("p", capacity_bytes=4 * GIB, directory=tmp_path)
    seen: list[int] = []
    changed = threading.Event()
    ticks = [0]

    def on_limit(limit: int) -> None:
        seen.append(limit)
        changed.set()

    def flaky_tick() -> None:  # e.g. publishing usage while /dev/shm is full
        ticks[0] += 1
        if ticks[0] <= 5:
            raise OSError(28, "No space left on device")

    watcher = LimitWatcher(segment, on_limit, interval_s=0.01, on_tick=flaky_tick)
    try:
        deadline = time.monotonic() + 5
        while ticks[0] <= 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        set_limit("p", GIB, directory=tmp_path)
        assert changed.wait(2.0), "the watcher died on a failing poll"
    finally:
        watcher.stop()
    assert seen == [GIB]
    reports = [r.getMessage() for r in caplog.records if "still watching" in r.getMessage()]
    assert len(reports) == 1 and "No space left on device" in reports[0], reports
    segment.close()


def test_the_owner_rewrites_its_truncated_record_from_what_it_last_knew(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    segment = LimitSegment.create("p", capacity_bytes=4 * GIB, directory=tmp_path)
    set_limit("p", GIB, directory=tmp_path)
    assert segment.read().limit_bytes == GIB
    segment.update_usage(3 << 20, 1 << 20)
    os.truncate(segment.path, 0)
    with pytest.raises(CorruptRecordError):
        read_record("p", tmp_path)
    assert segment.read() == read_record("p", tmp_path)
    record = read_record("p", tmp_path)
    assert (record.limit_bytes, record.used_bytes, record.reserved_bytes) == (GIB, 3 << 20, 1 << 20)
    assert (record.capacity_bytes, record.owner_pid, record.revision) == (4 * GIB, os.getpid(), 2)
    assert len([r for r in caplog.records if "was corrupt" in r.getMessage()]) == 1
    segment.close()


def test_the_trailer_says_the_engine_and_follows_the_reserve_counters(tmp_path: Path) -> None:
    segment = LimitSegment.create("vllm-demo", capacity_bytes=GIB, directory=tmp_path,
                                  engine="vllm-0.32")
    assert read_about("vllm-demo", tmp_path) == PoolAbout("vllm-0.32", 0, 0)
    assert PoolAbout("x", 0, 0).hit_rate is None
    segment.update_usage(3 << 20, 1 << 20, 9, 1)
    about = read_about("vllm-demo", tmp_path)
    assert about == PoolAbout("vllm-0.32", 9, 1) and about.hit_rate == 0.9
    # Garbage over the file: the owner's next update rewrites the record and its trailer.
    (tmp_path / "kvcached.vllm-demo").write_bytes(b"garbage" * 30)
    assert read_about("vllm-demo", tmp_path) is None
    segment.update_usage(3 << 20, 0, 10, 1)
    assert read_record("vllm-demo", tmp_path).used_bytes == 3 << 20
    assert read_about("vllm-demo", tmp_path) == PoolAbout("vllm-0.32", 10, 1)
    segment.close()
    assert read_about("vllm-demo", tmp_path) is None


def test_the_engine_label_is_the_cell_the_engine_build_wrote() -> None:
    code = ("import sys, types; from kvcached_core.limits import engine_of_this_process as e\n"
            "print(repr(e()))\n"
            "sys.modules['vllm'] = types.ModuleType('vllm'); print(repr(e()))\n"
            "sys.modules['vllm._kvcached_build'] = types.SimpleNamespace(CELL='vllm-0.32')\n"
            "print(e())\n"
            "sys.modules['sglang'] = types.ModuleType('sglang')\n"
            "sys.modules['sglang._kvcached_build'] = types.SimpleNamespace(CELL='sglang-0.5.23')\n"
            "print(e())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out == ["''", "''", "vllm-0.32", "sglang-0.5.23"]  # a stock engine: no label
