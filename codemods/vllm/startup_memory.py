"""Seam: the GPU worker's start-up memory checks, next to elastic neighbours.

Two comparisons of a vLLM GPU worker refuse to start an engine beside engines whose memory
grows and shrinks:

- the start-up check `<snapshot>.free_memory < <requested>` ("Free memory on device ... is less
  than desired GPU memory utilization"): in `request_memory` (vllm/v1/worker/utils.py, from
  0.2x) or in `Worker.init_device` (0.9.2, comparing `self.init_snapshot.free_memory` with
  `self.requested_memory`); 0.32 compares a second time against the share left after weights
  held outside the process;
- the profile-run assertion `assert <initial free> >= free_gpu_memory` ("Error in memory
  profiling", `>` in 0.9.2) in `Worker.determine_available_memory`.

Each comparison becomes a call of the adapter with the same operands, which makes the stock
comparison when the engine is not elastic (kvcached_core/integration/vllm/startup_memory.py).
The assertion keeps its message.

Seam: the start-up window. The worker's profile charges every device-wide change of used memory
between its initial snapshot (`self.init_snapshot = MemorySnapshot(...)` in `Worker.init_device`,
every release from 0.9.2) and the end of its profile to itself, so elastic engines on one device
must take that window in turn. The snapshot is taken through the adapter
(`startup_snapshot(lambda: MemorySnapshot(...), self.device)`, which waits for the device's
window first), and `Worker.determine_available_memory` and `Worker.initialize_from_config` end
it (`@ends_startup_window`).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.vllm._common import (
    FunctionCodemod,
    MethodCodemod,
    adapter_attr,
    is_adapter_call,
)

_FREE_MEMORY = m.Attribute(attr=m.Name("free_memory"))


class _ScopedComparisons(FunctionCodemod):
    """Rewrite comparisons inside any function (or method) named in FUNCTION_NAMES."""

    FUNCTION_NAMES: tuple[str, ...] = ()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if node.name.value in self.FUNCTION_NAMES:
            self._inside += 1

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if original_node.name.value in self.FUNCTION_NAMES:
            self._inside -= 1
        return updated_node


class ElasticStartupFreeMemoryCheck(_ScopedComparisons):
    # Start-up free-memory check: elastic neighbours and the engine's own unbacked KV count.

    DESCRIPTION = ("request_memory / Worker.init_device: free_memory < requested through "
                   "startup_memory_short(...)")
    FUNCTION_NAMES = ("request_memory", "init_device")

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if self._inside and is_adapter_call(updated_node, "startup_memory_short"):
            self.record_already_applied()
        return updated_node

    def leave_Comparison(self, original_node: cst.Comparison,
                         updated_node: cst.Comparison) -> cst.BaseExpression:
        if not self._inside or not m.matches(updated_node, m.Comparison(
                left=_FREE_MEMORY,
                comparisons=[m.ComparisonTarget(operator=m.LessThan())])):
            return updated_node
        self.record_hit()
        return cst.Call(func=adapter_attr("startup_memory_short"), args=[
            cst.Arg(value=updated_node.left),
            cst.Arg(value=updated_node.comparisons[0].comparator),
        ])


class ElasticMemoryProfileCheck(_ScopedComparisons):
    # Profile-run assertion: free memory given back by neighbours is no profiling error.

    DESCRIPTION = ("Worker.determine_available_memory: assert initial free >= "
                   "free_gpu_memory through memory_profile_consistent(...)")
    FUNCTION_NAMES = ("determine_available_memory",)

    def leave_Assert(self, original_node: cst.Assert,
                     updated_node: cst.Assert) -> cst.Assert:
        if not self._inside:
            return updated_node
        if is_adapter_call(updated_node.test, "memory_profile_consistent"):
            self.record_already_applied()
            return updated_node
        comparison = updated_node.test
        if not isinstance(comparison, cst.Comparison) or not m.matches(comparison, m.Comparison(
                comparisons=[m.ComparisonTarget(
                    operator=m.GreaterThanEqual() | m.GreaterThan(),
                    comparator=m.Name("free_gpu_memory"))])):
            return updated_node
        self.record_hit()
        strict = isinstance(comparison.comparisons[0].operator, cst.GreaterThan)
        call = cst.Call(func=adapter_attr("memory_profile_consistent"), args=[
            cst.Arg(value=comparison.left),
            cst.Arg(value=comparison.comparisons[0].comparator),
            cst.Arg(keyword=cst.Name("strict"), value=cst.Name(str(strict)),
                    equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                          whitespace_after=cst.SimpleWhitespace(""))),
        ])
        return updated_node.with_changes(test=call)


_INIT_SNAPSHOT = m.AssignTarget(target=m.Attribute(value=m.Name("self"),
                                                  attr=m.Name("init_snapshot")))
_WINDOW_END = "_kvcached_vllm.ends_startup_window"


class StartupWindowAroundSnapshot(MethodCodemod):
    # The initial memory snapshot waits for the device's start-up window; the profile ends it.

    DESCRIPTION = ("Worker.init_device: self.init_snapshot = MemorySnapshot(...) through "
                   "startup_snapshot(lambda: ..., self.device); @ends_startup_window on "
                   "determine_available_memory and initialize_from_config")
    CLASS_NAME = "Worker"
    WINDOW_ENDS = ("determine_available_memory", "initialize_from_config")

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if self.in_target_class() and node.name.value == "init_device":
            self._method = "init_device"

    def leave_Assign(self, original_node: cst.Assign,
                     updated_node: cst.Assign) -> cst.Assign:
        if self._method != "init_device" or not any(
                m.matches(target, _INIT_SNAPSHOT) for target in updated_node.targets):
            return updated_node
        if is_adapter_call(updated_node.value, "startup_snapshot"):
            self.record_already_applied()
            return updated_node
        if not m.matches(updated_node.value, m.Call(func=m.Name("MemorySnapshot"))):
            return updated_node
        self.record_hit()
        take = cst.Lambda(params=cst.Parameters(), body=updated_node.value)
        device = cst.Attribute(value=cst.Name("self"), attr=cst.Name("device"))
        return updated_node.with_changes(value=cst.Call(
            func=adapter_attr("startup_snapshot"),
            args=[cst.Arg(value=take), cst.Arg(value=device)]))

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        name = original_node.name.value
        if not self.in_target_class():
            return updated_node
        if name == "init_device":
            self._method = None
        if name not in self.WINDOW_ENDS:
            return updated_node
        decorator = cst.Decorator(decorator=cst.parse_expression(_WINDOW_END))
        if any(d.deep_equals(decorator) for d in updated_node.decorators):
            self.record_already_applied()
            return updated_node
        self.record_hit()
        return updated_node.with_changes(decorators=[*updated_node.decorators, decorator])
