"""Seam swa-allocator, 0.5.16 - 0.5.20: the sliding-window composite before SGLang asks it for
its prefill budget, its eviction and its decode-node reclaim.

The same appended subclass and mixin as ``allocator_swa`` (``ElasticSWAAllocatorMixin``); what
differs is the anchor it checks for. These releases' composite has no
``create_prefill_budget``, ``reclaim_for_prealloc`` or ``evict_to_free_tokens`` of its own:
their scheduler reads the composite's full and window sizes itself, and the scheduler-capacity
seam's side reads (``scheduler_capacity_sides``) point those reads at what each elastic side
can allocate under its limit. The mixin's methods of those names are then
never called by the release. Kept apart from ``allocator_swa`` so that module's source, part of
the patch-set fingerprint of 0.5.21 - 0.5.23, does not move.
"""

from __future__ import annotations

from codemods.sglang._append import AppendElasticSubclass
from codemods.sglang.allocator_swa import ElasticSWAAllocator


class ElasticSWAAllocatorBeforeBudget(AppendElasticSubclass):
    DESCRIPTION = ("Subclass SWATokenToKVPoolAllocator (no prefill budget or eviction methods "
                   "yet) with the elastic sliding-window mixin and rebind its name.")
    ANCHOR = ElasticSWAAllocator.ANCHOR
    ELASTIC = ElasticSWAAllocator.ELASTIC
    MIXIN_MODULE = ElasticSWAAllocator.MIXIN_MODULE
    MIXIN = ElasticSWAAllocator.MIXIN
    DOC = ElasticSWAAllocator.DOC
    REQUIRED_METHODS = ("__init__", "clear", "resize", "available_size", "full_available_size",
                        "swa_available_size", "new_pages_available", "alloc", "alloc_extend",
                        "alloc_extend_swa_tail", "alloc_decode", "set_full_to_swa_mapping")
