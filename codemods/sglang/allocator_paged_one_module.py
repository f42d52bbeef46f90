"""Seam paged-allocator, 0.5.12: the paged allocator still in ``mem_cache/allocator.py``, whose
``alloc_extend`` already takes ``num_new_pages``.

0.5.12 gave the paged ``alloc_extend`` its ``num_new_pages`` parameter, one release before
0.5.13 made ``mem_cache/allocator`` a package: its class is 0.5.13's (the free-group flag,
``free`` the only free path, ``backup_state`` / ``restore_state`` on the base class), so it takes
the codemod and mixin of codemods/sglang/allocators_free_group_flag.py, declared for this
module. It applies only to a class whose ``alloc_extend`` takes ``num_new_pages``: the mixin
passes the count on, which the stock method of 0.5.3 - 0.5.11 does not take.
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang.allocators_free_group_flag import ElasticPagedAllocatorFreeGroupFlag
from codemods.sglang.allocators_one_module import _alloc_extend_parameters


class ElasticPagedAllocatorOneModule(ElasticPagedAllocatorFreeGroupFlag):
    DESCRIPTION = ("Subclass PagedTokenToKVPoolAllocator (free-group flag, alloc_extend with "
                   "num_new_pages, in mem_cache/allocator.py) with the elastic ledger mixin and "
                   "rebind its name.")

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        parameters = _alloc_extend_parameters(node)
        return (super().anchor_fits(node) and parameters is not None
                and "num_new_pages" in parameters)
