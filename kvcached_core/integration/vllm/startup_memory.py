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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvcached_core.integration.vllm.config import engine_settings, pool_name
from kvcached_core.startup_memory import (
    GIB,
    StartupMemory,
    first_pages_bytes,
    neighbour_kv_bytes,
)

__all__ = [
    "first_pages_bytes",
    "memory_profile_consistent",
    "neighbour_kv_bytes",
    "startup_memory_short",
]

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

