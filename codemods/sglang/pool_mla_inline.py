"""Seam mla-pool up to 0.5.5: the latent buffers are allocated inline in ``__init__``.

Until 0.5.6 gave ``MLATokenToKVPool`` a ``_create_buffers`` method, its ``__init__`` allocates
every layer's latent buffer itself, in one ``with self.memory_saver_adapter.region(...)``
statement between the fields the rest of the class reads and the pointer table built from the
buffers. This variant first does to the release what 0.5.6 did: that statement becomes the
method ``_create_buffers`` (its reads of ``__init__``'s parameters become reads of the fields
that hold them) and ``__init__`` calls it where the statement stood; ``_clear_buffers`` drops
the buffers, as 0.5.6's does. Then it subclasses the pool with the same mixin as the later
releases (``ElasticMLAPoolMixin``), so the buffers are views of VMM-backed tensors and the
pointer table ``__init__`` builds next describes them.

It applies only to a class without ``_create_buffers`` whose ``__init__`` has exactly one such
statement, assigning ``self.kv_buffer``, and whose statement reads no parameter the class does
not keep under the same name: a release that allocates elsewhere, or from a value the method
could not see, matches nothing and the build fails.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang._append import AppendElasticSubclass, _class_defs

_KV_BUFFER = m.AssignTarget(target=m.Attribute(value=m.Name("self"), attr=m.Name("kv_buffer")))
_KV_REGION = m.With(items=[m.WithItem(item=m.Call(func=m.Attribute(
    value=m.Attribute(value=m.Name("self"), attr=m.Name("memory_saver_adapter")),
    attr=m.Name("region")))), m.ZeroOrMore()])
#: Parameters of ``__init__`` that SGLang's ``KVCache.__init__`` keeps as fields of the same
#: name when ``__init__`` passes them to it (every release from 0.4).
_KV_CACHE_FIELDS = frozenset({"size", "page_size", "dtype", "device", "layer_num"})
_CREATE = "_create_buffers"
_CLEAR = "_clear_buffers"


def _self_field(name: str) -> cst.Attribute:
    return cst.Attribute(value=cst.Name("self"), attr=cst.Name(name))


class _ReadFields(cst.CSTTransformer):
    """Replace reads of the given local names by reads of ``self.<name>``."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__()
        self._names = names

    def leave_Name(self, original_node: cst.Name,
                   updated_node: cst.Name) -> cst.BaseExpression:
        return _self_field(updated_node.value) if updated_node.value in self._names \
            else updated_node

    # An attribute's name (`x.size`) and a keyword (`device=`) are not reads of a local.
    def leave_Attribute(self, original_node: cst.Attribute,
                        updated_node: cst.Attribute) -> cst.Attribute:
        return updated_node.with_changes(attr=original_node.attr)

    def leave_Arg(self, original_node: cst.Arg, updated_node: cst.Arg) -> cst.Arg:
        return updated_node.with_changes(keyword=original_node.keyword)


def _names_read(node: cst.CSTNode) -> set[str]:
    """Every name the node reads as a variable (not attribute names, not keywords)."""
    attrs = {id(a.attr) for a in m.findall(node, m.Attribute())
             if isinstance(a, cst.Attribute)}
    keywords = {id(a.keyword) for a in m.findall(node, m.Arg())
                if isinstance(a, cst.Arg) and a.keyword is not None}
    return {n.value for n in m.findall(node, m.Name())
            if isinstance(n, cst.Name) and id(n) not in attrs | keywords}


def _kept_fields(init: cst.FunctionDef, before: list[cst.BaseStatement]) -> set[str]:
    """Parameters ``__init__`` keeps under their own name before the allocation: assigned to
    ``self.<name>`` itself, or handed to ``super().__init__`` (KVCache's fields)."""
    kept = set()
    for statement in before:
        for assign in m.findall(statement, m.Assign(
                targets=[m.AssignTarget(target=m.Attribute(value=m.Name("self")))],
                value=m.Name())):
            assert isinstance(assign, cst.Assign)
            target, value = assign.targets[0].target, assign.value
            assert isinstance(target, cst.Attribute) and isinstance(value, cst.Name)
            if target.attr.value == value.value:
                kept.add(value.value)
        for call in m.findall(statement, m.Call(func=m.Attribute(
                value=m.Call(func=m.Name("super")), attr=m.Name("__init__")))):
            assert isinstance(call, cst.Call)
            kept |= {arg.value.value for arg in call.args
                     if isinstance(arg.value, cst.Name)} & _KV_CACHE_FIELDS
    return kept


def _with_buffers_method(node: cst.ClassDef) -> cst.ClassDef | None:
    """``node`` with its inline allocation moved into ``_create_buffers`` (None: not this
    release's shape)."""
    methods = {s.name.value: s for s in node.body.body if isinstance(s, cst.FunctionDef)}
    init = methods.get("__init__")
    if init is None or _CREATE in methods or _CLEAR in methods:
        return None
    assert isinstance(init.body, cst.IndentedBlock)
    body = list(init.body.body)
    regions = [i for i, s in enumerate(body) if m.matches(s, _KV_REGION)]
    if len(regions) != 1 or not m.findall(body[regions[0]], _KV_BUFFER):
        return None
    (at,) = regions
    allocation = body[at]
    assert isinstance(allocation, cst.With)
    parameters = {p.name.value for p in (*init.params.params, *init.params.kwonly_params)}
    assigned = set()
    for statement in body[:at]:
        for target in m.findall(statement, m.AssignTarget(target=m.Name())):
            assert isinstance(target, cst.AssignTarget) and isinstance(target.target, cst.Name)
            assigned.add(target.target.value)
    locals_before = parameters | assigned
    read = (_names_read(allocation) & locals_before) - {"self"}
    kept = _kept_fields(init, body[:at])
    if not read <= kept:
        return None  # the allocation reads a local no field holds
    moved = allocation.visit(_ReadFields(frozenset(read)))
    assert isinstance(moved, cst.With)
    call = cst.SimpleStatementLine(
        body=[cst.Expr(cst.parse_expression(f"self.{_CREATE}()"))],
        leading_lines=allocation.leading_lines)
    new_init = init.with_changes(body=init.body.with_changes(
        body=[*body[:at], call, *body[at + 1:]]))
    create = cst.parse_statement(f"def {_CREATE}(self):\n    pass\n")
    clear = cst.parse_statement(f"def {_CLEAR}(self):\n    del self.kv_buffer\n")
    assert isinstance(create, cst.FunctionDef) and isinstance(clear, cst.FunctionDef)
    create = create.with_changes(
        leading_lines=[cst.EmptyLine(indent=False)],
        body=create.body.with_changes(body=[moved.with_changes(leading_lines=[])]))
    clear = clear.with_changes(leading_lines=[cst.EmptyLine(indent=False)])
    members: list[cst.BaseStatement | cst.BaseSmallStatement] = []
    for member in node.body.body:
        if member is init:
            members += [new_init, create, clear]
        else:
            members.append(member)
    return node.with_changes(body=node.body.with_changes(body=members))


class ElasticInlineMLAPool(AppendElasticSubclass):
    DESCRIPTION = ("Move MLATokenToKVPool's inline latent buffer allocation into "
                   "_create_buffers and subclass it so the buffers are views of kvcached "
                   "tensors.")
    ANCHOR = "MLATokenToKVPool"
    ELASTIC = "ElasticMLATokenToKVPool"
    MIXIN_MODULE = "kvcached_core.integration.sglang.pools"
    MIXIN = "ElasticMLAPoolMixin"
    DOC = ("MLATokenToKVPool whose latent buffers, allocated in the _create_buffers the "
           "build moved them to, are views of VMM-backed kvcached tensors.")
    REQUIRED_METHODS = ("__init__", _CREATE, _CLEAR)

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        classes = _class_defs(updated_node)
        anchors = classes.get(self.ANCHOR, [])
        if self.ELASTIC in classes or len(anchors) != 1:
            return super().leave_Module(original_node, updated_node)
        moved = _with_buffers_method(anchors[0])
        if moved is None:
            return updated_node
        body = [moved if statement is anchors[0] else statement
                for statement in updated_node.body]
        return super().leave_Module(original_node, updated_node.with_changes(body=body))
