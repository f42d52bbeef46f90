"""What an elastic engine may count on at start-up, next to other elastic engines.

Engines check device free memory while they start (vLLM before and after its profile run,
SGLang before loading weights and when it sizes its KV pools). Free memory is a device-wide
figure: other engines on the device move it, and elastic ones move it all the time, mapping
KV pages in a burst and giving them back when idle. The helpers here describe what those
neighbours hold (their limit records) and what an elastic engine must have before its first
request (its reserve pool), so that each engine's adapter can keep its own check's meaning.

Those figures are only right when no neighbour starts at the same moment: an engine that
loads its weights while another measures charges them to the other. The start-up window (a
lock per device, below) makes elastic engines on one device measure one after another.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcached_core.limits import list_records, shm_dir
from kvcached_core.settings import KVCachedSettings, current_settings

__all__ = [
    "GIB",
    "STARTUP_WINDOW_PREFIX",
    "StartupMemory",
    "StartupWindow",
    "acquire_startup_window",
    "acquire_startup_windows_of_engine",
    "cuda_device_identity",
    "first_pages_bytes",
    "holds_startup_window",
    "neighbour_kv_bytes",
    "release_startup_windows",
    "startup_window_path",
]

logger = logging.getLogger(__name__)

GIB = float(1 << 30)


@dataclass(frozen=True)
class StartupMemory:
    """What one decision saw: bytes free, the bytes the check needs, elastic neighbours' KV."""

    free_bytes: int
    needed_bytes: int
    neighbour_kv_bytes: int

    @property
    def short(self) -> bool:
        return self.free_bytes + self.neighbour_kv_bytes < self.needed_bytes


def first_pages_bytes(settings: KVCachedSettings) -> int:
    """Device memory an elastic engine maps before its first request: its reserve pool
    (at least one page), so that the first step can place KV at all."""
    return settings.page_size * max(1, settings.min_reserved_pages)


def neighbour_kv_bytes(own_pool: str | None = None, directory: str | None = None) -> int:
    """KV bytes that other live elastic pools on this host have mapped (used + reserve).

    They are given back as those engines go idle or shrink under their limits, so they count
    as memory an elastic engine can expect. This process's pools are never neighbours (by
    owner pid), nor is `own_pool` (default: the configured `KVCACHED_POOL_NAME`). A host with
    several devices counts every device's pools (records do not name a device), which can
    only make the count larger.
    """
    own = own_pool if own_pool is not None else current_settings().pool_name
    me = os.getpid()
    return sum(
        record.used_bytes + record.reserved_bytes
        for record in list_records(directory)
        if record.pool != own and record.owner_pid != me and not record.stale
    )


# --- the start-up window ------------------------------------------------------------------
# A per-device lock that elastic engines hold while they measure their start-up memory.
#
# Engines size their memory from device-wide figures taken over a window: vLLM snapshots
# device memory, loads its weights, runs its profile, and charges every change of device-wide
# used memory in between that its own allocator did not make to itself. An engine whose window
# holds a neighbour's weight load or profile takes the neighbour's memory for its own and
# sizes itself too small (or, when the neighbour gives memory back, too large). The window
# makes those measurements take turns on one device.
#
# State (one process; `_windows_lock` guards every field of it):
#   _held             device identity -> the open lock file this process holds the window of
#                     that device through (fcntl.flock, LOCK_EX). One entry per device: a
#                     second acquire of a held device is answered from here, never by a second
#                     flock of the same file (that one would wait for this very process).
# Invariants:
#   - The OS lock is exclusive per device file and dies with its last descriptor: a process
#     that exits or is killed holding a window frees it without any action.
#   - A forked child closes its copies without unlocking (the `register_at_fork` hook), so a
#     window never outlives the process that took it in a child it forked.
#   - Release is explicit (LOCK_UN, then close), idempotent, and frees every window this
#     process holds; nothing else is released.
#   - No wait is unbounded: after `timeout_s` the caller goes on without the window (with a
#     warning), so a holder that never releases slows a start but never stops one.
#   - The lock files are never removed: unlinking one while another process waits on it would
#     let two processes hold "the" window of one device through different files.

STARTUP_WINDOW_PREFIX = "kvcached-startup-window-"
_IDENTITY_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
# Polling the lock: short at first (a window is often released within a second of the wait
# starting), then at most every half second.
_FIRST_POLL_S = 0.02
_LONGEST_POLL_S = 0.5

_windows_lock = threading.Lock()
_held: dict[str, int] = {}


@dataclass(frozen=True)
class StartupWindow:
    """The outcome of one acquire: `held` is False when the wait timed out and the caller
    went on without the window; `waited_s` is how long it waited."""

    device: str
    path: Path
    held: bool
    waited_s: float


def cuda_device_identity(index: int, environ: Mapping[str, str] | None = None) -> str:
    """A name of CUDA device `index` (as this process numbers it) that every process on the
    host gives the same device: its UUID when torch reports one, else its physical index
    (or UUID entry) in `CUDA_VISIBLE_DEVICES`, else the index itself."""
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:  # no CUDA runtime here, or a torch without device UUIDs
        uuid = None
    if uuid is not None and str(uuid).strip():
        return _identity(f"gpu-{_without_gpu_prefix(str(uuid))}")
    env = os.environ if environ is None else environ
    visible = [entry.strip() for entry in env.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if index < len(visible) and visible[index]:
        entry = visible[index]
        if entry.isdigit():
            return f"cuda-{int(entry)}"
        return _identity(f"gpu-{_without_gpu_prefix(entry)}")
    return f"cuda-{index}"


def _without_gpu_prefix(text: str) -> str:
    # CUDA_VISIBLE_DEVICES names a device "GPU-<uuid>"; torch reports "<uuid>".
    text = text.strip().lower()
    return text[len("gpu-"):] if text.startswith("gpu-") else text


def _identity(text: str) -> str:
    return _IDENTITY_UNSAFE.sub("_", text)[:128]


def startup_window_path(device: str, directory: str | os.PathLike[str] | None = None) -> Path:
    return shm_dir(directory) / f"{STARTUP_WINDOW_PREFIX}{_identity(device)}"


def acquire_startup_window(
    device: str,
    *,
    timeout_s: float,
    holder: str,
    directory: str | os.PathLike[str] | None = None,
) -> StartupWindow:
    """Wait for the start-up window of `device` and hold it until `release_startup_windows`
    (or this process's exit).

    Waiting logs one line naming the holder (the engine and pid that hold it and for how
    long). After `timeout_s` the caller goes on without the window, with a warning. A device
    whose window this process already holds is answered at once (held). A lock file that
    cannot be opened (another user's, a read-only directory) is a warning, not a refusal.
    """
    path = startup_window_path(device, directory)
    with _windows_lock:
        if device in _held:
            logger.debug("kvcached: this process already holds the start-up window of %s",
                         device)
            return StartupWindow(device, path, held=True, waited_s=0.0)
    try:
        fd = _open_lock_file(path)
    except OSError as exc:
        logger.warning("kvcached: cannot open the start-up window of %s (%s: %s); starting "
                       "without it, so this engine's memory figures may include a "
                       "neighbour's start-up", device, path, exc)
        return StartupWindow(device, path, held=False, waited_s=0.0)
    started = time.monotonic()
    poll = _FIRST_POLL_S
    announced = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        waited = time.monotonic() - started
        if waited >= timeout_s:
            os.close(fd)
            logger.warning(
                "kvcached: waited %.0f s for the start-up window of %s (%s); going on "
                "without it (KVCACHED_START_WINDOW_TIMEOUT), so this engine's memory figures "
                "may include that engine's start-up", waited, device, _holder_of(path))
            return StartupWindow(device, path, held=False, waited_s=waited)
        if not announced:
            logger.info(
                "kvcached: waiting for the start-up window of %s: %s is measuring its "
                "start-up memory; elastic engines on one device take their memory snapshots "
                "one after another (at most %.0f s, KVCACHED_START_WINDOW_TIMEOUT)",
                device, _holder_of(path), timeout_s)
            announced = True
        time.sleep(min(poll, max(0.0, timeout_s - waited)))
        poll = min(poll * 2, _LONGEST_POLL_S)
    waited = time.monotonic() - started
    # Who holds it, for the waiting line of the next engine (read without the lock: a torn
    # read only garbles that line, and a failed write only loses it).
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {time.time():.0f} {holder}\n".encode(), 0)
    with _windows_lock:
        _held[device] = fd
    if announced:
        logger.info("kvcached: took the start-up window of %s after %.1f s", device, waited)
    return StartupWindow(device, path, held=True, waited_s=waited)


def _open_lock_file(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        # Another user's engine created it (and the umask took write access away): flock
        # needs no write access, only the holder line is not written.
        return os.open(path, os.O_RDONLY)


def _holder_of(path: Path) -> str:
    try:
        pid, since, name = path.read_text(encoding="utf-8").split(maxsplit=2)
        return f"engine {name.strip()} (pid {int(pid)}, for {time.time() - float(since):.0f} s)"
    except (OSError, ValueError):
        return "another engine"


def release_startup_windows() -> None:
    """Release every start-up window this process holds (none held: nothing happens)."""
    with _windows_lock:
        held = list(_held.items())
        _held.clear()
    for device, fd in held:
        try:
            # Unlock before closing: a copy of the descriptor in a child this process forked
            # before the hook below existed would otherwise keep the lock.
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        logger.debug("kvcached: released the start-up window of %s", device)


# --- an engine spread over several devices ------------------------------------------------
# Ranks of one engine measure together: their profiles run collectives, so no rank finishes
# its measurement before every rank has. If each rank took its own device's window, two such
# engines started together on the same devices could each hold one device and wait in their
# collectives for a rank that waits for the other engine's device: neither would move until
# the timeout let the waiting ranks go on without their windows. So the windows of an engine's
# devices are taken as one acquisition, in one order that every engine follows:
#   - the engine's ranks first tell each other (all-gather over the engine's CPU group) which
#     window namespace (the shm directory, on this boot of this host) and device each uses;
#   - namespaces are visited in sorted order; in each, the engine's lowest rank there takes
#     the windows of every device the engine uses there, in sorted order, and a barrier over
#     the engine's ranks follows, so no namespace is entered before the ones before it are held;
#   - only then does any rank take its snapshot; the ranks that took windows release them as a
#     single-device engine does (release_startup_windows), the others hold none.
# Every engine takes windows in the same global order (namespace, device), and an engine holds
# a window only while it waits for windows later in that order, so waits cannot form a cycle.
# One timeout (the caller's) bounds the whole acquisition of one engine, not each window.


def window_namespace(directory: str | os.PathLike[str] | None = None) -> str:
    """What names the set of start-up windows a lock file in `directory` belongs to: this
    boot of this host and the directory's file system and inode (two containers share windows
    exactly when they share that directory)."""
    path = shm_dir(directory)
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        boot = os.uname().nodename
    try:
        stat = path.stat()
        where = f"{stat.st_dev}:{stat.st_ino}"
    except OSError:
        where = str(path.resolve())
    return f"{boot}:{where}"


def acquire_startup_windows_of_engine(
    device: str,
    *,
    group: Any,
    timeout_s: float,
    holder: str,
    directory: str | os.PathLike[str] | None = None,
) -> list[StartupWindow]:
    """Take the start-up windows of every device an engine's ranks use, as one acquisition
    (see above), and return the windows this rank took (none on a rank that is not the
    lowest of its namespace).

    Every rank of the engine calls this once, at the same point of its start, with its own
    `device`; `group` is a `torch.distributed` process group of the engine's ranks that can
    exchange Python objects (a CPU group; None: the default group). An engine of one rank, or
    a process whose ranks cannot talk yet (no process group set up), takes its own device's
    window, as `acquire_startup_window` does.
    """
    import torch.distributed as dist

    if (not dist.is_available() or not dist.is_initialized()
            or dist.get_world_size(group) <= 1):
        return [acquire_startup_window(device, timeout_s=timeout_s, holder=holder,
                                       directory=directory)]
    mine = (window_namespace(directory), device)
    ranks: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, mine, group=group)
    me = dist.get_rank(group)
    deadline = time.monotonic() + timeout_s
    taken: list[StartupWindow] = []
    for namespace in sorted({entry[0] for entry in ranks}):
        members = [rank for rank, entry in enumerate(ranks) if entry[0] == namespace]
        if me == members[0]:
            devices = sorted({ranks[rank][1] for rank in members})
            logger.debug("kvcached: rank %d takes the start-up windows of %s for its engine",
                         me, ", ".join(devices))
            for each in devices:
                taken.append(acquire_startup_window(
                    each, timeout_s=max(0.0, deadline - time.monotonic()),
                    holder=f"{holder} (rank {me} of {len(ranks)})", directory=directory))
        dist.barrier(group=group)
    return taken


def holds_startup_window(device: str) -> bool:
    with _windows_lock:
        return device in _held


def _forget_windows_in_child() -> None:
    # The child's copies share the parent's lock: close them without unlocking, so the window
    # stays the parent's and ends with it.
    global _windows_lock
    for fd in _held.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()
    _windows_lock = threading.Lock()  # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_forget_windows_in_child)
