"""Seams token-allocator and paged-allocator up to 0.5.16: the allocators' older API.

Up to 0.5.16 a free group is the ``is_not_in_free_group`` flag (``free_group is None`` from
0.5.19), ``free`` is the only free path (``free_segment`` came in 0.5.17, ``free_page_ids``
in 0.5.20), the base class keeps ``backup_state`` / ``restore_state`` (gone in 0.5.17) and the
paged allocator stages freed pages in ``release_pages`` (``staged_pages`` from 0.5.20). The
elastic subclass is appended the same way (codemods/sglang/_append.py) with the adapter's
mixins for that API, which route every one of those methods through the ledger. Each variant
applies only to a class whose ``clear`` resets the flag and which defines no free path its
mixin does not override, so a release with the newer API is never given these mixins.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang._append import AppendElasticSubclass

_MIXIN_MODULE = "kvcached_core.integration.sglang.allocators"
# Free paths of later releases that the mixins below do not override: a class that defines
# one would free pages behind the ledger's back.
_LATER_FREE_PATHS = frozenset({"free_segment", "free_page_ids", "_release_page_ids"})
_FLAG_RESET = m.Assign(targets=[m.AssignTarget(target=m.Attribute(
    value=m.Name("self"), attr=m.Name("is_not_in_free_group")))])


def _resets_free_group_flag(node: cst.ClassDef) -> bool:
    """Whether the class's ``clear`` resets the ``is_not_in_free_group`` flag and the class
    defines no free path of a later release."""
    methods = {
        statement.name.value: statement
        for statement in node.body.body
        if isinstance(statement, cst.FunctionDef)
    }
    clear = methods.get("clear")
    return (clear is not None and not _LATER_FREE_PATHS & methods.keys()
            and bool(m.findall(clear, _FLAG_RESET)))


class ElasticTokenAllocatorFreeGroupFlag(AppendElasticSubclass):
    DESCRIPTION = ("Subclass TokenToKVPoolAllocator (free-group flag, backup_state) with the "
                   "elastic ledger mixin and rebind its name.")
    ANCHOR = "TokenToKVPoolAllocator"
    ELASTIC = "ElasticTokenToKVPoolAllocator"
    MIXIN_MODULE = _MIXIN_MODULE
    MIXIN = "ElasticTokenAllocatorFreeGroupFlagMixin"
    DOC = "TokenToKVPoolAllocator whose slots come from kvcached_core (elastic KV memory)."
    REQUIRED_METHODS = ("__init__", "clear", "available_size", "alloc", "free")

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        return _resets_free_group_flag(node)


class ElasticPagedAllocatorFreeGroupFlag(AppendElasticSubclass):
    DESCRIPTION = ("Subclass PagedTokenToKVPoolAllocator (free-group flag, backup_state) with "
                   "the elastic ledger mixin and rebind its name.")
    ANCHOR = "PagedTokenToKVPoolAllocator"
    ELASTIC = "ElasticPagedTokenToKVPoolAllocator"
    MIXIN_MODULE = _MIXIN_MODULE
    MIXIN = "ElasticPagedAllocatorFreeGroupFlagMixin"
    DOC = "PagedTokenToKVPoolAllocator whose pages come from kvcached_core (elastic KV memory)."
    REQUIRED_METHODS = ("__init__", "clear", "alloc", "alloc_extend", "alloc_decode", "free")

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        return _resets_free_group_flag(node)
