"""Seam token-allocator, 0.5.19: ``free_group is None``, no ``free_page_ids`` yet.

0.5.19's token allocator has the newer free group (``free_group`` is None outside a group, a
list inside; the flag is gone) and copies a deferred free, as 0.5.20 does, but ``free_page_ids``
came only in 0.5.20. The newer API's mixin overrides ``clear``, ``alloc`` and ``free`` exactly
as 0.5.20's class needs, so it serves this release unchanged. The variant applies only to a
class whose ``clear`` sets ``free_group`` to None and which defines no ``free_page_ids``.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang._append import AppendElasticSubclass
from codemods.sglang.allocator_token import ElasticTokenAllocator

_FREE_GROUP_NONE = m.Assign(
    targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("free_group")))],
    value=m.Name("None"),
)


class ElasticTokenAllocatorFreeGroupNone(AppendElasticSubclass):
    # 0.5.20's class, mixin and subclass (codemods/sglang/allocator_token.py), for a class
    # without free_page_ids.

    DESCRIPTION = ("Subclass TokenToKVPoolAllocator (free_group None, no free_page_ids) with "
                   "the elastic ledger mixin and rebind its name.")
    ANCHOR, ELASTIC = ElasticTokenAllocator.ANCHOR, ElasticTokenAllocator.ELASTIC
    MIXIN_MODULE, MIXIN = ElasticTokenAllocator.MIXIN_MODULE, ElasticTokenAllocator.MIXIN
    DOC = ElasticTokenAllocator.DOC
    REQUIRED_METHODS = ("__init__", "clear", "available_size", "alloc", "free")

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        methods = {s.name.value: s for s in node.body.body if isinstance(s, cst.FunctionDef)}
        clear = methods.get("clear")
        return ("free_page_ids" not in methods and clear is not None
                and bool(m.findall(clear, _FREE_GROUP_NONE)))
