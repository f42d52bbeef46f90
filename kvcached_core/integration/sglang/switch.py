"""The one switch: `KVCACHED_ENABLE` decides, once per process, whether SGLang is elastic.

It is read when the rewritten SGLang modules are imported. Off, they bind SGLang's own classes
and skip every added call, so the patched wheel behaves as the stock one.
"""

from __future__ import annotations

from functools import lru_cache

from kvcached_core.settings import KVCachedSettings


@lru_cache(maxsize=1)
def sglang_settings() -> KVCachedSettings:
    """The process's kvcached settings (read from the environment once)."""
    return KVCachedSettings.from_env()


def elastic_enabled() -> bool:
    return sglang_settings().enabled


ELASTIC: bool = elastic_enabled()
