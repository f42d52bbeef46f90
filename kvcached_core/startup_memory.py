"""What an elastic engine may count on at start-up, next to other elastic engines.

Engines check device free memory while they start (vLLM before and after its profile run,
SGLang before loading weights and when it sizes its KV pools). Free memory is a device-wide
figure: other engines on the device move it, and elastic ones move it all the time, mapping
KV pages in a burst and giving them back when idle. The helpers here describe what those
neighbours hold (their limit records) and what an elastic engine must have before its first
request (its reserve pool), so that each engine's adapter can keep its own check's meaning.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvcached_core.limits import list_records
from kvcached_core.settings import KVCachedSettings, current_settings

__all__ = ["GIB", "StartupMemory", "first_pages_bytes", "neighbour_kv_bytes"]

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
