"""Shared memory budgets: one capacity that the KV pools of several engines on a host draw from.

A budget is one file, `<dir>/kvcached-budget-<name>` (dir as for limit records: `KVCACHED_SHM_DIR`,
default `/dev/shm`). `kvctl budget set` creates or resizes it; a pool joins it with
`KVCACHED_BUDGET=<name>` and then charges every physical page it creates to its process's slot
(native `BudgetedBackend`, see csrc/shared_budget.hpp for the layout this module shares).
Every read and write holds `flock` on the file. Slots of processes that are gone (or are
zombies, or whose pid was reused) do not count: a crashed engine's bytes return to the budget.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvcached_core.errors import KVCachedConfigError, KVCachedError
from kvcached_core.limits import shm_dir
from kvcached_core.settings import validate_budget_name

MAGIC = b"KVCBUDGT"
FORMAT_VERSION = 1
NUM_SLOTS = 64
BUDGET_PREFIX = "kvcached-budget-"
# magic, version, slot count, capacity, revision, 32 reserved bytes
_HEADER = struct.Struct("<8sIIQQ32x")
# pid, start time (clock ticks after boot), charged bytes, attached backends
_SLOT = struct.Struct("<qQQQ")
FILE_SIZE = _HEADER.size + NUM_SLOTS * _SLOT.size


class UnknownBudgetError(KVCachedConfigError, LookupError):
    """No budget file of that name exists."""


class CorruptBudgetError(KVCachedError):
    """The file is not a budget of a format this code understands."""


@dataclass(frozen=True)
class BudgetMember:
    pid: int
    charged_bytes: int
    attached: int


@dataclass(frozen=True)
class BudgetState:
    name: str
    capacity_bytes: int
    revision: int
    members: tuple[BudgetMember, ...]  # live processes only

    @property
    def charged_bytes(self) -> int:
        return sum(member.charged_bytes for member in self.members)

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.charged_bytes)


def budget_path(name: str, directory: str | os.PathLike[str] | None = None) -> Path:
    return shm_dir(directory) / f"{BUDGET_PREFIX}{validate_budget_name(name)}"


def process_start_time(pid: int) -> int:
    """Start time of a live process (clock ticks after boot); 0 if gone or a zombie.

    The same reading as the native side's, so both agree on which slots are live."""
    if pid <= 0:
        return 0
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = text[text.rfind(")") + 1 :].split()
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return 0
    return int(fields[19])


@contextlib.contextmanager
def _locked(path: Path, name: str, *, create: bool = False) -> Iterator[int]:
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        raise UnknownBudgetError(
            f"no budget named {name!r} in {path.parent}; create it with "
            f"`kvctl budget set {name} SIZE`"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)  # closing drops the lock


def _read_locked(name: str, fd: int) -> tuple[int, int, list[tuple[int, int, int, int]]]:
    data = os.pread(fd, FILE_SIZE, 0)
    if len(data) < FILE_SIZE:
        raise CorruptBudgetError(f"budget {name!r} is {len(data)} bytes, expected {FILE_SIZE}")
    magic, version, num_slots, capacity, revision = _HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != FORMAT_VERSION or num_slots != NUM_SLOTS:
        raise CorruptBudgetError(
            f"budget {name!r} is not a budget file of format {FORMAT_VERSION} "
            f"(magic {magic!r}, version {version}, {num_slots} slots)"
        )
    slots = [_SLOT.unpack_from(data, _HEADER.size + i * _SLOT.size) for i in range(NUM_SLOTS)]
    return capacity, revision, slots


def _state(name: str, capacity: int, revision: int,
           slots: list[tuple[int, int, int, int]]) -> BudgetState:
    members = tuple(
        BudgetMember(pid, charged, attached)
        for pid, start_time, charged, attached in slots
        if pid != 0 and process_start_time(pid) == start_time
    )
    return BudgetState(name, capacity, revision, members)


def set_budget(
    name: str, capacity_bytes: int, *, directory: str | os.PathLike[str] | None = None
) -> BudgetState:
    """Create the budget or change its capacity. Shrinking below what members hold is allowed:
    nothing is taken back, new charges are refused until they fall below it."""
    if capacity_bytes < 0:
        raise ValueError(f"budget capacity must be >= 0 bytes, got {capacity_bytes}")
    path = budget_path(name, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path, name, create=True) as fd:
        if os.fstat(fd).st_size == 0:  # new: the lock makes a concurrent creator wait here
            empty = _HEADER.pack(MAGIC, FORMAT_VERSION, NUM_SLOTS, 0, 0)
            os.pwrite(fd, empty + bytes(NUM_SLOTS * _SLOT.size), 0)
        _capacity, revision, slots = _read_locked(name, fd)
        os.pwrite(fd, _HEADER.pack(MAGIC, FORMAT_VERSION, NUM_SLOTS, capacity_bytes,
                                   revision + 1), 0)
        return _state(name, capacity_bytes, revision + 1, slots)


def read_budget(name: str, directory: str | os.PathLike[str] | None = None) -> BudgetState:
    """The budget's capacity and its live members (UnknownBudgetError if there is none)."""
    path = budget_path(name, directory)
    with _locked(path, name) as fd:
        capacity, revision, slots = _read_locked(name, fd)
    return _state(name, capacity, revision, slots)


def list_budgets(directory: str | os.PathLike[str] | None = None) -> list[BudgetState]:
    """Every readable budget in the directory, by name."""
    where = shm_dir(directory)
    if not where.is_dir():
        return []
    found = []
    for path in sorted(where.glob(f"{BUDGET_PREFIX}*")):
        name = path.name[len(BUDGET_PREFIX) :]
        with contextlib.suppress(KVCachedError, OSError):
            found.append(read_budget(name, where))
    return found


def delete_budget(
    name: str, *, force: bool = False, directory: str | os.PathLike[str] | None = None
) -> BudgetState:
    """Remove a budget that no live process charges (or any budget, with `force`)."""
    path = budget_path(name, directory)
    with _locked(path, name) as fd:
        capacity, revision, slots = _read_locked(name, fd)
        state = _state(name, capacity, revision, slots)
        if state.members and not force:
            pids = ", ".join(str(member.pid) for member in state.members)
            raise KVCachedConfigError(
                f"budget {name!r} has live members (pid {pids}); use --force"
            )
        path.unlink()
        return state


def require_budget(name: str, directory: str | os.PathLike[str] | None = None) -> Path:
    """The budget's path, or KVCachedConfigError saying how to create it."""
    path = budget_path(name, directory)
    if not path.is_file():
        raise UnknownBudgetError(
            f"KVCACHED_BUDGET names budget {name!r}, which does not exist in {path.parent}; "
            f"create it first with `kvctl budget set {name} SIZE`"
        )
    return path
