"""Seam: the KV pools are sized from the kvcached budget, not only from free memory at start.

``KVCacheConfigurator._profile_available_bytes`` returns the byte budget every pool size is
derived from; each of its ``return`` values is passed through the adapter's
``kv_budget_bytes``, which applies the kvcached budget when elastic memory is on.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang._method import (
    MethodScopedCodemod,
    body_statements,
    is_marked,
    statement,
    with_body,
)

WRAPPER = "_kvcached_kv_budget_bytes"
IMPORT = ("from kvcached_core.integration.sglang.startup import kv_budget_bytes as "
          f"{WRAPPER}")


class KVBudgetCapacity(MethodScopedCodemod):
    DESCRIPTION = "Pass every KV budget KVCacheConfigurator profiles through kvcached's budget."
    CLASS = "KVCacheConfigurator"
    METHOD = "_profile_available_bytes"

    def leave_Return(self, original_node: cst.Return, updated_node: cst.Return) -> cst.Return:
        if not self.in_target or updated_node.value is None:
            return updated_node
        if m.matches(updated_node.value, m.Call(func=m.Name(WRAPPER))):
            self.record_already_applied()
            return updated_node
        self.record_hit()
        wrapped = cst.Call(func=cst.Name(WRAPPER), args=[cst.Arg(updated_node.value)])
        return updated_node.with_changes(value=wrapped)

    def rewrite_target(self, node: cst.FunctionDef) -> cst.FunctionDef:
        statements = body_statements(node)
        if self.hits and not any(is_marked(s, WRAPPER) and isinstance(s, cst.SimpleStatementLine)
                                 and m.matches(s.body[0], m.ImportFrom())
                                 for s in statements):
            # The import goes first in the body: the wrapper exists before any return.
            statements.insert(0, statement(IMPORT + "\n"))
        return with_body(node, statements)
