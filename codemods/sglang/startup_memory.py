"""Seams: SGLang's start-up free-memory figures, next to elastic neighbours.

SGLang reads device free memory, reduced to the minimum across ranks, twice while it starts:

- ``measure_pre_model_load_memory`` (srt/distributed/bootstrap.py), before the weights load:
  the figure sets the non-KV slack and is compared with this rank's own free memory by the
  TP memory-balance check ("The memory capacity is unbalanced", an error by default);
- ``KVCacheConfigurator._profile_available_bytes`` (srt/mem_cache/kv_cache_configurator.py),
  after the weights load: the figure minus the slack is the KV pools' budget, refused when it
  is not positive ("Loaded weights leave no GPU memory for the KV cache") and, through the
  pool sizes, when it holds no token ("Not enough memory").

The ``get_available_gpu_memory(..., distributed=...)`` call in each becomes a call of the
adapter with the same arguments and the measuring function first
(kvcached_core/integration/sglang/startup.py, ``elastic_free_memory_gb``), which returns
SGLang's own figure when the pools are not elastic. The call also names its end of the
device's start-up window: ``startup_window="begin"`` on the pre-load read (the window is taken
before measuring), ``startup_window="end"`` on the KV-profile read (released after measuring),
so that elastic engines on one device do not measure each other's weight loads. A draft worker
(speculative decoding) takes the pre-load read too but reuses the target's pool config, so no
KV-profile read follows it: its read passes ``startup_window=None if is_draft_worker else
"begin"``, and a target without an ``is_draft_worker`` parameter is not rewritten. The import
goes first in the function's body (after its docstring), so the module's imports are
untouched.
"""

from __future__ import annotations

from typing import ClassVar

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

MEASURE = "get_available_gpu_memory"
WRAPPER = "_kvcached_elastic_free_memory_gb"
IMPORT = ("from kvcached_core.integration.sglang.startup import elastic_free_memory_gb as "
          f"{WRAPPER}")

_DISTRIBUTED_MEASURE = m.Call(
    func=m.Name(MEASURE),
    args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("distributed")), m.ZeroOrMore()],
)


class _ElasticFreeMemory(MethodScopedCodemod):
    """Base: route the target's rank-reduced free-memory measure through the adapter."""

    # The end of the start-up window this read marks ("begin" or "end").
    STARTUP_WINDOW: ClassVar[str]
    # A parameter of the target that, when true, makes the read take no window ("": none).
    NO_WINDOW_WHEN: ClassVar[str] = ""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._target_parameters: set[str] = set()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        super().visit_FunctionDef(node)
        if self.in_target:
            params = node.params
            self._target_parameters = {
                param.name.value
                for param in (*params.posonly_params, *params.params, *params.kwonly_params)
            }

    def _window_value(self) -> cst.BaseExpression:
        window = cst.SimpleString(f'"{self.STARTUP_WINDOW}"')
        if not self.NO_WINDOW_WHEN:
            return window
        return cst.IfExp(test=cst.Name(self.NO_WINDOW_WHEN), body=cst.Name("None"),
                         orelse=window)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.Call:
        if not self.in_target:
            return updated_node
        if m.matches(updated_node, m.Call(func=m.Name(WRAPPER))):
            self.record_already_applied()
            return updated_node
        if not m.matches(updated_node, _DISTRIBUTED_MEASURE):
            return updated_node
        if self.NO_WINDOW_WHEN and self.NO_WINDOW_WHEN not in self._target_parameters:
            return updated_node  # the anchor changed: the build fails on the missing hit
        self.record_hit()
        # The measure goes first, separated as the call separates its own arguments (one per
        # line stays one per line).
        first_comma = updated_node.args[0].comma
        comma = first_comma if isinstance(first_comma, cst.Comma) else cst.Comma(
            whitespace_after=cst.SimpleWhitespace(" "))
        # The window keyword goes last, taking the call's own trailing comma (if any).
        *leading, last = updated_node.args
        window = cst.Arg(
            keyword=cst.Name("startup_window"),
            value=self._window_value(),
            equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                  whitespace_after=cst.SimpleWhitespace("")),
            comma=last.comma,
        )
        return updated_node.with_changes(
            func=cst.Name(WRAPPER),
            args=[cst.Arg(value=cst.Name(MEASURE), comma=comma), *leading,
                  last.with_changes(comma=comma), window],
        )

    def rewrite_target(self, node: cst.FunctionDef) -> cst.FunctionDef:
        statements = body_statements(node)
        if self.hits and not any(is_marked(s, WRAPPER) and isinstance(s, cst.SimpleStatementLine)
                                 and m.matches(s.body[0], m.ImportFrom())
                                 for s in statements):
            statements.insert(first_after_docstring(statements), statement(IMPORT + "\n"))
        return with_body(node, statements)


class ElasticPreModelLoadMemory(_ElasticFreeMemory):
    DESCRIPTION = ("measure_pre_model_load_memory: get_available_gpu_memory(distributed=...) "
                   "through elastic_free_memory_gb(..., startup_window=\"begin\" unless "
                   "is_draft_worker)")
    METHOD = "measure_pre_model_load_memory"
    STARTUP_WINDOW = "begin"
    NO_WINDOW_WHEN = "is_draft_worker"


class ElasticKVProfileMemory(_ElasticFreeMemory):
    DESCRIPTION = ("KVCacheConfigurator._profile_available_bytes: "
                   "get_available_gpu_memory(distributed=...) through "
                   "elastic_free_memory_gb(..., startup_window=\"end\")")
    CLASS = "KVCacheConfigurator"
    METHOD = "_profile_available_bytes"
    STARTUP_WINDOW = "end"
