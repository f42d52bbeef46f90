"""Which elastic mode a patched vLLM runs in: its view of `kvcached_core.settings`.

A patched wheel is elastic unless `KVCACHED_ENABLE=0`. Every value comes from the process's
settings (`settings.current_settings()`, one parse per distinct `KVCACHED_*` environment);
this module only adds vLLM's defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvcached_core.settings import KVCachedSettings, current_settings


def engine_settings(environ: Mapping[str, str] | None = None) -> KVCachedSettings:
    """The settings of a patched engine: elastic unless `KVCACHED_ENABLE=0`."""
    return current_settings(environ)


def elastic_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return current_settings(environ).enabled


def virtual_kv_bytes(environ: Mapping[str, str] | None = None) -> int | None:
    """`KVCACHED_VIRTUAL_SIZE`: address space for the KV cache of all layers (None: vLLM's)."""
    return current_settings(environ).virtual_size_bytes


def vllm_zero_page_writable(settings: KVCachedSettings) -> bool:
    """Whether unbacked KV pages take writes: yes unless `KVCACHED_ZERO_PAGE=read-only`.

    vLLM's dummy runs (warm-up, CUDA graph capture; Model Runner V2 in 0.25 at least) write
    the KV of padding tokens into blocks no request owns, which stock memory absorbs and a
    read-only zero page turns into an illegal-address fault. No request ever reads a block it
    does not own, so what those writes leave behind is never seen.
    """
    return settings.zero_page_writable is not False


def pool_name(environ: Mapping[str, str] | None = None) -> str:
    """Name of this engine's pool (its shared limit record): `KVCACHED_POOL_NAME` or vllm-<pid>."""
    return current_settings(environ).pool_name or f"vllm-{os.getpid()}"
