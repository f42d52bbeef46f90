"""Seam paged-allocator, 0.5.17 - 0.5.19: every free path ends in ``_release_page_ids``, and
there is no ``free_page_ids`` yet.

0.5.17 gave the paged allocator ``free_segment`` and the one method every free path ends in,
``_release_page_ids`` (``free``, ``free_segment`` and ``free_group_end`` all call it), while its
free group stayed the ``is_not_in_free_group`` flag (``free_group is None`` from 0.5.19) and
``free_page_ids`` came only in 0.5.20. The newer API's mixin overrides exactly what these
releases route through: allocation (its pages staged from the ledger) and
``_release_page_ids`` (pages back to the ledger); ``free``, ``free_segment`` and the group
methods stay the release's own, so its deferred frees (copied from 0.5.18) and its group
bookkeeping are unchanged. The variant applies only to a class that defines both
``free_segment`` and ``_release_page_ids`` and no ``free_page_ids``: 0.5.16 (no
``_release_page_ids``) and 0.5.20 (``free_page_ids``) are refused.
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang._append import AppendElasticSubclass
from codemods.sglang.allocator_paged import ElasticPagedAllocator


class ElasticPagedAllocatorReleasePageIds(AppendElasticSubclass):
    # 0.5.20's class, mixin and subclass (codemods/sglang/allocator_paged.py), for a class
    # with fewer methods.

    DESCRIPTION = ("Subclass PagedTokenToKVPoolAllocator (free paths ending in "
                   "_release_page_ids, no free_page_ids) with the elastic ledger mixin and "
                   "rebind its name.")
    ANCHOR, ELASTIC = ElasticPagedAllocator.ANCHOR, ElasticPagedAllocator.ELASTIC
    MIXIN_MODULE, MIXIN = ElasticPagedAllocator.MIXIN_MODULE, ElasticPagedAllocator.MIXIN
    DOC = ElasticPagedAllocator.DOC
    REQUIRED_METHODS = (
        "__init__", "clear", "alloc", "alloc_extend", "alloc_decode", "free", "free_segment",
        "_release_page_ids", "free_group_begin", "free_group_end",
    )

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        return not any(isinstance(s, cst.FunctionDef) and s.name.value == "free_page_ids"
                       for s in node.body.body)
