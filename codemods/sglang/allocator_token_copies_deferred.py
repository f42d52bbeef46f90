"""Seam token-allocator, 0.5.18: the free-group flag, with deferred frees on a copy.

0.5.18's token allocator still marks a free group with the ``is_not_in_free_group`` flag
(``free_group is None`` from 0.5.19) and frees only through ``free``, but a free inside a group
now keeps a copy of its indices (``_copy_for_free_group``): from 0.5.18 the scheduler groups the
frees of a whole prefill result, and a caller may reuse the tensor it freed (a view of a
request's row) before the group ends. The free-group-flag mixin defers the tensor itself, as
0.5.16 did, so the elastic class keeps the mixin and copies a deferred free first, as the
release does. The variant applies only to a class whose ``clear`` resets the flag, whose
``free`` copies what it defers and which defines no later free path.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang.allocators_free_group_flag import ElasticTokenAllocatorFreeGroupFlag

COPY_ON_DEFER = '''
def free(self, free_index):
    # The release defers a grouped free on a copy: the caller may reuse the tensor.
    if not self.is_not_in_free_group:
        free_index = self._copy_for_free_group(free_index)
    super().free(free_index)
'''
_COPY_CALL = m.Call(func=m.Attribute(value=m.Name("self"), attr=m.Name("_copy_for_free_group")))


def _free_copies_what_it_defers(node: cst.ClassDef) -> bool:
    return any(isinstance(s, cst.FunctionDef) and s.name.value == "free"
               and bool(m.findall(s, _COPY_CALL)) for s in node.body.body)


class ElasticTokenAllocatorFreeGroupFlagCopies(ElasticTokenAllocatorFreeGroupFlag):
    DESCRIPTION = ("Subclass TokenToKVPoolAllocator (free-group flag, deferred frees copied) "
                   "with the elastic ledger mixin, copying a deferred free, and rebind its name.")

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        return super().anchor_fits(node) and _free_copies_what_it_defers(node)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        hits = self.hits
        module = super().leave_Module(original_node, updated_node)
        if self.hits == hits:
            return module
        method = cst.parse_statement(COPY_ON_DEFER)
        assert isinstance(method, cst.FunctionDef)

        def with_free(statement: cst.BaseStatement) -> cst.BaseStatement:
            if not (isinstance(statement, cst.ClassDef) and statement.name.value == self.ELASTIC):
                return statement
            body = statement.body
            assert isinstance(body, cst.IndentedBlock)
            free = method.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
            return statement.with_changes(body=body.with_changes(body=[*body.body, free]))

        return module.with_changes(body=[with_free(s) for s in module.body])
