"""kvcached for vLLM: what the call sites written into a patched vLLM call.

Every name here is called from a place a registered transform rewrote (see
`codemods/catalog.py` and `docs/seams.md`); anything that differs between vLLM versions is
passed in by that call site, so this package holds no version checks.
"""

from kvcached_core.integration.vllm.block_pool import (
    ElasticBlockPoolMixin,
    elastic_block_pool_class,
    make_block_pool,
)
from kvcached_core.integration.vllm.config import elastic_enabled, engine_settings
from kvcached_core.integration.vllm.engine import (
    RANKS_KEEP_THEIR_BYTES,
    close_on_shutdown,
    kv_cache_budget,
    kv_cache_configs_in_whole_pages,
    kv_caches_sized_with_executor,
    none_on_pool_exhausted,
    released_after_step,
)
from kvcached_core.integration.vllm.kv_buffers import (
    kv_tensor_buffer,
    per_layer_kv_buffer,
    shared_kv_buffer,
)
from kvcached_core.integration.vllm.pools import EnginePool, engine_pools
from kvcached_core.integration.vllm.startup_memory import (
    ends_startup_window,
    memory_profile_consistent,
    startup_memory_short,
    startup_snapshot,
)

__all__ = [
    "RANKS_KEEP_THEIR_BYTES",
    "ElasticBlockPoolMixin",
    "EnginePool",
    "close_on_shutdown",
    "elastic_block_pool_class",
    "elastic_enabled",
    "engine_pools",
    "ends_startup_window",
    "engine_settings",
    "kv_cache_budget",
    "kv_cache_configs_in_whole_pages",
    "kv_caches_sized_with_executor",
    "kv_tensor_buffer",
    "memory_profile_consistent",
    "make_block_pool",
    "none_on_pool_exhausted",
    "per_layer_kv_buffer",
    "released_after_step",
    "shared_kv_buffer",
    "startup_memory_short",
    "startup_snapshot",
]
