"""Per-pool memory-limit records shared between processes on one host.

One small file per pool, `<dir>/kvcached.<pool>` (dir: `KVCACHED_SHM_DIR`, default `/dev/shm`),
with a fixed little-endian layout (see `_RECORD`). The owning pool creates it with `O_EXCL`,
updates used/reserved bytes when its pages change, watches the limit and removes the file on
shutdown. `kvctl` writes the limit. Every read and write holds `flock` on the file, so a reader
never sees half a record. A record whose owner process is gone is *stale*.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from kvcached_core.errors import KVCachedConfigError, KVCachedError

MAGIC = b"KVCLIMIT"
FORMAT_VERSION = 1
RECORD_PREFIX = "kvcached."
# magic, format version, flags (0), limit, used, reserved, revision, owner pid, capacity
_RECORD = struct.Struct("<8sIIqqqQqq")
RECORD_SIZE = _RECORD.size
_POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class UnknownPoolError(KVCachedError, LookupError):
    """No record exists for the pool."""


class StaleRevisionError(KVCachedError):
    """The record moved on since the revision the caller based its change on."""


class CorruptRecordError(KVCachedError):
    """The file is not a limit record of a format this code understands."""


def shm_dir(directory: str | os.PathLike[str] | None = None) -> Path:
    """Where records live: the argument, else `KVCACHED_SHM_DIR`, else `/dev/shm`."""
    if directory is not None:
        return Path(directory)
    return Path(os.environ.get("KVCACHED_SHM_DIR") or "/dev/shm")


def validate_pool_name(pool: str) -> str:
    if not _POOL_NAME.match(pool):
        raise KVCachedConfigError(
            f"invalid pool name {pool!r}: use letters, digits, '_', '-', '.' (at most 128)"
        )
    return pool


def record_path(pool: str, directory: str | os.PathLike[str] | None = None) -> Path:
    return shm_dir(directory) / f"{RECORD_PREFIX}{validate_pool_name(pool)}"


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class LimitRecord:
    pool: str
    limit_bytes: int
    used_bytes: int
    reserved_bytes: int
    revision: int
    owner_pid: int
    capacity_bytes: int

    @property
    def stale(self) -> bool:
        """The owner process no longer exists."""
        return not pid_alive(self.owner_pid)

    def pack(self) -> bytes:
        return _RECORD.pack(
            MAGIC,
            FORMAT_VERSION,
            0,
            self.limit_bytes,
            self.used_bytes,
            self.reserved_bytes,
            self.revision,
            self.owner_pid,
            self.capacity_bytes,
        )

    @classmethod
    def unpack(cls, pool: str, data: bytes) -> LimitRecord:
        if len(data) < RECORD_SIZE:
            raise CorruptRecordError(
                f"record {pool!r} is {len(data)} bytes, expected {RECORD_SIZE}"
            )
        magic, version, _flags, limit, used, reserved, revision, pid, capacity = _RECORD.unpack(
            data[:RECORD_SIZE]
        )
        if magic != MAGIC:
            raise CorruptRecordError(f"record {pool!r} has bad magic {magic!r}")
        if version != FORMAT_VERSION:
            raise CorruptRecordError(
                f"record {pool!r} has format version {version}, this code reads {FORMAT_VERSION}"
            )
        return cls(pool, limit, used, reserved, revision, pid, capacity)


@contextlib.contextmanager
def _locked(path: Path, *, write: bool) -> Iterator[int]:
    try:
        fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
    except FileNotFoundError:
        raise UnknownPoolError(f"no pool named {_pool_of(path)!r} in {path.parent}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if write else fcntl.LOCK_SH)
        yield fd
    finally:
        os.close(fd)  # closing drops the lock


def _pool_of(path: Path) -> str:
    return path.name[len(RECORD_PREFIX) :]


def _read_fd(pool: str, fd: int) -> LimitRecord:
    return LimitRecord.unpack(pool, os.pread(fd, RECORD_SIZE, 0))


def read_record(pool: str, directory: str | os.PathLike[str] | None = None) -> LimitRecord:
    with _locked(record_path(pool, directory), write=False) as fd:
        return _read_fd(pool, fd)


def list_records(directory: str | os.PathLike[str] | None = None) -> list[LimitRecord]:
    """Every readable record in the directory, sorted by pool name (corrupt files skipped)."""
    base = shm_dir(directory)
    records = []
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return []
    for name in names:
        if not name.startswith(RECORD_PREFIX):
            continue
        pool = name[len(RECORD_PREFIX) :]
        if not _POOL_NAME.match(pool):
            continue
        with contextlib.suppress(UnknownPoolError, CorruptRecordError, PermissionError):
            records.append(read_record(pool, base))
    return records


def set_limit(
    pool: str,
    limit_bytes: int,
    *,
    expected_revision: int | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> LimitRecord:
    """Write a new limit (clamped to the pool's capacity) and bump the revision.

    With `expected_revision`, refuse (StaleRevisionError) if the record has moved on.
    """
    if limit_bytes < 0:
        raise ValueError(f"limit must be >= 0 bytes, got {limit_bytes}")
    with _locked(record_path(pool, directory), write=True) as fd:
        current = _read_fd(pool, fd)
        if expected_revision is not None and current.revision != expected_revision:
            raise StaleRevisionError(
                f"pool {pool!r} is at revision {current.revision}, not {expected_revision}"
            )
        updated = replace(
            current,
            limit_bytes=min(limit_bytes, current.capacity_bytes),
            revision=current.revision + 1,
        )
        os.pwrite(fd, updated.pack(), 0)
        return updated


def delete_record(
    pool: str, *, force: bool = False, directory: str | os.PathLike[str] | None = None
) -> LimitRecord:
    """Remove a record whose owner is gone (or any record, with `force`)."""
    path = record_path(pool, directory)
    with _locked(path, write=True) as fd:
        record = _read_fd(pool, fd)
        if not force and not record.stale:
            raise KVCachedConfigError(
                f"pool {pool!r} is owned by live process {record.owner_pid}; use --force"
            )
        path.unlink()
        return record


def collect_stale(directory: str | os.PathLike[str] | None = None) -> list[LimitRecord]:
    """Remove every record whose owner is gone; returns what was removed."""
    removed = []
    for record in list_records(directory):
        if record.stale:
            with contextlib.suppress(UnknownPoolError, KVCachedConfigError):
                removed.append(delete_record(record.pool, directory=directory))
    return removed


class LimitSegment:
    """The owner's handle on its pool's record: create, publish usage, close."""

    def __init__(self, pool: str, path: Path, fd: int, inode: tuple[int, int]) -> None:
        self.pool = pool
        self.path = path
        self._fd = fd
        self._inode = inode
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def create(
        cls,
        pool: str,
        *,
        capacity_bytes: int,
        limit_bytes: int | None = None,
        directory: str | os.PathLike[str] | None = None,
    ) -> LimitSegment:
        """Create the record exclusively; a stale record of the same name is replaced."""
        path = record_path(pool, directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        limit = capacity_bytes if limit_bytes is None else min(limit_bytes, capacity_bytes)
        record = LimitRecord(pool, limit, 0, 0, 0, os.getpid(), capacity_bytes)
        for _attempt in range(2):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                try:
                    existing = read_record(pool, directory)
                except (UnknownPoolError, CorruptRecordError):
                    existing = None
                if existing is not None and not existing.stale:
                    raise KVCachedConfigError(
                        f"pool name {pool!r} is in use by process {existing.owner_pid} "
                        f"({path}); choose another name"
                    ) from None
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.pwrite(fd, record.pack(), 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
                stat = os.fstat(fd)
            except BaseException:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            return cls(pool, path, fd, (stat.st_dev, stat.st_ino))
        raise KVCachedConfigError(f"could not create limit record {path}")

    def read(self) -> LimitRecord:
        with self._lock:
            self._check_open()
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            try:
                return _read_fd(self.pool, self._fd)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def update_usage(self, used_bytes: int, reserved_bytes: int) -> None:
        """Publish mapped bytes (called when pages change, not per block)."""
        with self._lock:
            if self._closed:
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                current = _read_fd(self.pool, self._fd)
                updated = replace(current, used_bytes=used_bytes, reserved_bytes=reserved_bytes)
                os.pwrite(self._fd, updated.pack(), 0)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def set_limit(self, limit_bytes: int) -> LimitRecord:
        self._check_open()
        return set_limit(self.pool, limit_bytes, directory=self.path.parent)

    def close(self) -> None:
        """Remove the record if the path still names the file this owner created."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                stat = os.stat(self.path)
                if (stat.st_dev, stat.st_ino) == self._inode:
                    self.path.unlink()
            except FileNotFoundError:
                pass
            finally:
                os.close(self._fd)

    def _check_open(self) -> None:
        if self._closed:
            raise KVCachedError(f"limit record of pool {self.pool!r} is closed")


class LimitWatcher:
    """Polls a record and calls `on_limit(limit_bytes)` when its revision changes.

    The callback runs on the watcher thread; it should only publish a target (the manager
    applies it on its own thread). `on_tick`, if given, runs after every poll (the pool uses it
    to publish what its background refill mapped, which no allocation reports).
    """

    def __init__(
        self,
        segment: LimitSegment,
        on_limit: Callable[[int], None],
        *,
        interval_s: float = 0.1,
        on_tick: Callable[[], None] | None = None,
    ) -> None:
        self._segment = segment
        self._on_limit = on_limit
        self._on_tick = on_tick
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._revision = segment.read().revision
        self._thread = threading.Thread(
            target=self._run, name=f"kvcached-limit-{segment.pool}", daemon=True
        )
        self._thread.start()

    def poll_once(self) -> bool:
        """Check the record now; True if a new revision was seen."""
        try:
            record = self._segment.read()
        except (KVCachedError, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno not in (errno.EBADF, errno.ENOENT):
                raise
            return False
        if record.revision == self._revision:
            return False
        self._revision = record.revision
        self._on_limit(record.limit_bytes)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.poll_once()
            if self._on_tick is not None:
                self._on_tick()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
