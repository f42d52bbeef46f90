"""Seam paged-allocator up to 0.5.2: extend and decode get the batch's lengths on the device only.

Before 0.5.3 added the CPU copies of the lengths, the paged allocator's ``alloc_extend(prefix_lens,
seq_lens, last_loc, extend_num_tokens)`` and ``alloc_decode(seq_lens, last_loc)`` let their
kernels count the new pages and read the count back. The rest of the API is that of
codemods/sglang/allocators_free_group_flag.py (in ``mem_cache/allocator.py``). This variant's
mixin counts the batch's new pages from the same tensors before the stock method runs, stages
that many ledger pages, and calls the stock method with its own arguments; it applies only to a
class whose ``alloc_extend`` takes exactly those four arguments.
"""

from __future__ import annotations

import libcst as cst

from codemods.sglang.allocators_free_group_flag import ElasticPagedAllocatorFreeGroupFlag

_DEVICE_LENGTHS = ["self", "prefix_lens", "seq_lens", "last_loc", "extend_num_tokens"]


def _alloc_extend_parameters(node: cst.ClassDef) -> list[str] | None:
    for statement in node.body.body:
        if isinstance(statement, cst.FunctionDef) and statement.name.value == "alloc_extend":
            params = statement.params
            return [param.name.value
                    for param in (*params.posonly_params, *params.params, *params.kwonly_params)]
    return None


class ElasticPagedAllocatorDeviceLengths(ElasticPagedAllocatorFreeGroupFlag):
    DESCRIPTION = ("Subclass PagedTokenToKVPoolAllocator (free-group flag, alloc_extend with "
                   "device lengths only) with the elastic ledger mixin and rebind its name.")
    MIXIN = "ElasticPagedAllocatorDeviceLengthsMixin"

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        return (super().anchor_fits(node)
                and _alloc_extend_parameters(node) == _DEVICE_LENGTHS)
