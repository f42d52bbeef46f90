"""Visit one method (``Class.method``) or one module-level function, and nothing else."""

from __future__ import annotations

import libcst as cst

from codemods.base import HitCountingCodemod


class MethodScopedCodemod(HitCountingCodemod):
    """Base: ``in_target`` is true only inside ``CLASS.METHOD`` (``CLASS`` empty: a function).

    Nested functions and classes inside the target are not part of it.
    """

    CLASS: str = ""
    METHOD: str = ""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._classes: list[str] = []
        self._functions: list[str] = []

    @property
    def in_target(self) -> bool:
        classes = [self.CLASS] if self.CLASS else []
        return self._classes == classes and self._functions == [self.METHOD]

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef,
                       updated_node: cst.ClassDef) -> cst.ClassDef:
        self._classes.pop()
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._functions.append(node.name.value)

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        try:
            if self.in_target:
                return self.rewrite_target(updated_node)
            return updated_node
        finally:
            self._functions.pop()

    def rewrite_target(self, node: cst.FunctionDef) -> cst.FunctionDef:
        return node


def body_statements(node: cst.FunctionDef) -> list[cst.BaseStatement]:
    body = node.body
    assert isinstance(body, cst.IndentedBlock)
    return list(body.body)


def with_body(node: cst.FunctionDef, statements: list[cst.BaseStatement]) -> cst.FunctionDef:
    body = node.body
    assert isinstance(body, cst.IndentedBlock)
    return node.with_changes(body=body.with_changes(body=statements))


def statement(source: str) -> cst.BaseStatement:
    return cst.parse_statement(source)


def is_marked(node: cst.BaseStatement, marker: str) -> bool:
    """Whether a statement is one the codemod wrote (its source mentions ``marker``)."""
    return marker in cst.Module(body=[]).code_for_node(node)


def first_after_docstring(statements: list[cst.BaseStatement]) -> int:
    """Index of the first statement after the body's docstring (0 when it has none)."""
    first = statements[0] if statements else None
    is_docstring = (isinstance(first, cst.SimpleStatementLine)
                    and isinstance(first.body[0], cst.Expr)
                    and isinstance(first.body[0].value,
                                   cst.SimpleString | cst.ConcatenatedString))
    return 1 if is_docstring else 0
