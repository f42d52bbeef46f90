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
import importlib
import logging
import os
import re
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from kvcached_core.errors import KVCachedConfigError, KVCachedError
from kvcached_core.processes import has_exited
from kvcached_core.settings import current_settings

MAGIC = b"KVCLIMIT"
FORMAT_VERSION = 1
RECORD_PREFIX = "kvcached."
# magic, format version, flags (0), limit, used, reserved, revision, owner pid, capacity
_RECORD = struct.Struct("<8sIIqqqQqq")
RECORD_SIZE = _RECORD.size
_POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")
# After the record, its owner keeps a trailer for observers (`kvtop`): the engine the pool
# serves and how its reserve served new pages. Every reader of the record reads RECORD_SIZE
# bytes only, so the trailer changes nothing for them, and a record rewritten after corruption
# has none until the owner's next usage update. magic, reserve hits, reserve misses, label
# length, then the UTF-8 label.
_ABOUT = struct.Struct("<8sqqH")
ABOUT_MAGIC = b"KVCABOUT"
MAX_LABEL_BYTES = 128
# Where the owner pid sits in a record (after magic, version, flags and four 8-byte fields).
_OWNER_PID = struct.Struct("<q")
_OWNER_PID_OFFSET = 8 + 4 + 4 + 4 * 8
# Default names of the engines' pools carry their owner's pid: `vllm-<pid>`,
# `sglang-<kind>-<pid>-<n>` (see integration/*/); a name chosen by the user may not.
_PID_IN_DEFAULT_NAME = re.compile(r"^(?:vllm|sglang-[a-z]+)-([1-9][0-9]{0,9})(?:-[0-9]+)?$")

logger = logging.getLogger(__name__)


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
    return Path(current_settings().shm_dir)


def validate_pool_name(pool: str) -> str:
    if not _POOL_NAME.match(pool):
        raise KVCachedConfigError(
            f"invalid pool name {pool!r}: use letters, digits, '_', '-', '.' (at most 128)"
        )
    return pool


def record_path(pool: str, directory: str | os.PathLike[str] | None = None) -> Path:
    return shm_dir(directory) / f"{RECORD_PREFIX}{validate_pool_name(pool)}"


def pid_alive(pid: int) -> bool:
    """The process exists and has not exited: a zombie owner (killed, not yet reaped, or an
    orphan nobody reaps) holds no pages, so its records are stale."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return not has_exited(pid)


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


@dataclass(frozen=True)
class PoolAbout:
    """A record's trailer: `engine` ("vllm-0.32", "" when the owner runs no engine) and the
    reserve's hits and misses (new pages served mapped, or mapped on the allocation path)."""

    engine: str
    reserve_hits: int
    reserve_misses: int

    @property
    def hit_rate(self) -> float | None:
        served = self.reserve_hits + self.reserve_misses
        return self.reserve_hits / served if served else None

    def pack(self) -> bytes:
        label = self.engine.encode()[:MAX_LABEL_BYTES]
        return _ABOUT.pack(ABOUT_MAGIC, self.reserve_hits, self.reserve_misses,
                           len(label)) + label

    @classmethod
    def unpack(cls, data: bytes) -> PoolAbout | None:
        """The trailer in the bytes after a record, or None (absent, or not yet rewritten)."""
        if len(data) < _ABOUT.size:
            return None
        magic, hits, misses, length = _ABOUT.unpack(data[:_ABOUT.size])
        label = data[_ABOUT.size:_ABOUT.size + length]
        if magic != ABOUT_MAGIC or length > MAX_LABEL_BYTES or len(label) != length:
            return None
        return cls(label.decode(errors="replace"), hits, misses)


def engine_of_this_process() -> str:
    """The cell of the patched engine build this process runs ("vllm-0.32"; "" when none): the
    `CELL` its build wrote into the engine's `_kvcached_build` module, so no version is read
    here. Looked up only for an engine package already imported; SGLang first, since some of
    its releases import vLLM's kernels on their CPU path."""
    for engine in ("sglang", "vllm"):
        if engine not in sys.modules:
            continue
        try:
            build = importlib.import_module(f"{engine}._kvcached_build")
        except ImportError:  # the stock engine: no build of ours
            continue
        return str(getattr(build, "CELL", engine))
    return ""


def read_about(pool: str, directory: str | os.PathLike[str] | None = None) -> PoolAbout | None:
    """The trailer of a pool's record, or None (no record, or no trailer yet)."""
    try:
        with _locked(record_path(pool, directory), write=False) as fd:
            data = os.pread(fd, RECORD_SIZE + _ABOUT.size + MAX_LABEL_BYTES, 0)
    except UnknownPoolError:
        return None
    return PoolAbout.unpack(data[RECORD_SIZE:])


def _pool_of(path: Path) -> str:
    return path.name[len(RECORD_PREFIX) :]


def _read_fd(pool: str, fd: int) -> LimitRecord:
    return LimitRecord.unpack(pool, os.pread(fd, RECORD_SIZE, 0))


def read_record(pool: str, directory: str | os.PathLike[str] | None = None) -> LimitRecord:
    with _locked(record_path(pool, directory), write=False) as fd:
        return _read_fd(pool, fd)


def list_records(directory: str | os.PathLike[str] | None = None) -> list[LimitRecord]:
    """Every readable record in the directory, sorted by pool name (see `scan_records` for the
    corrupt ones)."""
    return scan_records(directory)[0]


@dataclass(frozen=True)
class CorruptRecord:
    """A record file whose bytes are not a record (truncated, overwritten, foreign format)."""

    pool: str
    path: Path
    reason: str
    #: From the header when it still holds one, else from a default pool name; None: unknown.
    owner_pid: int | None
    #: Seconds since the file last changed (a live owner rewrites a corrupt record at once).
    age_s: float

    @property
    def stale(self) -> bool:
        """No live owner will rewrite it: its owner is gone, or (owner unknown) nobody has
        rewritten it for `CORRUPT_GRACE_S`."""
        if self.owner_pid is not None:
            return not pid_alive(self.owner_pid)
        return self.age_s >= CORRUPT_GRACE_S


#: How long a corrupt record of unknown owner is left alone: an owner's watcher rewrites its
#: record within one poll (0.1 s), so one corrupt for this long has no live owner watching it.
CORRUPT_GRACE_S = 5.0


def _owner_pid_of_corrupt(pool: str, data: bytes) -> int | None:
    if data[: len(MAGIC)] == MAGIC and len(data) >= _OWNER_PID_OFFSET + _OWNER_PID.size:
        (pid,) = _OWNER_PID.unpack_from(data, _OWNER_PID_OFFSET)
        if pid > 0:
            return int(pid)
    match = _PID_IN_DEFAULT_NAME.match(pool)
    return int(match.group(1)) if match else None


def _inspect(pool: str, path: Path) -> LimitRecord | CorruptRecord | None:
    """The record at `path`, what is known of it when corrupt, None when it vanished."""
    try:
        with _locked(path, write=False) as fd:
            data = os.pread(fd, RECORD_SIZE, 0)
            age_s = max(0.0, time.time() - os.fstat(fd).st_mtime)
    except UnknownPoolError:
        return None
    try:
        return LimitRecord.unpack(pool, data)
    except CorruptRecordError as exc:
        return CorruptRecord(pool, path, str(exc), _owner_pid_of_corrupt(pool, data), age_s)


def scan_records(
    directory: str | os.PathLike[str] | None = None,
) -> tuple[list[LimitRecord], list[CorruptRecord]]:
    """Every record file in the directory, sorted by pool name: the readable records and the
    corrupt ones. Files of other names and unreadable files (permissions) are not records."""
    base = shm_dir(directory)
    records: list[LimitRecord] = []
    corrupt: list[CorruptRecord] = []
    try:
        names = sorted(os.listdir(base))
    except FileNotFoundError:
        return records, corrupt
    for name in names:
        if not name.startswith(RECORD_PREFIX):
            continue
        pool = name[len(RECORD_PREFIX) :]
        if not _POOL_NAME.match(pool):
            continue
        try:
            entry = _inspect(pool, base / name)
        except PermissionError:
            continue
        if isinstance(entry, LimitRecord):
            records.append(entry)
        elif isinstance(entry, CorruptRecord):
            corrupt.append(entry)
    return records, corrupt


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


def _remove_if_still_corrupt(entry: CorruptRecord) -> bool:
    """Unlink the file if its bytes are still not a record (its owner may have rewritten it
    since it was inspected)."""
    try:
        with _locked(entry.path, write=True) as fd:
            try:
                LimitRecord.unpack(entry.pool, os.pread(fd, RECORD_SIZE, 0))
            except CorruptRecordError:
                entry.path.unlink()
                return True
            return False
    except (UnknownPoolError, FileNotFoundError, PermissionError):
        return False


@dataclass(frozen=True)
class RemovedRecord:
    """A record `collect_stale` removed, and why."""

    pool: str
    owner_pid: int | None
    reason: str


def collect_stale(directory: str | os.PathLike[str] | None = None) -> list[RemovedRecord]:
    """Remove every record no live owner holds: stale ones (owner gone) and corrupt ones whose
    owner is gone or, owner unknown, that nobody rewrote for `CORRUPT_GRACE_S`."""
    records, corrupt = scan_records(directory)
    removed = []
    for record in records:
        if record.stale:
            with contextlib.suppress(UnknownPoolError, KVCachedError):
                delete_record(record.pool, directory=directory)
                removed.append(RemovedRecord(
                    record.pool, record.owner_pid,
                    f"stale: owner pid {record.owner_pid} is gone"))
    for entry in corrupt:
        if not entry.stale:
            continue
        owner = (f"owner pid {entry.owner_pid} is gone" if entry.owner_pid is not None
                 else f"owner unknown, not rewritten for {entry.age_s:.0f}s")
        if _remove_if_still_corrupt(entry):
            removed.append(RemovedRecord(entry.pool, entry.owner_pid,
                                         f"corrupt ({entry.reason}); {owner}"))
    return removed


class LimitSegment:
    """The owner's handle on its pool's record: create, publish usage, close.

    The owner remembers the last record it read or wrote. When the file's bytes stop being a
    record (truncated by another process, a full /dev/shm), the owner rewrites it from that
    memory (limit, usage, capacity, a revision past the last one) and logs one warning.
    """

    def __init__(
        self, pool: str, path: Path, fd: int, inode: tuple[int, int], record: LimitRecord,
        engine: str = "",
    ) -> None:
        self.pool = pool
        self.path = path
        self.engine = engine
        self._fd = fd
        self._inode = inode
        self._lock = threading.Lock()
        self._closed = False
        self._last = record

    @classmethod
    def create(
        cls,
        pool: str,
        *,
        capacity_bytes: int,
        limit_bytes: int | None = None,
        directory: str | os.PathLike[str] | None = None,
        engine: str | None = None,
    ) -> LimitSegment:
        """Create the record exclusively; a stale record of the same name is replaced.
        `engine` labels the trailer (default: the engine this process imported)."""
        label = engine_of_this_process() if engine is None else engine
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
                os.pwrite(fd, record.pack() + PoolAbout(label, 0, 0).pack(), 0)
                fcntl.flock(fd, fcntl.LOCK_UN)
                stat = os.fstat(fd)
            except BaseException:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            return cls(pool, path, fd, (stat.st_dev, stat.st_ino), record, label)
        raise KVCachedConfigError(f"could not create limit record {path}")

    def read(self) -> LimitRecord:
        with self._lock:
            self._check_open()
            fcntl.flock(self._fd, fcntl.LOCK_SH)
            try:
                self._last = _read_fd(self.pool, self._fd)
                return self._last
            except CorruptRecordError:
                pass
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                return self._read_or_recover_locked()
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def update_usage(self, used_bytes: int, reserved_bytes: int, reserve_hits: int = 0,
                     reserve_misses: int = 0) -> None:
        """Publish mapped bytes and the reserve's counters (called when pages change, not per
        block)."""
        about = PoolAbout(self.engine, reserve_hits, reserve_misses)
        with self._lock:
            if self._closed:
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                current = self._read_or_recover_locked()
                updated = replace(current, used_bytes=used_bytes, reserved_bytes=reserved_bytes)
                os.pwrite(self._fd, updated.pack() + about.pack(), 0)
                self._last = updated
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _read_or_recover_locked(self) -> LimitRecord:
        """The record (caller holds the exclusive flock); a corrupt one is rewritten first."""
        try:
            self._last = _read_fd(self.pool, self._fd)
            return self._last
        except CorruptRecordError as exc:
            # A revision past every one seen makes the watcher (and `kvctl --revision`)
            # treat the rewrite as a change; the limit is the last one the owner knew.
            recovered = replace(self._last, revision=self._last.revision + 1,
                                owner_pid=os.getpid())
            os.pwrite(self._fd, recovered.pack(), 0)
            os.ftruncate(self._fd, RECORD_SIZE)
            self._last = recovered
            logger.warning(
                "kvcached: limit record %s was corrupt (%s); rewrote it from the state of "
                "pool %r (limit %d bytes, revision %d)",
                self.path, exc, self.pool, recovered.limit_bytes, recovered.revision,
            )
            return recovered

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
        failing: str | None = None  # the error last reported, so a persisting one logs once
        while not self._stop.wait(self._interval_s):
            try:
                self.poll_once()
                if self._on_tick is not None:
                    self._on_tick()
            except Exception as exc:  # the watcher outlives any one bad poll
                if repr(exc) != failing:
                    logger.warning("kvcached: limit watcher of pool %r: %s (still watching)",
                                   self._segment.pool, exc)
                failing = repr(exc)
            else:
                failing = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
