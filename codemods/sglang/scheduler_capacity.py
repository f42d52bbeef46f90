"""Seam scheduler-capacity (0.4.10 - 0.5.20): the scheduler's capacity reads see the limit.

Up to 0.5.20 SGLang's scheduler reads the allocator's free capacity itself to admit requests
(``PrefillAdder.rem_total_tokens`` / ``cur_rem_tokens``), to decide whether the next decode
step fits (``ScheduleBatch.check_decode_mem`` from 0.5.9, ``_is_available_size_sufficient``
before, and ``retract_decode``'s own reads up to 0.5.6; 0.5.19 and 0.5.20 ask the allocator's
``check_decode_capacity``, which the elastic allocators answer), and to size the eviction that
precedes an allocation (``evict_from_tree_cache`` from 0.5.3, ``ScheduleBatch.
_evict_tree_cache_if_needed`` before). ``available_size()`` stays logical for the leak check,
so each of those reads becomes ``allocatable_size(allocator)`` and each eviction starts by
evicting what the limit withholds (kvcached_core/integration/sglang/capacity.py): a request
the limit cannot hold waits, and running requests are retracted, instead of an allocation
failing on SGLang's out-of-memory path. Other reads (metrics, the leak check) are left alone.

Each declaration (codemods/catalog.py) names the release's scopes; a read is rewritten only
inside them, including functions nested in them (``retract_decode._get_available_size``).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
import libcst.matchers as m

from codemods.base import HitCountingCodemod
from codemods.sglang._method import body_statements, first_after_docstring, statement, with_body

READ = "_kvcached_allocatable_size"
EVICT = "_kvcached_evict_under_limit"
READ_IMPORT = ("from kvcached_core.integration.sglang.capacity import allocatable_size as "
               f"{READ}\n")
EVICT_IMPORT = ("from kvcached_core.integration.sglang.capacity import evict_under_limit as "
                f"{EVICT}\n")
ALLOCATOR = "token_to_kv_pool_allocator"


def _is_allocator(node: cst.BaseExpression) -> bool:
    """`self.token_to_kv_pool_allocator`, `batch.token_to_kv_pool_allocator`, or the bare name."""
    return (m.matches(node, m.Attribute(attr=m.Name(ALLOCATOR)))
            or m.matches(node, m.Name(ALLOCATOR)))


class SchedulerCapacityUnderLimit(HitCountingCodemod):
    """Base: READS are the qualified names (``Class.method`` or ``function``) whose allocator
    capacity reads are rewritten; EVICTIONS map an eviction function to the expression naming
    its tree, evaluated in that function (its arguments are the release's own)."""

    DESCRIPTION = ("Point the scheduler's admission, decode and eviction capacity reads at "
                   "what the elastic pool can allocate under its limit.")
    READS: ClassVar[frozenset[str]] = frozenset()
    EVICTIONS: ClassVar[dict[str, str]] = {}

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._scope: list[str] = []
        self._read_depth: list[int] = []  # scope depths of the READS functions entered
        self._reads_in: list[int] = []  # reads rewritten in each READS function entered

    @property
    def _qualname(self) -> str:
        return ".".join(self._scope)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._scope.append(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef,
                       updated_node: cst.ClassDef) -> cst.ClassDef:
        self._scope.pop()
        return updated_node

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._scope.append(node.name.value)
        if self._qualname in self.READS:
            self._read_depth.append(len(self._scope))
            self._reads_in.append(0)

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        qualname = self._qualname
        try:
            if qualname in self.READS:
                self._read_depth.pop()
                rewritten = self._reads_in.pop()
                if rewritten:
                    updated_node = self._with_import(updated_node, READ_IMPORT)
            if qualname in self.EVICTIONS:
                updated_node = self._with_eviction(updated_node, self.EVICTIONS[qualname])
            return updated_node
        finally:
            self._scope.pop()

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if not self._read_depth:
            return updated_node
        if m.matches(updated_node, m.Call(func=m.Name(READ))):
            self.record_already_applied()
            return updated_node
        func = updated_node.func
        if (updated_node.args or not isinstance(func, cst.Attribute)
                or func.attr.value != "available_size" or not _is_allocator(func.value)):
            return updated_node
        self.record_hit()
        self._reads_in[-1] += 1
        return cst.Call(func=cst.Name(READ), args=[cst.Arg(func.value)])

    @staticmethod
    def _with_import(node: cst.FunctionDef, import_line: str) -> cst.FunctionDef:
        statements = body_statements(node)
        statements.insert(first_after_docstring(statements), statement(import_line))
        return with_body(node, statements)

    def _with_eviction(self, node: cst.FunctionDef, tree: str) -> cst.FunctionDef:
        statements = body_statements(node)
        code = cst.Module(body=statements).code
        if EVICT in code:
            self.record_already_applied()
            return node
        self.record_hit()
        at = first_after_docstring(statements)
        statements[at:at] = [statement(EVICT_IMPORT),
                             statement(f"{EVICT}({tree}, num_tokens)\n")]
        return with_body(node, statements)


# The release's scopes, newest first. `evict_from_tree_cache(tree_cache, num_tokens)` is in
# mem_cache/common.py from 0.5.3; ScheduleBatch evicted in its own method before.
_ADMISSION = frozenset({"PrefillAdder.rem_total_tokens", "PrefillAdder.cur_rem_tokens"})
_COMMON_EVICTION = {"evict_from_tree_cache": "tree_cache"}


# 0.5.19 - 0.5.20: the admission reads and the eviction; the decode check is the allocator's.
class SchedulerCapacityAllocatorDecodeCheck(SchedulerCapacityUnderLimit):
    DESCRIPTION = ("Point PrefillAdder's capacity reads at what the pool can allocate under its "
                   "limit, and evict what the limit withholds before an allocation.")
    READS = _ADMISSION
    EVICTIONS = _COMMON_EVICTION


# 0.5.9 - 0.5.18: ScheduleBatch.check_decode_mem reads the capacity itself.
class SchedulerCapacityCheckDecodeMem(SchedulerCapacityUnderLimit):
    DESCRIPTION = ("sglang-scheduler-capacity, and ScheduleBatch.check_decode_mem's read "
                   "under the limit.")
    READS = _ADMISSION | {"ScheduleBatch.check_decode_mem"}
    EVICTIONS = _COMMON_EVICTION


# 0.5.7 - 0.5.8: the decode check's read is ScheduleBatch._is_available_size_sufficient.
class SchedulerCapacityAvailableSizeSufficient(SchedulerCapacityUnderLimit):
    DESCRIPTION = ("sglang-scheduler-capacity, and ScheduleBatch._is_available_size_sufficient's "
                   "read under the limit.")
    READS = _ADMISSION | {"ScheduleBatch._is_available_size_sufficient"}
    EVICTIONS = _COMMON_EVICTION


# 0.5.3 - 0.5.6: retract_decode also reads the capacity itself.
class SchedulerCapacityRetractReads(SchedulerCapacityUnderLimit):
    DESCRIPTION = ("sglang-scheduler-capacity, and the reads of ScheduleBatch."
                   "_is_available_size_sufficient and retract_decode under the limit.")
    READS = _ADMISSION | {"ScheduleBatch._is_available_size_sufficient",
                          "ScheduleBatch.retract_decode"}
    EVICTIONS = _COMMON_EVICTION


# 0.4.10 - 0.5.2: the eviction is ScheduleBatch._evict_tree_cache_if_needed(num_tokens).
class SchedulerCapacityBatchEviction(SchedulerCapacityUnderLimit):
    DESCRIPTION = ("sglang-scheduler-capacity-retract-reads where ScheduleBatch evicts in its own "
                   "_evict_tree_cache_if_needed.")
    READS = _ADMISSION | {"ScheduleBatch._is_available_size_sufficient",
                          "ScheduleBatch.retract_decode"}
    EVICTIONS = {"ScheduleBatch._evict_tree_cache_if_needed": "self.tree_cache"}
