"""Seam swa-allocator: SGLang's hybrid sliding-window allocator gates and allocates under the
physical limit of both of its elastic sides (from 0.5.21, whose scheduler asks the allocator
for admission, eviction and the decode check).

Two appended subclasses in ``mem_cache/allocator/swa.py``: the composite
``SWATokenToKVPoolAllocator`` gets the elastic mixin (its sub-allocators and pools are already
elastic through the token / paged allocator and MHA pool seams); the all-window
``PureSWATokenToKVPoolAllocator``, which derives from the stock composite above the appended
block, gets a mixin that refuses it with elastic memory on.
"""

from __future__ import annotations

from codemods.sglang._append import AppendElasticSubclass


class ElasticSWAAllocator(AppendElasticSubclass):
    DESCRIPTION = ("Subclass SWATokenToKVPoolAllocator with the elastic sliding-window mixin "
                   "and rebind its name.")
    ANCHOR = "SWATokenToKVPoolAllocator"
    ELASTIC = "ElasticSWATokenToKVPoolAllocator"
    MIXIN_MODULE = "kvcached_core.integration.sglang.swa"
    MIXIN = "ElasticSWAAllocatorMixin"
    DOC = ("SWATokenToKVPoolAllocator whose capacity gates and allocations respect both "
           "elastic sides' limits (kvcached_core).")
    REQUIRED_METHODS = ("__init__", "clear", "resize", "available_size", "create_prefill_budget",
                        "reclaim_for_prealloc", "evict_to_free_tokens", "new_pages_available",
                        "alloc", "alloc_extend", "alloc_extend_swa_tail", "alloc_decode",
                        "set_full_to_swa_mapping")


class RefusePureSWAAllocator(AppendElasticSubclass):
    DESCRIPTION = ("Subclass PureSWATokenToKVPoolAllocator so an elastic engine refuses it.")
    ANCHOR = "PureSWATokenToKVPoolAllocator"
    ELASTIC = "ElasticPureSWATokenToKVPoolAllocator"
    MIXIN_MODULE = "kvcached_core.integration.sglang.swa"
    MIXIN = "RefusePureSWAAllocatorMixin"
    DOC = ("PureSWATokenToKVPoolAllocator: every layer a sliding window; refused with elastic "
           "KV memory.")
    REQUIRED_METHODS = ("__init__",)
