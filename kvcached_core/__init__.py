"""kvcached_core: elastic KV-cache memory for LLM serving engines."""

from kvcached_core.errors import (
    KVCachedConfigError,
    KVCachedError,
    MapQuarantinedError,
    PoolExhausted,
    StateConsistencyError,
)

__all__ = [
    "KVCachedConfigError",
    "KVCachedError",
    "MapQuarantinedError",
    "PoolExhausted",
    "StateConsistencyError",
]
