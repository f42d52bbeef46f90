"""Seam scheduler-capacity, 0.5.16 - 0.5.20: the admission reads of a sliding-window model's
two sides see their limits too.

For a hybrid sliding-window model (``allocator_swa_before_budget``) these releases'
``PrefillAdder`` reads the composite allocator's ``full_available_size()`` (what a request may
take of the full-attention side) and ``swa_available_size()`` (of the window side, in
``rem_swa_tokens`` as well) itself. Those stay logical, as ``available_size()`` does, for
SGLang's leak check; so each of them, in the admission scopes, becomes
``side_allocatable_size(allocator, "full" | "swa")``
(kvcached_core/integration/sglang/capacity.py): what that side can allocate now under its
pool's limit and budget. Everything else is ``scheduler_capacity``'s rewrite of the release
(its ``available_size()`` reads and the eviction before an allocation, whose start evicts
each side's shortfall under its limit). In 0.5.20 ``rem_swa_tokens`` reads the allocator
through a local named ``allocator``, which is matched there too.
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
import libcst.matchers as m

from codemods.sglang.scheduler_capacity import (
    SchedulerCapacityAllocatorDecodeCheck,
    SchedulerCapacityCheckDecodeMem,
    SchedulerCapacityUnderLimit,
)

SIDE_READ = "_kvcached_side_allocatable_size"
SIDE_IMPORT = ("from kvcached_core.integration.sglang.capacity import side_allocatable_size "
               f"as {SIDE_READ}\n")
SIDES = {"full_available_size": "full", "swa_available_size": "swa"}
_ALLOCATOR_NAMES = ("token_to_kv_pool_allocator", "allocator")


def _is_side_allocator(node: cst.BaseExpression) -> bool:
    """`self.token_to_kv_pool_allocator`, or a bare `token_to_kv_pool_allocator` / `allocator`."""
    return (m.matches(node, m.Attribute(attr=m.Name("token_to_kv_pool_allocator")))
            or any(m.matches(node, m.Name(name)) for name in _ALLOCATOR_NAMES))


class _SideReads(SchedulerCapacityUnderLimit):
    """Adds the side reads to a release's scheduler-capacity rewrite (its READS scopes)."""

    SIDE_SCOPES: ClassVar[frozenset[str]] = frozenset({
        "PrefillAdder.rem_total_tokens", "PrefillAdder.cur_rem_tokens",
        "PrefillAdder.rem_swa_tokens"})

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._side_reads_in: list[int] = []  # side reads rewritten in each scope entered

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        super().visit_FunctionDef(node)
        if self._qualname in self.SIDE_SCOPES:
            self._side_reads_in.append(0)

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if self._qualname in self.SIDE_SCOPES and self._side_reads_in.pop():
            updated_node = self._with_import(updated_node, SIDE_IMPORT)
        return super().leave_FunctionDef(original_node, updated_node)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        rewritten = super().leave_Call(original_node, updated_node)
        if rewritten is not updated_node or not self._side_reads_in:
            return rewritten
        if m.matches(updated_node, m.Call(func=m.Name(SIDE_READ))):
            self.record_already_applied()
            return updated_node
        func = updated_node.func
        if (updated_node.args or not isinstance(func, cst.Attribute)
                or func.attr.value not in SIDES or not _is_side_allocator(func.value)):
            return updated_node
        self.record_hit()
        self._side_reads_in[-1] += 1
        return cst.Call(func=cst.Name(SIDE_READ), args=[
            cst.Arg(func.value), cst.Arg(cst.SimpleString(f'"{SIDES[func.attr.value]}"'))])


# 0.5.19 - 0.5.20: the decode check is the allocator's (the elastic composite answers it).
class SchedulerCapacitySidesAllocatorDecodeCheck(_SideReads,
                                                 SchedulerCapacityAllocatorDecodeCheck):
    DESCRIPTION = ("sglang-scheduler-capacity, and PrefillAdder's reads of the full and window "
                   "sides under their limits.")


# 0.5.16 - 0.5.18: ScheduleBatch.check_decode_mem reads the capacity itself.
class SchedulerCapacitySidesCheckDecodeMem(_SideReads, SchedulerCapacityCheckDecodeMem):
    DESCRIPTION = ("sglang-scheduler-capacity-check-decode-mem, and PrefillAdder's reads of the "
                   "full and window sides under their limits.")
