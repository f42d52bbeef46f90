"""Seam: SGLang's paged allocator draws its pages from kvcached_core."""

from __future__ import annotations

from codemods.sglang._append import AppendElasticSubclass


class ElasticPagedAllocator(AppendElasticSubclass):
    DESCRIPTION = ("Subclass PagedTokenToKVPoolAllocator with the elastic ledger mixin and rebind "
                   "its name.")
    ANCHOR = "PagedTokenToKVPoolAllocator"
    ELASTIC = "ElasticPagedTokenToKVPoolAllocator"
    MIXIN_MODULE = "kvcached_core.integration.sglang.allocators"
    MIXIN = "ElasticPagedAllocatorMixin"
    DOC = "PagedTokenToKVPoolAllocator whose pages come from kvcached_core (elastic KV memory)."
    REQUIRED_METHODS = (
        "__init__", "clear", "available_size", "alloc", "alloc_extend", "alloc_decode", "free",
        "free_segment", "free_page_ids", "_release_page_ids", "free_group_begin",
        "free_group_end", "merge_and_sort_free", "get_all_free_pages",
    )
