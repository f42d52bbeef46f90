"""Seam: the worker's raw `torch.zeros(n, dtype=torch.int8, ...)` KV buffers become VMM-backed.

The call keeps its arguments and gains `torch.zeros` as its first argument, so with elastic
mode off the adapter makes exactly the stock buffer. What the adapter must know about the
layout is passed in by the rewritten call site, in the words of that version:

- vLLM <= 0.28, `GPUModelRunner._allocate_kv_cache_tensors`: one buffer per layer, plus the
  backend's `get_kv_cache_shape` (K/V planes or not);
- vLLM >= 0.29, `vllm/v1/worker/utils.py:allocate_kv_cache`: one buffer for every layer, plus
  each KVCacheTensor's offset, layer count, layer stride and block stride.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

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


def _rewrite(call: cst.Call, adapter_function: str, extra_kwargs: str) -> cst.Call:
    extra = cst.parse_expression(f"f(__X__, {extra_kwargs})")
    assert isinstance(extra, cst.Call)
    return call.with_changes(
        func=cst.Attribute(value=cst.Name(ADAPTER_ALIAS), attr=cst.Name(adapter_function)),
        args=[cst.Arg(value=cst.parse_expression("torch.zeros")),
              *(a.with_changes(comma=cst.MaybeSentinel.DEFAULT) for a in call.args),
              *extra.args[1:]],
    )


class PerLayerKVBuffers(MethodCodemod):
    """Back each layer's KV buffer with kvcached (vLLM <= 0.28)."""

    DESCRIPTION = "GPUModelRunner._allocate_kv_cache_tensors: torch.zeros -> per_layer_kv_buffer"
    CLASS_NAME = "GPUModelRunner"
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
        if is_adapter_call(updated_node, "per_layer_kv_buffer"):
            self.record_already_applied()
            return updated_node
        if not m.matches(updated_node, _INT8_ZEROS):
            return updated_node
        self.record_hit()
        return _rewrite(updated_node, "per_layer_kv_buffer", self.EXTRA)


class SharedKVBuffer(FunctionCodemod):
    """Back the single KV buffer of all layers with kvcached (vLLM >= 0.29)."""

    DESCRIPTION = "allocate_kv_cache: torch.zeros -> shared_kv_buffer"
    FUNCTION_NAME = "allocate_kv_cache"
    EXTRA = ("regions=[(t.offset, len(t.layers), t.layer_stride, t.block_stride) "
             "for t in kv_cache_config.kv_cache_tensors]")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not self._inside:
            return updated_node
        if is_adapter_call(updated_node, "shared_kv_buffer"):
            self.record_already_applied()
            return updated_node
        if not m.matches(updated_node, _INT8_ZEROS):
            return updated_node
        self.record_hit()
        return _rewrite(updated_node, "shared_kv_buffer", self.EXTRA)
