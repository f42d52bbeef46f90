"""Seam: the worker's raw `torch.zeros(n, dtype=torch.int8, ...)` KV buffers become VMM-backed.

The call keeps its arguments and gains `torch.zeros` as its first argument, so with elastic
mode off the adapter makes exactly the stock buffer. What the adapter must know about the
layout is passed in by the rewritten call site, in the words of that version:

- vLLM <= 0.11, `GPUModelRunner._allocate_kv_cache_tensors`: one buffer per layer, plus the
  backend's `get_kv_cache_shape` (K/V planes or not);
- vLLM 0.24 - 0.28, the V1 runner's `GPUModelRunner._allocate_kv_cache_tensors` and Model Runner
  V2's `gpu/attn_utils._allocate_kv_cache`: one buffer per KVCacheTensor, or one shared "packed
  backing" when its `block_stride > 0`, plus each attention group's layer names, shape and
  stride-order functions (where the block dimension lies in memory). `_allocate_kv_cache` is
  not given the attention groups upstream, so its caller `init_kv_cache` passes them in;
- vLLM >= 0.29, `vllm/v1/worker/utils.py:allocate_kv_cache`: one buffer for every layer, plus
  each KVCacheTensor's offset, layer count, layer stride and block stride.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.base import HitCountingCodemod
from codemods.vllm._common import (
    ADAPTER_ALIAS,
    FunctionCodemod,
    MethodCodemod,
    is_adapter_call,
)

_INT8_ZEROS = m.Call(
    func=m.Attribute(value=m.Name("torch"), attr=m.Name("zeros")),
    args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("dtype"),
                                value=m.Attribute(value=m.Name("torch"), attr=m.Name("int8"))),
          m.ZeroOrMore()],
)


_NO_SPACE = cst.SimpleWhitespace("")


def _rewrite(call: cst.Call, adapter_function: str, extra_kwargs: str) -> cst.Call:
    extra = cst.parse_expression(f"f(__X__, {extra_kwargs})")
    assert isinstance(extra, cst.Call)
    # The space (or line break) before the closing parenthesis stays before it.
    closing = call.args[-1].whitespace_after_arg if call.args else _NO_SPACE
    added = [*extra.args[1:-1], extra.args[-1].with_changes(whitespace_after_arg=closing)]
    return call.with_changes(
        func=cst.Attribute(value=cst.Name(ADAPTER_ALIAS), attr=cst.Name(adapter_function)),
        args=[cst.Arg(value=cst.parse_expression("torch.zeros")),
              *(a.with_changes(comma=cst.MaybeSentinel.DEFAULT, whitespace_after_arg=_NO_SPACE)
                for a in call.args),
              *added],
    )


def _rewrite_zeros_site(codemod: HitCountingCodemod, call: cst.Call, adapter_function: str,
                        extra_kwargs: str) -> cst.Call:
    """A call inside a target function: an int8 `torch.zeros` becomes the adapter call (a hit),
    an adapter call already there counts as applied, anything else stays."""
    if is_adapter_call(call, adapter_function):
        codemod.record_already_applied()
        return call
    if not m.matches(call, _INT8_ZEROS):
        return call
    codemod.record_hit()
    return _rewrite(call, adapter_function, extra_kwargs)


class PerLayerKVBuffers(MethodCodemod):
    DESCRIPTION = "GPUModelRunner._allocate_kv_cache_tensors: torch.zeros -> per_layer_kv_buffer"
    CLASS_NAME = "GPUModelRunner"
    ADAPTER = "per_layer_kv_buffer"
    EXTRA = ("kv_cache_config=kv_cache_config, kv_cache_tensor=kv_cache_tensor, "
             "kv_cache_shape=self.attn_backends[0].get_kv_cache_shape")

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if self.in_target_class() and node.name.value == "_allocate_kv_cache_tensors":
            self._method = node.name.value

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if original_node.name.value == "_allocate_kv_cache_tensors":
            self._method = None
        return updated_node

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if self._method is None:
            return updated_node
        return _rewrite_zeros_site(self, updated_node, self.ADAPTER, self.EXTRA)


def _tensor_extra(attn_groups: str) -> str:
    """What a 0.24 - 0.28 zeros site passes: the tensor, its packing and the groups' layouts."""
    return ("kv_cache_config=kv_cache_config, kv_cache_tensor=kv_cache_tensor, "
            "block_stride=kv_cache_tensor.block_stride, "
            "kv_layouts=[(g.layer_names, g.backend.get_kv_cache_shape, "
            f"g.backend.get_kv_cache_stride_order) for gs in {attn_groups} for g in gs]")


class TensorKVBuffers(PerLayerKVBuffers):
    DESCRIPTION = "GPUModelRunner._allocate_kv_cache_tensors: torch.zeros -> kv_tensor_buffer"
    ADAPTER = "kv_tensor_buffer"
    EXTRA = _tensor_extra("self.attn_groups")


def _names_bound_in(function: cst.FunctionDef) -> set[str]:
    """The parameters of `function` and the plain names it assigns or loops over."""
    params = function.params
    bound = {p.name.value for p in (*params.posonly_params, *params.params,
                                    *params.kwonly_params)}
    for star in (params.star_arg, params.star_kwarg):
        if isinstance(star, cst.Param):
            bound.add(star.name.value)
    for node in m.findall(function.body, m.AssignTarget() | m.AnnAssign() | m.For()):
        if isinstance(node, cst.AssignTarget | cst.AnnAssign | cst.For):
            bound.update(name.value for name in m.findall(node.target, m.Name())
                         if isinstance(name, cst.Name))
    return bound


class ModelRunnerV2KVBuffers(FunctionCodemod):
    # Four places: the two zeros sites of `_allocate_kv_cache`, a new `attn_groups=()` parameter
    # of it, and `attn_groups=attn_groups` in the call from `init_kv_cache`.
    DESCRIPTION = "gpu/attn_utils._allocate_kv_cache: torch.zeros -> kv_tensor_buffer"
    FUNCTION_NAME = "_allocate_kv_cache"
    CALLER_NAME = "init_kv_cache"
    ADAPTER = "kv_tensor_buffer"
    GROUPS = "attn_groups"
    EXTRA = _tensor_extra(GROUPS)

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._in_caller = 0
        # Whether the caller being visited binds GROUPS. A release whose caller holds the
        # layouts under another name must not match: passing an unbound name compiles and
        # fails only when the engine starts (NameError), with or without KVCACHED_ENABLE.
        self._caller_binds_groups: list[bool] = []

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        super().visit_FunctionDef(node)
        if node.name.value == self.CALLER_NAME:
            self._in_caller += 1
            self._caller_binds_groups.append(self.GROUPS in _names_bound_in(node))

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        name = original_node.name.value
        if name == self.CALLER_NAME:
            self._in_caller -= 1
            self._caller_binds_groups.pop()
        if name == self.FUNCTION_NAME:
            updated_node = self._with_groups_parameter(updated_node)
        return super().leave_FunctionDef(original_node, updated_node)

    def _with_groups_parameter(self, node: cst.FunctionDef) -> cst.FunctionDef:
        params = node.params
        if any(p.name.value == self.GROUPS for p in (*params.params, *params.kwonly_params)):
            self.record_already_applied()
            return node
        self.record_hit()
        default = cst.Tuple(elements=[])
        if params.star_arg is not cst.MaybeSentinel.DEFAULT or params.kwonly_params:
            added = cst.Param(name=cst.Name(self.GROUPS), default=default)
            return node.with_changes(params=params.with_changes(
                kwonly_params=[*params.kwonly_params, added]))
        existing = list(params.params)
        closing: cst.BaseParenthesizableWhitespace = _NO_SPACE
        if existing:
            closing = existing[-1].whitespace_after_param
            existing[-1] = existing[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT,
                                                     whitespace_after_param=_NO_SPACE)
        added = cst.Param(name=cst.Name(self.GROUPS), default=default,
                          equal=cst.AssignEqual(whitespace_before=_NO_SPACE,
                                                whitespace_after=_NO_SPACE),
                          whitespace_after_param=closing)
        return node.with_changes(params=params.with_changes(params=[*existing, added]))

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if self._in_caller and m.matches(updated_node.func, m.Name(self.FUNCTION_NAME)):
            if not self._caller_binds_groups[-1]:
                return updated_node
            if any(a.keyword is not None and m.matches(a.keyword, m.Name(self.GROUPS))
                   for a in updated_node.args):
                self.record_already_applied()
                return updated_node
            self.record_hit()
            args = list(updated_node.args)
            closing: cst.BaseParenthesizableWhitespace = _NO_SPACE
            if args:
                closing = args[-1].whitespace_after_arg
                args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT,
                                                 whitespace_after_arg=_NO_SPACE)
            passed = cst.Arg(keyword=cst.Name(self.GROUPS), value=cst.Name(self.GROUPS),
                             equal=cst.AssignEqual(whitespace_before=_NO_SPACE,
                                                   whitespace_after=_NO_SPACE),
                             whitespace_after_arg=closing)
            return updated_node.with_changes(args=[*args, passed])
        if not self._inside:
            return updated_node
        return _rewrite_zeros_site(self, updated_node, self.ADAPTER, self.EXTRA)


class SharedKVBuffer(FunctionCodemod):
    DESCRIPTION = "allocate_kv_cache: torch.zeros -> shared_kv_buffer"
    FUNCTION_NAME = "allocate_kv_cache"
    EXTRA = ("regions=[(t.offset, len(t.layers), t.layer_stride, t.block_stride) "
             "for t in kv_cache_config.kv_cache_tensors]")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not self._inside:
            return updated_node
        return _rewrite_zeros_site(self, updated_node, "shared_kv_buffer", self.EXTRA)
