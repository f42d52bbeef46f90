"""The one switch: `KVCACHED_ENABLE` decides, once per process, whether SGLang is elastic.

It is read when the rewritten SGLang modules are imported: they pick SGLang's own classes or
the elastic ones then, so the switch cannot change afterwards. Off, they bind SGLang's own
classes and skip every added call, so the patched wheel behaves as the stock one. Every other
setting is read like anywhere else in kvcached (`settings.current_settings()`).
"""

from __future__ import annotations

from kvcached_core.settings import KVCachedSettings, current_settings


def sglang_settings() -> KVCachedSettings:
    """The process's kvcached settings."""
    return current_settings()


ELASTIC: bool = current_settings().enabled


def elastic_enabled() -> bool:
    """Whether the rewritten modules bound the elastic classes (the switch at import)."""
    return ELASTIC
