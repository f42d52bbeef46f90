"""How a release's MHATokenToKVPool lays out K and V of a layer (read from its source).

The plain NHD branch of ``_create_buffers_normal`` assigns ``self.v_buffer`` a list built
per layer. SGLang 0.5.23 fuses K and V: ``self.v_buffer = [buf[1, :rows] for buf in fused]``
(an index into one allocation). Earlier releases allocate V on its own:
``self.v_buffer = [torch.zeros(v_shape, ...) for _ in range(self.layer_num)]``.
"""

from __future__ import annotations

from typing import Literal

import libcst as cst
import libcst.matchers as m

KVLayout = Literal["fused", "separate", "unknown"]

_V_BUFFER_TARGET = m.AssignTarget(target=m.Attribute(value=m.Name("self"),
                                                     attr=m.Name("v_buffer")))


def _method(node: cst.ClassDef, name: str) -> cst.FunctionDef | None:
    for statement in node.body.body:
        if isinstance(statement, cst.FunctionDef) and statement.name.value == name:
            return statement
    return None


def mha_kv_layout(node: cst.ClassDef) -> KVLayout:
    """``fused`` when some per-layer V buffer is an index into a shared allocation,
    ``separate`` when every one is an allocation of its own, ``unknown`` otherwise."""
    method = _method(node, "_create_buffers_normal")
    if method is None:
        return "unknown"
    elements = [
        assign.value.elt
        for assign in m.findall(method, m.Assign(targets=[_V_BUFFER_TARGET],
                                                 value=m.ListComp()))
        if isinstance(assign, cst.Assign) and isinstance(assign.value, cst.ListComp)
    ]
    if any(isinstance(element, cst.Subscript) for element in elements):
        return "fused"
    if elements and all(isinstance(element, cst.Call) for element in elements):
        return "separate"
    return "unknown"
