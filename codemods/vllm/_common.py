"""What the vLLM codemods share: the adapter import and matching a method of a class."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.base import HitCountingCodemod

ADAPTER_ALIAS = "_kvcached_vllm"
ADAPTER_IMPORT = f"import kvcached_core.integration.vllm as {ADAPTER_ALIAS}\n"


def adapter_attr(name: str) -> cst.Attribute:
    return cst.Attribute(value=cst.Name(ADAPTER_ALIAS), attr=cst.Name(name))


def is_adapter_call(node: cst.BaseExpression, name: str) -> bool:
    return m.matches(node, m.Call(func=m.Attribute(value=m.Name(ADAPTER_ALIAS),
                                                   attr=m.Name(name))))


def _is_future_import(statement: cst.CSTNode) -> bool:
    return m.matches(statement, m.SimpleStatementLine(body=[m.ImportFrom(
        module=m.Name("__future__"))]))


def _is_docstring(statement: cst.CSTNode) -> bool:
    return m.matches(statement, m.SimpleStatementLine(body=[m.Expr(value=m.SimpleString())]))


def with_adapter_import(module: cst.Module) -> cst.Module:
    """The module with the adapter import after its docstring and `__future__` imports."""
    import_line = cst.parse_statement(ADAPTER_IMPORT)
    if any(s.deep_equals(import_line) for s in module.body):
        return module
    body = list(module.body)
    at = 0
    while at < len(body) and (_is_docstring(body[at]) or _is_future_import(body[at])):
        at += 1
    body.insert(at, import_line)
    return module.with_changes(body=body)


class MethodCodemod(HitCountingCodemod):
    """Base for codemods that rewrite inside one method of one class."""

    CLASS_NAME: str = ""
    METHOD_NAMES: tuple[str, ...] = ()

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._class_depth = 0
        self._method: str | None = None

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        if node.name.value == self.CLASS_NAME:
            self._class_depth += 1

    def leave_ClassDef(self, original_node: cst.ClassDef,
                       updated_node: cst.ClassDef) -> cst.ClassDef:
        if original_node.name.value == self.CLASS_NAME:
            self._class_depth -= 1
        return updated_node

    def in_target_class(self) -> bool:
        return self._class_depth > 0

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return with_adapter_import(updated_node) if self.hits else updated_node


class FunctionCodemod(HitCountingCodemod):
    """Base for codemods that rewrite inside one module-level function."""

    FUNCTION_NAME: str = ""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._inside = 0

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if node.name.value == self.FUNCTION_NAME:
            self._inside += 1

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if original_node.name.value == self.FUNCTION_NAME:
            self._inside -= 1
        return updated_node

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        return with_adapter_import(updated_node) if self.hits else updated_node


class DecorateMethods(MethodCodemod):
    """Add an adapter decorator to named methods of one class (idempotent)."""

    #: method name -> decorator source, e.g. "_kvcached_vllm.released_after_step(pipelined=False)"
    DECORATORS: dict[str, str] = {}

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if not self.in_target_class() or original_node.name.value not in self.DECORATORS:
            return updated_node
        source = self.DECORATORS[original_node.name.value]
        decorator = cst.Decorator(decorator=cst.parse_expression(source))
        if any(d.deep_equals(decorator) for d in updated_node.decorators):
            self.record_already_applied()
            return updated_node
        self.record_hit()
        return updated_node.with_changes(decorators=[*updated_node.decorators, decorator])
