"""Insert a guard first in one method (after its docstring), where the module's settings fit.

The config-guard variants of the releases where the model runner builds the pools differ only
in where the guard goes, what it reads and which module shape they accept; this base inserts
``GUARD`` (with the switch import) and records a hit, and leaves the method as it is (so the
build fails on the missing hit) when ``settings_fit`` says the module reads its settings
otherwise.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang._method import (
    MethodScopedCodemod,
    body_statements,
    first_after_docstring,
    is_marked,
    statement,
    with_body,
)
from codemods.sglang.config_guard import MARKER, SWITCH_IMPORT


def imports_name(module: cst.Module, name: str) -> bool:
    return bool(m.findall(module, m.ImportAlias(name=m.Name(name))))


class InsertGuardFirst(MethodScopedCodemod):
    """Base: ``GUARD`` (mentioning ``refuse_unsupported``) goes first in ``CLASS.METHOD``."""

    GUARD: str = ""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._settings_fit = False

    def visit_Module(self, node: cst.Module) -> None:
        self._settings_fit = self.settings_fit(node)

    def settings_fit(self, module: cst.Module) -> bool:
        """Whether the module reads the settings ``GUARD`` reads, the way it reads them."""
        return True

    def rewrite_target(self, node: cst.FunctionDef) -> cst.FunctionDef:
        statements = body_statements(node)
        if any(is_marked(s, MARKER) for s in statements):
            self.record_already_applied()
            return node
        if not self._settings_fit:
            return node  # the settings moved: the build fails on the missing hit
        first = first_after_docstring(statements)
        statements[first:first] = [statement(SWITCH_IMPORT), statement(self.GUARD)]
        self.record_hit()
        return with_body(node, statements)
