"""vLLM's start-up memory checks, next to elastic neighbours.

A vLLM GPU worker checks device memory twice before it sizes its KV cache:

1. at start-up, free memory must hold the whole `gpu_memory_utilization` share of the device
   ("Free memory on device ... is less than desired GPU memory utilization");
2. after the profile run, free memory must not have grown since start-up ("Error in memory
   profiling. Initial free memory ..., current free memory ..."), because the profile charges
   every change of device-wide free memory to this engine.

Both protect the stock layout, where the KV cache takes the rest of the share at once: the share
must be free, and the profile must be right or the KV allocation runs out of memory. An elastic
engine claims neither up front. Its KV cache is address space whose pages are mapped on demand
under the engine's limit and the shared budget, so the profiled budget only sizes that address
space. Its neighbours are elastic too: they give pages back when idle and take them again in a
burst, so free memory moves while the engine starts. What an elastic engine needs is room for
its first KV pages (the reserve pool) beside what it has already allocated, counting the KV
pages elastic neighbours hold as memory they give back. With `KVCACHED_ENABLE=0` both checks
are the stock comparisons, unchanged.

The profile itself is a device-wide measurement: the worker snapshots device memory in
`init_device`, loads its weights, runs its profile, and charges every change of device-wide
used memory its own allocator did not make to itself ("non-torch" memory). A neighbour that
loads its weights inside that window is charged to this engine, whose KV address space then
comes out too small for a burst. So an elastic worker takes that snapshot inside its device's
start-up window (`startup_snapshot`), and gives the window up when its profile is done
(`memory_profile_consistent`), when `determine_available_memory` returns by any path (the
`kv_cache_memory_bytes` path skips the profile) or when the KV cache is initialised
(`ends_startup_window`), or when the process exits.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from kvcached_core.integration.vllm.config import engine_settings, pool_name
from kvcached_core.startup_memory import (
    GIB,
    StartupMemory,
    acquire_startup_windows_of_engine,
    cuda_device_identity,
    first_pages_bytes,
    neighbour_kv_bytes,
    release_startup_windows,
)

__all__ = [
    "ends_startup_window",
    "first_pages_bytes",
    "memory_profile_consistent",
    "neighbour_kv_bytes",
    "startup_memory_short",
    "startup_snapshot",
]

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

logger = logging.getLogger(__name__)


def startup_memory_short(
    free_memory: float,
    requested_memory: float,
    *,
    environ: Mapping[str, str] | None = None,
    records_directory: str | None = None,
) -> bool:
    """Whether the start-up check refuses: vLLM's `free_memory < requested_memory`.

    Stock (`KVCACHED_ENABLE=0`): exactly that comparison. Elastic: the requested share is a
    ceiling, not a claim (its KV part is unbacked address space, the rest is allocated by the
    profile run, which fails on its own if memory runs out), so the engine refuses only when
    the device cannot hold its first KV pages even after elastic neighbours shrink.
    """
    settings = engine_settings(environ)
    if not settings.enabled:
        return free_memory < requested_memory
    if free_memory >= requested_memory:
        return False
    seen = StartupMemory(
        free_bytes=int(free_memory),
        needed_bytes=min(int(requested_memory), first_pages_bytes(settings)),
        neighbour_kv_bytes=neighbour_kv_bytes(pool_name(), directory=records_directory),
    )
    if not seen.short:
        logger.info(
            "kvcached: %.2f GiB free at start-up is below the requested %.2f GiB "
            "(gpu_memory_utilization); the KV cache is elastic, so the engine starts with "
            "%.2f GiB needed for its first KV pages (elastic neighbours hold %.2f GiB of KV).",
            free_memory / GIB, requested_memory / GIB, seen.needed_bytes / GIB,
            seen.neighbour_kv_bytes / GIB,
        )
    return seen.short


def memory_profile_consistent(
    initial_free: float,
    current_free: float,
    *,
    strict: bool = False,
    environ: Mapping[str, str] | None = None,
    records_directory: str | None = None,
) -> bool:
    """Whether the profile-run check passes: vLLM's `initial_free >= current_free`
    (`>` where the release compares strictly).

    Stock: exactly that comparison. Elastic: free memory that grew while this engine profiled
    was given back by a neighbour (an elastic engine trimming its pages, or another engine
    finishing its own profile run); the profile only sizes this engine's KV address space, so
    that is no error. What must still hold is room for the engine's first KV pages now that
    its weights, activations and graphs are allocated.
    """
    # Both figures are taken: this engine's measurement is over, a neighbour may start its own.
    release_startup_windows()
    settings = engine_settings(environ)
    stock_ok = initial_free > current_free if strict else initial_free >= current_free
    if not settings.enabled:
        return stock_ok
    needed = first_pages_bytes(settings)
    seen = StartupMemory(
        free_bytes=int(current_free),
        needed_bytes=needed,
        # The records are read only when free memory alone falls short.
        neighbour_kv_bytes=neighbour_kv_bytes(pool_name(), directory=records_directory)
        if current_free < needed else 0,
    )
    if seen.short:
        logger.error(
            "kvcached: after the profile run %.2f GiB is free and elastic neighbours hold "
            "%.2f GiB of KV: no room for this engine's first KV pages (%.2f GiB).",
            current_free / GIB, seen.neighbour_kv_bytes / GIB, seen.needed_bytes / GIB,
        )
        return False
    if not stock_ok:
        logger.info(
            "kvcached: free device memory grew from %.2f to %.2f GiB while this engine "
            "profiled (a neighbour gave memory back); the elastic KV cache does not depend on "
            "that figure, so start-up continues.",
            initial_free / GIB, current_free / GIB,
        )
    return True



def startup_snapshot(take: Callable[[], T], device: Any = None, *,
                     environ: Mapping[str, str] | None = None) -> T:
    """The worker's initial memory snapshot (`take()`), taken inside the start-up window of
    `device` (a `torch.device`; None: the current CUDA device).

    Elastic on a CUDA device: wait until no other elastic engine on the device is between its
    own snapshot and the end of its profile (at most `KVCACHED_START_WINDOW_TIMEOUT`), then
    hold the window until this engine's profile is done. An engine over several ranks whose
    process groups exist already takes the windows of all its devices as one acquisition
    (`acquire_startup_windows_of_engine`): every rank calls this at the same point. Stock
    (`KVCACHED_ENABLE=0`) or another device type (the CPU worker, tests): `take()` and nothing
    else.
    """
    settings = engine_settings(environ)
    if settings.enabled:
        index = _cuda_index(device)
        if index is not None:
            acquire_startup_windows_of_engine(
                cuda_device_identity(index, environ), group=_world_cpu_group(),
                timeout_s=settings.start_window_timeout_s, holder=pool_name(environ),
                directory=settings.shm_dir)
    return take()


def _world_cpu_group() -> Any:
    """vLLM's world group as a CPU group, where it is set up; else None (torch's default group).

    From vLLM 0.11 the worker joins the engine's process groups before its snapshot, so the
    ranks of an engine spread over several devices take their windows as one acquisition.
    Up to 0.10 the snapshot comes first and no group exists yet: each rank takes its own
    device's window (`docs/runtime.md` says what that leaves)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return get_world_group().cpu_group
    except Exception:  # not a vLLM process, or its world group is not set up yet
        return None


def _cuda_index(device: Any) -> int | None:
    """The CUDA device index of `device`, or None when it is not a CUDA device."""
    if device is None:
        try:
            import torch

            return int(torch.cuda.current_device()) if torch.cuda.is_available() else None
        except Exception:  # a torch without CUDA
            return None
    if getattr(device, "type", str(device).split(":")[0]) != "cuda":
        return None
    index = getattr(device, "index", None)
    return int(index) if index is not None else 0


def ends_startup_window(method: F) -> F:
    """Decorate a worker method after which this engine measures nothing device-wide any
    more (`Worker.determine_available_memory`, `Worker.initialize_from_config`): the start-up
    window is released when it returns or raises. Holding none, that is a no-op."""

    @functools.wraps(method)
    def releasing(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            release_startup_windows()

    return releasing  # type: ignore[return-value]
