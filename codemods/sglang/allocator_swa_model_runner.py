"""Seam swa-allocator, 0.5.13 - 0.5.15: the sliding-window composite while the model runner
still builds the pools.

The same appended subclass and mixin as ``allocator_swa`` (``ElasticSWAAllocatorMixin``) on the
composite of ``mem_cache/allocator/swa.py``, whose anchor is older: no ``resize`` (post-capture
KV sizing comes with 0.5.16's configurator) and, up to 0.5.14, no ``new_pages_available`` (its
extend checks both sides inline, on the logical sizes the mixin's taking of pages lowers
first). Like 0.5.16 - 0.5.20, its scheduler reads the composite's full and window sizes itself
(``scheduler_capacity_sides``). Kept apart from ``allocator_swa_before_budget``, whose source is
part of the patch-set fingerprint of 0.5.16 - 0.5.20.
"""

from __future__ import annotations

from codemods.sglang._append import AppendElasticSubclass
from codemods.sglang.allocator_swa import ElasticSWAAllocator


class ElasticSWAAllocatorModelRunner(AppendElasticSubclass):
    DESCRIPTION = ("Subclass SWATokenToKVPoolAllocator (no resize yet) with the elastic "
                   "sliding-window mixin and rebind its name.")
    ANCHOR = ElasticSWAAllocator.ANCHOR
    ELASTIC = ElasticSWAAllocator.ELASTIC
    MIXIN_MODULE = ElasticSWAAllocator.MIXIN_MODULE
    MIXIN = ElasticSWAAllocator.MIXIN
    DOC = ElasticSWAAllocator.DOC
    REQUIRED_METHODS = ("__init__", "clear", "available_size", "full_available_size",
                        "swa_available_size", "alloc", "alloc_extend", "alloc_extend_swa_tail",
                        "alloc_decode", "set_full_to_swa_mapping")
