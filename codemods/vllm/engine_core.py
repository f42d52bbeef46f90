"""Seams on EngineCore: page release at step end, the KV budget, shutdown.

- `step` / `step_with_batch_queue` get a decorator that gives idle pages back after each
  step (release epochs: at once after a synchronous step, later when batches are queued);
- `shutdown` gets a decorator that releases every page and removes the shared-memory record;
- in `_initialize_kv_caches`, `self.model_executor.determine_available_memory()` is wrapped by
  `_kvcached_vllm.kv_cache_budget(...)` (virtual KV size, user settings respected, page
  rounding, executor check, and the job announcement that worker processes of the mp executor
  look for). What that call passes differs by version (below); `pipeline_parallel_size` and
  `world_size` are fields of `ParallelConfig` in every supported vLLM (0.9.2: `vllm/config.py`,
  from 0.10: `vllm/config/parallel.py`).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.vllm._common import DecorateMethods, MethodCodemod, is_adapter_call


class ReleasePagesAfterStep(DecorateMethods):
    DESCRIPTION = "EngineCore.step/step_with_batch_queue: release idle pages after the step"
    CLASS_NAME = "EngineCore"
    DECORATORS = {
        "step": "_kvcached_vllm.released_after_step(pipelined=False)",
        "step_with_batch_queue": "_kvcached_vllm.released_after_step(pipelined=True)",
    }


class ClosePoolOnShutdown(DecorateMethods):
    DESCRIPTION = "EngineCore.shutdown: release every page and the shared-memory record"
    CLASS_NAME = "EngineCore"
    DECORATORS = {"shutdown": "_kvcached_vllm.close_on_shutdown"}


_BUDGET_KWARGS = (
    "block_bytes_per_layer=[spec.page_size_bytes for spec in kv_cache_specs[0].values()] "
    "if kv_cache_specs else [], "
    "user_kv_bytes={user_kv_bytes}, "
    "user_num_blocks=vllm_config.cache_config.num_gpu_blocks_override, "
    "executor_backend=vllm_config.parallel_config.distributed_executor_backend, "
    "world_size=vllm_config.parallel_config.world_size, "
    "pipeline_size=vllm_config.parallel_config.pipeline_parallel_size"
)


class KVCacheBudget(MethodCodemod):
    DESCRIPTION = "EngineCore._initialize_kv_caches: KV budget through kv_cache_budget(...)"
    CLASS_NAME = "EngineCore"
    #: The expression of the user's KV byte budget in this version (None: no such setting).
    USER_KV_BYTES = "None"

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        if self.in_target_class() and node.name.value == "_initialize_kv_caches":
            self._method = node.name.value
            self._inside_budget = 0

    def visit_Call(self, node: cst.Call) -> None:
        if self._method is not None and is_adapter_call(node, "kv_cache_budget"):
            self._inside_budget += 1

    def leave_FunctionDef(self, original_node: cst.FunctionDef,
                          updated_node: cst.FunctionDef) -> cst.FunctionDef:
        if original_node.name.value == "_initialize_kv_caches":
            self._method = None
        return updated_node

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        if self._method is None:
            return updated_node
        if is_adapter_call(updated_node, "kv_cache_budget"):
            self._inside_budget -= 1
            self.record_already_applied()
            return updated_node
        if self._inside_budget:  # the profiled call already wrapped by an earlier run
            return updated_node
        target = m.Call(func=m.Attribute(
            value=m.Attribute(value=m.Name("self"), attr=m.Name("model_executor")),
            attr=m.Name("determine_available_memory")), args=[])
        if not m.matches(updated_node, target):
            return updated_node
        self.record_hit()
        kwargs = _BUDGET_KWARGS.format(user_kv_bytes=self.USER_KV_BYTES)
        wrapped = cst.parse_expression(f"_kvcached_vllm.kv_cache_budget(__CALL__, {kwargs})")
        assert isinstance(wrapped, cst.Call)
        return wrapped.with_changes(args=[cst.Arg(value=updated_node), *wrapped.args[1:]])


class KVCacheBudgetWithUserBytes(KVCacheBudget):
    DESCRIPTION = ("EngineCore._initialize_kv_caches: KV budget through kv_cache_budget(...), "
                   "kv_cache_memory_bytes respected")
    USER_KV_BYTES = "vllm_config.cache_config.kv_cache_memory_bytes"
