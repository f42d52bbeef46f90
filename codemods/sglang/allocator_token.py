"""Seam: SGLang's token allocator (page size 1) draws its slots from kvcached_core."""

from __future__ import annotations

from codemods.sglang._append import AppendElasticSubclass


class ElasticTokenAllocator(AppendElasticSubclass):
    DESCRIPTION = (
        "Subclass TokenToKVPoolAllocator with the elastic ledger mixin and rebind its name.")
    ANCHOR = "TokenToKVPoolAllocator"
    ELASTIC = "ElasticTokenToKVPoolAllocator"
    MIXIN_MODULE = "kvcached_core.integration.sglang.allocators"
    MIXIN = "ElasticTokenAllocatorMixin"
    DOC = "TokenToKVPoolAllocator whose slots come from kvcached_core (elastic KV memory)."
    REQUIRED_METHODS = ("__init__", "clear", "available_size", "alloc", "free", "free_page_ids")
