"""Which elastic mode a patched vLLM runs in, read from `KVCACHED_*` settings.

A patched wheel is elastic unless `KVCACHED_ENABLE=0`; every other knob is a kvcached setting
(`kvcached_core.settings`), plus the virtual KV size, which only vLLM's sizing needs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvcached_core.errors import KVCachedConfigError
from kvcached_core.settings import KVCachedSettings, parse_size

VIRTUAL_SIZE_ENV = "KVCACHED_VIRTUAL_SIZE"
POOL_NAME_ENV = "KVCACHED_POOL_NAME"


def engine_settings(environ: Mapping[str, str] | None = None) -> KVCachedSettings:
    """The settings of a patched engine: elastic unless `KVCACHED_ENABLE=0`."""
    return KVCachedSettings.from_env(os.environ if environ is None else environ)


def elastic_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return engine_settings(environ).enabled


def virtual_kv_bytes(environ: Mapping[str, str] | None = None) -> int | None:
    """`KVCACHED_VIRTUAL_SIZE`: address space for the KV cache of all layers (None: vLLM's)."""
    env = os.environ if environ is None else environ
    raw = env.get(VIRTUAL_SIZE_ENV, "").strip()
    if not raw:
        return None
    try:
        return parse_size(raw)
    except ValueError as exc:
        raise KVCachedConfigError(f"{VIRTUAL_SIZE_ENV}: {exc}") from None


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
    env = os.environ if environ is None else environ
    return env.get(POOL_NAME_ENV, "").strip() or f"vllm-{os.getpid()}"
