"""Seams token-allocator and paged-allocator up to 0.5.12: both allocators in one module.

Until 0.5.13 made ``mem_cache/allocator`` a package, the token and paged allocators (and
their base class) lived in ``mem_cache/allocator.py``. Their API is that of
codemods/sglang/allocators_free_group_flag.py (the free-group flag, ``free`` the only free
path, ``backup_state`` / ``restore_state`` on the base class), so the token allocator takes
that codemod as it is, declared for this module. The paged allocator's ``alloc_extend`` counts
the batch's new pages itself from the CPU copies of the lengths (``prefix_lens_cpu``, from
0.5.3) until 0.5.12 added its ``num_new_pages`` parameter: this variant gives it a mixin that
calls the stock method without one, and applies only to a class whose ``alloc_extend`` takes
the CPU lengths and no such parameter.
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang.allocators_free_group_flag import ElasticPagedAllocatorFreeGroupFlag


def _alloc_extend_parameters(node: cst.ClassDef) -> set[str] | None:
    for statement in node.body.body:
        if isinstance(statement, cst.FunctionDef) and statement.name.value == "alloc_extend":
            params = statement.params
            return {param.name.value
                    for param in (*params.posonly_params, *params.params, *params.kwonly_params)}
    return None


class ElasticPagedAllocatorCountsItsPages(ElasticPagedAllocatorFreeGroupFlag):
    DESCRIPTION = ("Subclass PagedTokenToKVPoolAllocator (free-group flag, alloc_extend without "
                   "num_new_pages) with the elastic ledger mixin and rebind its name.")
    MIXIN = "ElasticPagedAllocatorCountsItsPagesMixin"

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        parameters = _alloc_extend_parameters(node)
        return (super().anchor_fits(node) and parameters is not None
                and "prefix_lens_cpu" in parameters and "num_new_pages" not in parameters)
