"""Seams capacity and kv-profile-free-memory up to 0.5.10: the model runner profiles a token
count, not a byte budget.

``ModelRunnerKVCacheMixin.profile_max_num_token`` (srt/model_executor/
model_runner_kv_cache_mixin.py; ``_profile_available_bytes`` from 0.5.11) reads free memory
after the weights load and returns ``<budget in bytes> // cell_size``, the token capacity
every pool is sized from. Its read is rewritten as codemods/sglang/startup_memory.py does
(``startup_window="end"``; a draft worker reuses the target's pool config and never calls it),
and the bytes it divides go through ``kv_budget_bytes`` as in codemods/sglang/capacity.py. A
return that is not such a division is left alone, and the build fails on the missing hit.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang.capacity import WRAPPER, KVBudgetCapacity
from codemods.sglang.startup_memory import _ElasticFreeMemory

_CLASS = "ModelRunnerKVCacheMixin"
_METHOD = "profile_max_num_token"


class KVBudgetCapacityTokens(KVBudgetCapacity):
    DESCRIPTION = ("Pass the bytes ModelRunnerKVCacheMixin.profile_max_num_token divides into "
                   "tokens through kvcached's budget.")
    CLASS = _CLASS
    METHOD = _METHOD

    def leave_Return(self, original_node: cst.Return, updated_node: cst.Return) -> cst.Return:
        value = updated_node.value
        if not self.in_target or not isinstance(value, cst.BinaryOperation):
            return updated_node
        if not isinstance(value.operator, cst.FloorDivide):
            return updated_node
        if m.matches(value.left, m.Call(func=m.Name(WRAPPER))):
            self.record_already_applied()
            return updated_node
        self.record_hit()
        wrapped = cst.Call(func=cst.Name(WRAPPER), args=[cst.Arg(value.left)])
        return updated_node.with_changes(value=value.with_changes(left=wrapped))


class ElasticKVProfileMemoryTokens(_ElasticFreeMemory):
    DESCRIPTION = ("ModelRunnerKVCacheMixin.profile_max_num_token: "
                   "get_available_gpu_memory(distributed=...) through "
                   "elastic_free_memory_gb(..., startup_window=\"end\")")
    CLASS = _CLASS
    METHOD = _METHOD
    STARTUP_WINDOW = "end"
