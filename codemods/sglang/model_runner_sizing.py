"""Seams capacity, kv-profile-free-memory and config-guard up to 0.5.6: the model runner itself
sizes and builds the pools.

Before 0.5.7 moved pool set-up into ``ModelRunnerKVCacheMixin``, ``ModelRunner`` (srt/
model_executor/model_runner.py) does it: ``profile_max_num_token`` reads free memory after the
weights load and returns ``int(<budget in bytes> // cell_size)``, and ``init_memory_pool``
(run by a target and by a draft worker, each sizing its own pools) calls it first.

- capacity: the bytes divided by ``cell_size`` go through ``kv_budget_bytes`` (as in
  codemods/sglang/capacity.py), taken as a whole number of bytes first;
- kv-profile-free-memory: the read is rewritten as codemods/sglang/startup_memory.py does
  (``startup_window="end"``: a draft worker's read, after its target's, releases nothing);
- config-guard: the guard of codemods/sglang/config_guard.py goes first in
  ``init_memory_pool``. These releases read the custom memory pool setting as a boolean
  environment variable and call sliding-window hybrids ``is_hybrid``; there is no post-capture
  sizing. Linear-attention (Mamba) pools came in 0.5.2 with the runner's ``mambaish_config``:
  one guard names both, one (for the releases before) names ``is_hybrid`` alone. Each applies
  only where the module imports ``get_bool_env_var`` and no ``envs``, and where the runner does
  (or does not) read ``self.mambaish_config``.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from codemods.sglang._guard import InsertGuardFirst, imports_name
from codemods.sglang.capacity import WRAPPER, KVBudgetCapacity
from codemods.sglang.startup_memory import _ElasticFreeMemory

_CLASS = "ModelRunner"
_PROFILE = "profile_max_num_token"
_PER_TOKEN = m.Name("cell_size")


class KVBudgetCapacityRunner(KVBudgetCapacity):
    DESCRIPTION = ("Pass the bytes ModelRunner.profile_max_num_token divides into tokens "
                   "through kvcached's budget.")
    CLASS = _CLASS
    METHOD = _PROFILE

    def leave_Return(self, original_node: cst.Return, updated_node: cst.Return) -> cst.Return:
        return updated_node  # the token count it returns is not the budget

    def leave_BinaryOperation(self, original_node: cst.BinaryOperation,
                              updated_node: cst.BinaryOperation) -> cst.BinaryOperation:
        if not self.in_target or not isinstance(updated_node.operator, cst.FloorDivide):
            return updated_node
        if not m.matches(updated_node.right, _PER_TOKEN):
            return updated_node
        if m.matches(updated_node.left, m.Call(func=m.Name(WRAPPER))):
            self.record_already_applied()
            return updated_node
        self.record_hit()
        whole = cst.Call(func=cst.Name("int"), args=[cst.Arg(updated_node.left)])
        return updated_node.with_changes(
            left=cst.Call(func=cst.Name(WRAPPER), args=[cst.Arg(whole)]))


class ElasticKVProfileMemoryRunner(_ElasticFreeMemory):
    DESCRIPTION = ("ModelRunner.profile_max_num_token: get_available_gpu_memory(distributed=...) "
                   "through elastic_free_memory_gb(..., startup_window=\"end\")")
    CLASS = _CLASS
    METHOD = _PROFILE
    STARTUP_WINDOW = "end"


_GUARD = """if _KVCACHED_ELASTIC_GUARD():
    from kvcached_core.integration.sglang.startup import refuse_unsupported

    refuse_unsupported(
        enable_memory_saver=self.server_args.enable_memory_saver,
        custom_mem_pool=get_bool_env_var("SGLANG_MOONCAKE_CUSTOM_MEM_POOL"),
        post_capture_kv_sizing=False,
        hybrid_layers={hybrid},
    )
"""
_MAMBA = m.Attribute(value=m.Name("self"), attr=m.Name("mambaish_config"))


class RefuseUnsupportedAtRunnerInitMemoryPool(InsertGuardFirst):
    DESCRIPTION = ("Refuse memory saver, custom mem pool and hybrid pools first in "
                   "ModelRunner.init_memory_pool.")
    CLASS = _CLASS
    METHOD = "init_memory_pool"
    GUARD = _GUARD.format(hybrid="self.is_hybrid or self.mambaish_config is not None")
    HAS_MAMBA_POOLS = True

    def settings_fit(self, module: cst.Module) -> bool:
        return (imports_name(module, "get_bool_env_var") and not imports_name(module, "envs")
                and bool(m.findall(module, _MAMBA)) == self.HAS_MAMBA_POOLS)


class RefuseUnsupportedAtRunnerInitMemoryPoolBeforeMamba(RefuseUnsupportedAtRunnerInitMemoryPool):
    DESCRIPTION = ("Refuse memory saver, custom mem pool and sliding-window hybrids first in "
                   "ModelRunner.init_memory_pool (no Mamba pools yet).")
    GUARD = _GUARD.format(hybrid="self.is_hybrid")
    HAS_MAMBA_POOLS = False
