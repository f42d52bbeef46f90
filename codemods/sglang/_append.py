"""Append an elastic subclass to the module that defines a class, and rebind the class's name.

Rewriting the defining module means every module that imports the name afterwards (with
`from ... import X` at module level) gets the elastic class, with no runtime aliasing. The
subclass is defined whatever the switch says; the name is rebound only when KVCACHED_ENABLE is
on, so with it off the module exports SGLang's own class.
"""

from __future__ import annotations

import libcst as cst

from codemods.base import HitCountingCodemod


def _class_defs(module: cst.Module) -> dict[str, list[cst.ClassDef]]:
    found: dict[str, list[cst.ClassDef]] = {}
    for statement in module.body:
        if isinstance(statement, cst.ClassDef):
            found.setdefault(statement.name.value, []).append(statement)
    return found


def _method_names(node: cst.ClassDef) -> set[str]:
    return {
        statement.name.value
        for statement in node.body.body
        if isinstance(statement, cst.FunctionDef)
    }


def elastic_block(*, anchor: str, elastic: str, mixin_module: str, mixin: str, doc: str) -> str:
    """The source appended after ``anchor``'s module (one class, one guarded rebinding)."""
    alias = f"_Kvcached{mixin}"
    return f'''# kvcached: elastic {anchor}, written at build time.
# KVCACHED_ENABLE=0 keeps the class above.
from kvcached_core.integration.sglang import ELASTIC as _KVCACHED_ELASTIC
from {mixin_module} import {mixin} as {alias}


class {elastic}({alias}, {anchor}):
    """{doc}"""

    _kvcached_elastic_leaf = True


if _KVCACHED_ELASTIC:
    {anchor} = {elastic}
'''


class AppendElasticSubclass(HitCountingCodemod):
    """Base: subclass ``ANCHOR`` with the adapter's mixin at the end of its defining module.

    One hit per module. It matches only when the module defines ``ANCHOR`` exactly once at
    module level with every method in ``REQUIRED_METHODS`` (the methods the mixin overrides or
    relies on), so an upstream rename fails the build instead of producing a dead subclass.
    """

    ANCHOR: str = ""
    ELASTIC: str = ""
    MIXIN_MODULE: str = ""
    MIXIN: str = ""
    DOC: str = ""
    REQUIRED_METHODS: tuple[str, ...] = ()

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        classes = _class_defs(updated_node)
        if self.ELASTIC in classes:
            self.record_already_applied()
            return updated_node
        anchors = classes.get(self.ANCHOR, [])
        if len(anchors) != 1:
            return updated_node
        if not set(self.REQUIRED_METHODS) <= _method_names(anchors[0]):
            return updated_node
        if not self.anchor_fits(anchors[0]):
            return updated_node
        block = cst.parse_module(elastic_block(
            anchor=self.ANCHOR, elastic=self.ELASTIC, mixin_module=self.MIXIN_MODULE,
            mixin=self.MIXIN, doc=self.DOC,
        ))
        # The block's comment is parsed as the module header; keep it above the first line.
        first = block.body[0].with_changes(
            leading_lines=[cst.EmptyLine(), cst.EmptyLine(), *block.header]
        )
        self.record_hit()
        return updated_node.with_changes(body=[*updated_node.body, first, *block.body[1:]])

    def anchor_fits(self, node: cst.ClassDef) -> bool:
        """Whether the anchor class is the shape the mixin is written for (beyond its
        methods); a variant whose mixin assumes more checks it here."""
        return True
